"""The pieces of a graceful stop, without a model: the signal flag, its agreement across ranks, saves under a second
signal, partial saves cleaned at start, elastic restarts resuming on their own, and the fault switch's format."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from ddp_ft.distributed import DistInfo
from ddp_ft.training.checkpoint import (
    TrainState,
    checkpoint_to_resume,
    clean_partial_saves,
    resolve_checkpoint,
    save_checkpoint,
    saved_position,
)
from ddp_ft.training.preemption import StopSignal

from ..helpers.checkpoints import training_parts
from ..helpers.dist_harness import PYTHONPATH, run_distributed
from ..helpers.faults import ENV, Fault, FaultInjector, injected, parse_faults

pytestmark = pytest.mark.faults


def test_stop_signal_is_recorded_handlers_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        assert stop.local_flag == 0.0
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first one's name
        assert stop.received == "SIGUSR1" and stop.local_flag == 1.0
    assert signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_stops_second_interrupts_only_alone(monkeypatch):
    """Under a launcher (ddp-ft, torchrun) a repeated SIGINT is the launcher's or a terminal's double delivery: one
    stop. A process running alone (one process, no launcher) gets a repeat only from the user pressing it again."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = signal.getsignal(signal.SIGINT)  # Python's KeyboardInterrupt, or SIG_IGN in a job started in background
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT" and stop.local_flag == 1.0
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr("ddp_ft.training.preemption._launched", lambda: True)
    monkeypatch.setattr(
        "ddp_ft.training.preemption._die_with_parent", lambda sig: False
    )  # not this test process's parent
    with StopSignal() as stop:
        for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            os.kill(os.getpid(), sig)
        assert stop.received == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


def test_signal_mid_step_stops_after_that_step(tmp_path):
    """The flag is read after the step's last backward: SIGUSR1 sent in step 2's forward stops the run after step 2
    with its checkpoint (it used to be read before the forward: the run went on to step 3)."""
    from ddp_ft.training.config import settings_from_preset
    from ddp_ft.training.loop import train

    settings = settings_from_preset("tiny", max_steps=4, save_every=0, report_to="none", output_dir=str(tmp_path))
    with injected("sigusr1-self@2"):
        result = train(settings, DistInfo())
    assert (result.steps, result.stopped_by) == (2, "SIGUSR1")
    assert resolve_checkpoint("latest", tmp_path).name == "ddp_ft-checkpoint-2"


