"""Can N processes share one card over gloo (what `--devices 0,0` rehearses)? Plain torch, stage by stage.

A first probe on an H100 (2 processes on cuda:0 over gloo: DDP, then fully_shard, 5 SGD steps each; then NCCL)
printed nothing within 125 s and logged no stage, so where it stopped is unknown. This one says each stage as it
begins and as every process ends it, flushed at once, with a time limit per stage:

    start       the processes spawned, torch imported
    device      the card set and a first tensor made there (CUDA's context)
    init        a gloo process group over a file store, and one all_reduce of a tensor on the device
    ddp-build   DistributedDataParallel around a small MLP (it broadcasts rank 0's weights)
    ddp-step    --steps SGD steps of a global batch split over the processes; the weights compared with one
                process's steps on the whole batch (they must agree to 1e-4)
    fsdp-build  fully_shard of a fresh MLP on a 1-D device mesh
    fsdp-step   the same steps under fsdp (reduce-scatter, all-gather), compared the same way
    destroy     the process group destroyed
    nccl        (--nccl, on a card) whether NCCL takes the processes on one card: a question, not a stage to pass
                (its refusal, a hang or a process it ends are all said, and the probe still exits 0)

A stage that an error ends, or that a process is still in after its limit, is named ("probe: init hung on rank 1
..."), every process is killed, and the probe exits 1 with "probe: FAILED at STAGE" as its last line. Nothing of
multicard is used, so a failure here is torch's, gloo's or the card's. On the CPU (--devices cpu) it runs the
same stages, which is how it is tested.

    python benchmarks/rehearse_probe.py [--devices cuda:0] [--processes 2] [--steps 5] [--nccl]
                                        [--stage-timeout 60] [--start-timeout 120]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback

STAGES = ("start", "device", "init", "ddp-build", "ddp-step", "fsdp-build", "fsdp-step", "destroy")
TOLERANCE = 1e-4  # largest difference of a weight from one process's after the steps (float32, no TF32)


class Stopped(Exception):
    """SIGTERM, SIGINT or SIGHUP to the probe."""


def worker(rank: int, world: int, device_text: str, steps: int, folder: str, events, nccl: bool, hang: str,
           timeout: float) -> None:
    """One process of the probe: every stage in turn, each one's begin, end (with what it saw) or error sent to the
    parent on `events`. Ends itself when the parent is gone."""
    parent = os.getppid()

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    stage = "start"
    try:
        import torch  # the start stage is over when torch is in

        events.put((rank, "start", "end", ""))
        for stage, run in plan(rank, world, torch.device(device_text), steps, folder, nccl, timeout):
            events.put((rank, stage, "begin", ""))
            if stage == hang:  # --hang-in: the watchdog's own test (every process stops in the stage)
                time.sleep(1e9)
            events.put((rank, stage, "end", run() or ""))
        events.put((rank, "finished", "end", ""))
    except BaseException as error:  # noqa: BLE001 (every way a stage can end is reported)
        last = traceback.format_exception_only(type(error), error)[-1].strip().splitlines()[0]
        events.put((rank, stage, "error", last[:300]))
        raise SystemExit(1) from None


def plan(rank: int, world: int, device, steps: int, folder: str, nccl: bool, timeout: float):
    """(stage, what it does) for every stage after start, in order."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    torch.backends.cuda.matmul.allow_tf32 = False  # the same arithmetic as the one-process reference
    cuda = device.type == "cuda"
    width, batch = 32, 8 * world
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(steps, batch, width, generator=data)
    held = {"x": inputs, "y": torch.randint(0, 10, (steps, batch), generator=data)}  # on the device from its stage
    mine = slice(rank * 8, rank * 8 + 8)

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, 64), nn.Tanh(), nn.Linear(64, 10)).to(device)

    def train(model: nn.Module, whole: bool) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in zip(held["x"], held["y"], strict=True):
            x, y = (x, y) if whole else (x[mine], y[mine])
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)

    def compare(weights: dict) -> str:
        reference = mlp()
        train(reference, whole=True)
        apart = max((weights[k].cpu() - v.cpu()).abs().max().item() for k, v in reference.state_dict().items())
        if not apart <= TOLERANCE:
            raise AssertionError(f"the weights differ from one process's by {apart:.2e} (more than {TOLERANCE})")
        return f"{steps} steps, weights {apart:.1e} from one process's"

    def on_device() -> str:
        if cuda:
            torch.cuda.set_device(device)
        held.update(x=held["x"].to(device), y=held["y"].to(device))
        return f"torch {torch.__version__}, " + (torch.cuda.get_device_name(device) if cuda else "the CPU")

    def init() -> str:
        dist.init_process_group("gloo", init_method=f"file://{folder}/gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        total = torch.tensor([rank + 1.0], device=device)
        dist.all_reduce(total)
        if total.item() != world * (world + 1) / 2:
            raise AssertionError(f"all_reduce gave {total.item()}, not {world * (world + 1) / 2}")
        return f"all_reduce on {device} gave {total.item():g}"

    def ddp_build() -> None:
        from torch.nn.parallel import DistributedDataParallel

        held["ddp"] = DistributedDataParallel(mlp(), device_ids=[device] if cuda else None)

    def fsdp_build() -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        held["fsdp"] = fully_shard(mlp(), mesh=init_device_mesh(device.type, (world,)))

    def ddp_step() -> str:
        train(held["ddp"], whole=False)
        return compare(held.pop("ddp").module.state_dict())

    def fsdp_step() -> str:
        train(held["fsdp"], whole=False)
        return compare({k: v.full_tensor() for k, v in held.pop("fsdp").state_dict().items()})

    def with_nccl() -> str:
        if not cuda:
            return "skipped: NCCL needs a card"
        try:
            dist.init_process_group("nccl", init_method=f"file://{folder}/nccl", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout))
            total = torch.ones(1, device=device)
            dist.all_reduce(total)
            torch.cuda.synchronize(device)
            return f"NCCL took {world} processes on one card (all_reduce gave {total.item():g})"
        except Exception as error:  # noqa: BLE001 (the refusal is the expected answer)
            return f"NCCL refused: {str(error).strip().splitlines()[0][:200]}"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    stages = [("device", on_device), ("init", init), ("ddp-build", ddp_build), ("ddp-step", ddp_step),
              ("fsdp-build", fsdp_build), ("fsdp-step", fsdp_step), ("destroy", dist.destroy_process_group)]
    return stages + ([("nccl", with_nccl)] if nccl else [])


