"""Run a report's steps in order, each a subprocess with its own time limit.

The report JSON is rewritten atomically before and after each step, so a run cut short keeps what it measured.
A step starts only if its expected time fits the budget left; otherwise it is ``skipped``.
A failed step never stops the later ones. No torch here, so tests run fast.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

STATUSES = ("pending", "running", "passed", "failed", "timeout", "skipped")
FAILED = ("failed", "timeout")
ERROR_TAIL_CHARS = 3000  # of a failed step's output, kept in the JSON
KILL_GRACE_S = 10.0  # from SIGTERM to SIGKILL

# summarize(result, done) -> (summary, problems); ``done`` holds the earlier steps' records by name.
Summarize = Callable[[dict, dict[str, dict]], tuple[dict, list[str]]]


@dataclass
class Step:
    """One step of the report: a command that writes its result JSON.

    Args:
        name (str): short key, unique in the report.
        title (str): what it measures.
        command (list[str]): the argv.
        result (Path | None): the JSON the command writes. Default: none.
        expected_s (float): seconds it needs; it starts only if they are left.
        timeout_s (float): the most seconds it may run.
        skip (str | None): why planning skipped it.
        env (dict[str, str]): variables added to the environment.
        summarize (Summarize | None): headline numbers and problems from the result.
        needs (tuple[str, ...]): the steps whose output it reads.
    """

    name: str
    title: str
    command: list[str]
    result: Path | None = None
    expected_s: float = 60.0
    timeout_s: float = 300.0
    skip: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    summarize: Summarize | None = None
    needs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.command:
            raise ValueError(f"Step {self.name!r}: a step needs a name and a command.")
        if self.expected_s <= 0 or self.timeout_s < self.expected_s:
            raise ValueError(
                f"Step {self.name!r}: expected_s={self.expected_s} must be positive and at most "
                f"timeout_s={self.timeout_s}."
            )


def choose_steps(steps: list[Step], names: list[str] | None) -> list[Step]:
    """The steps ``names`` asks for, in its order, each after the steps it reads from; then the rest, skipped.

    None keeps every step in the plan's order.

    Raises:
        ValueError: a name that is no step, listing the steps.
    """
    if names is None:
        return steps
    known = {s.name: s for s in steps}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--steps {' '.join(unknown)}: no such step; choose from {' '.join(known)}")
    order: list[str] = []

    def add(name: str) -> None:
        for need in known[name].needs:
            add(need)
        if name not in order:
            order.append(name)

    for name in names:
        add(name)
    unchosen = f"not chosen (--steps {' '.join(names)})"
    rest = [s if s.skip else replace(s, skip=unchosen) for s in steps if s.name not in order]
    return [known[name] for name in order] + rest


def write_report(report: dict, path: Path) -> None:
    """Write ``report`` to ``path`` atomically.

    Args:
        report (dict): the report.
        path (Path): the report JSON.

    Example:
        >>> write_report({"steps": []}, Path("report.json"))
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would make it private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _record(step: Step, logs: Path) -> dict:
    return {
        "name": step.name,
        "title": step.title,
        "status": "pending",
        "command": shlex.join(step.command),
        "env": step.env,
        "expected_s": step.expected_s,
        "timeout_s": step.timeout_s,
        "seconds": None,
        "exit_status": None,
        "reason": None,
        "result_file": str(step.result) if step.result else None,
        "log": str(logs / f"{step.name}.log"),
        "result": None,
        "summary": None,
        "error_tail": None,
    }


