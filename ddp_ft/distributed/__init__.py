"""Process-group lifecycle and rank facts, paired: ``init_distributed() -> DistInfo`` / ``destroy_distributed()``."""

from __future__ import annotations

import logging
import os
import re
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job.

    Args:
        rank (int): global rank, 0..world_size-1; decides rank-0 duties and data shards.
        local_rank (int): rank on this node; decides the device.
        world_size (int): number of processes in the job.
        local_world_size (int): number of processes on this node.
        device (torch.device): this process' device (``cuda:<local_rank>`` or ``cpu``).
        backend (str | None): process-group backend, None for a single process.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def restart_count() -> int:
    """How many times torchrun has restarted this job's ranks (``TORCHELASTIC_RESTART_COUNT``; 0: the first attempt)."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def cuda_device_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """This process's CUDA device among the ``visible`` ones.

    One visible device is ``cuda:0``: the launcher gave each process its own GPU (SLURM ``--gpus-per-task=1``, a
    Kubernetes device plugin, ``CUDA_VISIBLE_DEVICES`` per process). With at least as many devices as processes on
    the node, each takes ``cuda:<local_rank>`` (torchrun on a multi-GPU host).

    Raises:
        RuntimeError: fewer devices than processes on the node, and more than one, so neither rule applies: naming
            LOCAL_RANK, LOCAL_WORLD_SIZE, the visible count and the fixes.
    """
    if visible == 1:
        return 0
    if local_rank < visible and local_world_size <= visible:
        return local_rank
    raise RuntimeError(
        f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size} but {visible} CUDA devices are visible to this "
        "process: give each process one GPU (CUDA_VISIBLE_DEVICES per process, SLURM --gpus-per-task=1) or all of "
        "them, and launch at most one process per GPU (--nproc_per_node)."
    )


DEVICE_CHOICES = ("auto", "cuda", "cpu")


def device_and_backend(requested: str, cuda_available: bool) -> tuple[str, str]:
    """The device type and process-group backend for ``--device requested``, chosen together.

    ``auto`` is CUDA when it is available, the CPU otherwise; ``cpu`` ignores any GPU. CUDA always goes with NCCL and
    the CPU with gloo: an NCCL group cannot reduce CPU tensors, and gloo on CUDA tensors copies through the host.

    Args:
        requested (str): ``auto``, ``cuda`` or ``cpu``.
        cuda_available (bool): ``torch.cuda.is_available()``.

    Returns:
        tuple[str, str]: (``cuda`` or ``cpu``, ``nccl`` or ``gloo``).

    Raises:
        ValueError: an unknown device, or ``cuda`` where CUDA is not available, naming ``--device`` and the fix.
    """
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"--device {requested!r}: choose one of {', '.join(DEVICE_CHOICES)}.")
    if requested == "cuda" and not cuda_available:
        raise ValueError(
            "--device cuda but torch.cuda.is_available() is False: use --device cpu (gloo), or check "
            "the driver, the torch build (torch.version.cuda) and CUDA_VISIBLE_DEVICES."
        )
    use_cuda = requested == "cuda" or (requested == "auto" and cuda_available)
    return ("cuda", "nccl") if use_cuda else ("cpu", "gloo")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0, device_type: str | None = None) -> DistInfo:
    """Join the process group that torchrun / accelerate launch describe in the environment.

    A single process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) gets no process group. With CUDA each
    process takes its device by ``cuda_device_index`` and NCCL, and the group is bound to that device
    (``device_id``): NCCL's communicator is created at once rather than at the first collective, and barriers
    use this device without being told (no "using the device under current context" warning, no device index
    that one-GPU-per-process launches do not have). Without CUDA, the CPU and gloo.

    Args:
        backend (str | None): override the backend ("nccl" or "gloo"). Default: chosen by device.
        timeout_s (float): collective timeout; a dead rank fails the others after this long. Default: 600.
        device_type (str | None): ``cpu`` keeps this process off CUDA even when a GPU is visible (no CUDA context
            is created); ``cuda`` requires one. Default: CUDA when available (``device_and_backend``).

    Returns:
        DistInfo: this process' rank facts.
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    device_type, _ = device_and_backend(device_type or "auto", torch.cuda.is_available())
    if device_type == "cuda":
        index = cuda_device_index(local_rank, local_world_size, torch.cuda.device_count())
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return DistInfo(0, 0, 1, 1, device, None)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        store = _restart_safe_store(rank, world_size, timeout_s)
        kwargs = {"store": store, "rank": rank, "world_size": world_size} if store is not None else {}
        if device.type == "cuda" and backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    info = DistInfo(rank, local_rank, world_size, local_world_size, device, backend)
    logger.debug("initialised %s", info)
    return info


