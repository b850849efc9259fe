"""Bucket assignment: a pure function of the parameters, so every rank computes and compares it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MB = 1024 * 1024


@dataclass(frozen=True)
class ParamSpec:
    """What bucket assignment needs to know about one trainable parameter.

    Args:
        name (str): qualified name, for error messages.
        numel (int): number of elements.
        dtype (torch.dtype): gradient dtype; buckets never mix dtypes.
        device (str): gradient device; buckets never mix devices.
        shape (tuple[int, ...]): shape, compared across ranks.
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
    """One bucket: parameter indices in flat-buffer order, the order backward should produce them.

    Args:
        index (int): position in launch order.
        param_indices (tuple[int, ...]): indices into the trainable parameter list.
        offsets (tuple[int, ...]): element offset of each parameter.
        numel (int): elements of the flat buffer.
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

    Backward produces gradients roughly in reverse registration order, so buckets become ready in launch order.
    Each (dtype, device) starts with a small first bucket, so communication starts early.

    Args:
        params (list[ParamSpec]): trainable parameters in registration order.
        bucket_cap_mb (float): cap of every later bucket. Default: 25.
        first_bucket_cap_mb (float): cap of the first bucket of each (dtype, device). Default: 1.

    Returns:
        list[BucketSpec]: the buckets in launch order; each parameter is in exactly one.

    Raises:
        ValueError: if a cap is not positive.

    Example:
        >>> layout = compute_bucket_assignment([ParamSpec("w", 1024, torch.float32, "cpu")])
    """
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if first_bucket_cap_mb <= 0:
        raise ValueError(f"first_bucket_cap_mb must be > 0, got {first_bucket_cap_mb}")
    cap = bucket_cap_mb * MB
    first_cap = first_bucket_cap_mb * MB

    # key -> [param indices, bytes so far]; `started` keeps first-seen order across keys.
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
