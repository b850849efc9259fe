"""Measuring rungs: the two workloads, the interleaved repeats, and each step's breakdown on CPU or CUDA.

The ladder (``scripts/ladder.py``) and the bucket sweep (``scripts/bucket_sweep.py``) both build a set of wrapped
models from one workload, warm them up, check they trained alike, then measure them interleaved: every repeat runs
each model for a few optimizer steps, in an order that rotates, so drift on the machine hits them all alike.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ...distributed import destroy_distributed, setup_logging
from ...distributed.devices import DEVICE_CHOICES
from ...training.model.precision import DTYPES
from ...training.model.qlora import LoraSettings, ModelSettings, build_tiny_qwen3, load_qlora_model
from ..bench import ComputeSetup, compute_setup, synchronize
from .rungs import Rung, accumulate
from .timeline import StepBreakdown, Timeline, profiled_intervals, summarize

WORKLOADS = {
    "qlora": "tiny Qwen3, 4-bit NF4 base + LoRA: only the adapters' gradients travel (the product's workload)",
    "full": "tiny Qwen3, every weight trainable, no quantisation: the reference's setting, communication-heavy",
}


def add_run_arguments(p: argparse.ArgumentParser, out: Path) -> None:
    """The settings the ladder and the sweep share: workloads, repeats, batch shape, device."""
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS), help="what to train")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (each runs every configuration)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per configuration per round")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before measuring (torch DDP needs 2)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per micro-step per rank")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-steps per optimizer step (the reference's: 2)")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the tiny model")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (one: the analogue of one GPU)")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto", help="cuda (NCCL), cpu (gloo) or auto")
    p.add_argument("--compute-dtype", choices=["auto", *DTYPES], default="auto", help="auto: bf16/fp16 GPU, fp32 CPU")
    p.add_argument("--out", type=Path, default=out, help="JSON result; the .md table and .png chart go beside it")


def check_run_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("repeats", "steps", "seq_len", "micro_batch", "grad_accum", "threads", "vocab_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")


def start_run(args: argparse.Namespace) -> tuple[ComputeSetup, str]:
    """Join the launcher's group, quiet the libraries, and write the tiny model once (rank 0): (setup, model dir)."""
    import transformers

    setup = compute_setup(args.device, args.compute_dtype)
    torch.set_num_threads(args.threads)
    setup_logging(setup.info, logging.WARNING)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # an optional CPU kernel it cannot find, every load
    transformers.utils.logging.disable_progress_bar()  # one model per configuration: no bar for each
    model_dir = Path(tempfile.gettempdir()) / f"ddp_ft-bench-tiny-qwen3-v{args.vocab_size}"
    if setup.info.is_main_process:
        build_tiny_qwen3(model_dir, vocab_size=args.vocab_size, seed=0)
    dist.barrier()
    return setup, str(model_dir)


def run_each_workload(args: argparse.Namespace, run_workload: Callable, write: Callable) -> None:
    """Join the group, ``run_workload(args, setup, workload, model_dir)`` for each of ``args.workloads``, and
    ``write(args, setup, results)`` on rank 0; every rank tears the group down, also on failure."""
    setup, model_dir = start_run(args)
    try:
        results = {w: run_workload(args, setup, w, model_dir) for w in args.workloads}
        if setup.info.is_main_process:
            write(args, setup, results)
    finally:
        destroy_distributed()


def load_workload(name: str, model_dir: str, setup: ComputeSetup) -> nn.Module:
    """A fresh copy of workload ``name``'s model on this rank's device, in training mode, LoRA seeded alike."""
    torch.manual_seed(0)
    if name == "qlora":
        settings = ModelSettings(model_name_or_path=model_dir, compute_dtype=setup.precision.name)
        # No LoRA dropout: every model then computes the same gradients from the same batches (checked after warm-up).
        model = load_qlora_model(settings, LoraSettings(lora_dropout=0.0), setup.device_map, setup.info.world_size)
        return model.train()
    if name == "full":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(setup.info.device)
        model.config.use_cache = False
        return model.train()
    raise ValueError(f"workload={name!r}: choose one of {', '.join(WORKLOADS)}.")


def token_batches(setup: ComputeSetup, vocab_size: int, seq_len: int, micro_batch: int, count: int = 8):
    """``count`` micro-batches of random token ids, different on each rank (as a DistributedSampler's shards are)."""
    g = torch.Generator().manual_seed(1000 + setup.info.rank)
    return [
        torch.randint(0, vocab_size, (micro_batch, seq_len), generator=g).to(setup.info.device) for _ in range(count)
    ]


