"""multicard bench: a real sweep on the CPU with tiny data (its JSON, table, markdown and plot), an fsdp sweep
and what each process held there, the derived numbers, the spread of the timed epochs, the busy-machine and
scaling-above-100% warnings, and bad sweep arguments answered with one line and exit code 2."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from conftest import HUNG_S, ROOT, run_cli
from multicard.errors import UsageError
from multicard.tools import bench
from multicard.tools.bench_files import plot
from multicard.tools.bench_report import SPREAD_LIMIT, derive, markdown, table

TINY = ("--samples", "128", "--batch-size", "32", "--repeats", "2", "--strategies", "single,ddp", "--devices", "1,2",
        "--fast-batch", "64")
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # the CPU sweep also where the machine has a card
CELL_KEYS = {"strategy", "devices", "world_size", "samples_per_s", "ms_per_step", "scaling_efficiency",
             "peak_memory_mb", "imbalance", "loss", "loss_parity", "speedup_vs_baseline", "shard_mb", "held_vs_whole",
             "rate_min", "rate_max", "spread", "noisy", "load_before", "load_after", "cores", "busy"}
LENET5_MB = 61_706 * 4 / 2**20  # LeNet-5's parameters in fp32


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = run_cli("bench", "--out", str(out), *TINY, env={**CPU_ONLY, "OMP_NUM_THREADS": "1"}, timeout=HUNG_S)
    assert result.returncode == 0, result.stderr
    return out, result.stdout


@pytest.mark.slow
def test_sweep_writes_json_with_one_cell_per_strategy_and_count(swept):
    out, _ = swept
    report = json.loads((out / "bench.json").read_text())
    assert {"config", "torch", "hardware", "date", "command", "cells", "baseline", "fast", "warnings",
            "spread_limit"} <= set(report)
    assert report["config"]["strategies"] == "single,ddp" and report["config"]["repeats"] == 2
    assert isinstance(report["warnings"], list) and report["spread_limit"] == SPREAD_LIMIT
    assert report["hardware"]["cores"] >= 2 and report["hardware"]["cards"] == [] and report["hardware"]["cpu"]
    assert "bench" in report["command"] and "--samples 128" in report["command"]
    if (Path(ROOT) / ".git").exists():  # the tests run from a checkout: its commit is recorded
        assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", report["multicard_commit"])
    cells = report["cells"]
    assert [(c["strategy"], c["devices"], c["world_size"]) for c in cells] == [("single", 1, 1), ("ddp", 1, 1),
                                                                                ("ddp", 2, 2)]
    for cell in [*cells, report["baseline"], report["fast"]]:
        assert CELL_KEYS <= set(cell)
        assert cell["samples_per_s"] > 0 and len(cell["epoch_samples_per_s"]) == 2  # the warm-up is dropped
        rates = cell["epoch_samples_per_s"]  # the spread of the 2 timed epochs, and the load around the cell
        assert (cell["rate_min"], cell["rate_max"]) == (min(rates), max(rates))
        assert cell["rate_min"] <= cell["samples_per_s"] <= cell["rate_max"]
        assert cell["spread"] == pytest.approx((max(rates) - min(rates)) / cell["samples_per_s"])
        assert cell["noisy"] == (cell["spread"] > SPREAD_LIMIT)
        assert cell["load_before"] >= 0 and cell["load_after"] >= 0 and cell["cores"] == report["hardware"]["cores"]
        assert cell["busy"] == (max(cell["load_before"], cell["load_after"]) > cell["cores"])
        assert cell["ms_per_step"] == pytest.approx(1000 * cell["batch_size"] / cell["samples_per_s"])
        assert len(cell["peak_memory_mb"]) == cell["world_size"] and min(cell["peak_memory_mb"]) > 50
        assert cell["imbalance"] >= 1
        assert cell["speedup_vs_baseline"] == pytest.approx(cell["samples_per_s"] / report["baseline"]["samples_per_s"])
        assert len(cell["shard_mb"]) == cell["world_size"]  # every process holds the whole model and Adam's state
        for shard in cell["shard_mb"]:
            assert shard["params"] == shard["grads"] == pytest.approx(LENET5_MB, abs=0.005)
            assert shard["optimizer"] == pytest.approx(2 * LENET5_MB, abs=0.005)
        assert cell["held_vs_whole"] == 1
    single, ddp1, ddp2 = cells
    assert single["scaling_efficiency"] == ddp1["scaling_efficiency"] == 1
    assert ddp2["scaling_efficiency"] == pytest.approx(ddp2["samples_per_s"] / (2 * ddp1["samples_per_s"]))
    assert single["loss_parity"] == 0 and ddp1["loss_parity"] < 1e-5 and ddp2["loss_parity"] < 1e-5  # same steps
    assert report["baseline"]["batch_size"] == 64 and report["baseline"]["loss_parity"] is None
    assert report["fast"]["batch_size"] == 64 and report["fast"]["scaling_efficiency"] is None


@pytest.mark.slow
def test_sweep_prints_the_table_and_writes_markdown_and_plot(swept):
    out, stdout = swept
    assert "samples/s" in stdout and "ddp" in stdout and "plain loop" in stdout and "bench.png" in stdout
    assert "held MB params" in stdout and "held vs whole" in stdout
    assert "spread" in stdout and "load/cores" in stdout and "1-minute load average" in stdout
    md = (out / "bench.md").read_text()
    assert md.startswith("- hardware:") and "command:" in md and "date:" in md
    assert "| spread | load/cores |" in md and "(fastest - slowest timed epoch) / median" in md
    assert sum(line.startswith("| ") for line in md.splitlines()) == 1 + 5  # header, plain loop, 3 cells, fast
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert (out / "cells" / "ddp-2" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_fsdp_cells_hold_a_share_of_the_model_each(tmp_path):
    out = tmp_path / "bench"
    result = run_cli("bench", "--out", str(out), "--strategies", "fsdp", "--devices", "1,2", "--samples", "64",
                     "--batch-size", "32", "--repeats", "1", "--no-baseline", "--no-fast",
                     env={**CPU_ONLY, "OMP_NUM_THREADS": "1"}, timeout=HUNG_S)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    one, two = report["cells"]
    assert (one["strategy"], one["world_size"], two["strategy"], two["world_size"]) == ("fsdp", 1, "fsdp", 2)
    assert one["shard_mb"] == [{"params": round(LENET5_MB, 2), "grads": round(LENET5_MB, 2),
                                "optimizer": round(2 * LENET5_MB, 2)}] and one["held_vs_whole"] == 1
    assert len(two["shard_mb"]) == 2 and len(two["peak_memory_mb"]) == 2
    for shard in two["shard_mb"]:  # each process its half (to the 0.01 MB the summary rounds to)
        assert shard["params"] == shard["grads"] == pytest.approx(LENET5_MB / 2, abs=0.01)
        assert shard["optimizer"] == pytest.approx(LENET5_MB, abs=0.01)
    assert 0.45 < two["held_vs_whole"] < 0.55
    assert two["loss_parity"] is None  # no single x1 cell in this sweep
    assert one["spread"] is None and one["noisy"] is False  # one timed epoch: no spread to tell
    fsdp2 = next(line for line in result.stdout.splitlines() if line.startswith("fsdp") and " 2 " in line)
    assert "0.12 / 0.12" in fsdp2 and "0.24 / 0.24" in fsdp2 and f"{two['held_vs_whole']:.0%}" in fsdp2
    assert "| fsdp | 2 |" in (out / "bench.md").read_text()


def args(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **given})


def test_plan_defaults_for_cpu_and_cards():
    cpu = args()
    assert bench.plan(cpu, cards=0, cores=8) == [("single", 1), ("ddp", 1), ("ddp", 2), ("fsdp", 1),
                                                  ("fsdp", 2)]  # 1..min(2, cores)
    assert (cpu.batch_size, cpu.fast_batch, cpu.samples) == (64, 256, 4096)
    cards = args(model="resnet8")
    assert bench.plan(cards, cards=2, cores=8) == [("single", 1), ("dp", 1), ("dp", 2), ("dp-balanced", 1),
                                                    ("dp-balanced", 2), ("ddp", 1), ("ddp", 2), ("fsdp", 1),
                                                    ("fsdp", 2)]
    assert (cards.batch_size, cards.fast_batch, cards.samples) == (512, 16384, 65536)
    assert bench.device_spec(2, cards=0) == "cpu:2" and bench.device_spec(2, cards=4) == "2"


@pytest.mark.parametrize("given, cards, message", [
    ({"strategies": "single,zero"}, 0, "unknown strategy 'zero'"),
    ({"strategies": "dp"}, 0, "dp needs CUDA cards"),
    ({"devices": "1,4"}, 2, "asks for 4 devices, this machine has 2 cards"),
    ({"devices": "3"}, 0, "this machine has 2 CPU cores"),
    ({"devices": "1,two"}, 0, "give device counts as integers"),
    ({"devices": "0,1"}, 0, "at least 1"),
    ({"repeats": 0}, 0, "--repeats 0: must be at least 1"),
    ({"batch_size": 33, "devices": "1,2"}, 0, "does not split over 2 devices"),
    ({"strategies": "single", "devices": "2"}, 0, "single runs on one device only"),
])
def test_bad_sweeps_are_rejected_before_anything_runs(given, cards, message):
    with pytest.raises(UsageError, match=message):
        bench.plan(args(**given), cards=cards, cores=2)


def test_bad_sweep_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    result = run_cli("bench", "--out", str(tmp_path / "b"), "--strategies", "dp", env=CPU_ONLY)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("multicard: error: --strategies dp: dp needs CUDA cards")
    assert not (tmp_path / "b").exists()


def test_derived_numbers():
    def cell(strategy, devices, rate, loss):
        return {"strategy": strategy, "devices": devices, "samples_per_s": rate, "loss": loss}

    results = {"cells": [cell("single", 1, 100, 2.0), cell("ddp", 1, 90, 2.0), cell("ddp", 2, 150, 2.2)],
               "baseline": cell("plain loop", 1, 50, 1.0), "fast": cell("single fast", 1, 400, 1.5)}
    whole = {"params": 4.0, "grads": 4.0, "optimizer": 8.0}
    for c in results["cells"]:
        c["world_size"] = c["devices"]
        c["shard_mb"] = [whole] * c["devices"]
    results["cells"].append({**cell("fsdp", 2, 140, 2.2), "world_size": 2,
                             "shard_mb": [{"params": 2.0, "grads": 2.0, "optimizer": 4.0},
                                          {"params": 2.5, "grads": 2.5, "optimizer": 5.0}]})
    derive(results)
    assert [c["held_vs_whole"] for c in results["cells"]] == [1, 1, 1, 0.625]  # the fuller process: 10 of 16
    assert results["baseline"]["held_vs_whole"] is None  # not measured (a bench.json from before the column)
    ddp2 = results["cells"][2]
    assert ddp2["scaling_efficiency"] == pytest.approx(150 / 180) and ddp2["loss_parity"] == pytest.approx(0.1)
    assert ddp2["speedup_vs_baseline"] == 3 and results["fast"]["speedup_vs_baseline"] == 8
    assert results["fast"]["loss_parity"] is None and results["baseline"]["scaling_efficiency"] is None


def cell(strategy: str, devices: int, rates: list[float], **more) -> dict:
    """A made-up row: its timed epochs' rates and their median, the load around it on 2 cores."""
    return {"strategy": strategy, "devices": devices, "world_size": devices, "batch_size": 64,
            "epoch_samples_per_s": rates, "samples_per_s": sorted(rates)[len(rates) // 2], "loss": 2.0,
            "load_before": 0.5, "load_after": 1.9, "cores": 2, **more}


def test_spread_of_the_timed_epochs_and_the_large_ones_flagged():
    results = {"cells": [cell("single", 1, [95, 100, 105]), cell("ddp", 1, [80, 100, 101]), cell("ddp", 2, [150])]}
    derive(results)
    steady, shaky, once = results["cells"]
    assert (steady["rate_min"], steady["rate_max"], steady["spread"]) == (95, 105, pytest.approx(0.10))
    assert steady["noisy"] is False  # 10% is the limit, not above it
    assert shaky["spread"] == pytest.approx(0.21) and shaky["noisy"] is True
    assert once["spread"] is None and once["noisy"] is False and once["rate_min"] == once["rate_max"] == 150
    assert [w.partition(": ")[0] for w in results["warnings"]] == ["large spread"]
    assert "ddp x1 21%" in results["warnings"][0]


def test_busy_machine_when_the_load_is_above_the_cores():
    results = {"cells": [cell("single", 1, [100, 100]), cell("ddp", 1, [100, 100], load_after=3.4),
                         cell("ddp", 2, [200, 200], load_before=2.0, load_after=2.0)],
               "baseline": {**cell("plain loop", 1, [50, 50]), "load_before": None, "load_after": None}}
    derive(results)
    assert [c["busy"] for c in results["cells"]] == [False, True, False]  # 2.0 on 2 cores: full, not busy
    assert results["baseline"]["busy"] is None  # not measured
    (busy,) = results["warnings"]
    assert busy.startswith("machine busy: ") and "1 of 4 cells (ddp x1 3.4)" in busy and "2 cores" in busy


@pytest.mark.parametrize("one, two, headline", [
    ([100, 100], [1006, 1006], "ddp x2 scaling 503% is noise"),  # the case, no spread in either cell
    ([99, 100, 101], [250, 260, 270], "ddp x2 scaling 130% is noise"),  # above 100% + 2% + 8% spread
    ([95, 100, 105], [190, 212, 230], "ddp x2 scaling 106% within the noise"),  # 100% + the cells' 10% + 19%
    ([100], [180], None),  # 90%: below 100%, nothing to say
    ([100], [230], "ddp x2 scaling 115% unverified"),  # one timed epoch each: no spread to judge it by
])
def test_scaling_above_100_percent_beyond_the_spread_is_called_noise(one, two, headline):
    results = {"cells": [cell("ddp", 1, one), cell("ddp", 2, two)]}
    derive(results)
    found = [w for w in results["warnings"] if "scaling" in w]
    assert [w.partition(": ")[0] for w in found] == ([headline] if headline else [])
    if headline and headline.endswith("is noise"):
        assert "above 100% by more than the two cells' spread" in found[0] and "rerun on a quiet machine" in found[0]


def test_table_markdown_and_plot_mark_what_is_in_doubt(tmp_path):
    results = {"cells": [cell("single", 1, [100, 100, 100]), cell("ddp", 1, [80, 100, 110], load_after=4.3),
                         cell("ddp", 2, [1000, 1006, 1010])]}
    for c in results["cells"]:
        c.update(ms_per_step=1.0, peak_memory_mb=[300.0] * c["devices"], imbalance=1.0, card_used_mb=[],
                 shard_mb=None, device_names=["cpu"] * c["devices"])
    derive(results)
    report = {"config": {"model": "lenet5", "samples": 4096, "repeats": 3, "fast_batch": 256, "precision": "fp32",
                         "compile": False}, "torch": "2", "hardware": {"cpu": "cpu", "cores": 2, "cards": []},
              "date": "2026-01-01T00:00:00+00:00", "command": "multicard bench", "sweep_seconds": 1.0, **results}
    text = table(report)
    ddp1 = next(line for line in text.splitlines() if line.startswith("ddp") and " 1 " in line)
    assert "30% *" in ddp1 and "4.3/2 !" in ddp1
    assert "WARNING machine busy: " in text and "WARNING large spread: " in text
    assert "WARNING ddp x2 scaling 503% is noise: " in text and "503% ?" in text
    md = markdown(report)
    assert "**Warning: ddp x2 scaling 503% is noise.**" in md and "| 30% \\* | 4.3/2 ! |" in md
    assert md.index("**Warning") < md.index("| cell |")  # read before the numbers
    said = plot(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert said == ["throughput and scaling", "peak memory"]  # nothing held was measured: no panel for it


def test_the_plot_shows_what_each_process_held_on_a_scale_of_its_own(tmp_path):
    """Beside a peak of hundreds of MB the few MB of a small model's parameters, gradients and optimizer state
    would not show: they get a panel of their own, each part labelled with its MB."""
    results = {"cells": [cell("single", 1, [100, 100]), cell("fsdp", 2, [150, 160])]}
    for c, held in zip(results["cells"], ([{"params": 0.24, "grads": 0.24, "optimizer": 0.47}],
                                          [{"params": 0.12, "grads": 0.12, "optimizer": 0.24}] * 2), strict=True):
        c.update(ms_per_step=1.0, peak_memory_mb=[340.0] * c["devices"], imbalance=1.0, card_used_mb=[],
                 shard_mb=held, world_size=c["devices"], device_names=["cpu"] * c["devices"])
    derive(results)
    report = {"config": {"model": "lenet5"}, "torch": "2", "hardware": {"cpu": "cpu", "cores": 2, "cards": []},
              "date": "2026-01-01T00:00:00+00:00", **results}
    said = plot(report, tmp_path / "bench.png")
    assert said[:3] == ["throughput and scaling", "peak memory", "held at the first step (each process)"]
    assert sorted(said[3:]) == sorted(["0.24", "0.24", "0.47", "0.95"] + ["0.12", "0.12", "0.24", "0.48"] * 2)
