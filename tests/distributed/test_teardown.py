"""Both entry points tear the process group down in ``finally`` on every rank: after success, and after a failure
on one rank or on all of them. Real 2-process gloo groups made by the entry point's own ``init_distributed``."""

import importlib
import importlib.util
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ddp_ft.training.resolve import Resolved

from ..helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
# entry point -> (the module the body reads it from, the name there that trains)
ENTRY_POINTS = {
    "scripts/train.py": ("ddp_ft.commands.train", "train"),
    "recipes/qwen_ami.py": ("ddp_ft.integrations.recipe", "build_trainer"),
}


class _Saved:
    """A model or tokenizer whose save writes an empty folder."""

    def save_pretrained(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)


class _FakeTrainer:
    """What the recipe's main calls on the trainer, doing nothing."""

    stopped_by = None
    model = processing_class = _Saved()
    accelerator = SimpleNamespace(unwrap_model=lambda model, **_: model)

    def __init__(self, resolved):
        self.resolved = resolved  # what build_trainer was given: run_config.yaml is written from it

    def train(self, resume_from_checkpoint=None):
        pass

    def evaluate(self):
        return {}

    def save_model(self, path):
        pass

    def save_state(self):
        pass


def _main_then_group_state(rank, world_size, entry_point, port, failing_ranks, output_dir):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    spec = importlib.util.spec_from_file_location(f"entry_{rank}", ROOT / entry_point)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = {}

    def work(
        settings, info, *args, **__
    ):  # the training (the recipe adds --trainer and what it resolved): the group is up, then fail or finish
        seen["initialized"] = dist.is_initialized() and dist.get_world_size() == world_size
        if rank in failing_ranks:
            raise RuntimeError(f"injected failure on rank {rank}")
        return _FakeTrainer(next((a for a in args if isinstance(a, Resolved)), None))

    body, name = ENTRY_POINTS[entry_point]
    setattr(importlib.import_module(body), name, work)
    try:
        module.main(["--preset", "tiny", "--report-to", "none", "--output-dir", output_dir])
        outcome = "returned"
    except RuntimeError as error:  # its own failure, or a collective (the final save's barrier) after a peer's
        assert f"injected failure on rank {rank}" in str(error) or (failing_ranks and rank not in failing_ranks)
        outcome = "raised" if rank in failing_ranks else "lost its peer"
    return seen["initialized"], outcome, dist.is_initialized()


@pytest.mark.parametrize("failing_ranks", [(), (1,)], ids=["success", "rank_1_fails"])
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_every_rank_tears_down_on_success_or_failure(entry_point, failing_ranks, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = run_distributed(
        _main_then_group_state, entry_point, port, failing_ranks, str(tmp_path / "run"), init_group=False, timeout=120
    )
    for rank, (was_initialized, outcome, still_initialized) in enumerate(results):
        assert was_initialized, f"rank {rank} trained without a 2-process group"
        expected = (
            {"raised"} if rank in failing_ranks else {"returned", "lost its peer"} if failing_ranks else {"returned"}
        )
        assert outcome in expected, (rank, outcome)
        assert not still_initialized, f"rank {rank} left its process group up ({outcome})"
