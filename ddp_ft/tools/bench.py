"""What the benchmarks and the GPU check share: one choice of device, backend and compute dtype, and timing that
waits for the device.

A benchmark that joins NCCL must hold its model and batches on its rank's GPU, and one that runs on the CPU must join
gloo and leave CUDA alone: :func:`compute_setup` makes the three choices together, from ``--device`` and
``--compute-dtype``. On CUDA the host runs ahead of the device, so a timed region starts and ends with
:func:`synchronize`, and intervals inside a step are CUDA events read after the region (:class:`ExposedWaitProbe`).

Also the GPU benchmark's model and yardstick: a Qwen3 of any shape with random weights, built without a download
(:func:`build_random_qwen3`), and the model FLOPs of QLoRA training per token (:func:`qlora_training_flops`,
:data:`MFU_FORMULA`) with the peak FLOP/s of known GPUs (:func:`peak_tflops`) for the model FLOPs utilisation.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from ..distributed import DistInfo, destroy_distributed, device_and_backend, init_distributed
from ..training.model.memory import QWEN3_4B, Qwen3Shape, lora_parameters
from ..training.model.precision import Precision, precision_for
from ..training.model.qlora import tiny_qwen3_config


@dataclass(frozen=True)
class ComputeSetup:
    """Where a benchmark runs and in which dtype.

    Args:
        info (DistInfo): this process's rank facts; ``info.device`` is its GPU or the CPU.
        backend (str): ``nccl`` with CUDA, ``gloo`` on the CPU (also for a single process, which has no group).
        precision (Precision): the compute dtype for ``info.device`` and why it was chosen.
    """

    info: DistInfo
    backend: str
    precision: Precision

    @property
    def device_map(self) -> dict[str, int | str]:
        """``from_pretrained``'s device map: the whole model on this rank's device."""
        device = self.info.device
        return {"": device.index if device.type == "cuda" else "cpu"}

    def describe(self) -> str:
        """``device cuda:0 (NVIDIA H100, compute capability 9.0), backend nccl, compute dtype bfloat16 (why)``."""
        device = self.info.device
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            where = f"{device} ({torch.cuda.get_device_name(device)}, compute capability {major}.{minor})"
        else:
            where = "cpu"
        return f"device {where}, backend {self.backend}, compute dtype {self.precision.name} ({self.precision.reason})"


BACKEND_CHOICES = ("auto", "gloo")


def compute_setup(
    device: str = "auto", compute_dtype: str = "auto", timeout_s: float = 600.0, backend: str = "auto"
) -> ComputeSetup:
    """Join the launcher's process group on the device ``device`` asks for, and choose the compute dtype for it.

    Args:
        device (str): ``auto`` (CUDA when available), ``cuda`` (this rank's GPU, NCCL) or ``cpu`` (gloo, CUDA
            ignored). Default: auto.
        compute_dtype (str): ``auto``, ``bfloat16``, ``float16`` or ``float32``
            (``ddp_ft.training.model.precision``). Default: auto.
        timeout_s (float): collective timeout. Default: 600.
        backend (str): ``auto`` (NCCL on CUDA, gloo on the CPU) or ``gloo`` (also on CUDA: gloo reduces CUDA
            tensors through the host, and, unlike NCCL, lets two ranks share one GPU, a test of BucketedDDP's CUDA
            events and streams with real asynchronous communication on a one-GPU host). Default: auto.

    Raises:
        ValueError: ``cuda`` without CUDA, an unknown backend, or bfloat16 on a GPU older than compute capability
            8.0, naming the fix.
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"--backend {backend!r}: choose one of {', '.join(BACKEND_CHOICES)}.")
    device_type, default_backend = device_and_backend(device, torch.cuda.is_available())
    backend = default_backend if backend == "auto" else backend
    info = init_distributed(backend=backend, timeout_s=timeout_s, device_type=device_type)
    try:
        return ComputeSetup(info, backend, precision_for(compute_dtype, info.device))
    except ValueError:
        destroy_distributed()
        raise


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a timed region ends when the GPU finished, not when the host did."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, else what ``platform`` knows, for a benchmark's hardware line."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