def _restart_safe_store(rank: int, world_size: int, timeout_s: float) -> dist.Store | None:
    """The process group's store under ``torchrun --max-restarts``, or None for the default (``env://``).

    torchrun shares its rendezvous TCPStore with the ranks and keeps it across restarts, so a restarted rank can read
    the failed attempt's addresses (gloo's connectFullMesh: "Connection refused"; NCCL's unique id; pytorch#135712).
    On one node every rank carries the same ``TORCHELASTIC_RESTART_COUNT``, so each attempt gets its own key space.
    Across nodes the counts can differ (a node restarting for a peer's failure does not count it), so there the
    shared store is refused before anything starts.

    Raises:
        RuntimeError: restarts allowed across several nodes with the shared store, naming the variable that fixes it.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or _env_int("TORCHELASTIC_MAX_RESTARTS", 0) == 0:
        return None
    if _env_int("GROUP_WORLD_SIZE", 1) > 1:
        raise RuntimeError(
            "torchrun --max-restarts across several nodes shares the rendezvous store with the ranks, and a "
            "restarted rank can read the failed attempt's addresses (pytorch#135712): export "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node before torchrun (or run without --max-restarts)."
        )
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"ddp_ft/attempt_{restart_count()}", store)


# Messages of a collective that failed because another rank went away: a consequence, not the cause.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")
PEER_ERROR_DELAY_S = 2.0
# Set by ddp-ft --nproc (ddp_ft.commands.launcher) for its workers: the folder where a failing rank writes its
# traceback.
FAILURE_DIR_ENV = "DDP_FT_FAILURE_DIR"


def traceback_file(folder: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes its traceback under ``ddp-ft --nproc`` (``failure_recorded``)."""
    return Path(folder) / f"rank{rank}-traceback.txt"


@contextmanager
def failure_recorded() -> Iterator[None]:
    """Write this rank's error file for the launcher (torchrun's ``record``) as an exception leaves the block.

    torchrun's summary names as root cause the failed rank whose error file is oldest, at one-second resolution; when
    rank 1 raises, rank 0's collective fails a moment later with "Connection closed by peer" and often ties, and the
    tie goes to rank 0. A rank that only lost a peer therefore waits ``PEER_ERROR_DELAY_S`` before writing its file,
    so the rank that failed first is the one named (the launcher usually stops the waiting rank before it writes).

    Under ``ddp-ft --nproc`` (``DDP_FT_FAILURE_DIR`` set) the traceback goes to ``traceback_file`` instead of the
    console and the rank exits with status 1: ddp-ft prints one line naming the first rank that failed, its error and
    that file, instead of a traceback per rank.
    """
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    quiet = os.environ.get(FAILURE_DIR_ENV)
    try:
        yield
    except Exception as error:
        if any(text in str(error) for text in _LOST_PEER):
            logger.error("lost a peer rank (see its error: it failed first): %s", error)
            time.sleep(PEER_ERROR_DELAY_S)
        handler.record_exception(error)
        if not quiet:
            raise
        try:
            path = traceback_file(quiet, _env_int("RANK", 0))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(traceback.format_exception(error)))
        except OSError:  # the launcher names torch's error file instead, which holds the traceback too
            pass
        raise SystemExit(1) from None