def run_step(step: Step, limit_s: float, log: Path, done: dict[str, dict]) -> dict:
    """Run one step for at most ``limit_s`` seconds and return its record's fields.

    It runs in its own session, so a timeout kills everything it started.
    """
    if step.result is not None:
        step.result.unlink(missing_ok=True)  # a stale result must not pass for this one
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(
            step.command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **step.env}, start_new_session=True
        )
        try:
            code, status = process.wait(timeout=limit_s), None
        except subprocess.TimeoutExpired:
            _kill_group(process)
            code, status = process.returncode, "timeout"
    fields = {"seconds": time.monotonic() - started, "exit_status": code, "timeout_s": limit_s}
    if status is None:
        status = "passed" if code == 0 else "failed"
    if step.result is not None and step.result.exists():
        try:
            fields["result"] = json.loads(step.result.read_text())
        except ValueError as error:
            fields["reason"] = f"{step.result} is not JSON: {error}"
            status = "failed"
    if status == "passed" and step.result is not None and fields.get("result") is None:
        fields["reason"], status = f"exited 0 but wrote no {step.result}", "failed"
    if status == "passed" and step.summarize is not None:
        summary, problems = step.summarize(fields["result"], done)
        fields["summary"] = summary
        if problems:
            fields["reason"], status = "; ".join(problems), "failed"
    if status == "timeout":
        fields["reason"] = f"did not finish within {limit_s:.0f} s: killed"
    elif status == "failed" and code != 0:
        fields["reason"] = f"exit status {code}"
    if status in FAILED:
        fields["error_tail"] = log.read_text(errors="replace")[-ERROR_TAIL_CHARS:]
    return {**fields, "status": status}


def _kill_group(process: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def run_report(
    steps: list[Step],
    out: Path,
    budget_s: float,
    header: dict,
    clock: Callable[[], float] = time.monotonic,
    progress: Callable[[str], None] = print,
    also_write: Callable[[dict], None] | None = None,
) -> dict:
    """Run every step in order within ``budget_s`` seconds, rewriting ``out`` after each.

    Args:
        steps (list[Step]): most valuable first.
        out (Path): the report JSON; step logs go beside it.
        budget_s (float): seconds for all the steps.
        header (dict): what the report is about.
        clock (Callable): a monotonic clock. Default: ``time.monotonic``.
        progress (Callable): one line per step start and end. Default: ``print``.
        also_write (Callable | None): called after each rewrite.

    Returns:
        dict: the report as written last.

    Example:
        >>> report = run_report(steps, Path("gpu_report.json"), 3600, {})
    """
    names = [s.name for s in steps]
    if len(set(names)) != len(names):
        raise ValueError(f"step names must be unique: {names}")
    logs = out.with_name(f"{out.stem}_logs")
    report = {
        **header,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "budget_s": budget_s,
        "elapsed_s": 0.0,
        "finished": False,
        "steps": [_record(s, logs) for s in steps],
    }

    def write() -> None:
        write_report(report, out)
        if also_write is not None:
            also_write(report)

    write()
    start = clock()
    done: dict[str, dict] = {}
    for index, (step, record) in enumerate(zip(steps, report["steps"], strict=True)):
        left = budget_s - (clock() - start)
        tag = f"[{index + 1}/{len(steps)}] {step.name}"
        if step.skip is not None or left < step.expected_s:
            reason = step.skip or (
                f"would not fit: expects {step.expected_s:.0f} s, {max(int(left), 0)} s of the {budget_s:.0f} s budget "
                "left (a larger --budget-s runs it)"
            )
            record.update(status="skipped", reason=reason)
            progress(f"{tag}: skipped ({reason})")
        else:
            record["status"] = "running"
            write()
            limit = min(step.timeout_s, left)
            progress(f"{tag}: {record['command']} (up to {limit:.0f} s; output in {record['log']})")
            record.update(run_step(step, limit, Path(record["log"]), done))
            headline = (record["summary"] or {}).get("headline") or record["reason"] or ""
            progress(f"{tag}: {record['status']} in {record['seconds']:.0f} s" + (f": {headline}" if headline else ""))
        done[step.name] = record
        report["elapsed_s"] = clock() - start
        write()
    report["finished"] = True
    write()
    return report


def report_failed(report: dict) -> bool:
    """Whether any step failed or timed out (skipped steps are not failures)."""
    return any(s["status"] in FAILED for s in report["steps"])
