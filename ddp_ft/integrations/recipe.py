"""The Trainer side of the reference recipe: the same model, data and settings as ``scripts/train.py``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from ..distributed import DistInfo
from ..report.metrics import JsonlLogger, log_to_active_wandb, resolve_wandb_mode
from ..report.records import METRICS_FILE, RunIdentity, predict_record, run_identity
from ..training.config import RunSettings
from ..training.model.compilation import compile_repeated_blocks
from ..training.model.precision import Precision
from ..training.model.probe import MicroBatchProbe
from ..training.perf_traps import command_line_fix
from ..training.predict import PREDICTIONS_FILE, predict_rows, prediction_table, rouge_l, write_predictions
from ..training.resolve import Resolved, probe_run_micro_batch
from ..training.setup import RunParts, build_model, prepare_run
from .callbacks import ExpectedPeakCallback, with_step_progress
from .recipe_eval import evaluating_every_row
from .stock import STOCK_TRAINERS, build_stock_trainer, check_stock_settings
from .trainer import BucketedTrainer

logger = logging.getLogger(__name__)


def wandb_report_to(settings: RunSettings, identity: RunIdentity, info: DistInfo) -> list[str]:
    """``["wandb"]`` on rank 0, else ``[]``: no other rank starts wandb.

    Offline without an API key; same project and group as the plain loop.
    """
    t = settings.train
    if not info.is_main_process or t.report_to != "wandb" or os.environ.get("WANDB_MODE") == "disabled":
        return []
    os.environ["WANDB_MODE"] = resolve_wandb_mode()
    os.environ.setdefault("WANDB_PROJECT", identity.project)
    os.environ.setdefault("WANDB_RUN_GROUP", identity.group)
    os.environ.setdefault("WANDB_JOB_TYPE", identity.job_type)
    os.environ.setdefault("WANDB_DIR", t.output_dir)
    Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
    return ["wandb"]


TRAINERS = ("hf", "trl", *STOCK_TRAINERS)


def build_trainer(
    settings: RunSettings,
    info: DistInfo,
    trainer: str = "hf",
    stock_find_unused: str = "trainer",
    resolved: Resolved | None = None,
    parts: RunParts | None = None,
) -> BucketedTrainer:
    """Builds the model, tokenized data and TrainingArguments from ``settings`` into a trainer.

    The returned trainer's ``resolved`` holds what the run trained with, for ``run_config.yaml``.

    Args:
        settings (RunSettings): the run.
        info (DistInfo): this process.
        trainer (str): ``hf`` (``BucketedTrainer``), ``trl`` (``BucketedSFTTrainer``), or ``stock-hf`` and
            ``stock-trl`` with torch DDP (``ddp_ft.integrations.stock``). Default: hf.
        stock_find_unused (str): a stock trainer's ``find_unused_parameters``: ``trainer``, ``true`` or ``false``.
            Default: trainer.
        resolved (Resolved | None): ``resolve_run``'s result, when the caller ran it. Default: resolved here.
        parts (RunParts | None): ``prepare_run``'s result, when the caller built it. Default: built here.

    Returns:
        BucketedTrainer: the trainer, or a stock one.

    Raises:
        ValueError: an unknown ``trainer``, float16 on the CPU, or a setting the trainer cannot honour.
    """
    from transformers import TrainingArguments

    if trainer not in TRAINERS:
        raise ValueError(f"--trainer {trainer!r}: choose one of {', '.join(TRAINERS)}.")
    check_stock_settings(settings, trainer, stock_find_unused)
    t = settings.train
    precision = trainer_precision(settings, info, trainer)
    parts = parts or prepare_run(settings, info, resolved)
    logger.info("data: %s", parts.truncation)
    model = build_model(settings, info, parts)
    resolved = parts.resolved
    if resolved.probe_pending:
        resolved = probe_as_the_trainer_trains(model, settings, info, resolved, trainer)
    arguments = training_arguments(settings, info, precision, resolved)
    if trainer.endswith("trl"):
        # The rows are already tokenized and labelled: TRL takes them as they are.
        arguments |= dict(max_length=None, packing=False, dataset_kwargs={"skip_prepare_dataset": True})
    data = dict(train_dataset=parts.train_set, eval_dataset=parts.eval_set, processing_class=parts.tokenizer)
    if trainer in STOCK_TRAINERS:
        stock = build_stock_trainer(
            trainer, arguments, settings, stock_find_unused, model=model, data_collator=parts.collate, **data
        )
        return with_step_progress(with_resolved(stock, resolved))
    trainer_class, args = BucketedTrainer, None
    if trainer == "trl":
        from .trl import BucketedSFTTrainer, SFTConfig  # trl is optional

        trainer_class, args = BucketedSFTTrainer, SFTConfig(**arguments)
    bucketed = evaluating_every_row(trainer_class)(
        model=model,
        args=args or TrainingArguments(**arguments),
        data_collator=parts.hooks.wrap_collate(parts.collate),
        ddp_settings=settings.ddp,
        balance_ranks=t.balance_ranks,
        **data,
    )
    bucketed.accelerator.compute_dtype_fix = command_line_fix
    return with_step_progress(with_resolved(bucketed, resolved))  # the loss on rank 0's bar


def probe_as_the_trainer_trains(
    model: torch.nn.Module,
    settings: RunSettings,
    info: DistInfo,
    resolved: Resolved,
    trainer: str = "hf",
    **overrides: object,
) -> Resolved:
    """Runs ``--micro-batch auto``'s probe on the model as ``Trainer.train()`` will run it.

    Liger and regional compilation are applied first, as the Trainer would apply them.
    A stock trainer's torch DDP buckets add one copy of the trainable bytes.
    Accelerate compiles a stock trainer's model inside ``train()``, so the probe measures it uncompiled.

    Args:
        model (torch.nn.Module): the unwrapped model.
        settings (RunSettings): the run's.
        info (DistInfo): this rank.
        resolved (Resolved): the run's, with ``probe_pending``.
        trainer (str): the recipe's ``--trainer``. Default: hf.
        **overrides: passed to ``probe_micro_batch``.

    Returns:
        Resolved: ``resolved`` with the probe's micro-batch and accumulation.
    """
    if settings.model.liger:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, None)
    if resolved.compile and trainer not in STOCK_TRAINERS:
        compile_repeated_blocks(model, backend="inductor")
    elif resolved.compile and info.is_main_process:
        logger.warning(
            "--micro-batch auto with --compile on the stock Trainer: Accelerate compiles the whole model inside "
            "train(), after the probe, so the probe measured the uncompiled model; compiled, the peak can be higher."
        )
    if trainer in STOCK_TRAINERS and "optimizer_state" not in overrides:
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        overrides["optimizer_state"] = 3 * trainable  # AdamW's two moments and torch DDP's buckets
    return probe_run_micro_batch(model, settings, info, resolved, **overrides)


def with_resolved(trainer, resolved: Resolved):
    """``trainer`` carrying ``resolved`` and logging the probe's expected peak."""
    trainer.resolved = resolved
    return with_expected_peak(trainer, resolved.probe)


