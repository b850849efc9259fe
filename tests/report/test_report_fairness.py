"""A comparison that cannot mislead: runs that differ in threads per process or device type get no speedup, old runs
a note, an oversubscribed or busy host a caveat. Small records, no training."""

from ddp_ft.report.comparison import Comparison, compare_runs, comparison_figure, markdown_table, summarize_run

from .test_report import compare, ddp_run, single_run


def _with(records, **host):
    """``records`` whose config record says ``host`` (a key set to None is removed: a run written before it)."""
    first = {k: v for k, v in {**records[0], **host}.items() if v is not None}
    return [first, *records[1:]]


def test_other_threads_per_process_withhold_ratios():
    c = compare(_with(single_run(), threads_per_process=16), ddp_run())
    assert (c.speedup, c.scaling_efficiency, c.step_time_ratio) == (None, None, None)
    (reason,) = c.not_comparable
    assert "threads per process (single-1: 16, ddp-2: 1)" in reason and "OMP_NUM_THREADS" in reason
    assert "ddp-ft train (or recipe) --nproc N" in reason
    table = markdown_table(c)
    for line in (
        "**Speedup** (global tokens/s, ddp-2 / single-1): not comparable (see below)",
        "**Scaling efficiency** (speedup / 2x devices): not comparable (see below)",
        "| device / threads per process | cpu / 16 | cpu / 1 |",
        "| tokens/s (global) | 1,100.0 | 1,900.0 |",  # each run's own numbers stay
        f"**Not comparable**: {reason}.",
    ):
        assert line in table, line
    assert c.loss_gap_max == 0.5  # the loss curves are still compared
    assert Comparison.from_dict(c.to_dict()) == c
    figure = comparison_figure(c)
    assert figure.get_supxlabel().startswith("Not comparable: the runs differ in threads per process")
    assert "speedup not comparable" in figure.axes[1].get_title()


def test_other_device_type_or_unfair_limit_is_named():
    c = compare(single_run(), _with(ddp_run(), device_type="cuda"))
    assert c.speedup is None and "device type (single-1: cpu, ddp-2: cuda)" in c.not_comparable[0]
    alone = summarize_run(_with(single_run(), threads_per_process=2))
    fair = compare(single_run(), ddp_run())
    limited = compare_runs(fair.baseline, single_run(), fair.other, ddp_run(), [alone, fair.baseline])
    assert limited.speedup == fair.speedup and limited.of_limit is None and limited.limit_tokens_per_s is not None
    assert "threads per process (single-1: 2, ddp-2: 1)" in limited.not_comparable[0]
    assert "of it (not comparable, see below)" in markdown_table(limited)


def test_runs_without_record_compared_with_a_note():
    unknown = {"threads_per_process": None, "device_type": None, "local_world_size": None, "usable_cpus": None}
    c = compare(_with(single_run(), **unknown), ddp_run())
    assert c.speedup == 1900.0 / 1100.0 and c.not_comparable == []
    assert any("threads per process and device type unknown for single-1" in n for n in c.notes)
    assert "| device / threads per process | unknown / unknown | cpu / 1 |" in markdown_table(c)


def test_an_oversubscribed_or_busy_host_is_a_caveat():
    crowded = _with(ddp_run(), threads_per_process=4, usable_cpus=2, host_load_1m=3.5)
    c = compare(_with(single_run(), threads_per_process=4, usable_cpus=4), crowded)
    assert c.speedup == 1900.0 / 1100.0  # same threads: comparable, with its caveats
    notes = " ".join(c.notes)
    assert "single-1 ran" not in notes
    assert "ddp-2 ran 2 process(es) x 4 thread(s) on 2 usable CPU(s): oversubscribed" in notes
    assert "at most 1 here" in notes and "the host was busy while ddp-2 started (load average 3.5" in notes
