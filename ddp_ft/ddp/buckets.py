"""Bucket assignment: a pure function of the trainable parameters' sizes, dtypes and devices.

Kept apart from the wrapper (as torch keeps ``_compute_bucket_assignment_by_size`` apart from its
Reducer) so the layout can be unit-tested without a process group, and so every rank can compute
it, compare it with the others and refuse to train on a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MB = 1024 * 1024


@dataclass(frozen=True)
class ParamSpec:
    """What bucket assignment needs to know about one trainable parameter.

    Args:
        name (str): qualified name in the wrapped module, used in error messages.
        numel (int): number of elements.
        dtype (torch.dtype): gradient dtype; buckets never mix dtypes.
        device (str): device the gradient lives on; buckets never mix devices.
        shape (tuple[int, ...]): parameter shape, compared across ranks.
    """

    name: str
    numel: int
    dtype: torch.dtype
    device: str
    shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, param: torch.Tensor) -> ParamSpec:
        return cls(name, param.numel(), param.dtype, str(param.device), tuple(param.shape))


@dataclass(frozen=True)
class BucketSpec:
    """One bucket of the layout: parameter indices (into the registration-ordered list) in the order
    they are laid out in the bucket's flat buffer, which is the order backward is expected to produce
    them (reverse registration order).

    Args:
        index (int): position in launch order.
        param_indices (tuple[int, ...]): indices into the trainable parameter list.
        offsets (tuple[int, ...]): element offset of each parameter in the flat buffer.
        numel (int): total elements of the flat buffer.
        dtype (torch.dtype): dtype of the flat buffer.
        device (str): device of the flat buffer.
    """

    index: int
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: str


def compute_bucket_assignment(
    params: list[ParamSpec], bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
) -> list[BucketSpec]:
    """Split trainable parameters into buckets, in reverse registration order, by dtype and device.

    Backward produces gradients roughly in reverse registration order (the last layers first), so
    walking the parameters backwards fills bucket 0 first, bucket 1 next, and so on: the launch order
    of the all-reduces matches the order in which buckets become ready. Each (dtype, device) pair has
    its own open bucket; a bucket is closed as soon as its size reaches its cap. The first bucket of
    each (dtype, device) pair uses the smaller ``first_bucket_cap_mb`` so that communication starts
    early in backward (torch DDP's default: 1 MB). A parameter larger than the cap gets a bucket of
    its own.

    Buckets are numbered in the order their first parameter is met in the reversed walk.

    Args:
        params (list[ParamSpec]): trainable parameters in registration order.
        bucket_cap_mb (float): cap of every bucket but the first of each (dtype, device). Default: 25.
        first_bucket_cap_mb (float): cap of the first bucket of each (dtype, device). Default: 1.

    Returns:
        list[BucketSpec]: the buckets in launch order; every parameter appears in exactly one.

    Raises:
        ValueError: if a cap is not positive.
    """
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if first_bucket_cap_mb <= 0:
        raise ValueError(f"first_bucket_cap_mb must be > 0, got {first_bucket_cap_mb}")
    cap = bucket_cap_mb * MB
    first_cap = first_bucket_cap_mb * MB

    # key -> [param indices, bytes so far]; `started` preserves first-seen order across keys.
    open_buckets: dict[tuple[torch.dtype, str], list] = {}
    closed_count: dict[tuple[torch.dtype, str], int] = {}
    started: list[list[int]] = []

    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        if key not in open_buckets:
            members: list[int] = []
            open_buckets[key] = [members, 0]
            started.append(members)
        entry = open_buckets[key]
        entry[0].append(i)
        entry[1] += p.nbytes
        limit = first_cap if closed_count.get(key, 0) == 0 else cap
        if entry[1] >= limit:
            closed_count[key] = closed_count.get(key, 0) + 1
            del open_buckets[key]

    buckets = []
    for index, members in enumerate(started):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i].numel
        first = params[members[0]]
        buckets.append(BucketSpec(index, tuple(members), tuple(offsets), total, first.dtype, first.device))
    return buckets