def say(line: str) -> None:
    print(f"probe: {line}", flush=True)


def watch(procs: list, events, stages: list[str], limits: dict[str, float], begun: list[str]) -> str | None:
    """Follow every process through the stages, saying each stage as it begins and as the last process ends it
    (`begun`: the stages begun so far, in order). Returns None when every process passed every stage, else the
    stage that failed or hung (said already)."""
    world = len(procs)
    now = time.monotonic()
    where = {rank: ("start", now) for rank in range(world)}  # each process's stage, and since when
    first = {"start": now}  # when each stage began on its first process
    ended: dict[str, list[str]] = {stage: [] for stage in stages}
    finished: set[int] = set()
    say("start ...")
    while len(finished) < world:
        try:
            rank, stage, what, detail = events.get(timeout=0.2)
        except queue.Empty:
            rank = None
        now = time.monotonic()
        if rank is not None and what == "error":
            say(f"{stage} FAILED on rank {rank}: {detail}")
            return stage
        if rank is not None and stage == "finished":
            finished.add(rank)
            where[rank] = ("finished", now)
        elif rank is not None and what == "begin":
            where[rank] = (stage, now)
            if stage not in first:
                first[stage] = now
                begun.append(stage)
                say(f"{stage} ...")
        elif rank is not None:
            ended[stage].append(detail)
            where[rank] = ("between stages", now)
            if len(ended[stage]) == world:
                seen = "; ".join(dict.fromkeys(d for d in ended[stage] if d))
                say(f"{stage} ok in {now - first[stage]:.2f} s" + (f" ({seen})" if seen else ""))
        hung = sorted((stages.index(s), r) for r, (s, since) in where.items()
                      if s in limits and now - since > limits[s] and r not in finished)
        if hung:
            stage = stages[hung[0][0]]
            ranks = [str(r) for i, r in hung if i == hung[0][0]]
            others = ", ".join(f"rank {r} in {s}" for r, (s, _) in where.items() if str(r) not in ranks)
            say(f"{stage} hung: rank{'s' * (len(ranks) > 1)} {', '.join(ranks)} still in it after "
                f"{limits[stage]:g} s" + (f" ({others})" if others else "") + "; killing every process")
            return stage
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in finished]
        if dead and events.empty():
            rank, code = dead[0]
            how = f"signal {-code}" if code < 0 else f"exit {code}"
            say(f"{where[rank][0]}: rank {rank} ended ({how}) without a word")
            return where[rank][0]
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="cuda:0", help="where every process works: cuda:0 (default) or cpu")
    p.add_argument("--processes", type=int, default=2, help="processes sharing the device (default: 2)")
    p.add_argument("--steps", type=int, default=5, help="SGD steps under DDP and under fsdp (default: 5)")
    p.add_argument("--nccl", action="store_true", help="last, ask whether NCCL takes the processes on one card")
    p.add_argument("--stage-timeout", type=float, default=60, help="seconds a stage may take (default: 60)")
    p.add_argument("--start-timeout", type=float, default=120, help="seconds to spawn the processes and import "
                   "torch in them (default: 120)")
    p.add_argument("--hang-in", choices=STAGES[1:] + ("nccl",), help=argparse.SUPPRESS)  # the watchdog's test
    args = p.parse_args()
    if args.processes < 2 or args.steps < 1:
        p.error("--processes must be at least 2 and --steps at least 1")
    stages = list(STAGES) + ["nccl"] * args.nccl
    limits = {stage: args.stage_timeout for stage in stages} | {"start": args.start_timeout}
    say(f"{args.processes} processes on {args.devices} over gloo; stages {', '.join(stages)}; at most "
        f"{args.stage_timeout:g} s each ({args.start_timeout:g} s to start)")

    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    context = multiprocessing.get_context("spawn")  # fresh processes: nothing of this one's state (CUDA) shared
    events = context.Queue()
    procs, begun = [], ["start"]
    with tempfile.TemporaryDirectory(prefix="rehearse-probe-") as folder:
        try:
            for rank in range(args.processes):
                procs.append(context.Process(target=worker, daemon=True, args=(
                    rank, args.processes, args.devices, args.steps, folder, events, args.nccl, args.hang_in,
                    args.stage_timeout)))
                procs[-1].start()
            failed = watch(procs, events, stages, limits, begun)
        except Stopped as signal_name:
            failed = begun[-1]
            say(f"stopped by {signal_name} in {failed}; killing every process")
        finally:
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.join(10)
    if failed == "nccl":
        say("every gloo stage passed; NCCL gave no answer (above)")
        return 0
    if failed:
        say(f"FAILED at {failed}")
        return 1
    say("every stage passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
