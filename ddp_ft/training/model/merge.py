"""A trained adapter merged into its base: one standalone model to serve (``ddp-ft merge``).

By default the base is dequantised from NF4 as training saw it, then peft adds the LoRA product.
Merging into the 4-bit layers would quantise again and lose the adapter's small updates.
``base="original"`` merges into the published 16-bit weights, which differ by the quantisation error.
The output folder is written whole or not at all.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import ADAPTER_DIR, CHECKPOINT_PREFIX, DATA_FILE, FINAL_DIR
from ..checkpoint.publish import fsync_tree, latest_name
from ..config import RUN_CONFIG, load_config
from .precision import BF16_MIN_CAPABILITY, DTYPES
from .qlora import ModelSettings
from .source import check_model_source

logger = logging.getLogger(__name__)

BASES = ("trained", "original")
ADAPTER_CONFIG = "adapter_config.json"
_TRAINER_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_LOOP_CHECKPOINT = re.compile(rf"{re.escape(CHECKPOINT_PREFIX)}-(\d+)$")
_BASE_FIX = (
    "Pass --base-model with the folder or hub id of the base model the adapter was trained on "
    f"(it overrides base_model_name_or_path in {ADAPTER_CONFIG})"
)


@dataclass(frozen=True)
class MergeSettings:
    """How ``ddp-ft merge`` builds the merged model.

    Args:
        base (str): ``trained``, the base as training saw it, or ``original``, the published weights. Default: trained.
        dtype (str): the merged model's dtype: ``auto``, bfloat16, float16 or float32. Default: auto.
        base_model (str | None): the base's folder or hub id. Default: None, from ``adapter_config.json``.
        device (str): ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. Default: auto.
    """

    base: str = "trained"
    dtype: str = "auto"
    base_model: str | None = None
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise ValueError(f"MergeSettings.base={self.base!r} (--base): choose one of {', '.join(BASES)}.")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"MergeSettings.dtype={self.dtype!r} (--dtype): choose auto or one of {sorted(DTYPES)}.")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"MergeSettings.device={self.device!r} (--device): choose auto, cpu, cuda or cuda:N.")
        if self.base_model is not None and not self.base_model.strip():
            raise ValueError("MergeSettings.base_model is empty (--base-model): give a folder or a hub id.")


@dataclass(frozen=True)
class MergePlan:
    """What a merge loads, resolved and checked before any weight is read.

    Args:
        adapter (Path): the adapter folder.
        base_model (str): the base model's folder or hub id.
        quantized (bool): merge into the dequantised NF4 base.
        double_quant (bool): the NF4 scales quantised again.
        dtype (torch.dtype): the merged model's dtype.
        device (torch.device): where the base loads and merges.
    """

    adapter: Path
    base_model: str
    quantized: bool
    double_quant: bool
    dtype: torch.dtype
    device: torch.device


def find_adapter(path: str | Path) -> Path:
    """The adapter a run folder ends with, or ``path`` itself when it is one.

    A run folder gives ``final/``, else its newest checkpoint's adapter.

    Raises:
        FileNotFoundError: no adapter there.
    """
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file():
        return path
    if (path / FINAL_DIR / ADAPTER_CONFIG).is_file():
        return path / FINAL_DIR
    found = _checkpoint_adapters(path) if path.is_dir() else []
    if found:
        step, adapter = max(found, key=lambda item: item[0])
        logger.info(
            "%s has no %s/: merging its newest checkpoint's adapter, %s (step %d)", path, FINAL_DIR, adapter, step
        )
        return adapter
    raise FileNotFoundError(
        f"no adapter in {path}: looked for {ADAPTER_CONFIG} there, in {FINAL_DIR}/ (a finished run), in the "
        f"checkpoint 'latest' names ({CHECKPOINT_PREFIX}-N/{ADAPTER_DIR}/, the plain loop's) and in checkpoint-N/ "
        "(the recipe's). Give a run's --output-dir or an adapter folder saved with save_pretrained."
    )


def check_output_dir(out: str | Path) -> None:
    """Refuses an output that exists and is not an empty folder.

    Raises:
        FileExistsError: naming ``--out`` and the fix.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"--out {out} exists and is not an empty folder; merge writes a new one and never replaces what is "
            "there. Give a new or empty folder."
        )


def plan_merge(source: str | Path, settings: MergeSettings) -> MergePlan:
    """Finds the adapter, its base and how training loaded the base, before any weight loads.

    Raises:
        FileNotFoundError: no adapter.
        ValueError: no base model named, or one that cannot be found.
    """
    adapter = find_adapter(source)
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    base_model = settings.base_model or config.get("base_model_name_or_path")
    setting = "--base-model" if settings.base_model else f"base_model_name_or_path in {adapter / ADAPTER_CONFIG} ="
    if not base_model:
        raise ValueError(f"{adapter / ADAPTER_CONFIG} names no base_model_name_or_path. {_BASE_FIX}.")
    check_model_source(base_model, setting=setting, fix=_BASE_FIX, tokenizer=False)  # the adapter has its own tokenizer
    load_in_4bit, double_quant = _trained_quantization(adapter)
    if settings.base == "trained" and not load_in_4bit:
        logger.info("the run trained on the unquantised base (load_in_4bit: false): merging into it")
    device = _device(settings.device)
    return MergePlan(
        adapter=adapter,
        base_model=base_model,
        quantized=settings.base == "trained" and load_in_4bit,
        double_quant=double_quant,
        dtype=_dtype(settings.dtype, device),
        device=device,
    )


