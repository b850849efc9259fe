"""BucketedDDP settings from ddp_ft's own, the Trainer's and Accelerate's.

Each setting is honoured or refused by name, never dropped.
Two sources that set one knob to different values are an error.
"""

from __future__ import annotations

from dataclasses import fields, replace

from ..ddp import DDPSettings
from .comm_hook_kwargs import accelerate_comm_hook

_TRAINING_ARGUMENTS = {
    "ddp_find_unused_parameters": "find_unused_parameters",
    "ddp_bucket_cap_mb": "bucket_cap_mb",
    "ddp_broadcast_buffers": "broadcast_buffers",
    "ddp_static_graph": "static_graph",
}
_DDP_KWARGS = (
    "find_unused_parameters",
    "bucket_cap_mb",
    "broadcast_buffers",
    "gradient_as_bucket_view",
    "static_graph",
)

STATIC_GRAPH_REFUSED = (
    "static_graph=True is not supported by BucketedDDP: its bucket layout is already fixed (reverse registration "
    "order, checked across ranks), and torch's other static-graph promises (unused parameters found once, "
    "reentrant checkpointing) are not made. Remove it ({source})."
)


def resolve_ddp_settings(
    explicit: DDPSettings | None = None,
    training_args: object | None = None,
    ddp_kwargs: object | None = None,
) -> tuple[DDPSettings, dict[str, str]]:
    """The BucketedDDP settings a run asked for, and where each non-default one came from.

    Knobs nobody set keep ddp_ft's defaults.
    So ``find_unused_parameters`` stays False where the stock Trainer would turn it on for a PeftModel.
    That saves a graph walk per step; an unused parameter raises an error naming it.

    Args:
        explicit (DDPSettings | None): ddp_ft's own settings. Default: None.
        training_args (TrainingArguments | None): the Trainer's arguments. Default: None.
        ddp_kwargs (DistributedDataParallelKwargs | None): the Accelerator's ``ddp_handler``. Default: None.

    Returns:
        tuple[DDPSettings, dict[str, str]]: the settings, and each set knob's source.

    Raises:
        ValueError: conflicting sources, ``static_graph=True``, or a setting with no BucketedDDP equivalent.
    """
    candidates: list[tuple[str, str, object]] = []
    if explicit is not None:
        defaults = DDPSettings()
        for f in fields(DDPSettings):
            value = getattr(explicit, f.name)
            if value != getattr(defaults, f.name):
                candidates.append((f.name, f"ddp_ft DDPSettings.{f.name}", value))
    if training_args is not None:
        for arg, knob in _TRAINING_ARGUMENTS.items():
            value = getattr(training_args, arg, None)
            if value is not None:
                candidates.append((knob, f"TrainingArguments.{arg}", value))
        # The Trainer starts the process group with its own ddp_timeout.
        if explicit is not None and explicit.ddp_timeout != DDPSettings().ddp_timeout:
            if training_args.ddp_timeout != explicit.ddp_timeout:
                raise ValueError(
                    f"conflicting process-group timeouts: ddp_ft DDPSettings.ddp_timeout={explicit.ddp_timeout} but "
                    f"TrainingArguments.ddp_timeout={training_args.ddp_timeout}, which the Trainer starts the group "
                    "with: set TrainingArguments.ddp_timeout."
                )
    if ddp_kwargs is not None:
        candidates += _from_ddp_kwargs(ddp_kwargs)

    chosen: dict[str, tuple[str, object]] = {}
    for knob, source, value in candidates:
        if knob == "static_graph":
            if value:
                raise ValueError(STATIC_GRAPH_REFUSED.format(source=f"{source}=True"))
            continue
        if knob in chosen and chosen[knob][1] != value:
            first_source, first_value = chosen[knob]
            raise ValueError(
                f"conflicting BucketedDDP settings: {first_source}={first_value!r} but {source}={value!r}. "
                "Set it in one place (or to the same value in both)."
            )
        chosen.setdefault(knob, (source, value))
    settings = replace(explicit or DDPSettings(), **{knob: value for knob, (_, value) in chosen.items()})
    return settings, {knob: source for knob, (source, _) in chosen.items()}


def _from_ddp_kwargs(kwargs: object) -> list[tuple[str, str, object]]:
    from accelerate.utils import DistributedDataParallelKwargs

    defaults = DistributedDataParallelKwargs()
    name = "DistributedDataParallelKwargs"
    for unsupported in ("dim", "check_reduction"):
        if getattr(kwargs, unsupported) != getattr(defaults, unsupported):
            raise ValueError(
                f"{name}.{unsupported}={getattr(kwargs, unsupported)!r} has no BucketedDDP equivalent: remove it "
                f"from {name}(...)."
            )
    found = [
        (knob, f"{name}.{knob}", getattr(kwargs, knob))
        for knob in _DDP_KWARGS
        if getattr(kwargs, knob) != getattr(defaults, knob)
    ]
    # FP16/BF16 alone is DDPSettings.comm_hook; other hooks are registered after the wrap.
    hook = accelerate_comm_hook(kwargs)
    if hook is not None and hook.ddp_settings_hook is not None:
        found.append(("comm_hook", f"{name}.comm_hook", hook.ddp_settings_hook))
    return found


def describe_sources(settings: DDPSettings, sources: dict[str, str]) -> str:
    """One log line: every knob with its value and source."""
    return ", ".join(
        f"{f.name}={getattr(settings, f.name)!r} ({sources.get(f.name, 'default')})" for f in fields(DDPSettings)
    )
