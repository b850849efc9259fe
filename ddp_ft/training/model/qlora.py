"""The QLoRA model: 4-bit NF4 base on this rank's device, LoRA adapters, non-reentrant checkpointing.

Also builds the embedded default, a tiny random Qwen3 loaded through ``from_pretrained`` like a hub model.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...ddp.four_bit import keep_4bit_training_layout
from ...ddp.ranges import check_ranges
from ..ranges import LORA_RANGES
from .attention import check_attention
from .precision import DTYPES, Precision, precision_for

logger = logging.getLogger(__name__)

EMBEDDED_MODEL = "embedded:tiny-qwen3"


@dataclass
class ModelSettings:
    """Which base model to load and how."""

    model_name_or_path: str = field(
        default="Qwen/Qwen3-4B",
        metadata={
            "help": f"Hub id or local folder of the base model, or {EMBEDDED_MODEL!r} (tiny Qwen3, built locally)."
        },
    )
    load_in_4bit: bool = field(default=True, metadata={"help": "Quantise the base to bitsandbytes NF4 (QLoRA)."})
    double_quant: bool = field(default=True, metadata={"help": "NF4 double quantisation of the scales."})
    compute_dtype: str = field(
        default="auto",
        metadata={
            "help": "Compute dtype of the 4-bit layers and of autocast: bfloat16, float16 (trained with a loss "
            "scaler), float32, or auto (bfloat16 on GPUs of compute capability >= 8.0, float16 on older ones such "
            "as T4/V100, float32 on CPU, where bf16 matmuls run ~9x slower without native bf16 support)."
        },
    )
    device_map: str = field(
        default="",
        metadata={
            "help": "Leave empty for this rank's device ({'': local_rank}). A single process may use 'auto' to shard "
            "a model over its GPUs; under DDP that is refused."
        },
    )
    gradient_checkpointing: bool | str = field(
        default="auto",
        metadata={
            "help": "Recompute activations in backward, trading compute for memory. auto (the default): on, except on "
            "CUDA with --micro-batch auto when the probe measures that the whole per-rank batch fits without it "
            "(then nothing is recomputed). true: on. --no-gradient-checkpointing: off."
        },
    )
    use_reentrant: bool = field(
        default=False,
        metadata={"help": "Reentrant checkpointing breaks DDP gradient hooks; keep False unless you know why."},
    )
    attention: str = field(
        default="auto",
        metadata={
            "help": "The decoder layers' attn_implementation: auto (flex_attention on CUDA when packed rows hold two "
            "or more samples, whose masked blocks it skips; transformers' default, sdpa, otherwise), or one "
            "transformers knows (sdpa, eager, flex_attention). Resolved before the model loads and logged."
        },
    )
    liger: bool = field(
        default=False,
        metadata={
            "help": "Liger's fused Triton kernels for Qwen3 (RMSNorm, RoPE, SwiGLU, and the fused linear cross-entropy "
            "that never materialises the logits): the plain loop patches transformers' Qwen3 before the model loads, "
            "the recipe sets TrainingArguments' use_liger_kernel. Opt-in: 0.92x the speed on one H100 at micro-batch "
            '1. Needs CUDA, Triton and the liger-kernel package (pip install "liger-kernel>=0.7,<1", the [liger] extra); refused before the '
            "model loads."
        },
    )
    compile: bool | str = field(
        default="auto",
        metadata={
            "help": "torch.compile each decoder layer in place before BucketedDDP wraps the model (regional "
            "compilation: identical layers compile once, and each layer's backward stays its own so the buckets' "
            "all-reduces still overlap it), on the loop and the recipe alike. auto (the default): on for CUDA "
            "(off, with the reason, where it is known to break), off on the CPU. true: on, refused before the model "
            "loads where it cannot work. --no-compile: off."
        },
    )
    upcast_frozen_weights: bool = field(
        default=False,
        metadata={
            "help": "Let peft's prepare_model_for_kbit_training upcast the frozen non-quantised weights (embedding, "
            "tied lm_head, norms) to float32, as it does by default. Off: they stay in the compute dtype, which saves "
            "about 1.6 GB per GPU on Qwen3-4B in bfloat16 (the fp32 copy, plus autocast's bf16 copy of the lm_head "
            "every forward; docs/memory_4bit_cpu.json). Turn on to reproduce a run made with peft's defaults "
            "(float32 residual stream in bfloat16), or for a model whose norms compute in their weight's dtype."
        },
    )

    def __post_init__(self) -> None:
        for name in ("compile", "gradient_checkpointing"):
            if getattr(self, name) not in (True, False, "auto"):
                raise ValueError(f"ModelSettings.{name}={getattr(self, name)!r}: choose true, false or auto.")
        check_attention(self.attention)
        if self.compute_dtype != "auto" and self.compute_dtype not in DTYPES:
            raise ValueError(
                f"ModelSettings.compute_dtype={self.compute_dtype!r}: choose auto or one of {sorted(DTYPES)}."
            )

    def precision(self, device: torch.device) -> Precision:
        """``compute_dtype`` resolved for ``device``."""
        return precision_for(self.compute_dtype, device)


@dataclass
class LoraSettings:
    """LoRA adapter settings (peft ``LoraConfig``)."""

    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Modules to adapt: 'all-linear' or comma-separated module names (q_proj,v_proj)."},
    )

    def __post_init__(self) -> None:
        check_ranges(self, LORA_RANGES)

    @property
    def target_modules(self) -> str | list[str]:
        if self.lora_target_modules == "all-linear":
            return "all-linear"
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]


def tiny_qwen3_config(vocab_size: int, **overrides):
    """A Qwen3 config of a few million parameters, with Qwen3-4B's code paths."""
    from transformers import Qwen3Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def build_tiny_qwen3(
    path: str | Path, vocab_size: int, seed: int = 0, token_ids: dict[str, int] | None = None, **overrides
) -> Path:
    """Writes a random tiny Qwen3 model to ``path``, once.

    The weights depend on ``seed`` only, so every rank gets the same.
    ``token_ids`` are set after the weights are drawn; a ``pad_token_id`` at init would zero its embedding.

    Returns:
        Path: the folder, loadable with ``from_pretrained``.
    """
    from transformers import Qwen3ForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size, **overrides))
    finally:
        torch.random.set_rng_state(generator_state)
    for name, value in (token_ids or {}).items():
        setattr(model.config, name, value)
        setattr(model.generation_config, name, value)
    return save_whole(model, path)


