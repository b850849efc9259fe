"""Accelerate's comm-hook options as BucketedDDP registers them.

``DistributedDataParallelKwargs``' ``comm_hook``, ``comm_wrapper`` and ``comm_state_option`` register torch's hooks.
BucketedDDP registers the same hook and state, one to one, so the gradients are torch DDP's.
FP16 or BF16 alone becomes ``DDPSettings.comm_hook``: ddp_ft's hooks, with no Python on the comm thread.
bf16 also runs on gloo, which torch DDP refuses.
Settings Accelerate would drop silently or fail on are refused before any step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..ddp import BucketedDDP, DDPSettings
from ..ddp.comm_hooks import check_powersgd_buckets

_NAME = "DistributedDataParallelKwargs"
_POWERSGD = ("power_sgd", "batched_power_sgd")
_PLAIN = ("fp16", "bf16")  # hooks DDPSettings.comm_hook names the same


def _value(option: object) -> str:
    """A ``DDPCommunicationHookType``, or its string, as its lower-case value."""
    return str(getattr(option, "value", option)).lower()


@dataclass(frozen=True)
class AccelerateCommHook:
    """Accelerate's comm-hook options, checked.

    Args:
        hook (str): ``fp16``, ``bf16``, ``power_sgd`` or ``batched_power_sgd``.
        wrapper (str): ``no``, ``fp16`` or ``bf16``.
        state_option (dict): ``PowerSGDState`` keyword arguments. Default: ``{}``.
    """

    hook: str
    wrapper: str = "no"
    state_option: dict = field(default_factory=dict)

    @property
    def ddp_settings_hook(self) -> str | None:
        """The ``DDPSettings.comm_hook`` this is, or None."""
        return self.hook if self.hook in _PLAIN and self.wrapper == "no" else None

    @property
    def is_powersgd(self) -> bool:
        return self.hook in _POWERSGD

    def describe(self) -> str:
        """One line for the settings log."""
        hook, _ = self._hook_and_state()
        state = f", PowerSGDState(**{self.state_option})" if self.is_powersgd else ""
        return f"{_NAME}(comm_hook={self.hook}, comm_wrapper={self.wrapper}): torch's {hook.__name__}{state}"

    def known_failure(self) -> str | None:
        """Why torch's hook will fail once it compresses, or None when it works.

        torch's ``batched_powerSGD_hook`` asserts at its first compressing step. Probed, not keyed on a version.
        """
        if self.hook != "batched_power_sgd":
            return None
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        try:
            powerSGD_hook._orthogonalize(torch.ones(2, 1))
        except AssertionError:
            start = self.state_option.get("start_powerSGD_iter", 1000)
            return (
                f"{_NAME}(comm_hook=batched_power_sgd): this torch's batched_powerSGD_hook fails at its first "
                f"compressing step (synced step {start}, start_powerSGD_iter) with an AssertionError, with torch DDP "
                "as with BucketedDDP: it hands torch's _orthogonalize one matrix where a batch is asserted. Until "
                "then it all-reduces as torch DDP does. For PowerSGD that compresses, use "
                f"{_NAME}(comm_hook=DDPCommunicationHookType.POWER_SGD) (comm_state_option "
                "batch_tensors_with_same_shape=True batches layers of one shape)."
            )
        return None

    def check(self, settings: DDPSettings) -> None:
        """Refuses a combination with ddp_ft's own settings that cannot hold.

        Raises:
            ValueError: ``DDPSettings.comm_hook`` names another hook, or PowerSGD with ``bucket_cap_mb='auto'``.
        """
        if settings.comm_hook != "allreduce":
            raise ValueError(
                f"two comm hooks: {_NAME}(comm_hook={self.hook}, comm_wrapper={self.wrapper}) and ddp_ft "
                f"DDPSettings(comm_hook={settings.comm_hook!r}). Set it in one place."
            )
        if self.is_powersgd and settings.bucket_cap_mb == "auto":
            raise ValueError(
                f"{_NAME}(comm_hook={self.hook}) with DDPSettings(bucket_cap_mb='auto'): PowerSGD keeps its state "
                "per bucket index, which the trial's layout changes would scramble. Give bucket_cap_mb a number."
            )

    def register(self, wrapped: BucketedDDP) -> None:
        """Registers the hook on ``wrapped`` as Accelerate would on torch DDP, with a fresh state.

        Raises:
            ValueError: PowerSGD on gloo with several buckets, which would hang.
        """
        if self.is_powersgd:
            caps = "BucketedAccelerator(ddp_settings=DDPSettings(first_bucket_cap_mb={mb}, bucket_cap_mb={mb}))"
            check_powersgd_buckets(wrapped.bucket_sizes, wrapped.process_group, f"{_NAME}(comm_hook={self.hook})", caps)
        hook, state = self._hook_and_state()
        wrapped.register_comm_hook(state, hook)

    def _hook_and_state(self) -> tuple[object, object]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
            "power_sgd": powerSGD_hook.powerSGD_hook,
            "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
        }
        wrappers = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}
        hook = hooks[self.hook]
        if self.wrapper != "no":
            hook = wrappers[self.wrapper](hook)
        state = powerSGD_hook.PowerSGDState(None, **self.state_option) if self.is_powersgd else None
        return hook, state


def accelerate_comm_hook(kwargs: object | None) -> AccelerateCommHook | None:
    """The comm hook a ``DistributedDataParallelKwargs`` asks for, checked.

    Returns:
        AccelerateCommHook | None: None when there is no hook.

    Raises:
        ValueError: an option without a hook to apply it to, an unknown value, or bad PowerSGD options.
    """
    if kwargs is None:
        return None
    hook, wrapper = _value(kwargs.comm_hook), _value(kwargs.comm_wrapper)
    options = dict(kwargs.comm_state_option or {})
    known = (*_PLAIN, *_POWERSGD)
    if hook not in ("no", *known):
        raise ValueError(
            f"{_NAME}(comm_hook={hook!r}): choose one of DDPCommunicationHookType's: no, {', '.join(known)}."
        )
    if wrapper not in ("no", *_PLAIN):
        raise ValueError(f"{_NAME}(comm_wrapper={wrapper!r}): choose no, fp16 or bf16.")
    if hook == "no" and wrapper != "no":
        raise ValueError(
            f"{_NAME}(comm_wrapper={wrapper}) without a comm_hook: the wrapper compresses what a hook sends, and "
            f"with comm_hook=no Accelerate registers nothing, so it would do nothing. For {wrapper} on the wire set "
            f"{_NAME}(comm_hook=DDPCommunicationHookType.{wrapper.upper()}), or remove comm_wrapper."
        )
    if options and hook not in _POWERSGD:
        raise ValueError(
            f"{_NAME}(comm_state_option={options}) with comm_hook={hook}: the options are PowerSGDState's, which only "
            f"comm_hook=DDPCommunicationHookType.POWER_SGD or BATCHED_POWER_SGD uses. Remove them or choose PowerSGD."
        )
    if hook == "no":
        return None
    found = AccelerateCommHook(hook, wrapper, options)
    if found.is_powersgd:
        _check_state_option(options)
    return found


def _check_state_option(options: dict) -> None:
    """Raises ValueError unless ``PowerSGDState(None, **options)`` builds."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    takes = [name for name in inspect.signature(PowerSGDState).parameters if name != "process_group"]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise ValueError(
            f"{_NAME}(comm_state_option=...) has {', '.join(map(repr, unknown))}, which PowerSGDState does not take "
            f"(the process group is Accelerate's default). It takes: {', '.join(takes)}."
        )
    try:
        PowerSGDState(None, **options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{_NAME}(comm_state_option={options}): PowerSGDState refuses it: {error}") from error
