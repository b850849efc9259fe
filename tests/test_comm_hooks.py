"""The comm hooks as plain functions, and the wire dtype each is counted in: no process group needed."""

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

from ddp_ft.ddp import COMM_HOOKS, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ddp_ft.ddp.comm_hooks import wire_dtype


def test_hooks_are_plain_functions_with_their_own_names_and_no_patched_attributes():
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


def test_wire_dtype_is_the_compressed_dtype_for_compress_hooks_and_the_buffers_otherwise():
    assert wire_dtype(bf16_compress_hook, torch.float32) is torch.bfloat16
    assert wire_dtype(fp16_compress_hook, torch.float32) is torch.float16
    assert wire_dtype(torch_hooks.bf16_compress_hook, torch.float32) is torch.bfloat16
    assert wire_dtype(torch_hooks.fp16_compress_hook, torch.float32) is torch.float16
    for hook in (allreduce_hook, torch_hooks.allreduce_hook, lambda state, bucket: None, _Unhashable()):
        assert wire_dtype(hook, torch.float32) is torch.float32
        assert wire_dtype(hook, torch.bfloat16) is torch.bfloat16
