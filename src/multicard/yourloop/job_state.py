"""JobState: what one job knows in this process, from the moment a Multicard joins it to its close. Each part is
defined beside the code that uses it, and handed to that code (a set-up loader, a set-up model) by the Multicard:

- `share`: this process's share of the last uneven split and the weight its gradient takes (data/uneven.py);
- `habits`: the script's habits seen around the batches (forwards, global batches, an empty evaluation batch;
  data/habits.py);
- `inputs`: the batches compared between the processes (mc.local's, the first training forward's; inputs_alike.py);
- `params`: what the set-up models hold and which optimizers were set up; the set-up optimizers' parameters
  outside the models, averaged at each step (outside_params.py);
- `steps`: the job's optimizer steps in this process (the set-up optimizers' and those over a set-up model, not
  an optimizer of this process's own): alike on every rank at one point of a loop, so a save is known by it
  (checkpoints/randoms.py pairs the ranks' saves by it) and the replica check says where it is;
- `warned`: what was said once in this job (a second job in the process says it again).

One optimizer-step hook per open job on 2+ processes (or under fsdp): it counts the step, refuses what fsdp
cannot step, and lets `params` look at the step (an optimizer no open job set up is judged by the newest job).
The job's readings of an error that ends the process (a shape naming the global batch, an empty evaluation
batch, an op with no deterministic version) are tried by the process's one excepthook while the job is open
(jobs/progress.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..checkpoints.randoms import Handover
from ..data.habits import Habits
from ..data.uneven import Share
from ..errors import UsageError, note
from ..jobs import progress
from . import determinism
from .inputs_alike import Inputs
from .outside_params import OutsideParams


class JobState:
    def __init__(self, strategy: Any, replicas: Any) -> None:
        self.strategy, self.replicas = strategy, replicas  # replicas: the job's ReplicaCheck (its mode and every)
        self.share, self.habits = Share(), Habits()
        self.inputs, self.params = Inputs(self), OutsideParams(self)
        self.steps, self.warned, self.handover = 0, set(), Handover()  # handover: the saves' (checkpoints/randoms.py)
        self._hook: Any = None

    def __reduce__(self) -> tuple:
        """A copy (the Multicard or a set-up model pickled into a DataLoader worker) is no process of the job: it
        starts afresh, with no hook."""
        return JobState, (self.strategy, self.replicas)

    def open(self) -> None:
        if self.strategy.world > 1 or getattr(self.strategy, "sharded", False):
            self._hook = register_optimizer_step_pre_hook(self._before_step)
        progress.job_opened(self)
        progress.hook_failures()  # an error that ends the process is read by the open jobs (the one excepthook)

    def close(self) -> None:
        self.inputs.finish()  # a comparison under way: waited for (the group goes down next)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        progress.job_closed(self)

    def holds(self, parameter: torch.Tensor) -> bool:
        """Whether a model set up in this job, or in another open in the process, holds `parameter`."""
        return any(parameter in job.params.held for job in (self, *progress.open_jobs()) if isinstance(job, JobState))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """torch's pre-step hook, for every optimizer of the process while the job is open (one another job open
        in the process set up, or said is its own, is that job's)."""
        jobs = [job for job in progress.open_jobs() if isinstance(job, JobState)]
        if any(optimizer in job.params.optimizers or optimizer in job.params.own for job in jobs if job is not self):
            return
        if getattr(self.strategy, "sharded", False):
            self.strategy.check_optimizer(optimizer)  # one fsdp cannot step: refused at its first step
        if self.strategy.world > 1 and self.params.before_step(optimizer, judge=not jobs or jobs[-1] is self):
            self.inputs.judge()  # the batches of this step, compared before it is taken
            self.steps += 1
            if optimizer not in self.params.optimizers:
                self.replicas.stepped_elsewhere(optimizer)

    def stop_or_warn(self, line: str, what: str) -> None:
        """As the replica check is set: `line` stops the job ("stop"), or is a warning said once in this job, on
        rank 0 ("warn"; `what` names it among those said)."""
        if self.replicas.mode == "stop":
            raise UsageError(line)
        self.warned.add(what)
        if self.strategy.is_main:
            note(f"warning: {line}")

    def say_once(self, what: str, line: str) -> None:
        """`line` on stderr, the first time `what` is said in this job."""
        if what not in self.warned:
            self.warned.add(what)
            note(line)

    def explain(self, error: BaseException) -> BaseException | None:
        """The one line an error that ends this process is read as (None: none), a note added under a shape
        error that names the global batch."""
        said = self.habits.explain(error)
        return said if said is not None else determinism.refused(error)
