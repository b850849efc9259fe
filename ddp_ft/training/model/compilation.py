"""``torch.compile`` that keeps BucketedDDP's overlap: each decoder layer compiled in place, before the wrap.

A compiled backward is one autograd node, so its gradients are all ready when it ends.
A whole compiled model fires every gradient hook together at the end of backward: no all-reduce overlaps it.
torch DDP survives this only through Dynamo's DDPOptimizer, which knows nothing of our buckets.
Compiled per layer, the last layers' buckets are on the wire while the first layers still compute.
The layers share code, so one compilation serves them all.

In place, parameter names, ``state_dict`` keys and checkpoints stay those of the eager model.
A pre-hook marks the sequence dimension dynamic, so a new padded length reuses the graph.
Flex attention's block mask is marked dynamic by name, so new widths and row counts also reuse it.
Gradient checkpointing still wraps each compiled layer.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

COMPILED_FLAG = "_ddp_ft_compiled"  # a second call leaves a compiled block
MIN_BITSANDBYTES = (0, 50)  # earlier Params4bit graph-breaks in every layer
RECOMPILES_WARNED = 4  # half of Dynamo's default recompile limit
# Flex attention's block mask holds the row count and width as ints and closure tensors, which Dynamo would specialise
# on and recompile at the first new value. Marked dynamic from the first compile by their names; block sizes stay static.
FLEX_DYNAMIC_SOURCES = (
    r"L\[.*'attention_mask'\]\.(?!BLOCK_SIZE)",  # the BlockMask the decoder layers get
    r"L\['(B|Q_LEN|KV_LEN)'\]$",  # create_block_mask's sizes, which transformers compiles
    r"L\['mask_mod'\]",  # and the tensors its mask function holds
)
DROPOUT_CHECKPOINT_FIXED_TORCH = (2, 11)  # compiled dropout in a checkpoint crashed before
# On CUDA it still crashes (docs/performance.md), so the blocker holds there.


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's outermost ``ModuleList``s of one class, such as decoder layers."""
    blocks: list[nn.Module] = []
    inside: list[str] = []  # a list within a block is compiled with it
    for name, module in model.named_modules():
        repeated = isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1
        if repeated and not any(name.startswith(f"{outer}.") for outer in inside):
            inside.append(name)
            blocks.extend(module)
    return blocks


def is_regionally_compiled(model: nn.Module) -> bool:
    """Whether :func:`compile_repeated_blocks` compiled this model's blocks."""
    return any(getattr(block, COMPILED_FLAG, False) for block in repeated_blocks(model))


