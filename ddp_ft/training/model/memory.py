"""Memory per GPU of the 4-bit QLoRA model, by arithmetic.

:func:`estimate` counts a Qwen3 shape: the NF4 base, frozen weights, LoRA adapters and their optimizer state.
It adds the tensors alive at the step's peak with non-reentrant checkpointing.
The step peaks in the loss's backward, when the float32 log-softmax and two gradients of its size are alive.
"Upcast" is peft's float32 layout of the frozen weights; "kept" leaves them in the compute dtype.
The CUDA context, cached free blocks and kernel workspaces are not counted.

:func:`parameter_bytes` and :func:`step_peak_bytes` measure the same on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..batch import gradient_accumulation_steps

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
NF4_BLOCKSIZE = 64  # one absmax per 64 weights
NESTED_BLOCKSIZE = 256  # absmaxes quantised to uint8 in blocks of 256
NF4_CODE_BYTES = 16 * 4  # float32 NF4 code table
NESTED_CODE_BYTES = 256 * 4  # 8-bit map of the nested quantisation


@dataclass(frozen=True)
class Qwen3Shape:
    """The sizes of a Qwen3 causal LM that decide its memory."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = True

    @classmethod
    def from_config(cls, config: object) -> Qwen3Shape:
        """From a ``Qwen3Config`` (or anything with the same attributes)."""
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of one decoder layer's seven linear layers."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_attention_heads, self.num_key_value_heads
        d = self.head_dim
        return [(q * d, h), (kv * d, h), (kv * d, h), (h, q * d), (i, h), (i, h), (h, i)]


