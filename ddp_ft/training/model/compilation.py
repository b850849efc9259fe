"""``torch.compile`` that keeps BucketedDDP's overlap: each decoder layer compiled in place, before the wrap.

Why regional, and why before the wrap. A compiled backward is one autograd node: every gradient of the compiled
region becomes ready when it ends. Compile the whole model (what the Trainer's ``torch_compile=True`` does through
Accelerate, around the DDP wrapper) and all of BucketedDDP's gradient hooks fire together at the end of backward, so
no all-reduce overlaps it. torch's own DDP survives this only through Dynamo's DDPOptimizer, which splits the graph at
*its* buckets and knows nothing of ours. Compile each decoder layer instead and each layer's backward is its own node:
the last layers' gradients are ready, and their buckets on the wire, while the first layers still compute. The
layers run the same code, so one compilation serves them all (a 36-layer model compiles one layer, not 36).

In place (the layer's ``forward`` replaced by its compiled version while gradients are recorded; evaluation runs
eagerly): parameter names, ``state_dict`` keys,
BucketedDDP's layout and checkpoints are those of the eager model. Hooks stay outside the compiled code, so a
forward pre-hook marks the sequence dimension of each layer's inputs dynamic (``maybe_mark_dynamic``): a new padded
length reuses the graph instead of recompiling it until Dynamo's limit, after which it would silently run eager.
Gradient checkpointing (transformers' ``GradientCheckpointingLayer.__call__``) still wraps each compiled layer.

:class:`CompileWatch` counts the graphs compiled, the recompilations after the first, the limit hits and the time
spent compiling, for the run's metrics. :func:`compile_blockers` lists what stops compilation from working here;
``ddp_ft.training.resolve`` turns the default off for them, an explicit ``--compile`` is refused.
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

COMPILED_FLAG = "_ddp_ft_compiled"  # set on each block this module compiled, so a second call leaves it
MIN_BITSANDBYTES = (0, 50)  # earlier Params4bit graph-breaks in every layer; in a checkpointed layer that is eager
RECOMPILES_WARNED = 4  # after warm-up; half of Dynamo's default recompile limit (8)
DROPOUT_CHECKPOINT_FIXED_TORCH = (2, 11)  # peft#3020 / pytorch#121966: compiled dropout in a checkpoint crashed before
# On CUDA it still crashes in the partitioner on torch 2.11 (docs/performance.md); no later CUDA torch has run here, so
# the blocker holds on CUDA at every version.


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's outermost ``ModuleList``s of more than one module of one class (decoder layers)."""
    blocks: list[nn.Module] = []
    inside: list[str] = []  # the lists taken: a list of blocks within a block is compiled with it, not again
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
    """Forward pre-hook: every dimension of the layer's tensor inputs that has the hidden states' length or batch
    size is dynamic.

    The first tensor argument is the hidden states (batch, sequence, hidden); the attention mask, position ids and
    rotary tables carry the same sizes in other places. ``maybe_mark_dynamic`` does not fail where Dynamo must
    specialise (a size the code branches on, and sizes 0 and 1 always); the recompile counter shows it then.
    """
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    tensors += [t for v in kwargs.values() if isinstance(v, tuple) for t in v if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() < 2:
        return
    sizes = {size for size in tensors[0].shape[:2] if size > 1}
    for tensor in tensors:
        for dim, size in enumerate(tensor.shape):
            if size in sizes:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _training_forward(eager: Callable, compiled: Callable) -> Callable:
    """The compiled forward where gradients are recorded (training, and checkpointing's recomputation), the eager one
    without (evaluation, generation): a no-grad pass would compile a second graph, and bitsandbytes' no-grad 4-bit
    path fails to compile on the CPU (its fake kernel's strides). Evaluation is a small share of a run's time."""

    def forward(*args, **kwargs):
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)

    forward.compiled, forward.eager = compiled, eager
    return forward


