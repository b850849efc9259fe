"""Host syncs per step, guarded on CPU: the loop reads what it logs from the device in one
transfer per step, and the meter times a CUDA step with events and reports peak memory per interval, with
torch.cuda's timing and memory calls mocked."""

import inspect

import pytest
import torch

from ddp_ft.report.metrics import ThroughputMeter


def test_loop_reads_the_device_once_per_step(tmp_path, monkeypatch):
    """Each ``.item()``/``.tolist()`` waits for the device. The loop's own, per step: one transfer of loss, grad norm,
    token count, the ranks' compute times and stop flags. Before: two (the stop flag read before the step, then the
    logged scalars); before that, four (loss, grad norm, tokens, flag)."""
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training import loop
    from ddp_ft.training.config import parse_settings

    reads = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = inspect.currentframe().f_back
            if caller.f_code.co_filename == loop.__file__:  # any of the loop's own functions
                reads.append((_name, caller.f_code.co_name, caller.f_lineno))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    settings = parse_settings(
        [
            "--preset",
            "tiny",
            "--max-steps",
            "3",
            "--effective-batch",
            "2",
            "--micro-batch",
            "1",
            "--max-seq-len",
            "96",
            "--eval-fraction",
            "0",
            "--report-to",
            "none",
            "--output-dir",
            str(tmp_path),
        ]
    )
    loop.train(settings, DistInfo())
    assert reads == [("tolist", "_step", reads[0][2])] * 3, reads


class _Event:
    """A CUDA event on a fake clock: ``record`` stamps it, ``elapsed_time`` is the difference in ms."""

    clock = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.stamp = None

    def record(self, stream=None):
        self.stamp = self.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.stamp - self.stamp) * 1000


def test_cuda_step_timed_by_events_peaks_per_interval(monkeypatch):
    """No ``torch.cuda.synchronize`` (it waits for every stream, the NCCL one included); the step time is the event
    pair's; the peaks are reset at each reading, so a log line reports its own interval, not the process's life."""
    peaks = {"allocated": 3e9, "reserved": 4e9}
    resets = []

    def no_synchronize(device=None):
        raise AssertionError("torch.cuda.synchronize in the meter")

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", no_synchronize)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    meter = ThroughputMeter(2, torch.device("cuda", 0))
    meter.start()
    _Event.clock[0] += 0.25
    first = meter.stop(1000)
    assert first["step_time_s"] == pytest.approx(0.25) and first["tokens_per_s"] == pytest.approx(4000)
    assert (first["peak_mem_gb"], first["peak_reserved_gb"]) == (3.0, 4.0) and len(resets) == 1
    peaks.update(allocated=1e9, reserved=4e9)
    meter.start()
    _Event.clock[0] += 0.5
    second = meter.stop(1000)
    assert (second["step_time_s"], second["peak_mem_gb"]) == (pytest.approx(0.5), 1.0) and len(resets) == 2
