"""Multi-node runs refuse an --output-dir that is not shared by every node, on every rank, naming the node.

Two real gloo processes stand for two nodes of one process each (``GROUP_RANK`` as torchrun sets it). Each runs in
its own working folder and uses the relative ``--output-dir run``: the same path on both "nodes", different
folders behind it, as node-local disks are.
"""

import os
import shutil
import socket
from pathlib import Path

import pytest

from ddp_ft.distributed import DistInfo
from ddp_ft.training.checkpoint import TrainState, checkpoint_to_resume, save_checkpoint
from ddp_ft.training.checkpoint.shared_fs import (
    MARKER_PREFIX,
    SharedFilesystemError,
    check_shared_output_dir,
    check_shared_resume,
)

from ..helpers.checkpoints import training_parts
from ..helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed


def _outcome(action):
    try:
        return ("ok", action())
    except Exception as err:
        return (type(err).__name__, str(err))


def _as_two_nodes(rank, world_size, root):
    os.environ["GROUP_RANK"] = str(rank)  # one process per node: node rank = rank
    info = DistInfo(rank=rank, local_rank=0, world_size=world_size, local_world_size=1)
    root = Path(root)
    resume = lambda: checkpoint_to_resume("latest", "run")  # noqa: E731 (what the loop resolves on every rank)
    results = {}
    os.chdir(root / "shared")
    results["shared"] = _outcome(lambda: check_shared_output_dir("run", info))
    results["shared_resume"] = _outcome(lambda: str(check_shared_resume(resume, info)))
    results["left_behind"] = sorted(p.name for p in Path("run").iterdir() if p.name.startswith(MARKER_PREFIX))
    os.chdir(root / f"node{rank}")
    results["apart"] = _outcome(lambda: check_shared_output_dir("run", info))
    results["apart_resume"] = _outcome(lambda: check_shared_resume(resume, info))
    os.chdir(root / "stale" / f"node{rank}")
    results["stale_resume"] = _outcome(lambda: check_shared_resume(resume, info))
    os.chdir(root / "empty")
    results["no_checkpoint"] = _outcome(lambda: check_shared_resume(resume, info))
    return results


def _checkpoint(output_dir: Path, step: int, samples_seen: int) -> None:
    model, optimizer, scheduler = training_parts()
    save_checkpoint(output_dir, model, optimizer, scheduler, TrainState(step, 0, 0, samples_seen), DistInfo())


def test_unshared_output_dir_fails_naming_the_node(tmp_path):
    _checkpoint(tmp_path / "shared" / "run", 4, 32)
    _checkpoint(tmp_path / "node0" / "run", 4, 32)  # node 1 has no checkpoint: its disk never got one
    (tmp_path / "node1").mkdir()
    _checkpoint(tmp_path / "stale" / "node0" / "run", 4, 32)
    _checkpoint(tmp_path / "stale" / "node1" / "run", 4, 64)  # same path and step, another run's state
    (tmp_path / "empty").mkdir()

    ranks = run_distributed(_as_two_nodes, str(tmp_path), timeout=120)

    host = socket.gethostname()
    for rank, results in enumerate(ranks):
        assert results["shared"] == ("ok", None), rank
        assert results["shared_resume"] == ("ok", "run/ddp_ft-checkpoint-4"), rank
        for scenario, problem in [
            ("apart", "cannot see it"),
            ("apart_resume", "FileNotFoundError"),
            ("stale_resume", "sees other files"),
        ]:
            kind, message = results[scenario]
            assert kind == SharedFilesystemError.__name__, (rank, scenario, message)
            assert message == ranks[0][scenario][1], "every rank raises the same message"
            assert f"rank 1 on node 1 (host {host}): {problem}" in message, message
            assert f"rank 0 on node 0 (host {host}): " not in message, "rank 0 is not among the failed"
            assert "filesystem shared by every node" in message
        # no checkpoint anywhere: rank 0's own error, on every rank
        assert results["no_checkpoint"] == (
            "FileNotFoundError",
            "--resume latest: no checkpoint in run (no 'latest' file).",
        ), rank
    assert ranks[0]["left_behind"] == [], "rank 0 removes its check file"
    assert not [p for p in (tmp_path / "node0" / "run").iterdir() if p.name.startswith(MARKER_PREFIX)]


def test_single_process_writes_nothing_resolves_same(tmp_path):
    check_shared_output_dir(tmp_path / "run", DistInfo())
    assert not (tmp_path / "run").exists()
    _checkpoint(tmp_path / "run", 2, 16)
    assert check_shared_resume(lambda: checkpoint_to_resume("latest", tmp_path / "run"), DistInfo()) == (
        tmp_path / "run" / "ddp_ft-checkpoint-2"
    )
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        check_shared_resume(lambda: checkpoint_to_resume("latest", tmp_path / "run"), DistInfo())