def with_expected_peak(trainer, probe: MicroBatchProbe | None):
    """``trainer`` logging the probe's expected peak beside the measured one."""
    if probe is not None:
        trainer.callback_handler.callbacks.insert(0, ExpectedPeakCallback(probe.expected_peak / 1e9))
    return trainer


def training_arguments(settings: RunSettings, info: DistInfo, precision: Precision, resolved: Resolved) -> dict:
    """The recipe's ``TrainingArguments`` values, the same for every trainer."""
    t = settings.train
    cuda = info.device.type == "cuda"
    identity = run_identity(t.wandb_project, t.wandb_group, t.run_name, settings.preset, info.world_size)
    return dict(
        output_dir=t.output_dir,
        run_name=identity.name,
        per_device_train_batch_size=resolved.micro_batch,
        per_device_eval_batch_size=resolved.micro_batch,
        gradient_accumulation_steps=resolved.accumulation,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": t.min_learning_rate},
        warmup_steps=t.warmup_ratio,  # a float < 1 is a ratio
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        optim="adamw_torch",
        logging_steps=1,
        save_steps=t.save_every or 10**9,
        save_total_limit=t.save_total_limit or None,
        eval_strategy="steps" if t.eval_every else "no",
        eval_steps=t.eval_every or None,
        seed=t.seed,
        bf16=precision.dtype == torch.bfloat16,
        fp16=precision.dtype == torch.float16,
        use_cpu=not cuda,
        report_to=wandb_report_to(settings, identity, info),
        remove_unused_columns=False,
        activation_checkpointing=False,  # already enabled by load_qlora_model
        include_num_input_tokens_seen="non_padding",
        average_tokens_across_devices=True,
        # Training only: the recipe's trainers evaluate every row (recipe_eval).
        dataloader_drop_last=True,
        ddp_backend=info.backend,  # the group init_distributed started (None for one process)
        ddp_timeout=settings.ddp.ddp_timeout,
        disable_tqdm=not info.is_main_process,
        log_level_replica="error",  # only rank 0 warns: transformers' warnings are the same on every rank
        use_liger_kernel=settings.model.liger,  # the Trainer patches the model at train()
        torch_compile=resolved.compile,
    )


