"""TRL's offline preference and reward trainers (DPO, KTO, reward) for tests/integrations/test_trl_offline.py: data, models,
configs, and one training run's record."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, field

import torch

from .trl_runs import Run, _text, cpu_arguments, split_steps


@dataclass(frozen=True)
class Case:
    """One offline run: the trainer, how the reference comes, base precision, and config overrides."""

    name: str
    trainer: str  # "DPO", "KTO" or "Reward"
    reference: str = "adapter"  # "adapter": the adapter disabled; "ref_model": a separate frozen model
    four_bit: bool = False
    config: dict = field(default_factory=dict)
    balance: bool = False  # BucketedTrainer's balance_ranks
    bf16: bool = False  # a bfloat16 model: TRL keeps a 4-bit reward model's score head in bf16, as its adapters

    def __hash__(self) -> int:
        return hash(self.name)


def rows(trainer: str, n: int = 32, seed: int = 0):
    """``n`` rows of uneven lengths: preference pairs (DPO, reward) or KTO's unpaired rows, half labelled good."""
    from datasets import Dataset

    rng = random.Random(seed)
    if trainer == "KTO":
        samples = [
            {"prompt": _text(rng, 2, 10), "completion": " " + _text(rng, 1, 14), "label": rng.random() < 0.5}
            for _ in range(n)
        ]
    else:
        samples = [
            {"prompt": _text(rng, 2, 10), "chosen": " " + _text(rng, 1, 14), "rejected": " " + _text(rng, 1, 14)}
            for _ in range(n)
        ]
    return Dataset.from_list(samples)


def shared_rows(trainer: str, folder: str):
    """:func:`rows` read from ``folder`` by every rank, as a dataset loaded from files is. TRL's
    ``precompute_ref_log_probs`` caches the reference log-probs beside the dataset's files, written by rank 0 and read
    by the others, so an in-memory dataset (cached in each process's own temporary folder) fails on rank 1."""
    import torch.distributed as dist
    from datasets import load_from_disk

    if not dist.is_initialized() or dist.get_rank() == 0:
        rows(trainer).save_to_disk(folder)
    if dist.is_initialized():
        dist.barrier()
    return load_from_disk(folder)


def _load(path: str, case: Case):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, BitsAndBytesConfig

    dtype = torch.bfloat16 if case.bf16 else torch.float32
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    kwargs = dict(dtype=dtype, device_map={"": "cpu"})
    if case.four_bit:
        kwargs["quantization_config"] = quantization
    if case.trainer == "Reward":
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def models(path: str, case: Case):
    """The policy, its ``peft_config`` and the reference model (None: TRL disables the adapter). Seeded: every
    rank and run starts equal (the reward model's score head is drawn at load)."""
    from peft import LoraConfig

    torch.manual_seed(0)
    model = _load(path, case)
    task = "SEQ_CLS" if case.trainer == "Reward" else "CAUSAL_LM"
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type=task)
    ref_model = _load(path, case) if case.reference == "ref_model" else None
    return model, lora, ref_model


def config(out: str, case: Case, world_size: int, **overrides):
    """The trainer's config: CPU, gloo, 2 optimizer steps of 8 rows (2 per micro-batch, accumulation 4 over the
    ranks), plain SGD (see ``trl_runs.sft_config``), a log every step, no saves."""
    import trl

    arguments = cpu_arguments(out) | dict(
        dataloader_drop_last=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4 // world_size,
        max_length=48,
    )
    arguments.update(case.config, **overrides)
    return getattr(trl, f"{case.trainer}Config")(**arguments)


@dataclass
class OfflineRun(Run):
    """A :class:`Run`, and what became of the separate reference model: its type after setup, how many of its
    parameters hold a gradient hook or a gradient after training."""

    ref_type: str | None = None
    ref_hooked: int = 0
    ref_grads: int = 0
    plan_costs: tuple[int, int] | None = None  # the first step's slowest rank in padded tokens: balanced, strided
    reordered: bool = False  # the first step's plan is not the strided split


def train(trainer_cls, paths: tuple[str, str], case: Case, world_size: int, log: list[str]) -> OfflineRun:
    """Train ``case`` with ``trainer_cls`` (TRL's or its bucketed class) and return its :class:`OfflineRun`, with
    the run's collectives per step (``log``: filled by ``tests.helpers.trainers.record_collectives``)."""
    from transformers import AutoTokenizer, TrainerCallback

    tokenizer_path, model_path = paths

    class Marker(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            log.append("train_begin")

        def on_step_end(self, args, state, control, **kwargs):
            log.append("step_end")

    model, lora, ref_model = models(model_path, case)
    precomputed = case.config.get("precompute_ref_log_probs")
    data = f"{model_path}-{case.name}-{world_size}" if precomputed else None
    extra = {} if ref_model is None else {"ref_model": ref_model}
    if case.balance:
        extra["balance_ranks"] = True
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_cls(
            model=model,
            args=config(out, case, world_size),
            train_dataset=shared_rows(case.trainer, data) if data else rows(case.trainer),
            processing_class=AutoTokenizer.from_pretrained(tokenizer_path),
            peft_config=lora,
            callbacks=[Marker()],
            **extra,
        )
        log.clear()
        trainer.train()
    steps = split_steps(log)
    trained = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    adapters = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    run = OfflineRun(adapters, logs, steps, len(getattr(trainer.model_wrapped, "bucket_sizes", [])) or None)
    if case.balance:
        run.plan_costs, run.reordered = _first_plan(trainer)
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        run.ref_type = type(ref).__name__
        run.ref_hooked = sum(bool(p._post_accumulate_grad_hooks) for p in ref.parameters())
        run.ref_grads = sum(p.grad is not None for p in ref.parameters())
    return run


def _first_plan(trainer) -> tuple[tuple[int, int], bool]:
    """The balanced run's first step: its slowest rank's padded tokens against the strided split's (widths from
    the rows as the collator pads them), and whether the plan differs from the strided split."""
    from ddp_ft.training.data.balance import rank_costs, strided_plan

    loader = trainer._plan_sampler.loader
    plan = next(loader.plans(0))
    indices = sorted(i for batches in plan for batch in batches for i in batch)
    rows = loader.dataset
    width = {i: trainer.data_collator([rows[i]])["input_ids"].shape[1] for i in indices}
    loader.sampler.set_epoch(0)
    step = loader.steps.extend([int(i) for i in loader.sampler])[loader.steps.positions(0)]
    strided = strided_plan(step, loader.steps.world_size, loader.micro_batch, len(plan[0]))
    costs = (max(rank_costs(plan, width)), max(rank_costs(strided, width)))
    return costs, plan != strided