# Qwen/Qwen3-4B's config.json, written out.
QWEN3_4B = Qwen3Shape(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def nf4_bytes(numel: int, double_quant: bool = True) -> int:
    """Bytes of one bitsandbytes NF4 weight of ``numel`` elements, with its quantisation state."""
    blocks = -(-numel // NF4_BLOCKSIZE)
    packed = -(-numel // 2)
    if not double_quant:
        return packed + 4 * blocks + NF4_CODE_BYTES
    nested = -(-blocks // NESTED_BLOCKSIZE)
    return packed + blocks + 4 * nested + 4 + NESTED_CODE_BYTES + NF4_CODE_BYTES


def lora_parameters(shape: Qwen3Shape, r: int) -> int:
    """LoRA parameters of rank ``r`` on every decoder linear layer, as peft's ``all-linear``."""
    return shape.num_hidden_layers * sum(r * (out + inp) for out, inp in shape.linear_shapes())


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by part; activations peak on top of the resident bytes."""

    parameters: dict[str, int]
    training_state: dict[str, int]
    activations: dict[str, int]

    @property
    def parameter_bytes(self) -> int:
        return sum(self.parameters.values())

    @property
    def resident(self) -> int:
        return self.parameter_bytes + sum(self.training_state.values())

    @property
    def step_peak(self) -> int:
        return sum(self.activations.values())

    @property
    def peak(self) -> int:
        """Peak tensor bytes, as ``torch.cuda.max_memory_allocated`` counts them."""
        return self.resident + self.step_peak


def estimate(
    shape: Qwen3Shape,
    seq_len: int,
    micro_batch: int = 1,
    compute_dtype: str = "bfloat16",
    upcast_frozen_weights: bool = False,
    lora_r: int = 16,
    double_quant: bool = True,
) -> MemoryEstimate:
    """Bytes per GPU of QLoRA training on ``shape`` at ``seq_len`` x ``micro_batch`` tokens.

    Args:
        shape (Qwen3Shape): the model's sizes.
        seq_len (int): tokens per sequence, padded.
        micro_batch (int): sequences per forward. Default: 1.
        compute_dtype (str): bfloat16, float16 or float32. Default: bfloat16.
        upcast_frozen_weights (bool): peft's float32 frozen weights. Default: False.
        lora_r (int): LoRA rank. Default: 16.
        double_quant (bool): NF4 double quantisation. Default: True.

    Returns:
        MemoryEstimate: the parts, named.

    Raises:
        ValueError: an unknown ``compute_dtype``.
    """
    if compute_dtype not in DTYPE_BYTES:
        raise ValueError(f"compute_dtype={compute_dtype!r}: choose one of {sorted(DTYPE_BYTES)}.")
    c = DTYPE_BYTES[compute_dtype]
    frozen = 4 if upcast_frozen_weights else c
    # The residual stream takes the embedding's dtype; fp16 is widened to fp32.
    residual = 4 if frozen == 4 or compute_dtype == "float16" else c
    h, v, layers, tokens = shape.hidden_size, shape.vocab_size, shape.num_hidden_layers, micro_batch * seq_len
    norms = layers * (2 * h + 2 * shape.head_dim) + h  # input, post-attention, q and k norms; the final norm
    lora = lora_parameters(shape, lora_r)
    parameters = {
        "nf4_linear_weights": layers * sum(nf4_bytes(o * i, double_quant) for o, i in shape.linear_shapes()),
        "embedding": v * h * frozen,  # the lm_head too when tied
        "lm_head": 0 if shape.tie_word_embeddings else v * h * frozen,
        "norms": norms * frozen,
        "rotary_buffers": 2 * (shape.head_dim // 2) * 4,
        "lora_adapters": lora * 4,  # float32 in every layout
    }
    training_state = {"lora_gradients": lora * 4, "adamw_moments": lora * 8}  # float32
    activations = {
        # autocast caches LoRA weight casts; the backward runs inside it.
        "lora_autocast_copies": lora * c if c < 4 else 0,
        # Non-reentrant checkpointing keeps each layer's input.
        "checkpointed_layer_inputs": layers * tokens * h * residual,
        "final_norm_input": tokens * h * 4,
        "rotary_cos_sin": 2 * seq_len * shape.head_dim * residual,
        # autocast's copy of a float32 lm_head, kept for the backward.
        "lm_head_autocast_copy": v * h * c if frozen == 4 and c < 4 else 0,
        # The saved log-softmax, plus two float32 gradients of its size in its backward.
        "log_softmax_output": tokens * v * 4,
        "loss_gradients": 2 * tokens * v * 4,
    }
    return MemoryEstimate(parameters, training_state, activations)


# --- Measuring the same on the CPU --------------------------------------------------------------------------------


def parameter_bytes(model) -> int:
    """Bytes of the distinct storages of ``model``'s parameters, buffers and 4-bit state.

    Tied weights count once.
    """
    import torch

    tensors = [*model.parameters(), *model.buffers()]
    for param in list(tensors):
        state = getattr(param, "quant_state", None)
        while state is not None:
            tensors += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
            state = getattr(state, "state2", None)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def skipped_matmuls_mode():
    """A ``TorchDispatchMode`` that answers matmuls and attention with zeros of the right shape."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    aten = torch.ops.aten
    skipped = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    }
    try:
        import bitsandbytes  # noqa: F401  (registers its ops)

        skipped.add(torch.ops.bitsandbytes.gemm_4bit.default)
    except (ImportError, AttributeError):
        pass

    def meta(t):
        return t.to("meta") if isinstance(t, torch.Tensor) else t

    def zeros(t):
        return torch.zeros_like(t, device="cpu") if isinstance(t, torch.Tensor) else t

    class SkippedMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func not in skipped:
                return func(*args, **kwargs)
            return tree_map(zeros, func(*tree_map(meta, args), **tree_map(meta, kwargs)))

    return SkippedMatmuls()


def step_peak_bytes(step: Callable[[], object], skip_matmuls: bool = True) -> int:
    """Peak CPU tensor bytes allocated while ``step()`` runs, from the profiler's memory events.

    With ``skip_matmuls`` the same tensors are allocated without the arithmetic.
    Kernels' scratch space is not counted. Python's collector runs before the step and not during it, so the
    finalizers of earlier objects stay out of the profile.
    """
    import gc
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with skipped_matmuls_mode() if skip_matmuls else nullcontext():
                step()
    finally:
        if collecting:
            gc.enable()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


# --- Choosing the micro-batch (``--micro-batch auto``) -----------------------------------------------------------

# Kept free under the expected peak: the allocator's reserve, the CUDA context, workspaces,
# and the estimate's error (docs/performance.md).
AUTO_MARGIN = 0.15


@dataclass(frozen=True)
class MicroBatchChoice:
    """What ``--micro-batch auto`` chose: the largest micro-batch whose expected peak fits."""

    micro_batch: int
    accumulation: int
    world_size: int
    expected_peak: int  # bytes
    budget: int  # bytes
    device_bytes: int

    def describe(self) -> str:
        return (
            f"--micro-batch auto: {self.micro_batch} (x {self.accumulation} accumulation x {self.world_size} "
            f"rank(s) = effective batch {self.micro_batch * self.accumulation * self.world_size}); expected peak "
            f"{self.expected_peak / 1e9:.3f} GB of a {self.budget / 1e9:.3f} GB budget "
            f"({self.device_bytes / 1e9:.3f} GB device)"
        )


def auto_micro_batch(
    shape: Qwen3Shape,
    seq_len: int,
    effective_batch: int,
    world_size: int,
    device_bytes: int,
    *,
    compute_dtype: str = "bfloat16",
    upcast_frozen_weights: bool = False,
    lora_r: int = 16,
    double_quant: bool = True,
    margin: float = AUTO_MARGIN,
) -> MicroBatchChoice:
    """The largest micro-batch that fits ``device_bytes`` by :func:`estimate`, effective batch unchanged.

    Candidates divide ``effective_batch / world_size``, so the accumulation is whole.

    Args:
        shape (Qwen3Shape): the model's sizes.
        seq_len (int): tokens per sequence, the run's ``max_seq_len``.
        effective_batch (int): samples per optimizer step over all ranks.
        world_size (int): ranks.
        device_bytes (int): memory of one device.
        compute_dtype, upcast_frozen_weights, lora_r, double_quant: as in :func:`estimate`.
        margin (float): share of ``device_bytes`` left free. Default: :data:`AUTO_MARGIN`.

    Returns:
        MicroBatchChoice: the micro-batch, its accumulation, expected peak and budget.

    Raises:
        ValueError: a bad batch or margin, or micro-batch 1 does not fit.
    """
    per_rank = gradient_accumulation_steps(effective_batch, 1, world_size)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin}: must be in [0, 1).")
    budget = int(device_bytes * (1.0 - margin))

    def peak(m: int) -> int:
        return estimate(shape, seq_len, m, compute_dtype, upcast_frozen_weights, lora_r, double_quant).peak

    for m in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
        expected = peak(m)
        if expected <= budget:
            return MicroBatchChoice(m, per_rank // m, world_size, expected, budget, device_bytes)
    raise ValueError(
        f"--micro-batch auto: even micro-batch 1 does not fit: expected peak {peak(1) / 1e9:.3f} GB at "
        f"{seq_len} tokens, budget {budget / 1e9:.3f} GB ({device_bytes / 1e9:.3f} GB device less "
        f"{margin:.0%} margin). Lower --max-seq-len, or use a larger device."
    )
