"""BucketedDDP's state_dict hooks: its keys are the wrapped module's (no ``module.`` prefix), and a load takes the
wrapped module's keys or torch DDP's prefixed ones."""

from __future__ import annotations

from torch import nn


def strip_module_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """The wrapper's state_dict is the wrapped module's: no ``module.`` prefix in saved keys."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def add_module_prefix(wrapper: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Accept the wrapped module's keys, which :func:`strip_module_prefix` writes, and torch DDP's prefixed ones.

    A key is taken as prefixed only if it is not one of the wrapped module's own keys, so a model whose own child
    is called ``module`` (keys ``module.*``) loads as itself.
    """
    wrapper._load_prefix = prefix
    inner = prefix + "module."
    own = set(wrapper.module.state_dict(keep_vars=True))
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = key[len(prefix) :]
        if name in own or not (name.startswith("module.") and name[len("module.") :] in own):
            state_dict[inner + name] = state_dict.pop(key)


def report_keys_unprefixed(wrapper: nn.Module, incompatible_keys) -> None:
    """Report missing and unexpected keys as :func:`strip_module_prefix` writes them (no ``module.``).

    Loaders that compare the report with ``state_dict()``'s keys, such as safetensors' ``load_model`` (Accelerate's
    ``load_state``) with tied weights, which it saves once and expects missing, need the two in one namespace.
    """
    prefix = wrapper._load_prefix
    inner = prefix + "module."
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [prefix + key[len(inner) :] if key.startswith(inner) else key for key in keys]
