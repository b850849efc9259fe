"""Process-group lifecycle and rank facts."""

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

from .devices import choose_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job.

    Args:
        rank (int): global rank.
        local_rank (int): rank on this node.
        world_size (int): processes in the job.
        local_world_size (int): processes on this node.
        device (torch.device): this process's device.
        backend (str | None): process-group backend; None for one process.
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
    """How many times torchrun restarted this job's ranks; 0 on the first attempt."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0, device_type: str | None = None) -> DistInfo:
    """Join the process group that torchrun or accelerate launch describe in the environment.

    A single process gets no group. NCCL binds to this rank's device, so barriers know it.
    The device and backend follow :func:`choose_device`.

    Args:
        backend (str | None): ``auto``, ``nccl`` or ``gloo``; None is auto: NCCL on CUDA, gloo on the CPU.
            Default: None.
        timeout_s (float): collective timeout, after which a dead rank fails the others. Default: 600.
        device_type (str | None): ``cpu``, ``cuda``, or None for CUDA when available. Default: None.

    Returns:
        DistInfo: this process's rank facts.

    Raises:
        ValueError: a device or backend this host cannot run, e.g. ``nccl`` without CUDA.
        RuntimeError: more processes than visible GPUs, where they cannot share one.

    Example:
        >>> info = init_distributed()
        >>> model = BucketedDDP(model.to(info.device))
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    device, backend = choose_device(
        device_type or "auto",
        backend or "auto",
        torch.cuda.is_available(),
        torch.cuda.device_count(),
        local_rank,
        local_world_size,
    )
    if device.type == "cuda":
        torch.cuda.set_device(device.index)
    if world_size == 1:
        return DistInfo(0, 0, 1, 1, device, None)
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
    """The process group's store under ``torchrun --max-restarts``, or None for ``env://``.

    torchrun's store outlives restarts, so each attempt gets its own key prefix.
    Restart counts can differ across nodes, so there it raises.
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


# Errors of a collective whose peer went away.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")
PEER_ERROR_DELAY_S = 2.0
# Set by ddp-ft --nproc: where a failing rank writes its traceback.
FAILURE_DIR_ENV = "DDP_FT_FAILURE_DIR"


def traceback_file(folder: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes its traceback under ``ddp-ft --nproc``."""
    return Path(folder) / f"rank{rank}-traceback.txt"


@contextmanager
def failure_recorded() -> Iterator[None]:
    """Write this rank's error file for the launcher as an exception leaves the block.

    torchrun blames the oldest error file, so a rank that only lost a peer waits first.
    Under ``ddp-ft --nproc`` the traceback goes to ``traceback_file`` instead of the console.
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
        except OSError:  # torch's error file holds the traceback too
            pass
        raise SystemExit(1) from None


def destroy_distributed() -> None:
    """Tear down the process group, if any; safe in ``finally``."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


LOG_LEVEL_ENV = "DDP_FT_LOG_LEVEL"  # rank 0's level name
DATA_LOGGER = "ddp_ft.training.data"  # its warnings are about data every rank prepares alike


def setup_logging(info: DistInfo, level: int | None = None) -> None:
    """Log at ``level`` on rank 0 and only warnings elsewhere.

    Args:
        info (DistInfo): rank facts.
        level (int | None): rank 0's level. Default: ``DDP_FT_LOG_LEVEL``, else INFO.

    Raises:
        ValueError: if ``DDP_FT_LOG_LEVEL`` is not a level name.
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
    # Every rank prepares the same data: what happened to it (rows dropped, samples cut) is rank 0's to say.
    logging.getLogger(DATA_LOGGER).setLevel(logging.NOTSET if info.is_main_process else logging.ERROR)
    try:
        import datasets
        import transformers
    except ImportError:
        return
    # transformers prints its records itself; with CI set it also passes them on, and each would print twice.
    transformers.utils.logging.disable_propagation()
    if not info.is_main_process:  # progress bars are rank 0's
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()


# bitsandbytes warns at import, on every rank, that a Hub CPU kernel is missing.
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
    """Hold bitsandbytes' CPU hub-kernel notice; :func:`setup_logging` logs it once on rank 0."""
    notices = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _HubKernelNotice) for f in notices.filters):
        notices.addFilter(_HubKernelNotice())


# Deprecation notices from peft, TRL and torch, matched exactly.
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
    """On ranks above 0, hold back upstream notices; call before bitsandbytes is imported.

    Args:
        environ (Mapping[str, str] | None): the launcher's environment (``RANK``). Default: ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    if environ.get("RANK", "0") in ("", "0"):
        return
    for category, message in _RANK_ZERO_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    notices = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _OtherRankNotice) for f in notices.filters):
        notices.addFilter(_OtherRankNotice())
