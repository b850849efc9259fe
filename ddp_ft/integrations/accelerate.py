"""An ``Accelerator`` that wraps multi-process models in BucketedDDP instead of torch DDP.

``Accelerator.prepare_model`` wraps every multi-process model with trainable parameters in
``torch.nn.parallel.DistributedDataParallel``, unconditionally. This subclass lets the parent do everything
else (device placement checks, mixed-precision forward, compilation) with the DDP step skipped, then wraps
with BucketedDDP; ``unwrap_model`` (and so ``get_state_dict`` / ``save_model``) sees through the wrapper.
``accelerator.accumulate()`` / ``no_sync()`` work unchanged: they call the wrapper's ``no_sync``.

Compilation (``dynamo_backend``, ``TorchDynamoPlugin``, the Trainer's ``torch_compile``) is regional and before the
wrap (``ddp_ft.training.model.compilation``): each decoder layer compiled in place with the plugin's options.
Accelerate's own compiles the whole model after wrapping, which leaves BucketedDDP's all-reduces nothing to overlap.
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
# The BucketedDDP of each module this process wrapped (by id; checked against ``wrapper.module``), kept weakly.
_WRAPPERS: weakref.WeakValueDictionary[int, BucketedDDP] = weakref.WeakValueDictionary()


def _warn_if_launched_alone(num_processes: int) -> None:
    """Say (once per process) that ``accelerate launch``, asked for several processes, started this one alone
    (``ddp_ft.distributed.launch.launched_alone``)."""
    why = launched_alone() if num_processes == 1 else None
    if why:
        _warn_once(why)


@functools.cache
def _warn_once(message: str) -> None:  # the Trainer adopts its accelerator again at each train(): one line is enough
    logger.warning(message)


class BucketedAccelerator(Accelerator):
    """``Accelerator`` with BucketedDDP as the data-parallel wrapper.

    ``DistributedDataParallelKwargs`` in ``kwargs_handlers`` are honoured as torch DDP's: its knobs through
    :func:`~ddp_ft.integrations.settings.resolve_ddp_settings`, its ``comm_hook``/``comm_wrapper``/
    ``comm_state_option`` registered on each BucketedDDP as Accelerate registers them
    (:mod:`ddp_ft.integrations.comm_hook_kwargs`).

    Args:
        *args: passed to ``Accelerator``.
        ddp_settings (DDPSettings | None): BucketedDDP knobs. Default: ``DDPSettings()``.
        **kwargs: passed to ``Accelerator``.

    Raises:
        RuntimeError: the process was launched with ``WORLD_SIZE`` > 1 but Accelerate sees one process (on a machine
            without CUDA, ``cpu=True`` is missing): the processes would train apart.
        ValueError: a ``DistributedDataParallelKwargs`` setting BucketedDDP cannot honour, naming it and the fix.
    """

    # How the idle-device warning tells this entry point to set the micro-batch (the Trainer sets its own).
    micro_batch_fix = staticmethod(accelerate_fix)
    # How the 4-bit dtype warning tells it to set the compute dtype (ddp_ft's recipe: --compute-dtype).
    compute_dtype_fix = staticmethod(bnb_config_fix)
    _for_trainer = False  # adopted by the HF Trainer (adopt with training_args), which never joins uneven inputs

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
        """The same configured accelerator (shared state, plugins, handlers) with BucketedDDP wrapping.

        For code that builds its ``Accelerator`` itself, such as the HF Trainer. With ``training_args`` their
        ``ddp_*`` fields are the source of the DDP settings, not the ``ddp_handler`` the Trainer derived from them
        (which also carries the Trainer's own find_unused_parameters guess).

        Raises:
            RuntimeError: launched with ``WORLD_SIZE`` > 1 while the accelerator sees one process.
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
        # A comm hook of Accelerate's that DDPSettings.comm_hook cannot name (PowerSGD, a wrapper): registered as
        # Accelerate registers it, after each wrap (ddp_ft.integrations.comm_hook_kwargs).
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
        """Prepare ``model`` as Accelerate does, wrapping a multi-process training model in BucketedDDP.

        Decided by what the model is, not by Accelerate's ``_is_accelerate_prepared`` flag (which the parent sets
        on the inner model, so a model prepared before, for evaluation or before ``free_memory()``, would come
        back unwrapped and train as independent processes): a BucketedDDP is returned as it is; an unwrapped
        training model gets its existing wrapper back (one wrapper per module: a second one's hooks would fight the
        first's), or a new one.

        A training model is also checked for two performance traps, each warned once on the main process
        (``ddp_ft.training.perf_traps``): 4-bit layers computing in float32 in a half-precision run, checked here; an
        idle device with memory for a larger micro-batch, measured at the 4th optimizer step (CUDA only).

        Raises:
            ValueError: reentrant gradient checkpointing would leave the adapters without gradient
                (:func:`~ddp_ft.integrations.checkpointing.check_checkpointed_adapters`).
            RuntimeError: the model is spread over devices, or on another rank's GPU (BucketedDDP's placement check).
        """
        if isinstance(model, BucketedDDP):
            if model not in self._models:
                self._models.append(model)
            return model
        if not evaluation_mode and any(p.requires_grad for p in model.parameters()):
            check_checkpointed_adapters(model)  # before the first step, on one process too
            # Performance traps: warned once, on the main process (ddp_ft.training.perf_traps).
            check_4bit_compute_dtype(
                model, self.mixed_precision, self.device, self.is_main_process, fix=self.compute_dtype_fix
            )
            watch_idle_device(model, self.device, self.is_main_process, self.micro_batch_fix)
        regional = self._compile_regions(model)
        with self._whole_model_compile(off=regional):
            if not self._wraps_with_bucketed_ddp(model, evaluation_mode):
                return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
            # Everything Accelerate does for a training model except its DDP wrap (which happens only when
            # evaluation_mode is False); a no-op for a model it prepared before. Then ours.
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
        """With a dynamo backend set, compile the model's decoder layers in place with the plugin's options.

        Returns:
            bool: the model is compiled regionally (now or before), so Accelerate must not compile it whole. False
            without a backend, for a model compiled whole already, or for one without repeated layers (then
            Accelerate compiles it whole, around the unwrapped model only: see :meth:`_whole_model_compile`).
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
                model.compile(**plugin.to_kwargs())  # in place, inside the wrapper: never around it
                return True
            return False
        compile_repeated_blocks(model, **plugin.to_kwargs())
        return True

    @contextmanager
    def _whole_model_compile(self, off: bool):
        """Accelerate's whole-model compilation turned off for the block when ``off`` (the state is shared)."""
        plugin = self.state.dynamo_plugin
        backend = plugin.backend
        if off:
            plugin.backend = DynamoBackend.NO
        try:
            yield
        finally:
            plugin.backend = backend

    def wait_for_everyone(self) -> None:
        """A barrier of the default group, which ``init_distributed`` bound to this process's device.

        Accelerate's own passes ``device_ids=[local_process_index]``: under a launcher that gives each process one
        visible GPU (SLURM ``--gpus-per-task=1``), that names ``cuda:1`` on a rank whose only device is ``cuda:0``.
        """
        if self.num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        else:
            super().wait_for_everyone()

    @staticmethod
    @contextmanager
    def trigger_sync_in_backward(model):
        """Accelerate's, for BucketedDDP too: the backward in this context syncs though its forward ran under
        ``no_sync`` (Accelerate's own acts on torch DDP only, and would leave the ranks' gradients apart)."""
        if isinstance(model, BucketedDDP):
            with model.trigger_sync_in_backward():
                yield
        else:
            with Accelerator.trigger_sync_in_backward(model):
                yield

    @contextmanager
    def join_uneven_inputs(self, joinables, even_batches=None):
        """Accelerate's, joining on CPU processes too: torch's ``Join`` over the joinables while the batches are
        uneven (``even_batches=False``), with the prepared map-style loaders' ``even_batches`` overridden for the
        context when given, as Accelerate does on GPUs.

        BucketedDDP is a torch ``Joinable`` (:mod:`ddp_ft.ddp.join`): a rank out of batches shadows the others'
        all-reduces with zero gradients, divided by the initial world size, and the ranks end with the last joiner's
        model. Stock Accelerate joins on GPU types only; on CPU processes it warns and does nothing (the override
        included), so uneven batches there would leave a rank waiting. With even batches the join is off, as in
        Accelerate. On one process: Accelerate's (a no-op).
        """
        if not (self.num_processes > 1 and self.distributed_type in _DATA_PARALLEL):
            with super().join_uneven_inputs(joinables, even_batches):
                yield
            return
        even = self.even_batches if even_batches is None else even_batches
        with self._even_batches(even_batches), Join(joinables, enable=not even, throw_on_early_termination=False):
            yield

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Accelerate's; for the HF Trainer, a loader whose ``even_batches=False`` gives the ranks different numbers
        of batches is refused (:func:`check_trainer_batches`)."""
        prepared = super().prepare_data_loader(
            data_loader, device_placement=device_placement, slice_fn_for_dispatch=slice_fn_for_dispatch
        )
        if self._for_trainer and self.num_processes > 1:
            check_trainer_batches(prepared, self.num_processes)
        return prepared

    @contextmanager
    def _even_batches(self, even_batches: bool | None):
        """Set the prepared map-style loaders' ``even_batches`` for the context (None: leave them); warn, as
        Accelerate does, that an iterable-style loader cannot be overridden."""
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
    """Each rank's number of batches from a loader Accelerate prepared, computed alike on every rank (no
    communication); None where it cannot be known here (iterable or dispatched data, ``split_batches``: the same
    count on every rank)."""
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, BatchSamplerShard) or sampler.split_batches:
        return None
    try:
        total = len(sampler.batch_sampler)
    except TypeError:
        return None
    if sampler.even_batches or sampler.drop_last:  # completed from the start, or cut where a rank runs out
        return [len(sampler)] * num_processes
    return [len(range(rank, total, num_processes)) for rank in range(num_processes)]


def check_trainer_batches(loader, num_processes: int) -> None:
    """Refuse a Trainer's loader that gives the ranks different numbers of batches (``even_batches=False``).

    The Trainer steps and evaluates every rank in lockstep and never joins uneven inputs: the rank with a batch
    more would all-reduce (or gather) alone, and the ranks go out of step. The stock Trainer with torch DDP does
    the same, unrefused.

    Raises:
        ValueError: the counts differ, naming them and the fix.
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
