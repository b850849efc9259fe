"""TRL SFTTrainer runs for tests/integrations/test_trl.py: data, models, configs, and one training run's record."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass

import torch

WORDS = "meeting budget design remote control team project manager market user interface idea button colour".split()


@dataclass(frozen=True)
class Case:
    """One SFTTrainer configuration: data format, packing, how the adapter comes, base precision."""

    data: str  # "prompt_completion" or "messages"
    packing: bool
    peft: str  # "peft_config": a base model and a LoraConfig; "peft_model": a ready PeftModel
    four_bit: bool

    @property
    def name(self) -> str:
        return f"{self.data}-{'packed' if self.packing else 'padded'}-{self.peft}-{'4bit' if self.four_bit else 'fp32'}"


# Each setting on and off, and each pair of settings in all four combinations (packing x 4-bit included): 4 runs.
CASES = (
    Case("prompt_completion", False, "peft_config", True),
    Case("prompt_completion", True, "peft_model", True),
    Case("messages", False, "peft_model", False),
    Case("messages", True, "peft_config", False),
)


def tiny_paths(root) -> tuple[str, str]:
    """The tiny tokenizer and a tiny Qwen3 of its vocabulary, built under ``root``: (tokenizer, model)."""
    from ddp_ft.training.data.tokenizer import build_tiny_tokenizer, load_tokenizer
    from ddp_ft.training.model.qlora import build_tiny_qwen3

    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    model = build_tiny_qwen3(root / "qwen3", vocab_size=len(load_tokenizer(str(tokenizer))), seed=0)
    return str(tokenizer), str(model)


def split_steps(log: list[str]) -> list[list[str]]:
    """The collectives of each optimizer step, from a log of ``train_begin``, collective names and ``step_end``.

    A step runs from the end of the one before: the Trainer draws its batches there.
    """
    steps, current = [], None
    for entry in log:
        if entry == "train_begin":
            current = []
        elif entry == "step_end":
            steps.append(current)
            current = []
        elif current is not None:
            current.append(entry)
    return steps


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def rows(data: str, n: int = 48, seed: int = 0):
    """``n`` samples of uneven lengths (a few to ~40 tokens) in TRL's prompt-completion or conversational format."""
    from datasets import Dataset

    rng = random.Random(seed)
    if data == "prompt_completion":
        samples = [{"prompt": _text(rng, 2, 12), "completion": _text(rng, 2, 20)} for _ in range(n)]
    else:
        samples = [
            {
                "messages": [
                    {"role": "user", "content": _text(rng, 2, 12)},
                    {"role": "assistant", "content": _text(rng, 2, 20)},
                ]
            }
            for _ in range(n)
        ]
    return Dataset.from_list(samples)


def model_and_peft_config(path: str, case: Case, world_size: int):
    """The model SFTTrainer is given and its ``peft_config``: a base model and a LoraConfig, or a ready PeftModel
    (``ddp_ft.training.model.qlora.load_qlora_model``); float32 compute on the CPU. Seeded: every rank and run starts
    equal."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from ddp_ft.training.model.qlora import LoraSettings, ModelSettings, load_qlora_model

    torch.manual_seed(0)
    if case.peft == "peft_model":
        settings = ModelSettings(model_name_or_path=path, load_in_4bit=case.four_bit, compute_dtype="float32")
        return load_qlora_model(settings, LoraSettings(lora_r=8, lora_dropout=0.0), {"": "cpu"}, world_size), None
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, device_map={"": "cpu"}, quantization_config=quantization if case.four_bit else None
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return model, lora


def cpu_arguments(out: str) -> dict:
    """What every TRL run of these tests shares: the CPU and gloo, 2 optimizer steps of plain SGD (see
    :func:`sft_config`), a log every step, no saves, no progress bar."""
    return dict(
        output_dir=out,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_steps=2,
        optim="sgd",
        learning_rate=0.1,
        bf16=False,
        seed=0,
    )


def sft_config(out: str, case: Case, world_size: int, **overrides):
    """SFTConfig of these runs: CPU, gloo, 2 optimizer steps of 8 rows (2 per micro-batch, accumulation 4 over the
    ranks), plain SGD, a log every step, no saves.

    SGD, not AdamW: Adam's first update is about ``lr * sign(grad)``, which turns the rounding-level gradient
    differences between 1 and 2 processes into lr-sized parameter differences (LoRA B starts at zero), so the
    1-vs-2 comparison would compare signs of noise. The stock-vs-ours comparison is bitwise either way."""
    from trl import SFTConfig

    arguments = cpu_arguments(out) | dict(
        dataloader_drop_last=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4 // world_size,
        max_length=48,
        packing=case.packing,
    )
    arguments.update(overrides)
    return SFTConfig(**arguments)


@dataclass
class Run:
    """What one training run left: its adapters, its training logs, and per optimizer step the collectives (and
    markers: ``substep_end`` after each micro-step but the last) it made, from the end of the step before."""

    adapters: dict[str, torch.Tensor]
    logs: list[dict]
    steps: list[list[str]]
    buckets: int | None
    summary: dict | None = None  # the Trainer's last log: ``train_loss`` and TRL's metrics since the last log


def train(
    trainer_cls,
    paths: tuple[str, str],
    case: Case,
    world_size: int,
    log: list[str] | None = None,
    n_rows: int = 48,
    config: dict | None = None,
    **kw,
):
    """Train ``case`` with ``trainer_cls`` (SFTTrainer or BucketedSFTTrainer) on ``n_rows`` rows and return its
    :class:`Run`; ``config`` overrides :func:`sft_config`'s settings. With ``log`` (filled by
    ``tests.helpers.trainers.record_collectives``), the run's collectives per step."""
    from transformers import AutoTokenizer, TrainerCallback

    tokenizer_path, model_path = paths

    class Marker(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            log.append("train_begin")

        def on_substep_end(self, args, state, control, **kwargs):
            log.append("substep_end")

        def on_step_end(self, args, state, control, **kwargs):
            log.append("step_end")

    model, peft_config = model_and_peft_config(model_path, case, world_size)
    overrides = {key: kw.pop(key) for key in list(kw) if key in ("gradient_accumulation_steps",)}
    overrides.update(config or {})
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_cls(
            model=model,
            args=sft_config(out, case, world_size, **overrides),
            train_dataset=rows(case.data, n_rows),
            processing_class=AutoTokenizer.from_pretrained(tokenizer_path),
            peft_config=peft_config,
            callbacks=[] if log is None else [Marker()],
            **kw,
        )
        if log is not None:
            log.clear()
        trainer.train()
    steps = split_steps(log or [])
    trained = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    adapters = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    buckets = len(getattr(trainer.model_wrapped, "bucket_sizes", [])) or None
    return Run(adapters, logs, steps, buckets, trainer.state.log_history[-1])