def _mark_sequence_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: marks the batch and sequence dimensions of the block's inputs dynamic.

    The first input is the hidden states, (batch, sequence, features). The others are marked where they share that
    layout: dims 0 and 1 of (batch, sequence, ...) inputs, the last two of (..., sequence, sequence) masks, dim 0
    of (sequence, ...) inputs. A feature dimension that happens to equal the length stays static.
    Where Dynamo must specialise, ``maybe_mark_dynamic`` does not fail; the recompile counter shows it.
    """
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    tensors += [t for v in kwargs.values() if isinstance(v, tuple) for t in v if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() < 2:
        return
    batch, length = tensors[0].shape[:2]
    for tensor in tensors:
        for dim in _batch_and_sequence_dims(tuple(tensor.shape), batch, length):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _batch_and_sequence_dims(shape: tuple[int, ...], batch: int, length: int) -> list[int]:
    """Where an input of ``shape`` holds the batch or the sequence, sizes of 1 left out."""
    if len(shape) == 4 and shape[2:] == (length, length):  # an attention mask
        dims = [0, 2, 3] if shape[0] == batch else [2, 3]
    elif shape[:1] == (length,) and length != batch:  # (sequence, ...), such as cache positions
        dims = [0]
    elif len(shape) > 1:  # (batch, sequence, ...), the batch maybe broadcast
        dims = [dim for dim, size in ((0, batch), (1, length)) if shape[dim] == size]
    else:
        dims = []
    return [dim for dim in dims if shape[dim] > 1]


def _mark_flex_masks_dynamic() -> None:
    """Add :data:`FLEX_DYNAMIC_SOURCES` to ``torch.compiler.config.dynamic_sources``, keeping what is there.

    A torch without that setting recompiles once at the first new width and at the first new row count.
    """
    if not hasattr(torch.compiler.config, "dynamic_sources"):
        return
    present = [source for source in torch.compiler.config.dynamic_sources.split(",") if source]
    torch.compiler.config.dynamic_sources = ",".join(present + [s for s in FLEX_DYNAMIC_SOURCES if s not in present])


def _training_forward(eager: Callable, compiled: Callable) -> Callable:
    """The compiled forward where gradients are recorded, the eager one without.

    A no-grad pass would compile a second graph, and bitsandbytes' no-grad path fails to compile on the CPU.
    """

    def forward(*args, **kwargs):
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)

    forward.compiled, forward.eager = compiled, eager
    return forward


def compile_repeated_blocks(model: nn.Module, **compile_kwargs) -> int:
    """``torch.compile`` each block of the model's repeated layers in place.

    Args:
        model (nn.Module): the unwrapped model, before any DDP wraps it.
        **compile_kwargs: ``torch.compile``'s. ``dynamic`` None marks sequence and batch dynamic.

    Returns:
        int: how many blocks were compiled; 0 when they already were.

    Raises:
        ValueError: the model has no ``ModuleList`` of blocks of one class.
    """
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"--compile (compile: true; TrainingArguments(torch_compile=True)) compiles the model's repeated layers, "
            f"and {type(model).__name__} has no ModuleList of layers of one class: turn compilation off "
            "(--no-compile; torch_compile=False)."
        )
    todo = [block for block in blocks if not getattr(block, COMPILED_FLAG, False)]
    mark = compile_kwargs.get("dynamic") is None
    if mark and todo and getattr(getattr(model, "config", None), "_attn_implementation", None) == "flex_attention":
        _mark_flex_masks_dynamic()
    for block in todo:
        if mark:
            block.register_forward_pre_hook(_mark_sequence_dynamic, with_kwargs=True)
        block.forward = _training_forward(block.forward, torch.compile(block.forward, **compile_kwargs))
        setattr(block, COMPILED_FLAG, True)
    if todo:
        logger.info(
            "compile: %d %s blocks compiled in place (regional compilation, sequence length and batch size %s)",
            len(todo),
            type(todo[0]).__name__,
            "dynamic" if mark or compile_kwargs.get("dynamic") else "static",
        )
    return len(todo)


@dataclass(frozen=True)
class Blocker:
    """Why compilation cannot work here, and the fix."""

    reason: str
    fix: str


def _version(package: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def compile_blockers(
    device: torch.device,
    *,
    four_bit: bool = True,
    lora_dropout: float = 0.0,
    checkpointing: bool = False,
    toolchain: bool = True,
    find_spec: Callable[[str], object] = importlib.util.find_spec,
    which: Callable[[str], str | None] = shutil.which,
    version: Callable[[str], tuple[int, ...] | None] = _version,
) -> list[Blocker]:
    """What stops regional compilation from working on ``device`` with these settings.

    Args:
        device (torch.device): this rank's device.
        four_bit (bool): the linear layers are bitsandbytes 4-bit.
        lora_dropout (float): the adapters' dropout.
        checkpointing (bool): gradient checkpointing is on.
        toolchain (bool): check what TorchInductor needs; False for other backends.
        find_spec, which, version: lookups, injectable for tests.

    Returns:
        list[Blocker]: empty when nothing blocks.
    """
    found = []
    if toolchain and device.type == "cuda" and find_spec("triton") is None:
        found.append(
            Blocker(
                "on CUDA TorchInductor writes its kernels in Triton, which is not installed",
                "install the CUDA build of torch (it brings Triton) or `pip install triton`",
            )
        )
    if toolchain and device.type == "cpu":
        compiler = os.environ.get("CXX", "g++")
        if which(compiler) is None:
            found.append(
                Blocker(
                    f"on the CPU TorchInductor builds its kernels with a C++ compiler, and {compiler!r} (the CXX "
                    "variable, default g++) is not on PATH",
                    "install one (`apt-get install g++`) or point CXX at it",
                )
            )
    bnb = version("bitsandbytes") if four_bit else None
    if bnb is not None and bnb < MIN_BITSANDBYTES:
        found.append(
            Blocker(
                f"bitsandbytes {'.'.join(map(str, bnb))} graph-breaks in every 4-bit layer, and a graph break in a "
                "checkpointed layer sends the whole layer back to eager",
                'pip install "bitsandbytes>=0.50"',
            )
        )
    torch_version = version("torch")
    old_torch = torch_version is not None and torch_version < DROPOUT_CHECKPOINT_FIXED_TORCH
    if lora_dropout > 0 and checkpointing and (old_torch or device.type == "cuda"):
        where = "on CUDA (seen on torch 2.11)" if device.type == "cuda" else "before torch 2.11 (peft#3020)"
        found.append(
            Blocker(
                f"LoRA dropout {lora_dropout} inside checkpointed compiled layers crashes TorchInductor's partitioner "
                f"{where}",
                "set --lora-dropout 0 (LoraConfig(lora_dropout=0.0))"
                + (", or upgrade torch to 2.11 or later" if device.type != "cuda" else ""),
            )
        )
    return found


def refuse_blockers(blockers: list[Blocker], setting: str) -> None:
    """Raises for an explicit request of compilation that cannot work.

    Raises:
        ValueError: naming ``setting``, each reason and its fix.
    """
    if blockers:
        details = "; ".join(f"{b.reason}: {b.fix}" for b in blockers)
        raise ValueError(f"{setting}: {details}; or turn compilation off (--no-compile).")


def check_model_compile(
    model: nn.Module,
    device: torch.device,
    setting: str,
    backend: str = "inductor",
    blockers: Callable[..., list[Blocker]] = compile_blockers,
) -> None:
    """Refuses compiling a user's model where it is known to break, read from the model.

    Raises:
        ValueError: naming ``setting``, each reason and its fix.
    """
    modules = list(model.modules())
    dropout = max(
        (m.p for name, m in model.named_modules() if isinstance(m, nn.Dropout) and "lora_dropout" in name), default=0.0
    )
    checkpointing = bool(getattr(model, "is_gradient_checkpointing", False)) or any(
        getattr(m, "gradient_checkpointing", False) is True for m in modules
    )
    four_bit = any(type(m).__name__ == "Linear4bit" for m in modules)
    found = blockers(
        device, four_bit=four_bit, lora_dropout=dropout, checkpointing=checkpointing, toolchain=backend == "inductor"
    )
    refuse_blockers(found, setting)


def check_compile_mode(mode: str | None, world_size: int, setting: str) -> None:
    """Refuses a compile mode known to break under data parallelism.

    Raises:
        ValueError: ``max-autotune`` on several processes, whose CUDA graphs break DDP.
    """
    if world_size > 1 and mode == "max-autotune":
        raise ValueError(
            f"{setting}='max-autotune' on {world_size} processes: torch DDP and max-autotune (CUDA graphs) are broken "
            "together since torch 2.5 (pytorch#140395), and BucketedDDP's hooks meet the same graphs. Use the default "
            "mode or 'max-autotune-no-cudagraphs'."
        )


class CompileWatch:
    """Counts this process's Dynamo graphs, recompilations, limit hits and compile seconds.

    Graphs before the first snapshot are warm-up: the probe's, each compiled function's first.
    Recompilations are the graphs compiled after it in training steps.
    Between :meth:`pause` and :meth:`resume`, as in an evaluation, graphs are not recompilations.
    It warns after :data:`RECOMPILES_WARNED` of them, or when Dynamo hits its limit and runs eagerly.
    """

    LIMIT_LOGGER = "torch._dynamo.convert_frame"

    def __init__(self) -> None:
        self._base = self._now()
        self.limit_hits = 0
        self._reported = (0, 0)
        self._warm: int | None = None  # graphs at the first snapshot, and those compiled while paused
        self._paused_at: int | None = None
        watch = self

        class _Counter(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                if "hit config." in str(record.msg):
                    watch.limit_hits += 1
                return True

        self._filter = _Counter()
        logging.getLogger(self.LIMIT_LOGGER).addFilter(self._filter)

    @staticmethod
    def _now() -> tuple[int, float]:
        from torch._dynamo.utils import compilation_time_metrics, counters

        return counters["stats"]["unique_graphs"], sum(compilation_time_metrics.get("_compile.compile_inner", []))

    def pause(self) -> None:
        """Training stops, for an evaluation or a save: what compiles until :meth:`resume` is no recompilation."""
        self._paused_at = self._now()[0]

    def resume(self) -> None:
        """Training goes on; graphs compiled since :meth:`pause` count as warm-up."""
        if self._paused_at is not None and self._warm is not None:
            self._warm += self._now()[0] - self._paused_at
        self._paused_at = None

    def snapshot(self) -> dict[str, float]:
        """The counts since the watch was made; a new recompilation is warned once."""
        graphs, seconds = (now - base for now, base in zip(self._now(), self._base, strict=True))
        self._warm = graphs if self._warm is None else self._warm
        recompiles = graphs - self._warm
        if (recompiles, self.limit_hits) != self._reported and (recompiles >= RECOMPILES_WARNED or self.limit_hits):
            logger.warning(
                "compile: %d graphs compiled since warm-up (%d in all, %d recompile-limit hits, after which Dynamo "
                "runs the layer eagerly): shapes or values the layers branch on keep changing. "
                'TORCH_LOGS="recompiles" names the reason.',
                recompiles,
                graphs,
                self.limit_hits,
            )
        self._reported = (recompiles, self.limit_hits)
        return {
            "compile/graphs": graphs,
            "compile/recompiles": recompiles,
            "compile/limit_hits": self.limit_hits,
            "compile/time_s": round(seconds, 3),
        }

    def close(self) -> None:
        logging.getLogger(self.LIMIT_LOGGER).removeFilter(self._filter)
