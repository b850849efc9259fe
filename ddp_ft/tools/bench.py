"""What the benchmarks and the GPU check share.

:func:`compute_setup` picks device, backend and compute dtype together. Timed regions wait for the device.
Also here: random-weight Qwen3 models, model FLOPs per token, and the peak FLOP/s of known GPUs.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from ..distributed import DistInfo, destroy_distributed, init_distributed
from ..distributed.devices import device_and_backend
from ..training.model.memory import QWEN3_4B, Qwen3Shape, lora_parameters
from ..training.model.precision import Precision, precision_for
from ..training.model.qlora import save_whole, tiny_qwen3_config


@dataclass(frozen=True)
class ComputeSetup:
    """Where a benchmark runs and in which dtype.

    Args:
        info (DistInfo): this process's rank and device.
        backend (str): ``nccl`` or ``gloo``.
        precision (Precision): the compute dtype and why.
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
        """One line naming the device, backend and compute dtype."""
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
    """Join the launcher's process group and choose the compute dtype.

    Args:
        device (str): ``auto``, ``cuda`` or ``cpu``. Default: auto.
        compute_dtype (str): ``auto``, ``bfloat16``, ``float16`` or ``float32``. Default: auto.
        timeout_s (float): collective timeout. Default: 600.
        backend (str): ``auto`` or ``gloo``; gloo lets two ranks share one GPU. Default: auto.

    Returns:
        ComputeSetup: the rank, backend and precision.

    Raises:
        ValueError: if the device, backend or dtype cannot work here.

    Example:
        >>> setup = compute_setup("cpu")
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"--backend {backend!r}: choose one of {', '.join(BACKEND_CHOICES)}.")
    device_type, backend = device_and_backend(device, torch.cuda.is_available(), backend)
    info = init_distributed(backend=backend, timeout_s=timeout_s, device_type=device_type)
    try:
        return ComputeSetup(info, backend, precision_for(compute_dtype, info.device))
    except ValueError:
        destroy_distributed()
        raise


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work before reading a timer."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_name() -> str:
    """The CPU's model name, for a benchmark's hardware line."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


class ExposedWaitProbe:
    """Time from the last trainable gradient of a backward to the end of ``backward()``.

    In a synced backward that is the communication backward could not hide.
    The same hooks measure torch DDP and BucketedDDP, so the two compare directly.
    On CUDA it is timed with events, read only after the timed region.
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
        """Every recorded interval in seconds."""
        return [s if isinstance(s, float) else _event_seconds(*s) for s in self.samples]


def _event_seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# --- A Qwen3 of any shape with random weights, written once --------------------------------------------------------


# ``tiny`` is the CPU smoke test.
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


def build_random_qwen3(
    path: str | Path, shape: Qwen3Shape, dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu"
) -> Path:
    """Write a Qwen3 of ``shape`` with random weights, once.

    It skips transformers' slow initialisation, since only the shapes matter to speed.
    The folder appears whole by a rename.

    Args:
        path (str | Path): the model folder.
        shape (Qwen3Shape): the model's sizes.
        dtype (torch.dtype): the weights' dtype.
        seed (int): the random seed. Default: 0.
        device (str | torch.device): where the weights are drawn, which changes them. ``"auto"``: the GPU if it
            has room for them twice, else the CPU. Default: ``"cpu"``

    Returns:
        Path: the folder, loadable with ``from_pretrained``.

    Example:
        >>> build_random_qwen3("models/tiny", BENCH_SHAPES["tiny"], torch.float32)
    """
    from transformers import Qwen3ForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    with torch.device("meta"):
        model = Qwen3ForCausalLM._from_config(tiny_qwen3_config(**vars(shape)), dtype=dtype)
    if device == "auto":
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        device = "cuda" if torch.cuda.is_available() and torch.cuda.mem_get_info()[0] > 2 * weights else "cpu"
    model = model.to_empty(device=device)
    model.tie_weights()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.05, 0.05, generator=generator)
    return save_whole(model, path)


def random_qwen3_name(shape: Qwen3Shape, dtype: torch.dtype) -> str:
    """A cache folder name holding every size, so shapes never collide."""
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
        base_matmul_params (int): N_base, the frozen matmul weights.
        lora_params (int): N_lora, the adapters' parameters.
        attention_forward (int): 4*L*T*d_attn, one token's attention forward.
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
    """The :class:`TrainingFlops` of ``shape`` at ``seq_len`` tokens and LoRA rank ``lora_r``."""
    linears = sum(out * inp for out, inp in shape.linear_shapes())
    base = shape.num_hidden_layers * linears + shape.vocab_size * shape.hidden_size  # the lm_head, tied or not
    d_attn = shape.num_attention_heads * shape.head_dim
    return TrainingFlops(base, lora_parameters(shape, lora_r), 4 * shape.num_hidden_layers * seq_len * d_attn)


# Dense bf16/fp16 datasheet peaks in TFLOP/s, matched against the device name in order.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),
    ("A100", 312.0),
    ("RTX 4090", 165.0),
)


def peak_tflops(device_name: str, compute_dtype: torch.dtype) -> float | None:
    """The peak for a device name in bfloat16/float16, else None."""
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return None
    return next((peak for key, peak in PEAK_TFLOPS if key in device_name), None)


def exit_without_finalization() -> NoReturn:
    """Exit without finalization, since a gloo thread can abort a finished run at shutdown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