def save_whole(model, path: Path) -> Path:
    """``save_pretrained`` into a temporary folder renamed to ``path``: readers see the model whole or not at all.

    Where another process renamed its copy first, that copy is kept.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").exists():
            raise
    return path


def check_device_map(device_map: object, world_size: int) -> None:
    """Refuses device maps that split one model across devices under data parallelism.

    Raises:
        ValueError: naming the map and the fix, ``device_map={"": local_rank}``.
    """
    if world_size <= 1:
        return
    devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
    if isinstance(device_map, str) or len(devices) != 1 or (isinstance(device_map, dict) and "" not in device_map):
        raise ValueError(
            f"device_map={device_map!r} under data parallelism (world size {world_size}) would split each "
            "rank's model across devices. Use device_map={'': local_rank} so each rank holds a whole copy on "
            "its own device."
        )


def map_device(device_map: dict[str, object] | str) -> torch.device:
    """The device a ``device_map`` puts the model on."""
    where = next(iter(device_map.values())) if isinstance(device_map, dict) else device_map
    if isinstance(where, int):
        return torch.device("cuda", where)
    if where == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(where)


def load_qlora_model(
    model: ModelSettings, lora: LoraSettings, device_map: dict[str, object], world_size: int = 1
) -> torch.nn.Module:
    """Loads the base model on this rank's device and adds LoRA adapters.

    Args:
        model (ModelSettings): which base model and how to load it.
        lora (LoraSettings): adapter settings.
        device_map (dict): ``{"": local_rank}`` or ``{"": "cpu"}``.
        world_size (int): for the device-map check.

    Returns:
        torch.nn.Module: a peft model whose trainable parameters are the LoRA weights.

    Raises:
        ValueError: a device map that splits the model.
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    check_device_map(device_map, world_size)
    base = _load_base(model, device_map)
    base.config.use_cache = False
    if model.load_in_4bit:
        # Checkpointing comes below: peft would use a deprecated call.
        with nullcontext() if model.upcast_frozen_weights else _frozen_weights_kept(base):
            base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    if base.get_input_embeddings().weight.dtype == torch.float16:
        # fp16 overflows a 36-layer residual stream, so widen the embedding's output to fp32.
        # Prepended before enable_input_require_grads, so the fp16 output is freed at once.
        base.get_input_embeddings().register_forward_hook(_residual_stream_in_float32, prepend=True)
    if model.gradient_checkpointing:  # auto: on until the probe finds it unneeded
        set_checkpointing(base, True, model.use_reentrant)
    config = LoraConfig(
        r=lora.lora_r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft reads a deprecated attribute
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        peft_model = get_peft_model(base, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    logger.info(
        "loaded %s (4-bit=%s), %d trainable LoRA parameters", model.model_name_or_path, model.load_in_4bit, trainable
    )
    return peft_model


@contextmanager
def _frozen_weights_kept(base: torch.nn.Module) -> Iterator[None]:
    """Hides the frozen fp16/bf16 weights from peft's float32 upcast within the block.

    The upcast costs resident memory (docs/performance.md has the numbers), plus a bf16 re-cast on every forward.
    Qwen3's RMSNorm normalises in fp32 anyway, so the norms can stay in the compute dtype too.
    Empty fp32 placeholders stand in, so no fp32 copy ever exists.
    """
    kept = [
        (p, p.data)
        for p in base.parameters()
        if p.dtype in (torch.float16, torch.bfloat16) and p.__class__.__name__ != "Params4bit"
    ]
    try:
        for param, data in kept:
            param.data = torch.empty(0, dtype=torch.float32, device=data.device)
        yield
    finally:
        for param, data in kept:
            param.data = data


def _residual_stream_in_float32(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def load_trained_adapter(model: ModelSettings, adapter_path: str, device_map: dict[str, object]) -> torch.nn.Module:
    """Loads the base model with a saved LoRA adapter, for evaluation or inference."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_load_base(model, device_map), adapter_path).eval()


def _load_base(model: ModelSettings, device_map: dict[str, object]) -> torch.nn.Module:
    """``from_pretrained`` with NF4 4-bit weights, unless disabled, on ``device_map``.

    Its 4-bit weights keep one layout, so evaluation and inference compute as training does.
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = model.precision(map_device(device_map)).dtype
    kwargs: dict = {"device_map": device_map, "dtype": dtype}
    if model.attention != "auto":  # auto is resolved before the build
        kwargs["attn_implementation"] = model.attention
    if model.load_in_4bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=model.double_quant,
            bnb_4bit_compute_dtype=dtype,
        )
    base = AutoModelForCausalLM.from_pretrained(model.model_name_or_path, **kwargs)
    keep_4bit_training_layout(base)
    return base


def set_checkpointing(model: torch.nn.Module, on: bool, use_reentrant: bool = False) -> None:
    """Turns activation checkpointing of a transformers or peft ``model`` on or off.

    The embeddings' output requires grad, so checkpointed segments reach the adapters.
    The hook stays when off, so a compiled first layer keeps its graph.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if on:
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        base.activation_checkpointing_disable()
    base.disable_input_require_grads()  # the hooks transformers tracks: one stays, not one more per call
    base.enable_input_require_grads()
