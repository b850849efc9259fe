"""BucketedDDP's state_dict hooks: saved keys are the wrapped module's, without ``module.``."""

from __future__ import annotations

from torch import nn


def strip_module_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """Save the wrapped module's keys, without the ``module.`` prefix."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def add_module_prefix(wrapper: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Accept the wrapped module's keys and torch DDP's ``module.``-prefixed ones.

    A key counts as prefixed only if it is not the module's own, so a child named ``module`` still loads.
    """
    wrapper._load_prefix = prefix
    inner = prefix + "module."
    own = set(wrapper.module.state_dict(keep_vars=True))
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = key[len(prefix) :]
        if name in own or not (name.startswith("module.") and name[len("module.") :] in own):
            state_dict[inner + name] = state_dict.pop(key)


def report_keys_unprefixed(wrapper: nn.Module, incompatible_keys) -> None:
    """Report missing and unexpected keys without ``module.``, as ``state_dict()`` names them.

    safetensors' ``load_model`` compares the two to skip tied weights, so they must share a namespace.
    """
    prefix = wrapper._load_prefix
    inner = prefix + "module."
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [prefix + key[len(inner) :] if key.startswith(inner) else key for key in keys]
