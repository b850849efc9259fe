"""Fault injection: how the fault tests break real runs, through the library's hook point (``ddp_ft.training.hooks``).

In a process the suite starts, ``tests/helpers/fault_site/sitecustomize.py`` installs a ``FaultInjector`` when
``DDP_FT_INJECT_FAULT`` is set (``install_from_env``); a test that trains in its own process installs one itself.

``DDP_FT_INJECT_FAULT`` holds ``;``-separated faults ``KIND@STEP[,rank=R][,attempt=A]``:

- ``forward`` / ``backward`` / ``data``: raise ``InjectedFault`` in the model's forward, during its backward, or
  while collating, on the first micro-batch of optimizer step ``STEP`` (1-based, counted like ``global_step``).
- ``hang``: sleep for ever in that forward (a rank that is stuck while the others wait in a collective); SIGTERM
  kills it, where a rank stuck in C code would wait for the launcher's SIGKILL.
- ``sigterm-launcher`` / ``sigusr1-launcher``: send that signal to this rank's launcher (its parent process).
- ``sigterm-self`` / ``sigusr1-self``: send it to this rank only.
- ``overflow``: make that micro-batch's gradient inf/nan on this rank only (a float16 overflow), in backward.
- ``kill-in-save``: SIGKILL this rank in the middle of writing the checkpoint of step ``STEP`` (files partly
  written, nothing published).
- ``slow-save``: in ``BucketedTrainer``'s save of the checkpoint of step ``STEP``, hold this rank ``SLOW_SAVE_S``
  seconds after the ranks meet to save and before it writes its files (a slow disk): a rank 0 that published without
  waiting for every rank's files would publish a checkpoint without this rank's RNG state.

``rank`` (default 0) picks the rank; ``attempt`` the torchrun restart it fires on (``TORCHELASTIC_RESTART_COUNT``,
default 0: the first run only; ``*``: every attempt, so restarts run out).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ddp_ft.distributed import restart_count
from ddp_ft.training.hooks import RunHooks, install_run_hooks

ENV = "DDP_FT_INJECT_FAULT"
KINDS = (
    "forward",
    "backward",
    "data",
    "hang",
    "sigterm-launcher",
    "sigusr1-launcher",
    "sigterm-self",
    "sigusr1-self",
    "kill-in-save",
    "overflow",
    "slow-save",
)
SLOW_SAVE_S = 2.0
NOT_IN_FORWARD = ("data", "kill-in-save", "slow-save")  # fired elsewhere than the model's forward hooks


class InjectedFault(RuntimeError):
    """The error an injected fault raises."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    attempt: int | None = 0  # None: every attempt


def parse_faults(spec: str) -> list[Fault]:
    """``DDP_FT_INJECT_FAULT``'s value as faults.

    Raises:
        ValueError: an unknown kind, a step below 1 or a malformed field, naming the variable and the format.
    """
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        try:
            head, *fields = item.split(",")
            kind, step = head.split("@")
            options = dict(field.split("=", 1) for field in fields)
            unknown = set(options) - {"rank", "attempt"}
            if kind not in KINDS or int(step) < 1 or unknown:
                raise ValueError
            attempt = options.get("attempt", "0")
            faults.append(Fault(kind, int(step), int(options.get("rank", 0)), None if attempt == "*" else int(attempt)))
        except ValueError:
            raise ValueError(
                f"{ENV}={spec!r}: {item!r} is not KIND@STEP[,rank=R][,attempt=A|*] with KIND one of {', '.join(KINDS)} "
                "and STEP >= 1; unset it outside the fault tests."
            ) from None
    return faults


