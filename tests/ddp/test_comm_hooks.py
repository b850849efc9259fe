"""The comm hooks as plain functions, the wire dtype each is counted in, and each registered on torch DDP."""

import copy

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ft.ddp import COMM_HOOKS, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ddp_ft.ddp.comm_hooks import wire_dtype

from ..helpers.dist_harness import run_distributed


def test_hooks_are_plain_functions_with_own_names():
    for name, hook in zip(
        ("allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"),
        (allreduce_hook, bf16_compress_hook, fp16_compress_hook),
        strict=True,
    ):
        assert hook.__name__ == hook.__qualname__ == name
        assert hook.__doc__
        assert vars(hook) == {}, f"{name} carries attributes set after its definition: {vars(hook)}"
    assert list(COMM_HOOKS.values()) == [allreduce_hook, bf16_compress_hook, fp16_compress_hook]


class _Unhashable:
    __hash__ = None

    def __call__(self, state, bucket):
        raise AssertionError("not called")


def test_wire_dtype_is_compressed_or_the_buffers():
    assert wire_dtype(bf16_compress_hook, torch.float32) is torch.bfloat16
    assert wire_dtype(fp16_compress_hook, torch.float32) is torch.float16
    assert wire_dtype(torch_hooks.bf16_compress_hook, torch.float32) is torch.bfloat16
    assert wire_dtype(torch_hooks.fp16_compress_hook, torch.float32) is torch.float16
    for hook in (allreduce_hook, torch_hooks.allreduce_hook, lambda state, bucket: None, _Unhashable()):
        assert wire_dtype(hook, torch.float32) is torch.float32
        assert wire_dtype(hook, torch.bfloat16) is torch.bfloat16


def _bf16_hook_as_named_for_gloo(state, bucket):
    """Our bf16 hook under another name: torch refuses any hook *named* bf16_compress_hook (its own included) unless
    CUDA and NCCL 2.10+ are there, so on gloo its gradients are checked through this wrapper."""
    return bf16_compress_hook(state, bucket)


def _refusal(model: torch.nn.Module, hook) -> str | None:
    """torch DDP's error when registering ``hook`` on a fresh wrapper of ``model``, or None when it registers."""
    try:
        TorchDDP(copy.deepcopy(model)).register_comm_hook(None, hook)
    except (TypeError, ValueError) as err:
        return str(err)
    return None


def _grads_with_each_hook_on_torch_ddp(rank: int, world_size: int) -> dict:
    """Per hook: torch DDP's gradients with our hook registered, and with torch's default (no hook); and what torch
    says when registering ours and its own bf16 hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + rank))  # each rank its own batch
    reference = TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.01)
    reference(x).pow(2).sum().backward()
    expected = [p.grad for p in reference.parameters()]
    refusals = {name: _refusal(model, hook) for name, hook in COMM_HOOKS.items()}
    refusals["torch bf16"] = _refusal(model, torch_hooks.bf16_compress_hook)
    grads = {}
    for name, hook in COMM_HOOKS.items():
        if name == "bf16" and refusals["torch bf16"] is not None:  # this torch refuses bf16 hooks by name here
            hook = _bf16_hook_as_named_for_gloo
        ddp = TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.01)  # several buckets: the hook runs more than once
        ddp.register_comm_hook(None, hook)  # state None: the default group
        ddp(x).pow(2).sum().backward()
        grads[name] = [p.grad for p in ddp.parameters()]
    return {"expected": expected, "grads": grads, "refusals": refusals}


@pytest.mark.timeout(300)
def test_hooks_register_on_torch_ddp_as_its_defaults():
    """torch's ``register_comm_hook`` checks the hook's annotations (``dist.GradBucket``,
    ``torch.futures.Future[torch.Tensor]``; strings under ``from __future__ import annotations`` fail). Each of ours
    registers (bf16 refused only where torch refuses its own bf16 hook: no CUDA/NCCL), and averages as torch's
    default does: allreduce to float32 rounding, bf16 and fp16 within their precision."""
    tolerance = {"allreduce": (1e-6, 1e-6), "bf16": (1.6e-2, 1e-2), "fp16": (2e-3, 1e-3)}
    for rank, result in enumerate(run_distributed(_grads_with_each_hook_on_torch_ddp)):
        refusals = result["refusals"]
        assert refusals["allreduce"] is None and refusals["fp16"] is None, refusals
        assert refusals["bf16"] == refusals["torch bf16"], refusals  # None with CUDA + NCCL 2.10+
        for name, grads in result["grads"].items():
            rtol, atol = tolerance[name]
            for g, e in zip(grads, result["expected"], strict=True):
                scale = e.abs().max().item()
                torch.testing.assert_close(g, e, rtol=rtol, atol=atol * scale, msg=f"{name} hook, rank {rank}")


def test_gradients_are_views_into_the_set_buffer():
    """torch's compress wrappers hand the hook a 16-bit copy (set_buffer) and PowerSGD then compresses
    ``bucket.gradients()``: those must be views into that copy, in its dtype, as in torch's GradBucket."""
    from ddp_ft.ddp import GradBucket

    flat = torch.arange(10.0)
    params = [torch.zeros(2, 3), torch.zeros(4)]
    views = [flat[0:6].view(2, 3), flat[6:10]]
    bucket = GradBucket(0, flat, params, views, is_last=True)
    assert [v.data_ptr() for v in bucket.gradients()] == [v.data_ptr() for v in views]
    half = flat.to(torch.float16)
    bucket.set_buffer(half)
    grads = bucket.gradients()
    assert [g.dtype for g in grads] == [torch.float16] * 2 and [g.shape for g in grads] == [(2, 3), (4,)]
    grads[1].fill_(-1)  # written through into the buffer the hook reduces
    assert half[6:].tolist() == [-1] * 4 and flat[6:].tolist() == [6, 7, 8, 9]
    bucket.reset_buffer()
    assert bucket.gradients()[0].data_ptr() == flat.data_ptr()
