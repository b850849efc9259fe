"""BucketedTrainer's checkpoints and step bookkeeping on 2 real gloo processes, the HF Trainer in-process: a checkpoint
is published only once every rank's files are in it and all of it is on disk, and ``total_flos`` counts every rank."""

import json
import os
from pathlib import Path

import pytest
import torch

from ..helpers.dist_harness import run_distributed
from ..helpers.trainers import Regressor, as_accelerate_rank, gloo_trainer_args, regression_rows

pytestmark = [pytest.mark.distributed, pytest.mark.faults]

STEPS, SAVE_EVERY, MICRO, ACCUMULATION = 4, 2, 2, 2


def _flos_per_sample(rank: int) -> float:
    """Each rank counts flos at its own rate, so the ranks' sum is told apart from either rank's count."""
    return 1000.0 * (1 + rank)


def _record_publishing(events: list[tuple]) -> None:
    """Append ``("fsync", path)`` for every ``os.fsync`` and ``("replace", src, dst, files, unsynced)`` for every
    ``os.replace`` (``files``: what ``src`` holds at that moment; ``unsynced``: those of them, and ``src``, not
    fsynced before)."""
    real_fsync, real_replace = os.fsync, os.replace
    synced = set()

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.add(path)
        events.append(("fsync", path))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        src = Path(src)
        held = [src, *src.rglob("*")] if src.is_dir() else [src]
        unsynced = [str(p.relative_to(src)) for p in held if str(p.resolve()) not in synced]
        files = sorted(str(p.relative_to(src)) for p in held if p.is_file())
        events.append(("replace", str(src), str(dst), files, unsynced))
        return real_replace(src, dst, **kwargs)

    os.fsync, os.replace = fsync, replace


def _checkpointing_run(rank, world_size, out):
    as_accelerate_rank(rank, world_size)
    from ddp_ft.integrations import BucketedTrainer
    from ddp_ft.training.hooks import install_run_hooks

    from ..helpers.faults import Fault, FaultInjector

    events: list[tuple] = []
    _record_publishing(events)
    torch.manual_seed(0)
    args = gloo_trainer_args(
        out,
        max_steps=STEPS,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=0.1,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
    )
    # rank 1 writes its files of checkpoint 2 two seconds after rank 0 (a slow disk)
    install_run_hooks(FaultInjector([Fault("slow-save", SAVE_EVERY, rank=1)], rank, attempt=0))

    class CountingTrainer(BucketedTrainer):
        def floating_point_ops(self, inputs) -> float:  # the Trainer's documented override; a rate per rank
            return _flos_per_sample(rank) * inputs["x"].shape[0]

    trainer = CountingTrainer(model=Regressor(), args=args, train_dataset=regression_rows())
    trainer.train()
    return events, trainer.state.total_flos


def test_published_whole_durable_flos_count_all_ranks(tmp_path):
    """Checkpoints at steps 2 and 4, rank 1 slow to write its files of the first: rank 0 renames each staging folder
    into place only once it holds every rank's RNG state and every file and folder in it was fsynced, then fsyncs the
    run folder (the rename itself). ``total_flos`` is the ranks' sum (each rank counts at its own rate), on both
    ranks and in every checkpoint's trainer_state.json."""
    run = tmp_path / "run"
    (events, flos0), (events1, flos1) = run_distributed(_checkpointing_run, str(run), timeout=180)
    assert not [e for e in events1 if e[0] == "replace" and "checkpoint-" in e[2]], "rank 1 published"
    published = {Path(e[2]).name: (i, e) for i, e in enumerate(events) if e[0] == "replace" and "checkpoint-" in e[2]}
    assert sorted(published) == ["checkpoint-2", "checkpoint-4"], events
    for name, (at, (_, src, dst, files, unsynced)) in published.items():
        assert Path(src).parent.name == ".staging" and Path(dst) == run / name, (src, dst)
        assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= set(files), (name, files)
        assert unsynced == [], (name, unsynced)
        assert ("fsync", str(run.resolve())) in events[at + 1 :], f"{name}: the rename was not made durable"
        assert sorted(str(p.relative_to(run / name)) for p in (run / name).rglob("*") if p.is_file()) == files
    # the premise: rank 1 wrote its files of checkpoint 2 well after rank 0 wrote its own (slow-save held it 2 s)
    first = run / "checkpoint-2"
    assert (first / "rng_state_1.pth").stat().st_mtime - (first / "rng_state_0.pth").stat().st_mtime > 1.0

    per_step = MICRO * ACCUMULATION * sum(_flos_per_sample(r) for r in range(2))
    assert flos0 == flos1 == STEPS * per_step
    for step in (2, 4):
        state = json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert state["total_flos"] == step * per_step, (step, state["total_flos"])
