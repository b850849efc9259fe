"""``ddp-ft --nproc 2`` owns its workers: a SIGTERM to ddp-ft, or a Ctrl-C to its process group, stops both ranks
after the step in flight with one checkpoint, one line says where it is and how to go on, no traceback, no process
left; ``--resume latest`` continues exactly. A rank that fails before training ends the launch with one line naming
the rank, the error and the file holding the traceback.

Which run covers what (real ``ddp-ft`` processes, tiny preset, 2 CPU ranks): ``train`` gets Ctrl-C as a terminal sends
it (SIGINT to the whole process group) and is resumed against an uninterrupted run; ``recipe`` gets SIGTERM sent to
the ``ddp-ft`` process alone; ``train`` with a wrong data path fails on both ranks.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_ft.report.metrics import read_jsonl, timeline
from ddp_ft.training.checkpoint import resolve_checkpoint

from ..helpers.dist_harness import PYTHONPATH, processes_running_with, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.faults]

DDP_FT = [sys.executable, "-m", "ddp_ft.commands.cli"]
FLAGS = ["--nproc", "2", "--preset", "tiny", "--save-every", "0", "--report-to", "none"]


def _env() -> dict:
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": PYTHONPATH,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return sum('"type": "train"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def _ctrl_c_as_in_a_terminal() -> None:
    """A terminal's job takes Ctrl-C; a suite started in the background (``cmd &``) ignores SIGINT, and its children
    would inherit that (ddp-ft keeps an ignored Ctrl-C ignored, as a background job should)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signalled(
    command: list[str], out: Path, sig: signal.Signals, whole_group: bool, console_dies: bool = False
) -> tuple[int, str]:
    """Start ``command`` as a terminal starts ``command | tee`` (a process group of its own, its output piped to a
    reader process), send ``sig`` once step 1 is logged (to the group, as Ctrl-C is, or to the ddp-ft process alone);
    its exit status and what the reader got. ``console_dies``: the reader is killed first, as Ctrl-C ends ``tee``."""
    console = out.parent / "console.txt"
    read, write = os.pipe()
    with console.open("wb") as sink:
        reader = subprocess.Popen(["cat"], stdin=read, stdout=sink)
    job = subprocess.Popen(
        command,
        cwd=out.parent,
        env=_env(),
        start_new_session=True,
        preexec_fn=_ctrl_c_as_in_a_terminal,
        stdout=write,
        stderr=write,
    )
    os.close(read)
    os.close(write)
    try:
        deadline = time.monotonic() + 240
        while _steps(out) < 1 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.poll() is None, console.read_text(errors="replace")[-6000:]
        if console_dies:
            reader.kill()
            reader.wait()
        os.killpg(job.pid, sig) if whole_group else job.send_signal(sig)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        try:
            reader.wait(timeout=30)  # its input ends once ddp-ft and every rank closed the pipe
        except subprocess.TimeoutExpired:
            reader.kill()
    assert not processes_running_with(str(out)), "a worker outlived ddp-ft"
    return job.returncode, console.read_text(errors="replace")


def _stopped_cleanly(output: str, checkpoint: Path, last_line: str) -> None:
    """One stop, one line saying where the checkpoint is and how to go on, ddp-ft's line last, no traceback."""
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-6000:]
    resume = [line for line in output.splitlines() if "--resume latest" in line]
    assert len(resume) == 1 and resume[0].startswith("[rank0] "), output[-6000:]
    assert "stopped by SIGTERM after step" in resume[0] and f"checkpoint {checkpoint};" in resume[0], resume
    assert checkpoint.is_dir()
    assert output.strip().splitlines()[-1].endswith(last_line), output[-3000:]


def _uninterrupted(rank: int, world_size: int, output_dir: str) -> None:
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training.config import settings_from_preset
    from ddp_ft.training.loop import train

    settings = settings_from_preset("tiny", max_steps=5, save_every=0, report_to="none", output_dir=output_dir)
    train(settings, DistInfo(rank, rank, world_size, world_size))


