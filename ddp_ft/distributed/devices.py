"""The device rule: which device and backend a process takes, from the request and what its host has.

Pure functions of their arguments, so each case is tested without a GPU.
"""

from __future__ import annotations

import torch


def cuda_device_index(local_rank: int, local_world_size: int, visible: int, backend: str = "nccl") -> int:
    """This process's CUDA device among the ``visible`` ones.

    One visible device is this process's own; otherwise ``cuda:<local_rank>``.
    Under gloo, processes that see one GPU share it by choice.

    Args:
        local_rank (int): rank on this node.
        local_world_size (int): processes on this node.
        visible (int): CUDA devices this process sees.
        backend (str): ``nccl`` or ``gloo``, for the fix the error names. Default: nccl.

    Raises:
        RuntimeError: if several devices are visible but fewer than the processes on the node.
    """
    if visible == 1:
        return 0
    if local_rank < visible and local_world_size <= visible:
        return local_rank
    where = f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size} but {visible} CUDA devices are visible"
    if backend == "gloo":
        raise RuntimeError(
            f"{where}: over gloo the processes share a GPU only when exactly one is visible, and each takes cuda:0. "
            f"Make one visible (CUDA_VISIBLE_DEVICES=0), or launch at most {visible} processes (--nproc_per_node)."
        )
    raise RuntimeError(
        f"{where} to this process: give each process one GPU (CUDA_VISIBLE_DEVICES per process, SLURM "
        "--gpus-per-task=1) or all of them, and launch at most one process per GPU (--nproc_per_node)."
    )


DEVICE_CHOICES = ("auto", "cuda", "cpu")
BACKEND_CHOICES = ("auto", "nccl", "gloo")  # DDPSettings.backend's, as TrainingArguments.ddp_backend's


def device_and_backend(requested: str, cuda_available: bool, backend: str = "auto") -> tuple[str, str]:
    """The device type and process-group backend for ``--device requested --backend backend``, chosen together.

    NCCL cannot reduce CPU tensors, so ``auto`` pairs CUDA with NCCL and the CPU with gloo.
    gloo also reduces CUDA tensors, and lets processes share one GPU.

    Args:
        requested (str): ``auto``, ``cuda`` or ``cpu``.
        cuda_available (bool): ``torch.cuda.is_available()``.
        backend (str): ``auto``, ``nccl`` or ``gloo``. Default: auto.

    Returns:
        tuple[str, str]: (``cuda`` or ``cpu``, ``nccl`` or ``gloo``).

    Raises:
        ValueError: for an unknown device or backend, ``cuda`` without CUDA, or ``nccl`` on the CPU.
    """
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"--device {requested!r}: choose one of {', '.join(DEVICE_CHOICES)}.")
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"--backend {backend!r}: choose one of {', '.join(BACKEND_CHOICES)}.")
    if requested == "cuda" and not cuda_available:
        raise ValueError(
            "--device cuda but torch.cuda.is_available() is False: use --device cpu (gloo), or check "
            "the driver, the torch build (torch.version.cuda) and CUDA_VISIBLE_DEVICES."
        )
    use_cuda = requested == "cuda" or (requested == "auto" and cuda_available)
    if backend == "nccl" and not use_cuda:
        why = "--device cpu" if requested == "cpu" else "torch.cuda.is_available() is False"
        raise ValueError(
            f"--backend nccl but {why}: NCCL reduces CUDA tensors only. Use --backend gloo or "
            "auto (gloo on the CPU), or run where CUDA is available (check the driver, torch.version.cuda and "
            "CUDA_VISIBLE_DEVICES)."
        )
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    return ("cuda" if use_cuda else "cpu"), backend


def choose_device(
    requested: str,
    backend: str,
    cuda_available: bool,
    visible: int,
    local_rank: int = 0,
    local_world_size: int = 1,
) -> tuple[torch.device, str]:
    """This process's device and the group's backend, from the request and what this host has.

    Args:
        requested (str): ``auto``, ``cuda`` or ``cpu``.
        backend (str): ``auto``, ``nccl`` or ``gloo``.
        cuda_available (bool): ``torch.cuda.is_available()``.
        visible (int): ``torch.cuda.device_count()``.
        local_rank (int): rank on this node. Default: 0.
        local_world_size (int): processes on this node. Default: 1.

    Returns:
        tuple[torch.device, str]: the device (``cuda:<index>`` or ``cpu``) and ``nccl`` or ``gloo``.

    Raises:
        ValueError: what :func:`device_and_backend` refuses.
        RuntimeError: what :func:`cuda_device_index` refuses.
    """
    device_type, backend = device_and_backend(requested, cuda_available, backend)
    if device_type == "cpu":
        return torch.device("cpu"), backend
    return torch.device("cuda", cuda_device_index(local_rank, local_world_size, visible, backend)), backend


def check_local_gpus(nproc: int, visible: int, backend: str) -> None:
    """Refuse ``nproc`` processes of one host, all seeing the same ``visible`` GPUs, that cannot all run.

    NCCL refuses two ranks on one GPU. gloo lets them share one, when it is the only one visible.

    Args:
        nproc (int): processes on this host.
        visible (int): GPUs each of them sees.
        backend (str): ``nccl`` or ``gloo``.

    Raises:
        ValueError: naming the fix.
    """
    if nproc <= visible or (backend == "gloo" and visible == 1):
        return
    if backend == "gloo":
        raise ValueError(
            f"{nproc} processes sharing a GPU over gloo, but {visible} GPUs are visible: make one visible "
            f"(CUDA_VISIBLE_DEVICES=0) so that every process takes it, or run at most {visible} processes."
        )
    raise ValueError(
        f"{nproc} processes but {visible} GPU(s) visible: NCCL takes one process per GPU (it refuses two ranks on "
        f"one). Run at most {visible}, or --backend gloo with one GPU visible (the processes share it), or on the CPU."
    )
