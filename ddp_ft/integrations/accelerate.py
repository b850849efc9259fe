"""An ``Accelerator`` that wraps multi-process models in BucketedDDP instead of torch DDP.

The parent prepares the model with its DDP step skipped; then BucketedDDP wraps it.
``unwrap_model``, ``accumulate()`` and ``no_sync()`` work through the wrapper.
Compilation is regional and before the wrap (``ddp_ft.training.model.compilation``).
Accelerate compiles the whole wrapped model, which leaves the all-reduces nothing to overlap.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher
from accelerate.utils import DistributedType, DynamoBackend
from accelerate.utils.other import is_compiled_module
from torch.distributed.algorithms.join import Join

from ..ddp import BucketedDDP, DDPSettings
from ..ddp.four_bit import keep_4bit_training_layout
from ..distributed.launch import TRAINER_CPU_FIX, check_world_seen, launched_alone
from ..training.model.compilation import (
    check_compile_mode,
    check_model_compile,
    compile_repeated_blocks,
    is_regionally_compiled,
    repeated_blocks,
)
from ..training.perf_traps import accelerate_fix, bnb_config_fix, check_4bit_compute_dtype, watch_idle_device
from .checkpointing import check_checkpointed_adapters
from .comm_hook_kwargs import accelerate_comm_hook
from .settings import describe_sources, resolve_ddp_settings

logger = logging.getLogger(__name__)

_DATA_PARALLEL = (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)
# Each wrapped module's BucketedDDP, by id, kept weakly.
_WRAPPERS: weakref.WeakValueDictionary[int, BucketedDDP] = weakref.WeakValueDictionary()


def _warn_if_launched_alone(num_processes: int) -> None:
    """Warns once when ``accelerate launch`` started this process alone."""
    why = launched_alone() if num_processes == 1 else None
    if why:
        _warn_once(why)


@functools.cache
def _warn_once(message: str) -> None:  # the Trainer adopts again at each train()
    logger.warning(message)


class BucketedAccelerator(Accelerator):
    """``Accelerator`` with BucketedDDP as the data-parallel wrapper.

    ``DistributedDataParallelKwargs`` are honoured as torch DDP honours them (``comm_hook_kwargs``).

    Args:
        *args: passed to ``Accelerator``.
        ddp_settings (DDPSettings | None): BucketedDDP knobs. Default: ``DDPSettings()``.
        **kwargs: passed to ``Accelerator``.

    Raises:
        RuntimeError: ``WORLD_SIZE`` > 1 but Accelerate sees one process (without CUDA, ``cpu=True`` is missing).
        ValueError: a ``DistributedDataParallelKwargs`` setting BucketedDDP cannot honour.
    """

    # How the idle-device warning tells this entry point to set the micro-batch.
    micro_batch_fix = staticmethod(accelerate_fix)
    compute_dtype_fix = staticmethod(bnb_config_fix)
    _for_trainer = False  # set by adopt for the HF Trainer

    def __init__(self, *args, ddp_settings: DDPSettings | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_world_seen(self.num_processes, "BucketedAccelerator(cpu=True)")
        _warn_if_launched_alone(self.num_processes)
        self._resolve_settings(ddp_settings, None, self.ddp_handler)
        self._check_compile_mode("TorchDynamoPlugin(mode=...)")

    @classmethod
    def adopt(
        cls, accelerator: Accelerator, ddp_settings: DDPSettings | None = None, training_args: object | None = None
    ) -> BucketedAccelerator:
        """The same configured accelerator, with BucketedDDP wrapping.

        For code that builds its own ``Accelerator``, such as the HF Trainer.
        With ``training_args``, their ``ddp_*`` fields are the source of the DDP settings.

        Args:
            accelerator (Accelerator): the accelerator to adopt.
            ddp_settings (DDPSettings | None): BucketedDDP knobs. Default: None.
            training_args: the Trainer's arguments. Default: None.

        Returns:
            BucketedAccelerator: sharing the accelerator's state.

        Raises:
            RuntimeError: ``WORLD_SIZE`` > 1 but the accelerator sees one process.
        """
        fix = TRAINER_CPU_FIX if training_args is not None else "cpu=True"
        check_world_seen(accelerator.num_processes, fix)
        _warn_if_launched_alone(accelerator.num_processes)
        adopted = cls.__new__(cls)
        adopted.__dict__.update(accelerator.__dict__)
        handler = None if training_args is not None else accelerator.ddp_handler
        adopted._resolve_settings(ddp_settings, training_args, handler)
        adopted._for_trainer = training_args is not None
        adopted._check_compile_mode("TrainingArguments(torch_compile_mode=...)" if training_args else "mode")
        return adopted

    def _check_compile_mode(self, setting: str) -> None:
        plugin = self.state.dynamo_plugin
        if plugin.backend != DynamoBackend.NO:
            check_compile_mode(plugin.mode, self.num_processes, setting)

    def _resolve_settings(self, explicit: DDPSettings | None, training_args: object | None, handler: object) -> None:
        self.ddp_settings, sources = resolve_ddp_settings(explicit, training_args, handler)
        # A hook DDPSettings.comm_hook cannot name is registered after each wrap.
        hook = accelerate_comm_hook(handler)
        self.comm_hook = hook if hook is not None and hook.ddp_settings_hook is None else None
        if self.comm_hook is not None:
            self.comm_hook.check(self.ddp_settings)
            failure = self.comm_hook.known_failure()
            if failure and self.is_main_process and self.num_processes > 1:
                _warn_once(failure)
        if self.is_main_process and self.num_processes > 1:
            line = describe_sources(self.ddp_settings, sources)
            logger.info("BucketedDDP settings: %s%s", line, f"; {self.comm_hook.describe()}" if self.comm_hook else "")

    def _wraps_with_bucketed_ddp(self, model: torch.nn.Module, evaluation_mode: bool) -> bool:
        return (
            not evaluation_mode
            and self.distributed_type in _DATA_PARALLEL
            and self.num_processes > 1
            and any(p.requires_grad for p in model.parameters())
        )

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        """Prepares ``model`` as Accelerate does, wrapping a multi-process training model in BucketedDDP.

        It checks the model itself, not Accelerate's prepared flag, which evaluation may have set.
        A model keeps its one wrapper across calls; a second wrapper's hooks would fight the first's.
        It is also checked for two performance traps (``ddp_ft.training.perf_traps``).

        Raises:
            ValueError: reentrant gradient checkpointing would leave the adapters without gradient.
            RuntimeError: the model is spread over devices, or on another rank's GPU.
        """
        if isinstance(model, BucketedDDP):
            if model not in self._models:
                self._models.append(model)
            return model
        if not evaluation_mode and any(p.requires_grad for p in model.parameters()):
            check_checkpointed_adapters(model)  # before the first step, on one process too
            keep_4bit_training_layout(model)
            check_4bit_compute_dtype(
                model, self.mixed_precision, self.device, self.is_main_process, fix=self.compute_dtype_fix
            )
            watch_idle_device(model, self.device, self.is_main_process, self.micro_batch_fix)
        regional = self._compile_regions(model)
        with self._whole_model_compile(off=regional):
            if not self._wraps_with_bucketed_ddp(model, evaluation_mode):
                return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
            # Everything Accelerate does except its DDP wrap; then ours.
            model = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        if is_compiled_module(model):
            logger.warning(
                "the model reached BucketedAccelerator.prepare compiled whole (torch.compile(model)): its backward is "
                "one graph, so every gradient is ready at its end and BucketedDDP's all-reduces overlap nothing. "
                "Pass the uncompiled model and set dynamo_backend (or TrainingArguments(torch_compile=True)): ddp_ft "
                "compiles each decoder layer instead (ddp_ft.training.model.compilation)."
            )
        wrapped = _WRAPPERS.get(id(model))
        if wrapped is None or wrapped.module is not model or wrapped.hooks_removed:
            wrapped = self.ddp_settings.wrap(model)
            if self.comm_hook is not None:
                self.comm_hook.register(wrapped)
            _WRAPPERS[id(model)] = wrapped
            logger.info("wrapped the model in BucketedDDP (%d buckets) instead of torch DDP", len(wrapped.bucket_sizes))
        wrapped._is_accelerate_prepared = True
        self._models[:] = [m for m in self._models if m is not model and m is not wrapped] + [wrapped]
        return wrapped

    def _compile_regions(self, model: torch.nn.Module) -> bool:
        """Compiles the decoder layers in place when a dynamo backend is set.

        Returns:
            bool: True when the model is compiled regionally, so Accelerate must not compile it whole.
        """
        plugin = self.state.dynamo_plugin
        if plugin.backend == DynamoBackend.NO or is_compiled_module(model):
            return False
        if is_regionally_compiled(model):
            return True
        setting = "torch_compile=True / dynamo_backend (regional compilation)"
        check_model_compile(model, self.device, setting, backend=plugin.backend.value.lower())
        if not repeated_blocks(model):
            if self._wraps_with_bucketed_ddp(model, False):
                logger.warning(
                    "%s has no repeated layers to compile one by one: it is compiled whole, so its gradients are "
                    "all ready at the end of backward and BucketedDDP's all-reduces overlap nothing.",
                    type(model).__name__,
                )
                model.compile(**plugin.to_kwargs())  # in place, inside the wrapper
                return True
            return False
        compile_repeated_blocks(model, **plugin.to_kwargs())
        return True

    @contextmanager
    def _whole_model_compile(self, off: bool):
        """Turns Accelerate's whole-model compilation off for the block when ``off``."""
        plugin = self.state.dynamo_plugin
        backend = plugin.backend
        if off:
            plugin.backend = DynamoBackend.NO
        try:
            yield
        finally:
            plugin.backend = backend

    def wait_for_everyone(self) -> None:
        """A barrier of the default group, bound to this process's device.

        Accelerate's own names ``cuda:<local rank>``, which fails with one visible GPU per process.
        """
        if self.num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        else:
            super().wait_for_everyone()

    @contextmanager
    def main_process_first(self):
        """Accelerate's, waiting at :meth:`wait_for_everyone`: the main process runs the block first."""
        with self._goes_first(self.is_main_process):
            yield

    @contextmanager
    def local_main_process_first(self):
        """Accelerate's, waiting at :meth:`wait_for_everyone`: each node's main process runs the block first."""
        with self._goes_first(self.is_local_main_process):
            yield

    @contextmanager
    def _goes_first(self, first: bool):
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    @staticmethod
    @contextmanager
    def trigger_sync_in_backward(model):
        """Accelerate's, extended to BucketedDDP."""
        if isinstance(model, BucketedDDP):
            with model.trigger_sync_in_backward():
                yield
        else:
            with Accelerator.trigger_sync_in_backward(model):
                yield

    @contextmanager
    def join_uneven_inputs(self, joinables, even_batches=None):
        """Accelerate's, joining on CPU processes too.

        BucketedDDP is a torch ``Joinable`` (:mod:`ddp_ft.ddp.join`).
        Stock Accelerate joins on GPUs only, so uneven CPU batches would leave a rank waiting.
        """
        if not (self.num_processes > 1 and self.distributed_type in _DATA_PARALLEL):
            with super().join_uneven_inputs(joinables, even_batches):
                yield
            return
        even = self.even_batches if even_batches is None else even_batches
        with self._even_batches(even_batches), Join(joinables, enable=not even, throw_on_early_termination=False):
            yield

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Accelerate's; refuses uneven batches for the HF Trainer."""
        prepared = super().prepare_data_loader(
            data_loader, device_placement=device_placement, slice_fn_for_dispatch=slice_fn_for_dispatch
        )
        if self._for_trainer and self.num_processes > 1:
            check_trainer_batches(prepared, self.num_processes)
        return prepared

    @contextmanager
    def _even_batches(self, even_batches: bool | None):
        """Sets the prepared map-style loaders' ``even_batches`` for the block."""
        if even_batches is not None and any(isinstance(dl, DataLoaderDispatcher) for dl in self._dataloaders):
            warnings.warn(
                "Overriding even_batches is only supported for map-style datasets, yet some dataloaders given were "
                "iterable",
                stacklevel=3,
            )
        samplers = [getattr(loader, "batch_sampler", None) for loader in self._dataloaders]
        samplers = [s for s in samplers if hasattr(s, "even_batches")] if even_batches is not None else []
        before = [s.even_batches for s in samplers]
        for sampler in samplers:
            sampler.even_batches = even_batches
        try:
            yield
        finally:
            for sampler, value in zip(samplers, before, strict=True):
                sampler.even_batches = value

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, BucketedDDP):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)


