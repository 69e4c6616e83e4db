"""--devices parsing (pure: a card count is passed in), strategy choice, and the global batch split."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tracemalloc

import pytest

from conftest import HUNG_S, train
from multicard import rules, strategies
from multicard.errors import UsageError
from multicard.jobs import devices
from multicard.jobs.devices import WAITING, Devices, cpu_cores, max_cpu_processes, parse
from multicard.jobs.dist import Job
from multicard.yourloop.multicard import Multicard


@pytest.mark.parametrize("text, cards, kind, ids", [
    ("auto", 2, "cuda", (0, 1)),
    ("auto", 1, "cuda", (0,)),
    ("cpu", 0, "cpu", (0,)),
    ("cpu", 2, "cpu", (0,)),
    ("cpu:1", 0, "cpu", (0,)),
    ("cpu:3", 0, "cpu", (0, 1, 2)),
    ("cpu:3", 2, "cpu", (0, 1, 2)),
    ("2", 2, "cuda", (0, 1)),
    ("1", 4, "cuda", (0,)),
    ("0,1", 2, "cuda", (0, 1)),
    ("1,0", 2, "cuda", (1, 0)),
    ("2,3", 4, "cuda", (2, 3)),
    ("cuda:1", 2, "cuda", (1,)),
    ("cuda:0", 1, "cuda", (0,)),
    ("cuda:0,2", 4, "cuda", (0, 2)),
    ("1,", 2, "cuda", (1,)),
    ("0,", 1, "cuda", (0,)),
    ("cuda", 2, "cuda", (0, 1)),
    (" CPU:2 ", 0, "cpu", (0, 1)),
    ("Cuda:1", 2, "cuda", (1,)),
    ("0, 1", 2, "cuda", (0, 1)),
])
def test_parse_forms(text, cards, kind, ids):
    devices = parse(text, cards)
    assert (devices.kind, devices.ids) == (kind, ids)
    assert devices.count == len(ids)
    assert devices.note == ""


def test_auto_without_cards_is_the_cpu_and_says_so():
    devices = parse("auto", 0)
    assert (devices.kind, devices.ids) == ("cpu", (0,))
    assert "no CUDA card" in devices.note


@pytest.mark.parametrize("text", ["cpu:0", "cpu:-1", "cpu:-3"])
def test_cpu_needs_one_process_at_least(text):
    with pytest.raises(UsageError, match=f"--devices {text}: the number of CPU processes must be at least 1"):
        parse(text, 2)


@pytest.mark.parametrize("cores, most", [(1, 64), (2, 64), (8, 64), (9, 72), (16, 128)])
def test_cpu_processes_are_bounded_by_the_cores(cores, most):
    assert max_cpu_processes(cores) == most
    assert parse(f"cpu:{most}", 0, cores=cores).count == most  # oversubscribing stays allowed up to the bound
    with pytest.raises(UsageError) as e:
        parse(f"cpu:{most + 1}", 2, cores=cores)
    assert str(e.value) == (f"--devices cpu:{most + 1}: {most + 1} CPU processes is too many for {cores} cores; "
                            f"use at most {most}")


def test_cpu_bound_defaults_to_the_cores_this_process_may_use():
    most = max_cpu_processes(cpu_cores())
    assert parse(f"cpu:{most}", 0).count == most
    with pytest.raises(UsageError, match=f"too many for {cpu_cores()} cores; use at most {most}"):
        parse(f"cpu:{most + 1}", 0)


def traced_peak(call) -> int:
    """The most memory Python allocated while `call()` ran."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("text, cards, words", [
    ("cpu:100000000", 2, "100000000 CPU processes is too many for 2 cores; use at most 64"),
    ("cpu:" + "9" * 1000, 0, "9" * 1000 + " CPU processes is too many"),
    ("100000000", 2, "asks for 100000000 cards, this machine has 2"),
    ("cuda:100000000", 2, "no card with id 100000000 "),
    ("0,100000000", 4, "no card with id 100000000 "),
    ("0," * 511 + "0", 2, "512 processes on card 0; a rehearsal puts at most 16"),  # 1023 characters: in the bound
])
def test_huge_counts_and_ids_are_refused_before_anything_big_is_built(text, cards, words):
    def refused():
        with pytest.raises(UsageError) as e:
            parse(text, cards, cores=2)
        message = str(e.value)
        assert message.startswith(f"--devices {text}:") and words in message and "\n" not in message

    assert traced_peak(refused) < 1 << 20  # not the GBs cpu:100000000 once built