@dataclass
class Trainee:
    """One wrapped model under measurement, with its optimizer and the breakdown of every measured step."""

    name: str
    model: Rung
    timeline: Timeline
    optimizer: torch.optim.Optimizer
    steps: list[StepBreakdown]
    seconds: list[float]  # wall time of each measured block of steps, slowest rank
    block_steps: list[int]  # optimizer steps in each block

    @classmethod
    def of(cls, name: str, model: Rung, timeline: Timeline) -> Trainee:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        return cls(name, model, timeline, optimizer, [], [], [])


class Stepper:
    """Runs optimizer steps of a :class:`Trainee` on fixed batches: the one loop that drives every rung."""

    def __init__(self, setup: ComputeSetup, batches: list[torch.Tensor], accumulation: int) -> None:
        self.setup, self.batches, self.accumulation = setup, batches, accumulation
        self.cursor = 0

    def loss_of(self, model: Rung, ids: torch.Tensor) -> torch.Tensor:
        with self.setup.precision.autocast_context():
            return model(input_ids=ids, labels=ids).loss

    def step(self, trainee: Trainee) -> None:
        micro = [self.batches[(self.cursor + i) % len(self.batches)] for i in range(self.accumulation)]
        self.cursor += self.accumulation
        accumulate(trainee.model, micro, self.loss_of)
        trainee.optimizer.step()
        trainee.optimizer.zero_grad(set_to_none=True)

    def measure(self, trainee: Trainee, steps: int) -> None:
        """``steps`` timed optimizer steps, each split by the timeline (CPU). On CUDA the timed steps run without the
        profiler, whose tracing would slow them, and one more step, untimed, is split by the profiler's device trace.
        """
        device = self.setup.info.device
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            trainee.timeline.step()
            self.step(trainee)
            if device.type != "cuda":
                trainee.steps.append(trainee.timeline.close())
        synchronize(device)
        elapsed = torch.tensor(time.perf_counter() - start, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        trainee.seconds.append(elapsed.item())
        trainee.block_steps.append(steps)
        if device.type == "cuda":
            trainee.steps.append(self._profiled_step(trainee))

    def _profiled_step(self, trainee: Trainee) -> StepBreakdown:
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainee.timeline.step()
            with record_function("ladder_step"):
                self.step(trainee)
                synchronize(self.setup.info.device)
        events = prof.events()
        compute, comm = profiled_intervals(events)
        (window,) = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events if e.name == "ladder_step"]
        return StepBreakdown.from_device(window, compute, comm, trainee.timeline.calls, trainee.timeline.nbytes)


def interleave(stepper: Stepper, trainees: list[Trainee], repeats: int, steps: int, progress: Callable) -> None:
    """``repeats`` rounds; each round measures every trainee for ``steps`` steps, the order rotating by one."""
    for repeat in range(repeats):
        shift = repeat % len(trainees)
        for trainee in trainees[shift:] + trainees[:shift]:
            stepper.measure(trainee, steps)
        progress(repeat + 1)


def max_parameter_difference(trainees: list[Trainee], reference: str) -> dict[str, float]:
    """Largest absolute difference of each trainee's trainable parameters from ``reference``'s, after warm-up."""
    ref = next(t for t in trainees if t.name == reference)
    ref_params = [p for p in ref.model.parameters() if p.requires_grad]
    out = {}
    for trainee in trainees:
        params = [p for p in trainee.model.parameters() if p.requires_grad]
        out[trainee.name] = max((a - b).abs().max().item() for a, b in zip(params, ref_params, strict=True))
    return out


def gathered_rows(trainees: list[Trainee], tokens_per_step: int) -> dict[str, dict]:
    """Every rank's step breakdowns gathered, summarised per trainee: the medians over both ranks' steps, and
    tokens/s per repeat (all ranks' tokens over the slowest rank's time) with median, min and max."""
    mine = {t.name: t.steps for t in trainees}
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rows = {}
    for trainee in trainees:
        steps = [s for rank in every for s in rank[trainee.name]]
        rates = [tokens_per_step * n / s for n, s in zip(trainee.block_steps, trainee.seconds, strict=True)]
        rows[trainee.name] = summarize(steps) | {
            "tokens_per_s": statistics.median(rates),
            "tokens_per_s_range": [min(rates), max(rates)],
            "tokens_per_s_all_repeats": rates,
        }
    return rows
