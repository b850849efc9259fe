"""When each bucket was ready in backward: ``BackwardRecorder`` at one process (no process group), and BucketedDDP's
reducer on two ranks, with the same buckets and the same clock (``ddp_ft.ddp.timeline``)."""

import time

import pytest
import torch
from torch import nn

from ddp_ft.ddp import BucketedDDP, DDPSettings, ParamSpec, compute_bucket_assignment
from ddp_ft.ddp.timeline import BackwardRecorder

from ..helpers.dist_harness import run_distributed

FIRST_CAP_MB = 16 / 1024  # the second layer's weight fills the first bucket: one bucket per layer
PAUSE_S = 0.1


class _PauseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class _Chain(nn.Module):
    """Two layers; backward pauses between them, and forward pauses before them (not backward's time)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(64, 64), nn.Linear(64, 64)
        self.pause = PAUSE_S

    def forward(self, x):
        time.sleep(self.pause)
        hidden = _PauseInBackward.apply(self.first(x), self.pause)
        return self.second(torch.tanh(hidden)).sum()


def _step(chain, pause, call=None):
    """One forward and backward of ``chain`` (through ``call``, a wrapper of it, if given)."""
    chain.pause = pause
    (call or chain)(torch.randn(4, 64)).backward()


def test_bucket_stamped_when_its_last_grad_is_ready():
    model = _Chain()
    recorder = BackwardRecorder(model, first_bucket_cap_mb=FIRST_CAP_MB)
    assert recorder.last_backward_timeline() is None
    _step(model, PAUSE_S)
    timeline = recorder.last_backward_timeline()
    second, first = timeline.ready_ms  # bucket 0 holds the last layer: backward reaches it first
    assert second < 0.5 * PAUSE_S * 1e3 <= PAUSE_S * 1e3 <= first <= timeline.backward_ms
    assert timeline.backward_ms < 1.9 * PAUSE_S * 1e3, "forward's pause counted: the clock must start in backward"
    assert PAUSE_S * 1e3 <= timeline.forward_ms < 1.9 * PAUSE_S * 1e3


def test_latest_kept_and_removed_hooks_record_nothing():
    model = _Chain()
    recorder = BackwardRecorder(model, first_bucket_cap_mb=FIRST_CAP_MB)
    _step(model, PAUSE_S)
    _step(model, 0.0)  # the next micro-step replaces it
    fast = recorder.last_backward_timeline()
    assert fast.ready_ms[1] < 0.5 * PAUSE_S * 1e3
    x = torch.randn(4, 64, requires_grad=True)
    model.pause = 0.0
    torch.autograd.grad(model(x), x)  # a pass into no parameter (a gradient penalty): not the iteration's backward
    assert recorder.last_backward_timeline() == fast
    recorder.remove_hooks()
    _step(model, PAUSE_S)
    assert recorder.last_backward_timeline() == fast


def test_bucket_bytes_are_the_layout_the_hook_sends():
    model = _Chain()
    specs = [ParamSpec.of(n, p) for n, p in model.named_parameters()]
    layout = compute_bucket_assignment(specs, 25.0, FIRST_CAP_MB)
    plain = DDPSettings(first_bucket_cap_mb=FIRST_CAP_MB).record_backward(model)
    assert plain.bucket_bytes == tuple(b.numel * 4 for b in layout) and len(layout) == 2
    compressed = DDPSettings(first_bucket_cap_mb=FIRST_CAP_MB, comm_hook="bf16").record_backward(model)
    assert compressed.bucket_bytes == tuple(b.numel * 2 for b in layout)
    with pytest.raises(ValueError, match="no trainable parameters"):
        BackwardRecorder(nn.Linear(2, 2).requires_grad_(False))


def _synced_backward_only(rank, world_size):
    model = _Chain()
    ddp = BucketedDDP(model, first_bucket_cap_mb=FIRST_CAP_MB)
    _step(model, PAUSE_S, ddp)
    slow = ddp.last_backward_timeline()
    with ddp.no_sync():
        _step(model, 0.0, ddp)  # no communication: not what a forecast replays
    unchanged = ddp.last_backward_timeline() == slow
    _step(model, 0.0, ddp)
    fast = ddp.last_backward_timeline()
    return slow, unchanged, fast, ddp.bucket_nbytes


@pytest.mark.distributed
def test_stamps_synced_backward_only_with_bytes_sent():
    for slow, unchanged, fast, nbytes in run_distributed(_synced_backward_only):
        assert slow.bucket_bytes == fast.bucket_bytes == tuple(nbytes)
        assert slow.ready_ms[0] < PAUSE_S * 1e3 <= slow.ready_ms[1] <= slow.backward_ms
        assert PAUSE_S * 1e3 <= slow.forward_ms and fast.forward_ms < PAUSE_S * 1e3
        assert unchanged and fast.ready_ms[1] < PAUSE_S * 1e3
