"""Forecast a finished one-process run on N ranks by replaying each measured step."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields

from ..records import BACKWARD, CONFIG, micro_step_ms, of_type, timed_train_records
from .links import MEASURED, Link, ring_allreduce_ms
from .schedule import MeasuredStep, PredictedStep, predict_step, rank_wait_ms

SINGLE_NODE_RANKS = (2, 4, 8)
NODES = 2


@dataclass(frozen=True)
class ForecastRow:
    """One setup of the table, as medians over the timed steps.

    Args:
        setup (str): e.g. ``2 processes`` or ``2 nodes x 8``.
        ranks (int): processes in all.
        nodes (int): machines.
        link (str): the links the ring crosses.
        accumulation (int): micro-steps per rank per step.
        effective_batch (int): samples per optimizer step.
        exposed_comm_ms (float): communication a step waits for.
        comm_ms (float): time the link is busy per step.
        step_time_s (float): seconds per optimizer step.
        tokens_per_s (float): tokens per second over all ranks.
        scaling_efficiency (float | None): None for the measured run.
    """

    setup: str
    ranks: int
    nodes: int
    link: str
    accumulation: int
    effective_batch: int
    exposed_comm_ms: float
    comm_ms: float
    step_time_s: float
    tokens_per_s: float
    scaling_efficiency: float | None


@dataclass
class Forecast:
    """What ``ddp-ft forecast`` prints and writes.

    Args:
        run_name (str): the measured run.
        device_type (str | None): where it computed.
        micro_batch (int): its micro-batch.
        accumulation (int): its micro-steps per optimizer step.
        effective_batch (int): its samples per optimizer step.
        bucket_bytes (list[int]): bytes per bucket, in launch order.
        timed_steps (int): steps the medians are over.
        nproc (int): the processes per node asked for.
        links (list[dict]): the links used (:class:`Link` as dicts), the node's first.
        rows (list[ForecastRow]): the measured run, then each setup.
        assumptions (list[str]): what the numbers take for granted.
        notes (list[str]): caveats of this forecast.
    """

    run_name: str
    device_type: str | None
    micro_batch: int
    accumulation: int
    effective_batch: int
    bucket_bytes: list[int]
    timed_steps: int
    nproc: int
    links: list[dict]
    rows: list[ForecastRow]
    assumptions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Forecast:
        """Rebuild from :meth:`to_dict` output (a ``forecast.json``; other keys are ignored)."""
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = required - data.keys()
        if missing:
            raise ValueError(f"not a ddp-ft forecast: {sorted(missing)} missing")
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        values["rows"] = [ForecastRow(**row) for row in values["rows"]]
        return cls(**values)

    def row(self, ranks: int, nodes: int = 1) -> ForecastRow | None:
        """The row of ``ranks`` processes on ``nodes`` machines, if the table has one."""
        return next((r for r in self.rows if r.ranks == ranks and r.nodes == nodes), None)


def measured_steps(records: list[dict], skip_first: int = 1) -> tuple[dict, list[MeasuredStep]]:
    """The run's first config record and its timed steps with their ``backward`` records.

    Raises:
        ValueError: if the run cannot be forecast, naming what to run instead.
    """
    configs = of_type(records, CONFIG)
    if not configs:
        raise ValueError("no config record (type 'config'): is this a ddp_ft metrics.jsonl?")
    config = configs[0]
    name = config.get("run_name") or "the run"
    if config.get("world_size") != 1:
        raise ValueError(
            f"{name} ran on {config.get('world_size')} processes: ddp-ft forecast reads a one-process run "
            "(ddp-ft train without --nproc)"
        )
    if config.get("comm_hook") == "powersgd":
        raise ValueError(f"{name} uses comm_hook powersgd, whose traffic the ring's cost does not describe")
    backward = {r["step"]: r for r in of_type(records, BACKWARD)}
    timed = timed_train_records(records, skip_first)
    steps = [_step(r, backward[r["step"]], config["accumulation"]) for r in timed if r["step"] in backward]
    if not steps:
        raise ValueError(
            f"{name} has no backward records: a Trainer without BucketedTrainer, or an older ddp_ft, wrote it. Rerun "
            "it on one process with ddp-ft train, ddp-ft recipe or a BucketedTrainer"
        )
    return config, steps


def _step(train: dict, backward: dict, accumulation: int) -> MeasuredStep:
    """A :class:`MeasuredStep`; a micro-step costs the last forward and backward, else its share of compute.

    A Trainer's record averages its ``logged_steps`` (``logging_steps``), and its ``tokens`` sums them.
    """
    micro = micro_step_ms(backward)
    if micro is None:
        micro = train["compute_max_ms"] / accumulation
    return MeasuredStep(
        step_ms=train["step_time_s"] * 1e3,
        micro_ms=micro,
        accumulation=accumulation,
        tokens=train["tokens"] / train.get("logged_steps", 1),
        bucket_bytes=tuple(backward["bucket_bytes"]),
        ready_ms=tuple(backward["bucket_ready_ms"]),
        backward_ms=backward["backward_ms"],
    )


def split_batch(effective_batch: int, micro_batch: int, ranks: int) -> tuple[int, str | None]:
    """Micro-steps per rank that keep ``effective_batch``, else 1 and a note naming the run that would keep it."""
    per_step = micro_batch * ranks
    if effective_batch % per_step == 0:
        return effective_batch // per_step, None
    accumulation = max(1, effective_batch // per_step)
    note = (
        f"{ranks} ranks: effective batch {effective_batch} does not split into micro-batch {micro_batch} x {ranks} "
        f"ranks; forecast at accumulation {accumulation} (effective batch {micro_batch * accumulation * ranks})"
    )
    smaller = effective_batch // ranks if effective_batch % ranks == 0 else 0
    if smaller:  # its micro-step is not this run's to measure
        note += (
            f". To keep {effective_batch}, each rank runs micro-batch {smaller}: forecast a one-process run with "
            f"--micro-batch {smaller}"
        )
    return accumulation, note


def forecast_run(
    records: list[dict], nproc: int, link: Link, node_link: Link, skip_first: int = 1, name: str = "run"
) -> Forecast:
    """Forecast a one-process run on 2, 4 and 8 ranks and ``nproc`` of one node, and on 2 nodes of ``nproc``.

    Args:
        records (list[dict]): the run's records after :func:`~ddp_ft.report.metrics.timeline`.
        nproc (int): processes per node asked for.
        link (Link): the link between the processes of a node.
        node_link (Link): the link between nodes.
        skip_first (int): warm-up steps left out. Default: 1.
        name (str): the run's name if its config has none. Default: run

    Returns:
        Forecast: the table, its links, assumptions and notes.

    Raises:
        ValueError: if the run cannot be read or ``nproc`` is below 1.

    Example:
        >>> forecast = forecast_run(records, 2, PRESETS["nvlink"], PRESETS["infiniband"])
    """
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: give the processes per node, 1 or more")
    config, steps = measured_steps(records, skip_first)
    micro, effective = config["micro_batch"], config["effective_batch"]
    base_rate = statistics.median(s.tokens / s.step_ms * 1e3 for s in steps)
    measured = ForecastRow(
        setup="measured: 1 process",
        ranks=1,
        nodes=1,
        link="-",
        accumulation=config["accumulation"],
        effective_batch=effective,
        exposed_comm_ms=0.0,
        comm_ms=0.0,
        step_time_s=statistics.median(s.step_ms for s in steps) / 1e3,
        tokens_per_s=base_rate,
        scaling_efficiency=None,
    )
    setups = [(f"{n} processes", n, 1, [link]) for n in sorted({*SINGLE_NODE_RANKS, nproc}) if n > 1]
    setups.append((f"{NODES} nodes x {nproc}", NODES * nproc, NODES, [link, node_link] if nproc > 1 else [node_link]))
    rows, notes = [measured], []
    for setup, ranks, nodes, links in setups:
        accumulation, note = split_batch(effective, micro, ranks)
        notes += [note] if note else []
        predicted = _predict(steps, ranks, accumulation, links)
        rate = statistics.median(p.tokens / p.step_ms * 1e3 for p in predicted)
        rows.append(
            ForecastRow(
                setup=setup,
                ranks=ranks,
                nodes=nodes,
                link=" + ".join(k.label for k in links),
                accumulation=accumulation,
                effective_batch=micro * accumulation * ranks,
                exposed_comm_ms=statistics.median(p.exposed_ms for p in predicted),
                comm_ms=statistics.median(p.comm_ms for p in predicted),
                step_time_s=statistics.median(p.step_ms for p in predicted) / 1e3,
                tokens_per_s=rate,
                scaling_efficiency=rate / (ranks * base_rate),
            )
        )
    device, run_name = config.get("device_type"), str(config.get("run_name") or name)
    if device == "cpu" and link.name != MEASURED:
        notes.append(f"{run_name} computed on the CPU: its compute is paired with a GPU link ({link.label})")
    return Forecast(
        run_name=run_name,
        device_type=device,
        micro_batch=micro,
        accumulation=config["accumulation"],
        effective_batch=effective,
        bucket_bytes=list(steps[-1].bucket_bytes),
        timed_steps=len(steps),
        nproc=nproc,
        links=[k.to_dict() for k in dict.fromkeys([link, node_link])],
        rows=rows,
        assumptions=assumptions(device),
        notes=notes,
    )


def _predict(steps: list[MeasuredStep], ranks: int, accumulation: int, links: list[Link]) -> list[PredictedStep]:
    """Replay every measured step on ``ranks`` over ``links``."""
    wait = rank_wait_ms([s.micro_ms for s in steps], ranks, accumulation)
    cost = lambda n: ring_allreduce_ms(n, ranks, links)  # noqa: E731
    return [predict_step(s, ranks, accumulation, cost, wait) for s in steps]


def assumptions(device_type: str | None) -> list[str]:
    """What every forecast takes for granted, one sentence each."""
    clock = "CUDA events" if device_type == "cuda" else "the host clock"
    return [
        "each rank computes a micro-step as fast as the measured process did: no contention between ranks for "
        "cores, memory bandwidth or power",
        "micro-steps vary from rank to rank as the measured ones varied from step to step, independently: each step "
        "waits for its slowest rank (a rank's step taken as normal, the wait as the expected maximum of N draws "
        "less their mean), and that wait counts as exposed communication",
        f"a micro-step costs the forward and backward of each step's last one (by {clock})",
        "the effective batch is kept (accumulation per rank = measured accumulation / ranks), and the rest of a step "
        "(optimizer, clipping, logging) costs what it cost",
        "only the last micro-step of a step communicates; its buckets launch in index order, each once it and those "
        "before it are ready and the link is free, one all-reduce at a time",
        "a ring all-reduce of B bytes over N ranks costs 2(N-1)/N x B / bandwidth + 2(N-1) x latency: one ring, "
        "no other traffic; on 2 nodes the slower hop paces every step",
        "bucket ready times are the measured run's, in that same backward",
        "collectives outside the buckets (the loss gather, buffer broadcasts) are left out; preset bandwidths are "
        "published peaks, which all-reduces do not reach",
    ]
