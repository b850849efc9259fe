"""Which model a run trains, settled before anything starts: the preset a run gets when it names no model, and a
model that cannot be found refused in a second instead of retried against the hub for a minute.

One rule for ``ddp-ft train`` and ``ddp-ft recipe`` (and ``scripts/train.py``, ``recipes/qwen_ami.py``): a run that
names no model (no ``--model-name-or-path``, no ``--preset``, and no ``model_name_or_path:`` or ``preset:`` in its
``--config`` file) starts from the device's default preset, ``qwen3-4b-ami`` with CUDA and the embedded ``tiny``
without (built locally: offline on a CPU). A run that names its model gets no preset: the dataclass defaults, then
its config file, then its flags. Either way the first log line says which, and why.
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

HUB_TIMEOUT_S = 10.0  # one request to the hub's API, without retries: reachable or not, known within seconds
_FIX = (
    "Give --model-name-or-path a local folder holding the model and its tokenizer (from save_pretrained), "
    "or try ddp_ft offline on the embedded model with --preset tiny"
)


@dataclass(frozen=True)
class ModelChoice:
    """The default preset of a command line and the reason, for its first log line."""

    preset: str  # ``parse_settings``'s ``default_preset``: "" when the run names its model
    why: str


def choose_default(argv: Sequence[str] | None = None, cuda: bool | None = None) -> ModelChoice:
    """The preset a command line starts from when it names none, by the rule of this module's docstring.

    Args:
        argv (Sequence[str] | None): the command line. Default: ``sys.argv[1:]``
        cuda (bool | None): whether CUDA is available. Default: ``torch.cuda.is_available()``

    Returns:
        ModelChoice: the default preset ("" when the run names its model or a preset) and why.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    named = argparse.ArgumentParser(add_help=False)
    named.add_argument("--preset", default="")
    named.add_argument("--config", default="")
    named.add_argument("--model-name-or-path", "--model_name_or_path", dest="model", default="")
    given, _ = named.parse_known_args(argv)
    try:
        from_file = load_config(given.config) if given.config else {}
    except ValueError:  # parse_settings reports it, naming the file
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
    """The run's first log line: its model, its preset and why, its processes (rank 0's logger only prints it)."""
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
    """Refuse a model that is neither embedded, a local folder, in the hub cache, nor found on the hub, in seconds.

    A hub id that is not cached is asked for once (``huggingface_hub.model_info``, ``timeout_s``, no retries):
    ``from_pretrained`` itself retries an unreachable hub for about half a minute per file before it fails.

    Args:
        name (str): ``ModelSettings.model_name_or_path``.
        timeout_s (float): the hub request's timeout. Default: 10
        setting (str): the setting the errors name. Default: ``--model-name-or-path``
        fix (str): the sentence the errors end with. Default: give a local folder, or ``--preset tiny``

    Raises:
        ValueError: no such folder, no such model on the hub, or the hub unreachable (``HF_HUB_OFFLINE`` included)
            with the model not cached; naming ``setting`` and ``fix``. A folder without a model or tokenizer
            (:func:`check_model_folder`).
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
    except Exception as error:  # the hub unreachable: offline mode, no network, a proxy, a timeout
        raise ValueError(
            f"{setting} {name}: not in the local hub cache, and the hub cannot be reached "
            f"({type(error).__name__}: {error}). {fix}; or connect and run again."
        ) from None


# A tokenizer's own files (fast, SentencePiece, BPE, WordPiece, tiktoken, or a config naming a class without vocabulary).
_TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "*.model", "vocab.*", "merges.txt", "*.tiktoken")


def check_model_folder(name: str, setting: str = "--model-name-or-path", tokenizer: bool = True) -> None:
    """Refuse a local model folder without ``config.json`` or any tokenizer file, before a worker starts.

    ``model.save_pretrained`` saves no tokenizer; without one ``AutoTokenizer`` fails on every rank, after start-up,
    asking to install sentencepiece or tiktoken.

    Args:
        name (str): ``ModelSettings.model_name_or_path``, an existing folder.
        setting (str): what names the folder, in errors. Default: --model-name-or-path
        tokenizer (bool): the folder must hold a tokenizer too (not a base an adapter brings its own to).
            Default: True

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