class FaultInjector(RunHooks):
    """Fires the faults meant for this rank and attempt; every method is a no-op when there are none.

    Micro-batches are counted from ``start(global_step, accumulation)`` on, so step numbers are the run's own
    ``global_step`` + 1 also after a resume.
    """

    def __init__(self, faults: list[Fault], rank: int, attempt: int) -> None:
        self.faults = [f for f in faults if f.rank == rank and f.attempt in (None, attempt)]
        self._start_step = 0
        self._accumulation = 1
        self._forwards = 0
        self._collates = 0
        self._pending_backward: Fault | None = None  # set by the forward whose backward is to fail

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector:
        return cls(parse_faults(os.environ.get(ENV, "")), rank, restart_count())

    def __bool__(self) -> bool:
        return bool(self.faults)

    def start(self, global_step: int, accumulation: int) -> None:
        self._start_step, self._accumulation = global_step, accumulation
        self._forwards = self._collates = 0

    def _due(self, kinds: tuple[str, ...], count: int) -> Fault | None:
        if count % self._accumulation:
            return None
        step = self._start_step + count // self._accumulation + 1
        return next((f for f in self.faults if f.kind in kinds and f.step == step), None)

    def wrap_collate(self, collate):
        if not any(f.kind == "data" for f in self.faults):
            return collate

        def collate_with_fault(samples):
            fault = self._due(("data",), self._collates)
            self._collates += 1
            if fault:
                raise InjectedFault(f"injected fault: data loading failed at step {fault.step} on rank {fault.rank}")
            return collate(samples)

        return collate_with_fault

    def attach(self, model: torch.nn.Module) -> None:
        if any(f.kind not in NOT_IN_FORWARD for f in self.faults):
            model.register_forward_pre_hook(self._before_forward)
            model.register_forward_hook(self._after_forward)

    def _before_forward(self, module, args):
        if not module.training:
            return
        fault = self._due(tuple(k for k in KINDS if k not in (*NOT_IN_FORWARD, "backward", "overflow")), self._forwards)
        self._pending_backward = self._due(("backward", "overflow"), self._forwards)
        self._forwards += 1
        if fault is None:
            return
        where = f"at step {fault.step} on rank {fault.rank}"
        if fault.kind == "forward":
            raise InjectedFault(f"injected fault: forward failed {where}")
        if fault.kind == "hang":
            # Stuck: the other ranks wait in their next collective until --ddp-timeout. SIGTERM ends it at once (as for
            # a process without a stop handler), so a test need not sit out the launcher's 30 s before SIGKILL, which
            # is what a rank stuck inside a collective or a kernel gets (its stop handler never runs).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(3600)
        sig = signal.SIGTERM if fault.kind.startswith("sigterm") else signal.SIGUSR1
        os.kill(os.getppid() if fault.kind.endswith("launcher") else os.getpid(), sig)

    def _after_forward(self, module, args, output):
        fault = self._pending_backward
        if fault is None or not module.training:
            return
        self._pending_backward = None
        logits = getattr(output, "logits", None)
        if logits is not None and logits.requires_grad and fault.kind == "overflow":
            logits.register_hook(lambda grad: grad * float("inf"))
        elif logits is not None and logits.requires_grad:

            def fail(grad):
                raise InjectedFault(f"injected fault: backward failed at step {fault.step} on rank {fault.rank}")

            logits.register_hook(fail)

    def checkpoint_partly_written(self, step: int) -> None:
        """Called by the savers between writing files and publishing them."""
        if any(f.kind == "kill-in-save" and f.step == step for f in self.faults):
            os.kill(os.getpid(), signal.SIGKILL)

    def checkpoint_writing(self, step: int) -> None:
        """Called by ``BucketedTrainer`` on every rank after the ranks meet to save, before this rank writes."""
        if any(f.kind == "slow-save" and f.step == step for f in self.faults):
            time.sleep(SLOW_SAVE_S)


def install_from_env() -> None:
    """Install the faults ``DDP_FT_INJECT_FAULT`` describes for this process's launched rank (``RANK``, else 0).

    Every rank gets an injector, one with no faults for it included, so a stock trainer is refused on every rank.
    """
    install_run_hooks(FaultInjector.from_env(int(os.environ.get("RANK") or 0)))


@contextmanager
def injected(spec: str, rank: int = 0, attempt: int = 0) -> Iterator[FaultInjector]:
    """The faults ``spec`` describes installed for ``rank`` and ``attempt`` while the block runs, in this process."""
    injector = FaultInjector(parse_faults(spec), rank, attempt)
    install_run_hooks(injector)
    try:
        yield injector
    finally:
        install_run_hooks(None)