class ExposedWaitProbe:
    """Time from the last trainable gradient of a backward to the end of ``backward()``.

    In a synced backward that is the communication (and the wait for the slower rank) that the backward could not
    hide. It is measured from outside, by the same hooks, for torch DDP and BucketedDDP alike, so the part of a step
    where communication shows is compared directly, without the compute that dominates the tokens/s noise.

    On the CPU it is wall time. On CUDA the host does not wait for the collectives (both DDPs only make the
    backward's stream wait for the communication stream), so the interval is taken on the device: an event recorded
    in every gradient hook on the stream backward runs on (the last record wins) and one after ``backward()``,
    read by :attr:`seconds` only after the timed region.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last_grad: float | torch.cuda.Event = 0.0
        self.samples: list[float | tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._stamp)

    def _stamp(self, param: torch.Tensor) -> None:
        if self.cuda:
            self.last_grad.record()
        else:
            self.last_grad = time.perf_counter()

    def backward(self, loss: torch.Tensor, record: bool) -> None:
        if self.cuda:
            self.last_grad = torch.cuda.Event(enable_timing=True)
        loss.backward()
        if not record:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.samples.append((self.last_grad, end))
        else:
            self.samples.append(time.perf_counter() - self.last_grad)

    @property
    def seconds(self) -> list[float]:
        """Every recorded interval in seconds (on CUDA this waits for the recorded events)."""
        return [s if isinstance(s, float) else _event_seconds(*s) for s in self.samples]


def _event_seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# --- A Qwen3 of any shape with random weights, written once --------------------------------------------------------


# The model shapes of the GPU benchmark and of scripts/random_model.py; ``tiny`` is their CPU smoke test.
BENCH_SHAPES: dict[str, Qwen3Shape] = {
    "qwen3-4b": QWEN3_4B,
    "tiny": Qwen3Shape(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=512,
    ),
}


def build_random_qwen3(path: str | Path, shape: Qwen3Shape, dtype: torch.dtype, seed: int = 0) -> Path:
    """A Qwen3 of ``shape`` with uniform random weights in ``dtype``, written with ``save_pretrained``, once.

    Like ``ddp_ft.training.model.qlora.build_tiny_qwen3``, but made on the meta device and filled in one pass:
    transformers' own initialisation of billions of parameters takes minutes, and only the shapes matter to memory and
    speed. The weights are deterministic in ``seed``; the folder is written under a temporary name and renamed, so a
    reader never sees half of it, and an existing one is kept.

    Returns:
        Path: the folder, loadable with ``from_pretrained`` (and so by ``load_qlora_model``).
    """
    from transformers import Qwen3ForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    with torch.device("meta"):
        model = Qwen3ForCausalLM._from_config(tiny_qwen3_config(**vars(shape)), dtype=dtype)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.05, 0.05, generator=generator)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").exists():
            raise
    return path


def random_qwen3_name(shape: Qwen3Shape, dtype: torch.dtype) -> str:
    """The cache folder name of :func:`build_random_qwen3`'s model: every size in it, so shapes never collide."""
    s = shape
    tied = "-tied" if s.tie_word_embeddings else ""
    return (
        f"random-qwen3-h{s.hidden_size}-i{s.intermediate_size}-l{s.num_hidden_layers}-a{s.num_attention_heads}"
        f"-kv{s.num_key_value_heads}-d{s.head_dim}-v{s.vocab_size}{tied}-{str(dtype).removeprefix('torch.')}"
    )


# --- Model FLOPs and utilisation -----------------------------------------------------------------------------------

MFU_FORMULA = (
    "model FLOPs per token = forward 2*N_base + 2*N_lora + 4*L*T*d_attn; backward 2*N_base (activation gradients "
    "through the frozen weights, no weight gradients) + 4*N_lora (activation and weight gradients of the adapters) "
    "+ 8*L*T*d_attn; total 4*N_base + 6*N_lora + 12*L*T*d_attn. N_base: weights of every matmul (the decoder's "
    "linear layers and the lm_head; the embedding lookup is no matmul), N_lora: LoRA parameters, L layers, T sequence "
    "length, d_attn = heads*head_dim (attention scores and weighted values, full T x T, causal mask not halved, as "
    "PaLM counts). Not counted: the forward recomputed under gradient checkpointing, 4-bit dequantisation, norms, "
    "softmax, optimizer (model FLOPs, not hardware FLOPs). MFU = tokens/s per device * FLOPs per token / peak FLOP/s."
)


@dataclass(frozen=True)
class TrainingFlops:
    """Model FLOPs per trained token of QLoRA on a Qwen3 (:data:`MFU_FORMULA`).

    Args:
        base_matmul_params (int): N_base, the frozen weights that multiply every token (decoder linears, lm_head).
        lora_params (int): N_lora, the adapters' parameters.
        attention_forward (int): 4*L*T*d_attn, the attention matmuls of one token's forward.
    """

    base_matmul_params: int
    lora_params: int
    attention_forward: int

    @property
    def forward(self) -> int:
        return 2 * self.base_matmul_params + 2 * self.lora_params + self.attention_forward

    @property
    def backward(self) -> int:
        return 2 * self.base_matmul_params + 4 * self.lora_params + 2 * self.attention_forward

    @property
    def per_token(self) -> int:
        return self.forward + self.backward


def qlora_training_flops(shape: Qwen3Shape, seq_len: int, lora_r: int = 16) -> TrainingFlops:
    """:class:`TrainingFlops` of ``shape`` trained on sequences of ``seq_len`` tokens with LoRA rank ``lora_r`` on
    every linear layer of the decoder (pure arithmetic)."""
    linears = sum(out * inp for out, inp in shape.linear_shapes())
    base = shape.num_hidden_layers * linears + shape.vocab_size * shape.hidden_size  # the lm_head, tied or not
    d_attn = shape.num_attention_heads * shape.head_dim
    return TrainingFlops(base, lora_parameters(shape, lora_r), 4 * shape.num_hidden_layers * seq_len * d_attn)


# Dense (no sparsity) bf16/fp16 tensor-core peaks with fp32 accumulation, TFLOP/s, from NVIDIA's datasheets (H100,
# H200, A100) and the Ada Lovelace whitepaper (RTX 4090), matched against torch.cuda.get_device_name in this order.
# An assumption to check against the card's clocks: boards run below the datasheet's boost clock under load.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),
    ("A100", 312.0),
    ("RTX 4090", 165.0),
)


def peak_tflops(device_name: str, compute_dtype: torch.dtype) -> float | None:
    """The table's peak for a device name in bfloat16/float16, or None when unknown (other cards, float32, CPU)."""
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return None
    return next((peak for key, peak in PEAK_TFLOPS if key in device_name), None)


def exit_without_finalization() -> NoReturn:
    """Leave a finished, written benchmark or check without interpreter finalization, as tests/helpers/dist_harness.py does:
    a gloo thread that releases a collective's work while the interpreter shuts down aborts the process ("terminate
    called without an active exception", seen once in a few runs), which would turn a finished run into a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
