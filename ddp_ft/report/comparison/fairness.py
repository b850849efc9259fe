"""Whether two runs' speeds measure DDP: same threads per process, same device type, a quiet host.

A single process without ``OMP_NUM_THREADS`` takes every core, while torchrun's workers get one thread each.
Their ratio would measure threads, not DDP, so it is withheld.
"""

from __future__ import annotations

from typing import Protocol

# The config record's keys (``ddp_ft.report.records.host_record``) a RunSummary carries.
HOST_FIELDS = ("threads_per_process", "device_type", "local_world_size", "usable_cpus", "host_load_1m")

THREADS_FIX = (
    "start both with ddp-ft train (or recipe) --nproc N, which gives every process the same threads (one, unless "
    "OMP_NUM_THREADS is set), or export the same OMP_NUM_THREADS for both launches"
)


class HostFacts(Protocol):
    """What this module reads of a run (a ``RunSummary``)."""

    run_name: str
    threads_per_process: int | None
    device_type: str | None
    local_world_size: int | None
    usable_cpus: int | None
    host_load_1m: float | None


def mismatch(a: HostFacts, b: HostFacts) -> str | None:
    """Why the speeds of ``a`` and ``b`` cannot be compared, with the fix, else None.

    Args:
        a (HostFacts): one run.
        b (HostFacts): the other run.

    Returns:
        str | None: the reason and its fix.

    Example:
        >>> mismatch(single, ddp)
    """
    differ, fixes = [], []
    if a.device_type and b.device_type and a.device_type != b.device_type:
        differ.append(f"device type ({a.run_name}: {a.device_type}, {b.run_name}: {b.device_type})")
        fixes.append("run both on the same device type")
    if a.threads_per_process and b.threads_per_process and a.threads_per_process != b.threads_per_process:
        differ.append(
            f"threads per process ({a.run_name}: {a.threads_per_process}, {b.run_name}: {b.threads_per_process})"
        )
        fixes.append(THREADS_FIX)
    if not differ:
        return None
    return (
        f"{a.run_name} and {b.run_name} differ in {' and '.join(differ)}, so their speed ratio measures that, "
        f"not DDP: {'; '.join(fixes)}"
    )


def host_notes(runs: list[HostFacts]) -> list[str]:
    """Caveats on each run's host: facts missing, threads oversubscribed, or a busy host.

    Args:
        runs (list[HostFacts]): the runs compared.

    Returns:
        list[str]: the caveats.
    """
    notes = []
    unknown = [r.run_name for r in runs if r.threads_per_process is None or r.device_type is None]
    if unknown:
        notes.append(
            f"threads per process and device type unknown for {', '.join(unknown)} (written before ddp_ft recorded "
            "them): the speedup assumes every run had the same"
        )
    for run in runs:
        threads, local, cpus = run.threads_per_process, run.local_world_size, run.usable_cpus
        if run.device_type == "cpu" and threads and local and cpus and local * threads > cpus:
            notes.append(
                f"{run.run_name} ran {local} process(es) x {threads} thread(s) on {cpus} usable CPU(s): "
                f"oversubscribed, so its speed measures contention; give every run the same OMP_NUM_THREADS, at most "
                f"{max(1, cpus // local)} here"
            )
        if run.host_load_1m is not None and cpus and run.host_load_1m >= cpus:
            notes.append(
                f"the host was busy while {run.run_name} started (load average {run.host_load_1m:g} on {cpus} usable "
                "CPU(s), its own start-up included): other work may have slowed it; rerun on a quiet host"
            )
    return notes