def compile_repeated_blocks(model: nn.Module, **compile_kwargs) -> int:
    """``torch.compile`` each block of the model's repeated layers in place (regional compilation).

    Args:
        model (nn.Module): the unwrapped model (before BucketedDDP, or any DDP, wraps it).
        **compile_kwargs: ``torch.compile``'s (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``).
            ``dynamic`` None (the default) marks the sequence and batch dimensions dynamic; False keeps every shape
            static.

    Returns:
        int: how many blocks were compiled (0 when they already were).

    Raises:
        ValueError: the model has no ``ModuleList`` of blocks of one class, naming the setting.
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
    """Why compilation cannot work (or is known to break) here, and the fix."""

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
    """What stops regional compilation from working on ``device`` with these settings (empty: nothing).

    Args:
        device (torch.device): this rank's device.
        four_bit (bool): the model's linear layers are bitsandbytes 4-bit.
        lora_dropout (float): the adapters' dropout.
        checkpointing (bool): gradient checkpointing is on.
        toolchain (bool): check what TorchInductor needs (Triton, a C++ compiler); False for other backends.
        find_spec, which, version: module lookup, executable lookup, installed version (injectable for tests).
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
    """Raise for an explicit request of compilation that cannot work.

    Raises:
        ValueError: naming ``setting``, each reason and its fix, and how to turn compilation off.
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
    """Refuse compiling a user's model where it is known to break, read from the model itself: 4-bit layers
    (bitsandbytes' version), its LoRA dropout and whether its layers are checkpointed.

    Raises:
        ValueError: naming ``setting`` (the user's ``torch_compile`` or ``dynamo_backend``), each reason and its fix.
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
    """Refuse a compile mode known to break under data parallelism.

    Raises:
        ValueError: ``max-autotune`` on several processes (pytorch#140395: DDP with max-autotune, which captures CUDA
            graphs, is broken since torch 2.5), naming ``setting`` and the modes that work.
    """
    if world_size > 1 and mode == "max-autotune":
        raise ValueError(
            f"{setting}='max-autotune' on {world_size} processes: torch DDP and max-autotune (CUDA graphs) are broken "
            "together since torch 2.5 (pytorch#140395), and BucketedDDP's hooks meet the same graphs. Use the default "
            "mode or 'max-autotune-no-cudagraphs'."
        )


class CompileWatch:
    """Counts of this process's Dynamo compilations since it was made: graphs, recompilations, limit hits, seconds.

    Dynamo's counters are process-wide; the watch reads their change. A recompilation is any graph after the first.
    With the sequence and batch dimensions dynamic a run should show a few at most: size 1 is always specialised
    (the micro-batch probe's first point), evaluation runs without gradients. The graphs of the warm-up (everything
    before the first snapshot: the probe, with and without checkpointing under ``auto``, and the first step) are
    expected; from :data:`RECOMPILES_WARNED` graphs after it on, or when Dynamo hits its recompile limit (from then
    on it runs the layer eagerly, silently apart from one log line, which the watch counts), it warns.
    """

    LIMIT_LOGGER = "torch._dynamo.convert_frame"

    def __init__(self) -> None:
        self._base = self._now()
        self.limit_hits = 0
        self._reported = (0, 0)
        self._warm: int | None = None  # graphs at the first snapshot: the warm-up's
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

    def snapshot(self) -> dict[str, float]:
        """``compile/graphs``, ``compile/recompiles`` (graphs beyond the first), ``compile/limit_hits`` and
        ``compile/time_s`` since the watch was made; a recompilation newly seen is logged once as a warning."""
        graphs, seconds = (now - base for now, base in zip(self._now(), self._base, strict=True))
        recompiles = max(0, graphs - 1)
        self._warm = graphs if self._warm is None else self._warm
        late = graphs - self._warm
        if (recompiles, self.limit_hits) != self._reported and (late >= RECOMPILES_WARNED or self.limit_hits):
            logger.warning(
                "compile: %d graphs compiled since warm-up (%d in all, %d recompile-limit hits, after which Dynamo "
                "runs the layer eagerly): shapes or values the layers branch on keep changing. "
                'TORCH_LOGS="recompiles" names the reason.',
                late,
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
