"""Memory per GPU of the 4-bit QLoRA model: what is resident, what one training step adds, by arithmetic.

:func:`estimate` is pure arithmetic on a Qwen3 shape (no torch): the NF4 base with its quantisation state, the frozen
weights that are not quantised (embedding, tied lm_head, norms), the LoRA adapters (r on every linear layer of the
decoder, float32) with their gradients and AdamW moments, and the tensors alive at the step's peak with
non-reentrant gradient checkpointing. "Upcast" is peft's layout (``prepare_model_for_kbit_training`` casts the frozen
weights that are not quantised to float32, ``--upcast-frozen-weights``); "kept" is ours (they stay in the compute
dtype, ``ddp_ft.training.model.qlora._frozen_weights_kept``).

Where the step peaks (measured on a 2-layer proxy of Qwen3-4B at full width, ``scripts/memory_4bit.py``): in the
backward of the loss, when the log-softmax output transformers saved (float32, batch x seq x vocab), the gradient
flowing into it and the one it produces are alive together, on top of every checkpointed layer input and, in the
upcast layout, autocast's bf16 copy of the float32 lm_head (a frozen weight's cast is not cached; the matmul keeps
it for the input gradient). A decoder layer's recomputation in the backward holds far less than the vocabulary-wide
tensors of the loss, and the optimizer step comes after the activations are freed. Not counted: the CUDA context,
the caching allocator's free blocks, kernel workspaces.

:func:`parameter_bytes` and :func:`step_peak_bytes` measure the same on a model on the CPU: the first sums the
storages of parameters, buffers and 4-bit quantisation state; the second is the peak of torch's CPU allocator
accounting (the profiler's memory events) over a callable, with the arithmetic of matmuls and attention skipped
(:func:`skipped_matmuls_mode`), so a step of a 4B-wide model takes seconds instead of minutes on a CPU without bf16
units while allocating the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..batch import gradient_accumulation_steps

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
NF4_BLOCKSIZE = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights
NESTED_BLOCKSIZE = 256  # double quantisation: the absmaxes quantised to uint8 in blocks of 256
NF4_CODE_BYTES = 16 * 4  # the NF4 code table (float32), one per weight
NESTED_CODE_BYTES = 256 * 4  # the 8-bit dynamic map of the nested quantisation, one per weight


@dataclass(frozen=True)
class Qwen3Shape:
    """The sizes of a Qwen3 causal LM that decide its memory (the fields of ``transformers.Qwen3Config``)."""

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
        """(out, in) of one decoder layer's linear layers: q, k, v, o, gate, up, down (all 4-bit, all LoRA)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_attention_heads, self.num_key_value_heads
        d = self.head_dim
        return [(q * d, h), (kv * d, h), (kv * d, h), (h, q * d), (i, h), (i, h), (h, i)]