@pytest.mark.parametrize("text", ["9" * 5000, "0," * 50000 + "0", "cpu:" + "1" * 2000, " " * 1025 + "cpu"])
def test_a_text_too_long_to_be_a_device_list_is_refused_first(text):
    # "9" * 5000 was a ValueError traceback (int() takes at most 4300 digits); the long id list cost 10 MB of regex
    def refused():
        with pytest.raises(UsageError) as e:
            parse(text, 2)
        message = str(e.value)
        assert message.startswith(f"--devices {text[:20]}...: {len(text)} characters, too long (at most 1024)")
        assert len(message) < 200 and "\n" not in message

    assert traced_peak(refused) < 64 << 10


@pytest.mark.parametrize("text", ["0,1", "0", "1", "2", "cuda", "cuda:0", "cuda:1", "1,", "0,0", "-1"])
def test_any_card_form_without_cards_says_there_is_no_card(text):
    with pytest.raises(UsageError) as e:
        parse(text, 0)
    message = str(e.value)
    assert message.startswith(f"--devices {text}:") and "no CUDA card" in message
    assert "--devices cpu" in message


@pytest.mark.parametrize("text, cards, words", [
    ("0,-1", 2, "no card with id -1"),
    ("cuda:-1", 2, "no card with id -1"),
    ("-1,0", 2, "no card with id -1"),
    ("-1", 2, "asks for -1 cards"),
    ("0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0", 1, "17 processes on card 0; a rehearsal puts at most 16 on one card"),
    ("0,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0", 2, "17 processes on card 1"),
    ("0,0,2", 2, "no card with id 2"),
    ("0,2", 2, "no card with id 2 (this machine has ids 0..1)"),
    ("cuda:1", 1, "no card with id 1 (this machine has ids 0..0)"),
    ("7", 4, "asks for 7 cards, this machine has 4 (use 1..4)"),
    ("3", 2, "asks for 3 cards"),
    ("0", 2, "for the card with id 0 write cuda:0"),
])
def test_bad_card_choices(text, cards, words):
    with pytest.raises(UsageError) as e:
        parse(text, cards)
    assert str(e.value).startswith(f"--devices {text}:") and words in str(e.value)


@pytest.mark.parametrize("text", ["banana", "", "gpu", "gpu:0", "cpu:", "cpu:x", "cpu:2:3", "0,,1", ",0", "cuda:",
                                  "cuda:a", "cuda1", "1.5", "0;1", "cpu,cuda", "auto:2", "mps"])
def test_garbage_is_not_understood(text):
    with pytest.raises(UsageError, match="not understood; use auto, cpu, cpu:N"):
        parse(text, 2)


# -- strategies.choose ----------------------------------------------------------------------------------------

CPU1, CPU2 = Devices("cpu", (0,)), Devices("cpu", (0, 1))


@pytest.mark.parametrize("devices, expected", [
    (CPU1, "single"),
    (CPU2, "ddp"),
    (Devices("cuda", (0,)), "single"),
    (Devices("cuda", (1,)), "single"),
    (Devices("cuda", (0, 1)), "ddp"),
])
def test_auto_strategy(devices, expected):
    assert strategies.choose("auto", devices, Job()) == expected


def test_auto_in_a_launched_job_is_ddp():
    assert strategies.choose("auto", CPU1, Job(rank=1, world=2, launcher="torchrun")) == "ddp"


def test_explicit_strategies():
    assert strategies.choose("single", CPU1, Job()) == "single"
    assert strategies.choose("ddp", CPU2, Job()) == "ddp"
    assert strategies.choose("ddp", CPU1, Job()) == "ddp"  # one process of ddp is allowed


def test_single_with_two_devices_is_an_error():
    with pytest.raises(UsageError, match="--strategy single trains on one device, but --devices names 2"):
        strategies.choose("single", CPU2, Job())


def test_single_in_a_launched_job_is_an_error():
    with pytest.raises(UsageError, match="torchrun started 2; use --strategy ddp"):
        strategies.choose("single", CPU1, Job(rank=0, world=2, launcher="torchrun"))


def test_the_registry_holds_the_strategies_the_flags_and_keywords_take_in_their_order():
    assert ("auto", *strategies.STRATEGIES) == rules.STRATEGIES
    assert all(cls.name == name for name, cls in strategies.STRATEGIES.items())