def destroy_distributed() -> None:
    """Tear the process group down if there is one; safe to call from ``finally`` on every rank."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


LOG_LEVEL_ENV = "DDP_FT_LOG_LEVEL"  # rank 0's level for every logger (other ranks: warnings), e.g. WARNING


def setup_logging(info: DistInfo, level: int | None = None) -> None:
    """Log at ``level`` on rank 0 and only warnings elsewhere, each line tagged with the rank.

    ``level`` defaults to ``DDP_FT_LOG_LEVEL`` (a name: DEBUG, INFO, WARNING, ERROR), else INFO; ``make demo`` sets
    WARNING, so a run prints its progress bar and its warnings only.

    Raises:
        ValueError: ``DDP_FT_LOG_LEVEL`` is not a level name, naming the choices.
    """
    if level is None:
        name = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
        if name not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"{LOG_LEVEL_ENV}={name!r}: choose one of DEBUG, INFO, WARNING, ERROR.")
        level = getattr(logging, name)
    logging.basicConfig(
        level=level if info.is_main_process else logging.WARNING,
        format=f"[rank{info.rank}] %(asctime)s %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    if _held_notices and info.is_main_process:
        logger.info("bitsandbytes: %s (its own CPU 4-bit path is used instead)", _held_notices[0])
    if not info.is_main_process:  # progress bars are rank 0's
        try:
            import datasets
            import transformers

            datasets.disable_progress_bars()
            transformers.utils.logging.disable_progress_bar()
        except ImportError:
            pass


# bitsandbytes (a CPU with AVX512-BF16) warns on every process, at import, that it could not fetch an optional faster
# CPU 4-bit matmul from the Hub through the `kernels` package; it then uses its own CPU path.
_HUB_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
_held_notices: list[str] = []


class _HubKernelNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(_HUB_KERNEL_NOTICE):
            _held_notices.append(message.split(". Please")[0])
            return False
        return True


def hold_library_notices() -> None:
    """Hold bitsandbytes' CPU hub-kernel notice back; :func:`setup_logging` says it once, at INFO on rank 0. The
    ``ddp_ft`` commands call this before anything imports bitsandbytes."""
    notices = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _HubKernelNotice) for f in notices.filters):
        notices.addFilter(_HubKernelNotice())


# Upstream notices every process prints alike, kept to rank 0 (exact messages; rank 0 still shows each once): peft
# reads the deprecated `is_gradient_checkpointing` in every get_peft_model and calls the deprecated
# `gradient_checkpointing_enable` from prepare_model_for_kbit_training; TRL's configs default to the deprecated
# `gradient_checkpointing`; torch asks for `use_reentrant` where a caller's checkpointing leaves it out.
_RANK_ZERO_WARNINGS = (
    (FutureWarning, "`is_gradient_checkpointing` is deprecated"),
    (FutureWarning, "`gradient_checkpointing_enable` is deprecated"),
    (FutureWarning, "`gradient_checkpointing` is deprecated"),
    (UserWarning, "torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly"),
)


class _OtherRankNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_HUB_KERNEL_NOTICE)


def keep_upstream_notices_to_rank_zero(environ: Mapping[str, str] | None = None) -> None:
    """On a launched process of rank > 0, hold back the upstream notices every rank would print alike.

    These are bitsandbytes' hub-kernel notice and ``_RANK_ZERO_WARNINGS``, only those exact messages. Rank 0 and a
    single process keep them. ``import ddp_ft`` does not call this: the entry points do, first thing. bitsandbytes
    prints its notice when imported (``import peft`` imports it), so only a call before that holds it back.

    Args:
        environ (Mapping[str, str] | None): the launcher's environment (``RANK``). Default: ``os.environ``
    """
    environ = os.environ if environ is None else environ
    if environ.get("RANK", "0") in ("", "0"):
        return
    for category, message in _RANK_ZERO_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    notices = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _OtherRankNotice) for f in notices.filters):
        notices.addFilter(_OtherRankNotice())