# Qwen/Qwen3-4B's config.json (hub revision of 2025-04; no network here, so written out).
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
    """Bytes of one bitsandbytes NF4 weight of ``numel`` elements with its quantisation state.

    Two weights per byte; one absmax per 64-weight block, float32, or with double quantisation uint8 plus one
    float32 absmax per 256 blocks, a float32 offset and the 8-bit map; the NF4 code table.
    """
    blocks = -(-numel // NF4_BLOCKSIZE)
    packed = -(-numel // 2)
    if not double_quant:
        return packed + 4 * blocks + NF4_CODE_BYTES
    nested = -(-blocks // NESTED_BLOCKSIZE)
    return packed + blocks + 4 * nested + 4 + NESTED_CODE_BYTES + NF4_CODE_BYTES


def lora_parameters(shape: Qwen3Shape, r: int) -> int:
    """LoRA parameters with rank ``r`` on every linear layer of the decoder (peft's ``all-linear``: not lm_head)."""
    return shape.num_hidden_layers * sum(r * (out + inp) for out, inp in shape.linear_shapes())


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by part. ``resident`` lives for the whole run; ``activations`` at the step's peak on top."""

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
        """Peak tensor bytes (``torch.cuda.max_memory_allocated``); the CUDA context and the allocator's cached
        but free blocks come on top."""
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
    """Bytes per GPU of QLoRA training on ``shape`` at ``seq_len`` tokens x ``micro_batch`` sequences.

    Args:
        shape (Qwen3Shape): the model's sizes.
        seq_len (int): tokens per sequence (padded length).
        micro_batch (int): sequences per forward. Default: 1.
        compute_dtype (str): bfloat16, float16 or float32 (autocast and the 4-bit matmuls). Default: bfloat16.
        upcast_frozen_weights (bool): peft's float32 layout of the frozen weights that are not quantised.
            Default: False (kept in the compute dtype).
        lora_r (int): LoRA rank. Default: 16.
        double_quant (bool): NF4 double quantisation. Default: True.

    Returns:
        MemoryEstimate: the parts, named.
    """
    if compute_dtype not in DTYPE_BYTES:
        raise ValueError(f"compute_dtype={compute_dtype!r}: choose one of {sorted(DTYPE_BYTES)}.")
    c = DTYPE_BYTES[compute_dtype]
    frozen = 4 if upcast_frozen_weights else c  # the embedding, lm_head and norms
    # The residual stream takes the embedding's dtype; an fp16 one is widened to fp32 (model.py's forward hook).
    residual = 4 if frozen == 4 or compute_dtype == "float16" else c
    h, v, layers, tokens = shape.hidden_size, shape.vocab_size, shape.num_hidden_layers, micro_batch * seq_len
    norms = layers * (2 * h + 2 * shape.head_dim) + h  # input, post-attention, q and k norms; the final norm
    lora = lora_parameters(shape, lora_r)
    parameters = {
        "nf4_linear_weights": layers * sum(nf4_bytes(o * i, double_quant) for o, i in shape.linear_shapes()),
        "embedding": v * h * frozen,  # the lm_head too when tied
        "lm_head": 0 if shape.tie_word_embeddings else v * h * frozen,
        "norms": norms * frozen,
        "rotary_buffers": 2 * (shape.head_dim // 2) * 4,  # inv_freq and original_inv_freq, float32
        "lora_adapters": lora * 4,  # float32 in every layout (peft's autocast_adapter_dtype)
    }
    training_state = {"lora_gradients": lora * 4, "adamw_moments": lora * 8}  # float32; gradients: the DDP buckets
    activations = {
        # autocast caches its casts of the trainable LoRA weights until the autocast block ends; the loop runs the
        # backward inside it.
        "lora_autocast_copies": lora * c if c < 4 else 0,
        # Non-reentrant checkpointing keeps each decoder layer's input; the final norm keeps its float32 input.
        "checkpointed_layer_inputs": layers * tokens * h * residual,
        "final_norm_input": tokens * h * 4,
        "rotary_cos_sin": 2 * seq_len * shape.head_dim * residual,
        # autocast's copy of a float32 lm_head, made every forward and kept for the backward.
        "lm_head_autocast_copy": v * h * c if frozen == 4 and c < 4 else 0,
        # transformers upcasts the logits for the loss; the log-softmax output is saved, and in its backward the
        # incoming and outgoing gradients (float32, same size) are alive with it. The loop drops the output object
        # (and with it the compute-dtype logits) before the backward.
        "log_softmax_output": tokens * v * 4,
        "loss_gradients": 2 * tokens * v * 4,
    }
    return MemoryEstimate(parameters, training_state, activations)


# --- Measuring the same on the CPU --------------------------------------------------------------------------------


def parameter_bytes(model) -> int:
    """Bytes of the distinct storages of ``model``'s parameters, buffers and 4-bit quantisation state.

    Tied weights count once; a ``Params4bit``'s ``quant_state`` (absmax, nested absmax, offset, code tables) counts.
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
    """A ``TorchDispatchMode`` that answers matmuls, attention and bitsandbytes' 4-bit matmul with zeros of the
    right shape, dtype and strides instead of computing them (see :func:`step_peak_bytes`)."""
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
            return tree_map(zeros, func(*tree_map(meta, args), **tree_map(meta, kwargs)))  # shapes from meta kernels

    return SkippedMatmuls()


def step_peak_bytes(step: Callable[[], object], skip_matmuls: bool = True) -> int:
    """Peak of CPU tensor bytes allocated while ``step()`` runs, above what was allocated before it.

    From the profiler's memory events (torch's CPU allocator reports every allocation and free to it). With
    ``skip_matmuls`` the matmuls and attention return zeros instead of computing (:func:`skipped_matmuls_mode`):
    the same tensors are allocated, except the kernels' internal scratch space, which is a property of the kernel
    (and differs on a GPU anyway). Only tensors count, not the Python or allocator overhead of the process.
    """
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with skipped_matmuls_mode() if skip_matmuls else nullcontext():
            step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


# --- Choosing the micro-batch (``--micro-batch auto``) -----------------------------------------------------------

# The share of the device kept free under the expected peak. It covers what the caching allocator reserves above the
# allocated peak (measured on an H100: docs/performance.md), the CUDA context, which counts against the device's
# total, kernel workspaces, and the estimate's error growing with the micro-batch.
AUTO_MARGIN = 0.15


@dataclass(frozen=True)
class MicroBatchChoice:
    """What ``--micro-batch auto`` chose: the largest micro-batch whose expected peak fits the budget.

    ``micro_batch x accumulation x world_size`` is the effective batch, unchanged.
    """

    micro_batch: int
    accumulation: int
    world_size: int
    expected_peak: int  # bytes, MemoryEstimate.peak at this micro-batch
    budget: int  # bytes, device_bytes x (1 - margin)
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
    """The largest micro-batch that fits ``device_bytes`` with the effective batch unchanged, by :func:`estimate`.

    Candidates are the divisors of ``effective_batch / world_size`` (so the accumulation is a whole number); the
    choice is the largest whose expected peak (resident + step peak at ``seq_len`` x micro-batch tokens) is at most
    ``device_bytes x (1 - margin)``. The peak grows with the micro-batch, so no larger divisor fits either.

    Args:
        shape (Qwen3Shape): the model's sizes.
        seq_len (int): tokens per sequence (the run's ``max_seq_len``, the padded length at worst).
        effective_batch (int): samples per optimizer step over all ranks.
        world_size (int): ranks.
        device_bytes (int): memory of one device (``torch.cuda.mem_get_info``'s total).
        compute_dtype, upcast_frozen_weights, lora_r, double_quant: as in :func:`estimate`.
        margin (float): share of ``device_bytes`` left free. Default: :data:`AUTO_MARGIN`.

    Returns:
        MicroBatchChoice: the micro-batch, its accumulation, expected peak and budget.

    Raises:
        ValueError: ``effective_batch`` not a multiple of ``world_size``, a margin outside [0, 1), or micro-batch 1
            not fitting; naming ``--micro-batch`` and the numbers.
    """
    per_rank = gradient_accumulation_steps(effective_batch, 1, world_size)  # samples per rank per step
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