def test_ctrl_c_train_checkpoints_and_resumes_exactly(tmp_path):
    """A terminal's Ctrl-C reaches ddp-ft only (the workers run in sessions of their own); ddp-ft sends each worker
    one SIGTERM, they stop after the same step and rank 0 saves. Against an uninterrupted run: every step's loss and
    samples bit for bit (LoRA dropout on)."""
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    # The uninterrupted run on the suite's two ready processes (no launcher start-up: the same loop, group and data)
    run_distributed(_uninterrupted, str(full))
    command = [*DDP_FT, "train", *FLAGS, "--max-steps", "5", "--output-dir", str(interrupted)]
    status, output = _signalled(command, interrupted, signal.SIGINT, whole_group=True)
    assert status == 130, output[-6000:]
    (stop,) = [r for r in read_jsonl(interrupted / "metrics.jsonl") if r["type"] == "stop"]
    assert stop["signal"] == "SIGTERM" and 2 <= stop["step"] < 5, stop
    last = "ddp-ft train: stopped by SIGINT (sent once to every worker as SIGTERM); exit status 130"
    _stopped_cleanly(output, interrupted / f"ddp_ft-checkpoint-{stop['step']}", last)
    assert output.count(f"stopped by SIGTERM after step {stop['step']} of 5") == 2  # both ranks, the same step

    run = _run([*command, "--resume", "latest"], tmp_path)
    assert run.returncode == 0, run.stderr[-6000:]
    expected = [
        (r["step"], r["samples_seen"], r["loss"]) for r in read_jsonl(full / "metrics.jsonl") if r["type"] == "train"
    ]
    records = timeline(read_jsonl(interrupted / "metrics.jsonl"))
    assert [(r["step"], r["samples_seen"], r["loss"]) for r in records if r["type"] == "train"] == expected


def test_ctrl_c_with_dead_pipe_saves_and_logs_stop(tmp_path):
    """``ddp-ft train ... | tee run.log`` and Ctrl-C, which ends ``tee`` too: every write to the console then fails
    (BrokenPipeError). The ranks still stop after the step in flight, rank 0 saves the checkpoint ``--resume latest``
    finds, and the lines the console missed are in ``<output_dir>/logs/console.log``."""
    out = tmp_path / "run"
    command = [*DDP_FT, "train", *FLAGS, "--max-steps", "5", "--output-dir", str(out)]
    status, console = _signalled(command, out, signal.SIGINT, whole_group=True, console_dies=True)
    assert status == 130, console[-6000:]
    checkpoint = resolve_checkpoint("latest", out)  # raises without one
    log = (out / "logs" / "console.log").read_text(errors="replace")
    assert f"checkpoint {checkpoint}; continue with the same command and --resume latest" in log, log[-6000:]
    assert "ddp-ft train: stopped by SIGINT (sent once to every worker as SIGTERM)" in log, log[-6000:]
    assert "Traceback" not in log and not list(out.glob("logs/rank*-traceback.txt")), log[-6000:]


def test_sigterm_stops_recipe_with_one_checkpoint(tmp_path):
    out = tmp_path / "run"
    command = [*DDP_FT, "recipe", *FLAGS, "--max-steps", "6", "--output-dir", str(out)]
    status, output = _signalled(command, out, signal.SIGTERM, whole_group=False)
    assert status == 143, output[-6000:]
    (checkpoint,) = out.glob("checkpoint-*")
    last = "ddp-ft recipe: stopped by SIGTERM (sent once to every worker); exit status 143"
    _stopped_cleanly(output, checkpoint, last)
    assert not (out / "final").exists()  # stopped: no final evaluation and save


def test_missing_columns_end_launch_naming_rank_error(
    tmp_path,
):
    """Each rank fails as it loads the data (a file without the dialogue column: only a worker reads it); ddp-ft
    prints one line (instead of a traceback per rank and torchrun's summary: 151 lines) and keeps each rank's
    traceback in <output_dir>/logs."""
    out = tmp_path / "run"
    data = tmp_path / "meetings.jsonl"
    data.write_text("".join(f'{{"transcript": "meeting {i}", "summary": "s {i}"}}\n' for i in range(20)))
    run = _run([*DDP_FT, "train", *FLAGS, "--source", str(data), "--output-dir", str(out)], tmp_path)
    assert run.returncode == 1, run.stderr[-6000:]
    assert "Traceback" not in run.stdout + run.stderr, run.stderr[-6000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ddp-ft train: rank "), run.stderr[-6000:]
    rank = int(last.split("rank ")[1].split()[0])
    assert f"ValueError: DataSettings.source='{data}', split 'train': missing column(s) 'dialogue'" in last, last
    traceback_file = out / "logs" / f"rank{rank}-traceback.txt"
    assert f"full traceback: {traceback_file}" in last, last
    assert "Traceback (most recent call last)" in traceback_file.read_text()
    assert len(run.stderr.strip().splitlines()) < 15, run.stderr  # the ranks' startup lines, torch's two, ddp-ft's
