"""BucketedDDP's lifecycle and the less common ways to drive it, against torch DDP: 2 real gloo processes.

Re-wrapping a module after the wrapper is dropped (or its hooks removed), ``torch.autograd.grad`` through a synced
forward (a gradient penalty), and a model whose own child is named ``module``.
"""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close

from ddp_ft.ddp import BucketedDDP

from ..helpers.dist_harness import gather_tensors, run_distributed
from ..helpers.models import Net, local_slice, make_batch

pytestmark = pytest.mark.distributed


def _train_step(model, optimizer, step, local):
    x, y = make_batch(step)
    torch.nn.functional.mse_loss(model(x[local]), y[local]).backward()
    grads = [p.grad.clone() for p in model.module.parameters() if p.requires_grad]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grads


def _rewrap(rank, world_size, explicit):
    torch.manual_seed(0)
    reference = Net()
    ours_module, theirs_module = copy.deepcopy(reference), copy.deepcopy(reference)
    opt_ours = torch.optim.SGD(ours_module.parameters(), lr=0.1, momentum=0.9)
    opt_theirs = torch.optim.SGD(theirs_module.parameters(), lr=0.1, momentum=0.9)
    local = local_slice(rank, world_size)

    first = BucketedDDP(ours_module, bucket_cap_mb=5000 / 2**20, first_bucket_cap_mb=1000 / 2**20)
    theirs = TorchDDP(theirs_module)
    for g_ours, g_theirs in zip(
        _train_step(first, opt_ours, 0, local), _train_step(theirs, opt_theirs, 0, local), strict=True
    ):
        assert_close(g_ours, g_theirs, rtol=0, atol=0)
    alive = weakref.ref(first)
    if explicit:
        first.remove_hooks()
        with pytest.raises(RuntimeError, match="remove_hooks"):
            first(make_batch(0)[0])
        first.remove_hooks()  # idempotent
    del first, theirs
    gc.collect()
    assert alive() is None, "the dropped wrapper is still alive (its gradient hooks keep it)"

    # The bare module trains locally again: no wrapper intercepts its gradients, nothing is communicated.
    x, y = make_batch(1)
    torch.nn.functional.mse_loss(ours_module(x[local]), y[local]).backward()
    copies = gather_tensors([p.grad for p in ours_module.parameters() if p.requires_grad])
    assert any(not torch.equal(a, b) for a, b in zip(*copies, strict=True)), "a dropped wrapper still communicated"
    ours_module.zero_grad(set_to_none=True)

    second = BucketedDDP(ours_module)
    theirs = TorchDDP(theirs_module)
    for step in (2, 3):
        for g_ours, g_theirs in zip(
            _train_step(second, opt_ours, step, local), _train_step(theirs, opt_theirs, step, local), strict=True
        ):
            assert_close(g_ours, g_theirs, rtol=0, atol=0)
    for p_ours, p_theirs in zip(ours_module.parameters(), theirs_module.parameters(), strict=True):
        assert_close(p_ours, p_theirs, rtol=0, atol=0)


@pytest.mark.parametrize("explicit", [False, True], ids=["wrapper_dropped", "remove_hooks"])
def test_rewrapped_module_trains_as_torch_ddp(explicit):
    """Wrap, train a step, drop the wrapper (garbage-collected, or remove_hooks() first), train the bare module
    locally, wrap again and train: gradients and parameters equal torch DDP's, re-wrapped the same way."""
    run_distributed(_rewrap, explicit)


def _gradient_penalty(rank, world_size):
    torch.manual_seed(0)
    reference = Net()
    ours = BucketedDDP(copy.deepcopy(reference), bucket_cap_mb=5000 / 2**20, first_bucket_cap_mb=1000 / 2**20)
    theirs = TorchDDP(copy.deepcopy(reference))
    local = local_slice(rank, world_size)
    for step in range(2):
        x, y = make_batch(step)
        for model in (ours, theirs):
            inputs = x[local].clone().requires_grad_()
            loss = torch.nn.functional.mse_loss(model(inputs), y[local])
            (input_grad,) = torch.autograd.grad(loss, inputs, create_graph=True)
            (loss + input_grad.pow(2).sum()).backward()
        assert ours.last_comm_stats().allreduce_calls == len(ours.bucket_sizes)
        for (name, p_ours), p_theirs in zip(ours.module.named_parameters(), theirs.module.parameters(), strict=True):
            if p_ours.requires_grad:
                assert_close(p_ours.grad, p_theirs.grad, rtol=0, atol=0, msg=name)
        for model in (ours, theirs):
            model.module.zero_grad(set_to_none=True)


def test_autograd_grad_then_backward_as_torch_ddp():
    """A gradient penalty: torch.autograd.grad(loss, inputs, create_graph=True) accumulates into no parameter and
    must not end the iteration; the backward of loss + penalty that follows reduces, exactly as torch DDP."""
    run_distributed(_gradient_penalty)


class _HasModuleChild(nn.Module):
    """A model whose own top-level child is called ``module``, like the wrapper's attribute."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        return self.head(torch.tanh(self.module(x))) + self.offset


def _module_child_state_dict(rank, world_size):
    torch.manual_seed(0)
    inner = _HasModuleChild()
    model = BucketedDDP(inner)
    assert list(model.state_dict()) == list(inner.state_dict())
    for saved in (
        {k: v.clone() + 1 for k, v in model.state_dict().items()},  # the wrapper's own form: the inner model's keys
        {f"module.{k}": v.clone() + 2 for k, v in inner.state_dict().items()},  # torch DDP's prefixed form
    ):
        model.load_state_dict(saved)
        for (key, value), expected in zip(inner.state_dict().items(), saved.values(), strict=True):
            assert torch.equal(value, expected), key
    # nested under a parent module, the prefixes compose
    parent = nn.ModuleDict({"ddp": model})
    saved = {k: v.clone() + 3 for k, v in parent.state_dict().items()}
    assert list(saved) == [f"ddp.{k}" for k in inner.state_dict()]
    parent.load_state_dict(saved)
    for (key, value), expected in zip(inner.state_dict().items(), saved.values(), strict=True):
        assert torch.equal(value, expected), key


def test_state_dict_round_trips_child_named_module():
    run_distributed(_module_child_state_dict)


def _never_popped(rank, world_size):
    from ddp_ft.ddp.stats import MAX_PENDING_WAITS

    torch.manual_seed(0)
    ours = BucketedDDP(Net(), bucket_cap_mb=5000 / 2**20, first_bucket_cap_mb=1000 / 2**20)
    local = local_slice(rank, world_size)
    per_backward = []
    for step in range(MAX_PENDING_WAITS + 20):
        x, y = make_batch(step)
        torch.nn.functional.mse_loss(ours(x[local]), y[local]).backward()
        per_backward.append(ours.last_comm_stats().exposed_comm_ms)
        ours.module.zero_grad(set_to_none=True)
    held = ours.pending_comm_waits
    stats = ours.pop_comm_stats()
    return held, stats.synced_backwards, stats.exposed_comm_ms, sum(per_backward), MAX_PENDING_WAITS


def test_unpopped_comm_timings_bounded_and_add_up():
    """A plain Accelerate user never calls pop_comm_stats(): the wrapper kept one measurement (a CUDA event pair on
    GPU) per synced backward for the whole run. Now it holds at most MAX_PENDING_WAITS + 1, folding the oldest into
    milliseconds, and the popped total still equals the sum of every backward's own measurement."""
    for held, synced, total, expected, bound in run_distributed(_never_popped):
        assert synced == bound + 20 and held <= bound + 1, (held, synced)
        assert total == pytest.approx(expected, rel=1e-9)