def trainer_precision(settings: RunSettings, info: DistInfo, trainer: str = "hf") -> Precision:
    """The run's precision, which the Trainer's ``bf16`` and ``fp16`` flags follow.

    Raises:
        ValueError: float16 on the CPU, where Accelerate would drop autocast and the loss scaler.
    """
    precision = settings.model.precision(info.device)
    if precision.loss_scaling and info.device.type != "cuda":
        raise ValueError(
            "--compute-dtype float16 on the CPU with the Trainer recipe: Accelerate has no float16 autocast or loss "
            "scaler on the CPU and would drop them. Use --compute-dtype float32 or bfloat16, or scripts/train.py "
            "(the plain loop scales the loss on the CPU too)."
        )
    cast = trainer.endswith("trl") and settings.model.load_in_4bit and precision.dtype != torch.bfloat16
    logger.info(
        "compute dtype %s (%s)%s%s",
        precision.name,
        precision.reason,
        ", loss-scaled" if precision.loss_scaling else "",
        "; the LoRA adapters in bfloat16 (TRL's SFTTrainer casts a 4-bit model's)" if cast else "",
    )
    return precision


def trainer_resume_target(resume: str, output_dir: str, restart_count: int) -> str | bool | None:
    """``resume_from_checkpoint`` for ``Trainer.train`` from ``--resume``.

    After an elastic restart it resumes from the newest checkpoint, with no flag.
    """
    from transformers.trainer_utils import get_last_checkpoint

    newest = get_last_checkpoint(output_dir) if restart_count > 0 and os.path.isdir(output_dir) else None
    if newest:
        logger.info("elastic restart %d: resuming from %s", restart_count, newest)
        return True
    return True if resume == "latest" else (resume or None)


def log_resume(checkpoint: str | Path | None, info: DistInfo) -> None:
    """Logs on rank 0 which checkpoint the run resumes from, and at which step."""
    if checkpoint is None or not info.is_main_process:
        return
    try:
        step = json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):  # the Trainer's load names the fault
        step = "unknown"
    logger.info("resuming from %s at step %s", checkpoint, step)


def trainer_checkpoint(resume: str | bool | None, output_dir: str) -> str | None:
    """The folder ``Trainer.train`` will resume from, found before the model loads.

    Raises:
        FileNotFoundError: no checkpoint for ``--resume latest``, or no such ``--resume`` folder.
    """
    from transformers.trainer_utils import get_last_checkpoint

    if resume is True:
        found = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if found is None:
            raise FileNotFoundError(f"--resume latest: no Trainer checkpoint (checkpoint-N) in {output_dir}.")
        return found
    if resume and not os.path.isdir(resume):
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint folder.")
    return resume or None


def predict_at_end(trainer, parts: RunParts, settings: RunSettings, info: DistInfo) -> None:
    """``--predict`` for the recipe: rank 0 generates on the unwrapped model.

    Predictions go to ``predictions.jsonl``; their count and ROUGE-L to ``metrics.jsonl`` and wandb.
    """
    if not info.is_main_process:
        return
    t = settings.train
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    predictions = predict_rows(model, parts.tokenizer, parts.eval_rows, settings.data, t.predict, t.max_new_tokens)
    score = rouge_l(predictions)
    path = write_predictions(Path(t.output_dir) / PREDICTIONS_FILE, predictions)
    state = trainer.state
    samples_seen = state.global_step * t.effective_batch
    record = predict_record(step=state.global_step, samples_seen=samples_seen, samples=len(predictions), rouge_l=score)
    sink = JsonlLogger(Path(t.output_dir) / METRICS_FILE)
    sink.log(record)
    sink.close()
    log_to_active_wandb(sink.path, record, prediction_table(predictions))
    shown = "no answers to score" if score is None else f"ROUGE-L {score:.4f}"
    logger.info("predicted %d eval samples (%s): %s", len(predictions), shown, path)
