"""The report as text: a short table for the terminal (:func:`format_table`) and a markdown file beside the JSON
(:func:`format_markdown`) that the README's GPU section can quote: which GPU, when, with which torch and CUDA."""

from __future__ import annotations

from pathlib import Path


def hardware_line(report: dict) -> str:
    """``1 x NVIDIA H100 80GB HBM3, torch 2.13.0+cu130 (CUDA 13.0), commit abc1234, <UTC start>``."""
    gpus = report.get("gpus") or []
    where = f"{len(gpus)} x {gpus[0]}" if gpus else f"CPU ({report.get('cpu', 'unknown')}), the smoke test"
    versions = report.get("versions", {})
    extras = ", ".join(f"{k} {v}" for k, v in versions.items() if k not in ("torch", "cuda") and v)
    commit = f", commit {report['commit']}" if report.get("commit") else ""
    return (
        f"{where}; torch {versions.get('torch')} (CUDA {versions.get('cuda')}){', ' + extras if extras else ''}"
        f"{commit}; {report['started_at']}"
    )


def _rows(report: dict, width: int | None) -> list[str]:
    rows = ["| # | step | status | seconds | result |", "|---:|---|---|---:|---|"]
    for i, step in enumerate(report["steps"], 1):
        seconds = f"{step['seconds']:.0f}" if step["seconds"] is not None else ""
        text = (step["summary"] or {}).get("headline") or step["reason"] or ""
        if width is not None and len(text) > width:
            text = text[: width - 3] + "..."
        rows.append(f"| {i} | {step['name']} | {step['status']} | {seconds} | {text.replace('|', '/')} |")
    return rows


def _totals(report: dict) -> str:
    counts: dict[str, int] = {}
    for step in report["steps"]:
        counts[step["status"]] = counts.get(step["status"], 0) + 1
    state = "finished" if report["finished"] else "in progress (or cut short)"
    tally = ", ".join(f"{n} {status}" for status, n in counts.items())
    return f"{tally}; {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget, {state}"


def format_table(report: dict) -> str:
    """The terminal's short table: one row per step, results cut to a line."""
    return "\n".join([f"GPU report: {hardware_line(report)}", *_rows(report, 110), _totals(report)])


def format_markdown(report: dict, json_path: Path) -> str:
    """The markdown beside the JSON: the hardware line, the table with every headline in full, the totals."""
    lines = [
        "# GPU report",
        "",
        hardware_line(report),
        "",
        *_rows(report, None),
        "",
        _totals(report) + f". Every step's command, result JSON and error tail: `{json_path.name}`.",
    ]
    return "\n".join(lines) + "\n"


def write_markdown(report: dict, json_path: Path) -> Path:
    """Write :func:`format_markdown` beside ``json_path`` (same name, ``.md``); the path written."""
    path = json_path.with_suffix(".md")
    path.write_text(format_markdown(report, json_path))
    return path
