"""The check at construction that every rank reduces the same parameters in the same buckets and holds the same
frozen base (which is not broadcast).

Each rank describes itself (:func:`describe_rank`: its layout and the digests of its frozen parameters); the
descriptions are gathered, and :func:`cross_rank_mismatch`, a pure function of them, names the first difference
from rank 0's. Every rank gathers every description, so every rank raises the same error: none is left waiting in
a collective the others never reach.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .buckets import BucketSpec, ParamSpec
from .checksum import frozen_digest


def verify_across_ranks(
    module: nn.Module,
    params: list[ParamSpec],
    buckets: list[BucketSpec],
    world_size: int,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Gather every rank's :func:`describe_rank` and raise on every rank if any differs from rank 0's.

    Raises:
        RuntimeError: naming the first differing trainable parameter, bucket or frozen parameter.
    """
    gathered: list[dict | None] = [None] * world_size
    dist.all_gather_object(gathered, describe_rank(module, params, buckets), group=process_group)
    mismatch = cross_rank_mismatch(gathered)
    if mismatch is not None:
        raise RuntimeError(mismatch)


def describe_rank(module: nn.Module, params: list[ParamSpec], buckets: list[BucketSpec]) -> dict:
    """This rank's side of the check: its layout (:func:`describe_layout`) and, under ``frozen``, one
    ``(name, SHA-256)`` per frozen parameter not on the meta device, in registration order."""
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and p.device.type != "meta"]
    return {
        "layout": describe_layout(params, buckets),
        "frozen": [(n, frozen_digest(p)) for n, p in frozen],
    }


def cross_rank_mismatch(gathered: list[dict]) -> str | None:
    """The error for the first rank whose :func:`describe_rank` differs from rank 0's, or None if all agree.

    Args:
        gathered (list[dict]): every rank's description, by rank.

    Returns:
        str | None: the message, naming the first differing trainable parameter or bucket (layout first), else
        the first differing frozen parameter.
    """
    reference = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        diff = first_layout_difference(reference["layout"], other["layout"], other_rank=rank)
        if diff is not None:
            return (
                f"BucketedDDP: trainable parameters or buckets differ across ranks: {diff}. Every rank must "
                "build the same model with the same trainable parameters (same LoRA settings and target "
                "modules, same dtype) and the same bucket_cap_mb / first_bucket_cap_mb."
            )
        if reference["frozen"] != other["frozen"]:
            for (name_ref, digest_ref), (name, digest) in zip(reference["frozen"], other["frozen"], strict=False):
                if (name_ref, digest_ref) != (name, digest):
                    return (
                        f"BucketedDDP: frozen parameter {name_ref!r} (its bytes, or its 4-bit quant state) differs "
                        f"between rank 0 and rank {rank} (SHA-256 {digest_ref[:12]} vs {digest[:12]} for {name!r}). "
                        "Frozen weights are not broadcast; load the same base checkpoint on every rank (and seed "
                        "any random initialisation)."
                    )
            return (
                f"BucketedDDP: rank 0 has {len(reference['frozen'])} frozen parameters, rank {rank} "
                f"{len(other['frozen'])}. Every rank must load the same base model."
            )
    return None


def describe_layout(params: list[ParamSpec], buckets: list[BucketSpec]) -> dict[str, list[tuple]]:
    """A plain, picklable description of the parameters and the bucket layout, compared across ranks.

    Returns:
        dict[str, list[tuple]]: ``params``: one ``(name, shape, dtype)`` per parameter in registration
        order; ``buckets``: one ``param_indices`` tuple per bucket in launch order.
    """
    return {
        "params": [(p.name, tuple(p.shape), str(p.dtype)) for p in params],
        "buckets": [b.param_indices for b in buckets],
    }


def first_layout_difference(
    reference: dict[str, list[tuple]], other: dict[str, list[tuple]], other_rank: int
) -> str | None:
    """Describe the first difference between rank 0's layout (``reference``) and ``other_rank``'s, or None.

    Parameters are compared first (name, shape, dtype, in order), then bucket boundaries.
    """
    ref_params, params = reference["params"], other["params"]
    for i, (a, b) in enumerate(zip(ref_params, params, strict=False)):
        if a != b:
            return (
                f"trainable parameter #{i}: rank 0 has {a[0]!r} shape={list(a[1])} dtype={a[2]}, "
                f"rank {other_rank} has {b[0]!r} shape={list(b[1])} dtype={b[2]}"
            )
    if len(ref_params) != len(params):
        longer, where = (ref_params, "rank 0") if len(ref_params) > len(params) else (params, f"rank {other_rank}")
        extra = longer[min(len(ref_params), len(params))]
        return (
            f"rank 0 has {len(ref_params)} trainable parameters, rank {other_rank} {len(params)}; "
            f"first parameter only on {where}: {extra[0]!r} shape={list(extra[1])} dtype={extra[2]}"
        )
    if reference["buckets"] != other["buckets"]:
        for i, (a, b) in enumerate(zip(reference["buckets"], other["buckets"], strict=False)):
            if a != b:
                return f"bucket {i} holds parameters {list(a)} on rank 0 but {list(b)} on rank {other_rank}"
        return f"rank 0 has {len(reference['buckets'])} buckets, rank {other_rank} {len(other['buckets'])}"
    return None
