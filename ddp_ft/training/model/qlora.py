"""The QLoRA model: 4-bit NF4 base on this rank's device, LoRA adapters, non-reentrant checkpointing.

Also builds the embedded default, a tiny Qwen3-architecture model with random weights, saved to disk
and loaded back through the same ``from_pretrained`` path a hub model takes.
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

from ...ddp.ranges import check_ranges
from ..ranges import LORA_RANGES
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
        if self.compile not in (True, False, "auto"):
            raise ValueError(f"ModelSettings.compile={self.compile!r}: choose true, false or auto.")
        if self.compute_dtype != "auto" and self.compute_dtype not in DTYPES:
            raise ValueError(
                f"ModelSettings.compute_dtype={self.compute_dtype!r}: choose auto or one of {sorted(DTYPES)}."
            )

    def precision(self, device: torch.device) -> Precision:
        """``compute_dtype`` resolved for ``device`` (``ddp_ft.training.model.precision.choose_precision``)."""
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
    """A Qwen3-architecture config of a few million parameters: fast on a CPU, same code paths as Qwen3-4B."""
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
    """Write a randomly initialised tiny Qwen3 model to ``path`` (config.json + safetensors), once.

    Deterministic in ``seed``, so every rank (or a rank building it on its own) gets identical weights.
    ``token_ids`` (e.g. ``eos_token_id``, ``pad_token_id``) go into the saved config and generation config after
    the weights are drawn, so they do not change the weights (a ``pad_token_id`` at init would zero its embedding).

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
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process (e.g. a second node's local rank 0) finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").exists():
            raise
    return path


def check_device_map(device_map: object, world_size: int) -> None:
    """Refuse device maps that split one model across devices under data parallelism.

    ``device_map="auto"`` (or any map naming several devices) turns each rank's model into a pipeline
    over all GPUs: with DDP the ranks then fight over the same devices, hang or train on garbage.

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
    """The device a ``device_map`` puts the model on (its first device; ``auto`` is CUDA when there is one)."""
    where = next(iter(device_map.values())) if isinstance(device_map, dict) else device_map
    if isinstance(where, int):
        return torch.device("cuda", where)
    if where == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(where)


def load_qlora_model(
    model: ModelSettings, lora: LoraSettings, device_map: dict[str, object], world_size: int = 1
) -> torch.nn.Module:
    """Load the base model (4-bit NF4 unless disabled) on this rank's device and add LoRA adapters.

    Steps: ``from_pretrained`` with a BitsAndBytesConfig and ``device_map``; peft's
    ``prepare_model_for_kbit_training`` (freezes the base; its float32 upcast of the frozen non-quantised weights
    only with ``upcast_frozen_weights``, see ``_frozen_weights_kept``); activation checkpointing, non-reentrant unless
    configured otherwise, with input gradients; ``get_peft_model``.

    Args:
        model (ModelSettings): which base model and how to load it.
        lora (LoraSettings): adapter settings.
        device_map (dict): ``{"": local_rank}`` (or ``{"": "cpu"}``); anything splitting the model is refused.
        world_size (int): for the device-map check.

    Returns:
        torch.nn.Module: a peft model whose trainable parameters are the LoRA weights.
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    check_device_map(device_map, world_size)
    base = _load_base(model, device_map)
    base.config.use_cache = False
    if model.load_in_4bit:
        # Checkpointing is enabled below, not here: peft would call the deprecated gradient_checkpointing_enable.
        with nullcontext() if model.upcast_frozen_weights else _frozen_weights_kept(base):
            base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    if base.get_input_embeddings().weight.dtype == torch.float16:
        # fp16 tops out at 65,504, which a residual stream summed over 36 layers can pass: widen the embedding's
        # output and the stream stays fp32, as in peft's layout (each layer still computes in fp16 and its output is
        # added in fp32). bf16 has fp32's range: its stream stays bf16, the dtype the model was trained in. Run before
        # the hooks of enable_input_require_grads (activation_checkpointing_enable adds one too), so the fp32 output
        # is the leaf that requires grad and the fp16 one is freed at once, not held by the graph until the backward.
        base.get_input_embeddings().register_forward_hook(_residual_stream_in_float32, prepend=True)
    if model.gradient_checkpointing:  # True, or auto: on until the probe finds it is not needed
        set_checkpointing(base, True, model.use_reentrant)
    config = LoraConfig(
        r=lora.lora_r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft reads the deprecated `is_gradient_checkpointing`: not the user's concern
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        peft_model = get_peft_model(base, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    logger.info(
        "loaded %s (4-bit=%s), %d trainable LoRA parameters", model.model_name_or_path, model.load_in_4bit, trainable
    )
    return peft_model


@contextmanager
def _frozen_weights_kept(base: torch.nn.Module) -> Iterator[None]:
    """Hide the frozen bf16/fp16 weights that are not quantised from peft's float32 upcast, while in the block.

    ``prepare_model_for_kbit_training`` casts every fp16/bf16 parameter that is not ``Params4bit`` to float32
    (peft/utils/other.py). For Qwen3-4B that is the tied embedding/lm_head, 151,936 x 2,560: +0.78 GB resident, and
    autocast re-casts it to bf16 on every forward (+0.78 GB, not cached for a weight without gradient); the
    residual stream becomes fp32 too. Kept in the compute dtype instead. The norms can stay there as well:
    ``Qwen3RMSNorm.forward`` (transformers/models/qwen3/modeling_qwen3.py) normalises in fp32 whatever its input
    and only multiplies by the weight in the input's dtype; the checkpoint stores that weight in bf16 anyway.

    Their storage is swapped for empty fp32 placeholders, which peft leaves alone, and put back on exit (also on an
    error), so no fp32 copy ever exists. Casting back after peft would be simpler, but the embedding's fp32 copy and
    its bf16 cast would coexist (2.3 GB for the 0.78 GB kept): a load peak of about 4.2 GB on Qwen3-4B, as high as
    the 4.3 GB the training step then peaks at (docs/memory_4bit_cpu.json), with 1.6 GB left cached by CUDA's
    allocator.
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
    """Load the base model as for training and put a saved LoRA adapter on it, for evaluation or inference."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_load_base(model, device_map), adapter_path).eval()


def _load_base(model: ModelSettings, device_map: dict[str, object]) -> torch.nn.Module:
    """``from_pretrained`` with NF4 double-quantised 4-bit weights (unless disabled) on ``device_map``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = model.precision(map_device(device_map)).dtype
    kwargs: dict = {"device_map": device_map, "dtype": dtype}
    if model.attention != "auto":  # auto is resolved before the build (ddp_ft.training.model.attention)
        kwargs["attn_implementation"] = model.attention
    if model.load_in_4bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=model.double_quant,
            bnb_4bit_compute_dtype=dtype,
        )
    return AutoModelForCausalLM.from_pretrained(model.model_name_or_path, **kwargs)


def set_checkpointing(model: torch.nn.Module, on: bool, use_reentrant: bool = False) -> None:
    """Turn activation checkpointing of ``model`` (a transformers model, or a peft model around one) on or off.

    On, each decoder layer is recomputed in backward, and the input embeddings' output requires grad: the frozen
    base's inputs carry none, and checkpointed segments need one to reach the adapters. Off, the layers keep their
    activations; the embeddings' hook stays, so that a compiled first layer keeps the graph it was compiled with (an
    input no longer requiring grad would be a recompilation, toward Dynamo's limit of 8) at the cost of the input
    gradient of one layer of 36.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if on:
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        base.activation_checkpointing_disable()
    base.enable_input_require_grads()  # the output's requires_grad_ is idempotent: a hook more changes nothing