@pytest.mark.parametrize("name", ["nope", "DDP", "", "zero"])
def test_an_unknown_strategy_is_one_line_naming_where_it_came_from(name, monkeypatch):
    with pytest.raises(UsageError, match=rf"^strategy={name!r}: choose one of auto, single, ddp, dp, dp-balanced, "
                                         rf"fsdp$"):
        Multicard(name, "cpu")
    monkeypatch.setenv("MULTICARD_STRATEGY", name)  # multicard run's --strategy, or one set by hand
    with pytest.raises(UsageError, match=rf"^MULTICARD_STRATEGY={name} \(multicard run --strategy\): choose one "
                                         rf"of auto, single"):
        Multicard("auto", "cpu")


def test_create_gives_the_chosen_class():
    assert strategies.create("auto", CPU1, Job()).name == "single"
    ddp = strategies.create("auto", Devices("cpu", (0, 1, 2)), Job())
    assert ddp.name == "ddp" and ddp.processes == 3 and ddp.world == 3


# -- the global batch over processes --------------------------------------------------------------------------

def three_processes() -> strategies.Strategy:
    return strategies.create("ddp", Devices("cpu", (0, 1, 2)), Job())


def test_local_batch_splits_the_global_batch():
    assert three_processes().local_batch(96) == 32
    assert three_processes().local_batch(3) == 1
    assert strategies.create("single", CPU1, Job()).local_batch(7) == 7


@pytest.mark.parametrize("batch, suggestion", [(64, "e.g. 63 or 66"), (100, "e.g. 99 or 102"), (4, "e.g. 3 or 6")])
def test_local_batch_not_divisible(batch, suggestion):
    with pytest.raises(UsageError) as e:
        three_processes().local_batch(batch)
    message = str(e.value)
    assert message.startswith(f"--batch-size {batch} does not split over 3 processes")
    assert "use a multiple of 3" in message and suggestion in message


def test_local_batch_in_a_launched_job_uses_the_job_size():
    launched = strategies.create("ddp", CPU1, Job(rank=1, world=4, launcher="torchrun"))
    assert launched.processes == 1 and launched.world == 4
    assert launched.local_batch(64) == 16
    with pytest.raises(UsageError, match="over 4 processes"):
        launched.local_batch(66)


@pytest.mark.parametrize("batch", [0, -4])
def test_local_batch_must_be_positive(batch):
    for strategy in (three_processes(), strategies.create("single", CPU1, Job())):
        with pytest.raises(UsageError, match=f"--batch-size {batch}: must be at least 1"):
            strategy.local_batch(batch)


@pytest.mark.parametrize("flags", [dict(batch_size=10**9), dict(batch_size=None, accumulate=100)],
                         ids=["batch", "accumulate"])
def test_a_global_batch_larger_than_the_training_set_is_one_line(tmp_path, flags):
    named = r"--batch-size \d+" if flags["batch_size"] else r"--accumulate 100 \(a global batch of \d+\)"
    with pytest.raises(UsageError, match=named + r": the global batch is larger than the training set "
                                                 r"\(48 samples\); choose at most 48"):
        train(tmp_path, **flags)
    assert not any(tmp_path.iterdir())  # refused before --out is touched


# -- the cores a process may use, and how its threads wait (issue 34) --------------------------------------------

