"""Check at construction that every rank has the same buckets and the same frozen base.

Every rank gathers every description, so all raise the same error and none hangs in a collective.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

from .buckets import BucketSpec, ParamSpec
from .checksum import frozen_digest
from .placement import shared_device

logger = logging.getLogger(__name__)


def verify_across_ranks(
    module: nn.Module,
    params: list[ParamSpec],
    buckets: list[BucketSpec],
    world_size: int,
    process_group: dist.ProcessGroup | None = None,
    device: tuple[str, str] | None = None,
) -> None:
    """Gather every rank's :func:`describe_rank` and raise on every rank if any differs from rank 0's.

    Args:
        module (nn.Module): the wrapped model.
        params (list[ParamSpec]): trainable parameters in registration order.
        buckets (list[BucketSpec]): the layout.
        world_size (int): ranks in the group.
        process_group (ProcessGroup | None): the group. Default: the default group.
        device (tuple[str, str] | None): this rank's ``(host, GPU)``; shared GPUs only warn under gloo.

    Raises:
        RuntimeError: naming the first difference, or two ranks sharing one GPU under NCCL.
    """
    gathered: list[dict | None] = [None] * world_size
    mine = describe_rank(module, params, buckets) | {"device": device}
    dist.all_gather_object(gathered, mine, group=process_group)
    mismatch = cross_rank_mismatch(gathered)
    if mismatch is not None:
        raise RuntimeError(mismatch)
    shared = shared_device([g["device"] for g in gathered])
    if shared is not None:
        first, second, where = shared
        message = (
            f"BucketedDDP: ranks {first} and {second} both hold their model on {where}: they would share one GPU's "
            "compute and memory. Give each process its own device (torchrun / accelerate launch set LOCAL_RANK; "
            "torch.cuda.set_device(local_rank) and device_map={'': local_rank})"
        )
        if dist.get_backend(process_group) == "nccl":
            raise RuntimeError(message + ".")
        if dist.get_rank(process_group) == 0:  # gloo shares one GPU by choice (backend="gloo")
            logger.warning("%s; allowed on gloo, where they share it at the cost of speed.", message)


def describe_rank(module: nn.Module, params: list[ParamSpec], buckets: list[BucketSpec]) -> dict:
    """This rank's layout and ``(name, SHA-256)`` of each frozen parameter, in order."""
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and p.device.type != "meta"]
    return {
        "layout": describe_layout(params, buckets),
        "frozen": [(n, frozen_digest(p)) for n, p in frozen],
    }


def cross_rank_mismatch(gathered: list[dict]) -> str | None:
    """The error for the first rank whose :func:`describe_rank` differs from rank 0's, or None."""
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
    """A picklable description of the parameters and the bucket layout."""
    return {
        "params": [(p.name, tuple(p.shape), str(p.dtype)) for p in params],
        "buckets": [b.param_indices for b in buckets],
    }


def first_layout_difference(
    reference: dict[str, list[tuple]], other: dict[str, list[tuple]], other_rank: int
) -> str | None:
    """The first difference from rank 0's layout, parameters before buckets, or None."""
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