class _TinyLM(torch.nn.Module):
    """Called as the loop calls a causal LM."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, labels, attention_mask, num_items_in_batch):
        return SimpleNamespace(loss=self.linear(labels.float().unsqueeze(-1)).sum() / num_items_in_batch)


def _agree(rank, world_size):
    import torch.distributed as dist

    from ddp_ft.ddp import BucketedDDP
    from ddp_ft.training.steps import forward_backward_timed

    info = DistInfo(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")
    group = [{"labels": torch.tensor([[-100, 5, 6]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}]
    counts = torch.tensor([4.0, 6.0], dtype=torch.float64)  # the loop's: from the global order, no collective
    torch.manual_seed(0)
    model = BucketedDDP(_TinyLM())
    blocking = []  # the collectives a step waits on (the buckets' all-reduces are async)
    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_object"):
        original = getattr(dist, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            if not kwargs.get("async_op", False):
                blocking.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, recording)
    with StopSignal() as stop:
        flag = lambda: stop.local_flag  # noqa: E731
        before = forward_backward_timed(model, group, info, counts, stop_flag=flag).stop_flags.tolist()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        after = forward_backward_timed(model, group, info, counts, stop_flag=flag).stop_flags.tolist()
        return before, after, stop.received, blocking


@pytest.mark.distributed
def test_signal_to_1_rank_reaches_all_in_1_collective():
    """The flag rides on the gather of loss and compute time every step makes anyway: the signalled rank and the
    other see the same verdict at the same step boundary, and a step waits on that one collective only."""
    results = run_distributed(_agree)
    for rank, (before, after, received, blocking) in enumerate(results):
        assert before == [0.0, 0.0], rank
        assert after == [0.0, 1.0], rank
        assert received == (None if rank == 0 else "SIGUSR1")
        assert blocking == ["all_gather", "all_gather"], blocking  # one per step


def test_second_signal_does_not_interrupt_a_save(tmp_path):
    model, optimizer, scheduler = training_parts()
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)

        def signal_again(step):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)

        path = save_checkpoint(
            tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo(), before_publish=signal_again
        )
        assert stop.received == "SIGTERM"
    assert resolve_checkpoint("latest", tmp_path) == path
    assert saved_position(path)[0] == TrainState(3, 0, 6, 24)
    assert torch.load(path / "optimizer.pt", weights_only=True)["param_groups"]
    assert not clean_partial_saves(tmp_path)


def test_partial_saves_removed_previous_one_resumes(tmp_path):
    model, optimizer, scheduler = training_parts()
    good = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(2, 0, 4, 16), DistInfo())
    (tmp_path / ".tmp-ddp_ft-checkpoint-4" / "adapter").mkdir(parents=True)  # the loop's save, killed mid-write
    (tmp_path / ".staging" / "checkpoint-4").mkdir(parents=True)  # BucketedTrainer's, killed mid-write
    assert resolve_checkpoint("latest", tmp_path) == good
    assert sorted(clean_partial_saves(tmp_path)) == [".staging/checkpoint-4", ".tmp-ddp_ft-checkpoint-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp_ft-checkpoint-2", "latest"]


def test_elastic_restart_resumes_newest_checkpoint(tmp_path):
    model, optimizer, scheduler = training_parts()
    assert checkpoint_to_resume("", tmp_path, restart_count=1) is None  # crashed before the first save: start over
    first = save_checkpoint(tmp_path / "a", model, optimizer, scheduler, TrainState(2, 0, 4, 16), DistInfo())
    newest = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(4, 0, 8, 32), DistInfo())
    assert checkpoint_to_resume("", tmp_path, restart_count=0) is None
    assert checkpoint_to_resume(str(first), tmp_path, restart_count=0) == first
    # the restarted ranks get the first attempt's arguments: they continue where that attempt got to
    assert checkpoint_to_resume(str(first), tmp_path, restart_count=1) == newest
    assert checkpoint_to_resume("", tmp_path, restart_count=2) == newest


def test_fault_switch_is_strict_fires_on_its_rank():
    faults = parse_faults("forward@3,rank=1; kill-in-save@4,attempt=*")
    assert faults == [Fault("forward", 3, 1, 0), Fault("kill-in-save", 4, 0, None)]
    assert [f.kind for f in FaultInjector(faults, rank=0, attempt=1).faults] == ["kill-in-save"]
    assert [f.kind for f in FaultInjector(faults, rank=1, attempt=0).faults] == ["forward"]
    assert not FaultInjector(faults, rank=1, attempt=1)
    model = torch.nn.Linear(1, 1)
    FaultInjector(parse_faults("slow-save@2; kill-in-save@2; data@2"), rank=0, attempt=0).attach(model)
    assert not model._forward_pre_hooks and not model._forward_hooks  # faults fired outside forward add no hooks
    for bad in ("explode@3", "forward@0", "forward", "forward@3,ranks=1"):
        with pytest.raises(ValueError, match=ENV):
            parse_faults(bad)


def _elastic_env(monkeypatch, port: int, restart: int, nodes: int) -> None:
    for name, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_MAX_RESTARTS": "1",
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "GROUP_WORLD_SIZE": str(nodes),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(name, value)


def test_each_restart_gets_own_keys_in_shared_store(monkeypatch):
    """torchrun keeps its rendezvous store across restarts: a restarted rank reading a key the failed attempt wrote
    (gloo's peer addresses) connects to a dead process. Every attempt's process group gets its own key space."""
    from torch.distributed import TCPStore

    from ddp_ft.distributed import _restart_safe_store

    agent_store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    _elastic_env(monkeypatch, agent_store.port, restart=0, nodes=1)
    first = _restart_safe_store(rank=0, world_size=1, timeout_s=5)
    first.set("rank1_address", "attempt 0's")
    _elastic_env(monkeypatch, agent_store.port, restart=1, nodes=1)
    second = _restart_safe_store(rank=0, world_size=1, timeout_s=5)
    assert not second.check(["rank1_address"])  # the failed attempt's address is not seen
    second.set("rank1_address", "attempt 1's")
    assert first.get("rank1_address") == b"attempt 0's" and second.get("rank1_address") == b"attempt 1's"


def test_restarts_across_nodes_on_shared_store_refused(monkeypatch):
    from ddp_ft.distributed import _restart_safe_store

    _elastic_env(monkeypatch, 1, restart=0, nodes=2)
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        _restart_safe_store(rank=0, world_size=4, timeout_s=5)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restarts: torch's default rendezvous, nothing to refuse
    assert _restart_safe_store(rank=0, world_size=4, timeout_s=5) is None


_CHILD = """
import os, sys, time
from pathlib import Path
from ddp_ft.training.preemption import StopSignal
def mark(text):  # whole or not at all: the test polls the file while it is rewritten
    Path(sys.argv[1] + ".tmp").write_text(text)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
with StopSignal() as stop:
    mark("ready")
    deadline = time.monotonic() + 60
    while stop.received is None and time.monotonic() < deadline:
        time.sleep(0.05)
    mark(f"stopped by {stop.received}")
"""
_LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(120)
"""


def test_rank_gets_sigterm_when_its_launcher_dies(tmp_path):
    """A launcher that dies of a signal it does not forward (torchrun of SIGUSR1 without --signals-to-handle, the
    single-process ``accelerate launch`` of anything) would leave its rank training on alone; the rank asks Linux for
    SIGTERM when its parent dies, so it stops with a checkpoint instead."""
    marker = tmp_path / "child.txt"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "PYTHONPATH": PYTHONPATH}
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _CHILD, str(marker)], env=env)
    deadline = time.monotonic() + 60
    while not (marker.exists() and marker.read_text() == "ready") and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.kill()  # SIGKILL: forwards nothing
    launcher.wait()
    while marker.read_text() == "ready" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "stopped by SIGTERM"