def merge_adapter(source: str | Path, out: str | Path, settings: MergeSettings | None = None) -> Path:
    """Merges a run's adapter into its base and saves the model, tokenizer and data settings to ``out``.

    Args:
        source (str | Path): a run's output folder or an adapter folder.
        out (str | Path): a new or empty folder.
        settings (MergeSettings | None): which base, dtype and device. Default: ``MergeSettings()``.

    Returns:
        Path: ``out``, loadable with ``from_pretrained``.

    Raises:
        FileExistsError: ``out`` is not new or empty.
        FileNotFoundError: no adapter or tokenizer.
        ValueError: no usable base model.

    Example:
        >>> merge_adapter("runs/qwen3", "merged/qwen3", MergeSettings(dtype="bfloat16"))
    """
    from peft import PeftModel

    settings = settings or MergeSettings()
    out = Path(out)
    check_output_dir(out)
    plan = plan_merge(source, settings)
    tokenizer = load_adapter_tokenizer(plan)
    what = "its NF4 weights dequantised, as training saw them" if plan.quantized else "its original weights"
    logger.info("merging %s into %s (%s), %s on %s", plan.adapter, plan.base_model, what, plan.dtype, plan.device)
    base = load_base_to_merge(plan)
    with warnings.catch_warnings():  # peft reads a deprecated attribute
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        merged = PeftModel.from_pretrained(base, str(plan.adapter)).merge_and_unload(safe_merge=True)
    _write(merged, tokenizer, plan.adapter, out)
    logger.info("wrote the merged model, its tokenizer and data settings to %s", out)
    return out


def load_base_to_merge(plan: MergePlan) -> torch.nn.Module:
    """The base in ``plan.dtype`` on ``plan.device``, dequantised from NF4 when ``plan.quantized``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: dict = {"dtype": plan.dtype, "device_map": {"": str(plan.device)}}
    if plan.quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=plan.double_quant,
            bnb_4bit_compute_dtype=plan.dtype,
        )
    base = AutoModelForCausalLM.from_pretrained(plan.base_model, **kwargs)
    # No forward before this: bitsandbytes may repack a CPU weight at its first one.
    return base.dequantize(dtype=plan.dtype) if plan.quantized else base


def _checkpoint_adapters(run: Path) -> list[tuple[int, Path]]:
    """(step, adapter folder) of the loop's ``latest`` checkpoint and of every ``checkpoint-N``."""
    found = []
    name = latest_name(run)
    match = _LOOP_CHECKPOINT.search(name or "")
    if match and (run / name / ADAPTER_DIR / ADAPTER_CONFIG).is_file():
        found.append((int(match.group(1)), run / name / ADAPTER_DIR))
    for child in run.iterdir():
        match = _TRAINER_CHECKPOINT.match(child.name)
        if match and (child / ADAPTER_CONFIG).is_file():
            found.append((int(match.group(1)), child))
    return found


def _trained_quantization(adapter: Path) -> tuple[bool, bool]:
    """``load_in_4bit`` and ``double_quant`` from the run's ``run_config.yaml``, else the defaults."""
    defaults = ModelSettings()
    config = next((f / RUN_CONFIG for f in (adapter.parent, adapter.parent.parent) if (f / RUN_CONFIG).is_file()), None)
    if config is None:
        logger.info("no %s beside the adapter: assuming the base trained in NF4 with double quantisation", RUN_CONFIG)
        return defaults.load_in_4bit, defaults.double_quant
    try:
        values = load_config(config)
    except ValueError as error:
        logger.warning("%s; assuming the base trained in NF4 with double quantisation", error)
        return defaults.load_in_4bit, defaults.double_quant
    return bool(values.get("load_in_4bit", defaults.load_in_4bit)), bool(
        values.get("double_quant", defaults.double_quant)
    )


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(name)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16, or float16 on a GPU without native bfloat16."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < BF16_MIN_CAPABILITY:
        return torch.float16
    return torch.bfloat16


def load_adapter_tokenizer(plan: MergePlan):
    """The adapter's tokenizer, else the base model's with a warning."""
    from transformers import AutoTokenizer

    if (plan.adapter / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(plan.adapter))
    logger.warning(
        "%s holds no tokenizer: taking %s's, whose chat template may not be the one training used",
        plan.adapter,
        plan.base_model,
    )
    try:
        return AutoTokenizer.from_pretrained(plan.base_model)
    except (OSError, ValueError) as error:
        raise FileNotFoundError(
            f"no tokenizer in {plan.adapter} nor in the base model {plan.base_model} ({error}). Copy the run's "
            "tokenizer into the adapter folder (tokenizer.save_pretrained) and run merge again."
        ) from None


def _write(model: torch.nn.Module, tokenizer, adapter: Path, out: Path) -> None:
    """Saves into a hidden sibling of ``out``, fsyncs, and renames it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if (adapter / DATA_FILE).is_file():
            shutil.copyfile(adapter / DATA_FILE, tmp / DATA_FILE)
        else:
            logger.warning("%s holds no %s: the merged model has no record of its prompt format", adapter, DATA_FILE)
        fsync_tree(tmp)
        os.replace(tmp, out)  # replaces an empty folder only
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