def test_a_cgroup_cpu_quota_is_read_in_v2_and_v1_and_the_least_above_counts(tmp_path, monkeypatch):
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "job" / "cpu.max").write_text("250000 100000\n")  # 2.5 cores for the parent group
    (tmp_path / "job" / "step" / "cpu.max").write_text("max 100000\n")  # none of its own
    (tmp_path / "cpu" / "box").mkdir(parents=True)
    (tmp_path / "cpu" / "box" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "cpu" / "box" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "self").write_text("0::/job/step\n")
    monkeypatch.setattr(devices, "CGROUP", tmp_path)
    monkeypatch.setattr(devices, "SELF_CGROUP", tmp_path / "self")
    assert devices.cpu_quota() == 2.5
    (tmp_path / "self").write_text("4:cpu,cpuacct:/box\n0::/job/step\n")
    assert devices.cpu_quota() == 1.5
    (tmp_path / "cpu" / "box" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's no quota
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert devices.cpu_quota() is None
    monkeypatch.setattr(devices, "SELF_CGROUP", tmp_path / "missing")
    assert devices.cpu_quota() is None


def test_usable_cores_are_the_affinity_and_no_more_than_the_quota(monkeypatch):
    monkeypatch.setattr(devices, "cpu_cores", lambda: 8)
    monkeypatch.setattr(devices, "cpu_quota", lambda: 2.5)
    assert devices.usable_cores() == 2
    monkeypatch.setattr(devices, "cpu_quota", lambda: 0.5)
    assert devices.usable_cores() == 1
    monkeypatch.setattr(devices, "cpu_quota", lambda: None)
    assert devices.usable_cores() == 8


def test_others_running_is_the_kernels_runnable_count_less_this_process(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "LOADAVG", tmp_path / "loadavg")
    (tmp_path / "loadavg").write_text("6.61 5.02 4.10 5/310 4242\n")
    assert devices.others_running() == 4
    (tmp_path / "loadavg").write_text("0.00 0.00 0.00 1/120 4242\n")
    assert devices.others_running() == 0
    monkeypatch.setattr(devices, "LOADAVG", tmp_path / "missing")
    assert devices.others_running() == 0


@pytest.mark.parametrize("others, busy", [(0, False), (1, True), (6, True)])
def test_a_busy_machine_gets_passive_waiting_unless_the_user_chose_a_way(monkeypatch, others, busy):
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(devices, "usable_cores", lambda: 2)
    monkeypatch.setattr(devices, "others_running", lambda: others)
    assert devices.busy() is busy
    assert devices.openmp_env(1, {}) == ({"OMP_WAIT_POLICY": "PASSIVE"} if busy else {})
    assert devices.openmp_env(2, {}) == {"OMP_NUM_THREADS": "1", **({"OMP_WAIT_POLICY": "PASSIVE"} if busy else {})}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}, {"KMP_BLOCKTIME": "200"}):
        assert devices.openmp_env(1, chosen) == {}


def test_a_process_takes_its_share_of_the_usable_cores_and_never_follows_the_load(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(devices, "usable_cores", lambda: 4)
    monkeypatch.setattr(devices, "others_running", lambda: 100)  # the count must not change with the load
    assert devices.cpu_threads(1, 8) == 4  # torch's 8 on a container's 4 cores
    assert devices.cpu_threads(1, 2) == 2  # the script's (or torch's) own count, when lower
    assert devices.cpu_threads(3, 8) == 1
    assert devices.cpu_threads(8, 8) == 1
    assert devices.cpu_threads(2, 8) == 2 and devices.cpu_threads(2, 1) == 1  # on 2 processes too: the lower count
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert devices.cpu_threads(1, 6) == 6


DISPLAY = {"OMP_DISPLAY_ENV": "verbose"}  # libgomp prints what it read as torch loads it: GOMP_SPINCOUNT 0 is PASSIVE
BUSY = "import sys\nfrom multicard.jobs import devices\ndevices.busy = lambda: {busy}\n"


def spin_counts(stderr: str) -> list[str]:
    return re.findall(r"GOMP_SPINCOUNT = '(\d+)'", stderr)


@pytest.mark.parametrize("busy, spin", [(True, "0"), pytest.param(False, "300000", marks=pytest.mark.slow)])
def test_the_cli_tells_openmp_to_wait_passively_before_torch_loads_it_on_a_busy_machine(busy, spin):
    code = BUSY.format(busy=busy) + "from multicard.cli import main\nsys.exit(main(['env']))\n"
    env = {k: v for k, v in os.environ.items() if k not in WAITING} | DISPLAY
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HUNG_S)
    assert result.returncode == 0, result.stderr
    if not spin_counts(result.stderr):
        pytest.skip("this torch's OpenMP is not libgomp (it prints no GOMP_SPINCOUNT)")
    assert spin_counts(result.stderr) == [spin]


@pytest.mark.slow
def test_the_launcher_tells_each_rank_to_wait_passively_on_a_busy_machine():
    code = BUSY.format(busy=True) + ("from multicard.jobs.launcher import run_command\n"
                                     "sys.exit(run_command([sys.executable, '-c', 'import torch'], 2))\n")
    env = {k: v for k, v in os.environ.items() if k not in WAITING} | DISPLAY
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HUNG_S)
    assert result.returncode == 0, result.stderr
    if not spin_counts(result.stderr):
        pytest.skip("this torch's OpenMP is not libgomp (it prints no GOMP_SPINCOUNT)")
    assert spin_counts(result.stderr).count("0") == 2  # the two ranks' (this launcher had torch loaded before)
