"""Which model a run trains, settled before anything starts.

A run that names no model, by flag, preset or config file, starts from the device's default preset.
That is ``qwen3-4b-ami`` with CUDA, and the embedded ``tiny`` without.
A run that names its model gets no preset. The first log line says which, and why.
A model that cannot be found is refused in seconds, not retried against the hub for a minute.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import RunSettings, load_config
from .qlora import EMBEDDED_MODEL

logger = logging.getLogger(__name__)

HUB_TIMEOUT_S = 10.0  # one hub request, no retries
_FIX = (
    "Give --model-name-or-path a local folder holding the model and its tokenizer (from save_pretrained), "
    "or try ddp_ft offline on the embedded model with --preset tiny"
)


@dataclass(frozen=True)
class ModelChoice:
    """The default preset of a command line, and why."""

    preset: str  # "" when the run names its model
    why: str


def choose_default(argv: Sequence[str] | None = None, cuda: bool | None = None) -> ModelChoice:
    """The preset a command line starts from when it names none.

    Args:
        argv (Sequence[str] | None): the command line. Default: ``sys.argv[1:]``.
        cuda (bool | None): whether CUDA is available. Default: ``torch.cuda.is_available()``.

    Returns:
        ModelChoice: the default preset, "" when the run names its model or a preset, and why.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    named = argparse.ArgumentParser(add_help=False)
    named.add_argument("--preset", default="")
    named.add_argument("--config", default="")
    named.add_argument("--model-name-or-path", "--model_name_or_path", dest="model", default="")
    given, _ = named.parse_known_args(argv)
    try:
        from_file = load_config(given.config) if given.config else {}
    except ValueError:  # parse_settings reports it
        from_file = {}
    if given.preset:
        return ModelChoice("", "from --preset")
    if given.model:
        return ModelChoice("", "--model-name-or-path names the model: no preset, the defaults and your settings")
    if "preset" in from_file:
        return ModelChoice("", f"from preset: in {given.config}")
    if "model_name_or_path" in from_file:
        return ModelChoice("", f"{given.config} names the model: no preset, the defaults and your settings")
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        return ModelChoice("qwen3-4b-ami", "no model named, CUDA available: the reference run")
    return ModelChoice(
        "tiny", "no model named and no CUDA: the embedded default, offline; name yours with --model-name-or-path"
    )


def log_choice(settings: RunSettings, choice: ModelChoice, world_size: int) -> None:
    """Logs the run's model, preset, reason and process count."""
    logger.info(
        "model %s, preset %s (%s), %d process(es)",
        settings.model.model_name_or_path,
        settings.preset or "none",
        choice.why,
        world_size,
    )


def check_model_source(
    name: str,
    timeout_s: float = HUB_TIMEOUT_S,
    setting: str = "--model-name-or-path",
    fix: str = _FIX,
    tokenizer: bool = True,
) -> None:
    """Refuses, in seconds, a model that is not embedded, local, cached or on the hub.

    ``from_pretrained`` would retry an unreachable hub for half a minute per file.

    Args:
        name (str): ``ModelSettings.model_name_or_path``.
        timeout_s (float): the hub request's timeout. Default: 10.
        setting (str): the setting the errors name. Default: ``--model-name-or-path``.
        fix (str): the sentence the errors end with.
        tokenizer (bool): a local folder must hold a tokenizer. Default: True.

    Raises:
        ValueError: no such folder or hub model, or the hub unreachable and the model not cached.
    """
    if name == EMBEDDED_MODEL:
        return
    if Path(name).expanduser().is_dir():
        check_model_folder(name, setting, tokenizer)
        return
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise ValueError(f"{setting} {name}: no such folder. {fix}.")
    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
        model_info(name, timeout=timeout_s)
    except GatedRepoError:  # exists; from_pretrained says how to get access
        return
    except (RepositoryNotFoundError, HFValidationError):
        raise ValueError(
            f"{setting} {name}: neither a local folder nor a model on the hub (or a private one: "
            f"`hf auth login`). {fix}."
        ) from None
    except Exception as error:  # the hub unreachable
        raise ValueError(
            f"{setting} {name}: not in the local hub cache, and the hub cannot be reached "
            f"({type(error).__name__}: {error}). {fix}; or connect and run again."
        ) from None


# A tokenizer's own files, of any kind.
_TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "*.model", "vocab.*", "merges.txt", "*.tiktoken")


def check_model_folder(name: str, setting: str = "--model-name-or-path", tokenizer: bool = True) -> None:
    """Refuses a local model folder without ``config.json`` or a tokenizer, before a worker starts.

    ``model.save_pretrained`` saves no tokenizer, and ``AutoTokenizer`` would fail late on every rank.

    Args:
        name (str): an existing folder.
        setting (str): what names the folder, in errors. Default: --model-name-or-path.
        tokenizer (bool): the folder must hold a tokenizer too. Default: True.

    Raises:
        ValueError: naming the folder, the missing files and how to save them.
    """
    folder = Path(name).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{setting} {name}: {folder.resolve()} holds no config.json, so it is no saved model. Give the "
            "folder model.save_pretrained wrote (or a hub id)."
        )
    if tokenizer and not any(next(folder.glob(pattern), None) for pattern in _TOKENIZER_PATTERNS):
        raise ValueError(
            f"{setting} {name}: {folder.resolve()} holds no tokenizer (no tokenizer.json, "
            "tokenizer_config.json, tokenizer.model, vocab.json + merges.txt or vocab.txt): model.save_pretrained "
            f"saves none. Save the tokenizer beside the model: AutoTokenizer.from_pretrained(ORIGIN).save_pretrained("
            f"'{folder}'), ORIGIN being the hub id or folder the model came from."
        )
