"""The suite's multi-process harness: its processes come from a fork server started once, yet each sees what a
freshly spawned process would (the test's environment and working directory), and a failing rank is named."""

import os
from pathlib import Path

import pytest

from ..helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed


def _what_a_rank_sees(rank: int, world_size: int, name: str) -> tuple:
    print(f"rank {rank} says hello")
    return os.environ.get(name), os.getcwd(), os.getpid()


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own error")


def test_each_rank_own_process_with_test_env_and_cwd(tmp_path, monkeypatch, capsys):
    run_distributed(_what_a_rank_sees, "DDP_FT_HARNESS_PROBE")  # the fork server is running from here on
    monkeypatch.setenv("DDP_FT_HARNESS_PROBE", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    seen = run_distributed(_what_a_rank_sees, "DDP_FT_HARNESS_PROBE")
    assert [value for value, _, _ in seen] == ["set after the fork server started"] * 2
    assert [Path(cwd) for _, cwd, _ in seen] == [tmp_path] * 2
    assert len({pid for _, _, pid in seen} | {os.getpid()}) == 3
    out = capsys.readouterr().out  # each rank's output, replayed on the test's own stdout
    assert "--- rank 1 stdout:\nrank 1 says hello" in out


def test_raising_rank_fails_test_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)failed on 1 rank.*rank1 raised.*ValueError: rank one's own error"):
        run_distributed(_rank_one_raises)