def batches_per_rank(loader, num_processes: int) -> list[int] | None:
    """Each rank's number of batches from a prepared loader, with no communication.

    Returns:
        list[int] | None: None where the count cannot be known here.
    """
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, BatchSamplerShard) or sampler.split_batches:
        return None
    try:
        total = len(sampler.batch_sampler)
    except TypeError:
        return None
    if sampler.even_batches or sampler.drop_last:
        return [len(sampler)] * num_processes
    return [len(range(rank, total, num_processes)) for rank in range(num_processes)]


def check_trainer_batches(loader, num_processes: int) -> None:
    """Refuses a Trainer's loader that gives the ranks different numbers of batches.

    The Trainer never joins, so the rank with one batch more would all-reduce alone.

    Raises:
        ValueError: the counts differ.
    """
    counts = batches_per_rank(loader, num_processes)
    if counts is not None and len(set(counts)) > 1:
        raise ValueError(
            f"TrainingArguments(accelerator_config={{'even_batches': False}}): this loader gives the ranks {counts} "
            "batches, and the Trainer steps and evaluates every rank in lockstep without a join, so the rank with "
            "more would all-reduce alone (the stock Trainer with torch DDP goes out of step silently there). Keep "
            "even_batches=True (the default: the last batches are completed with samples from the start), or set "
            "dataloader_drop_last=True."
        )
