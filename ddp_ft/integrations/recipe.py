"""The Trainer side of the reference recipe: the same model, data and settings as ``scripts/train.py``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from ..distributed import DistInfo
from ..report.metrics import JsonlLogger, log_to_active_wandb, resolve_wandb_mode
from ..report.records import RunIdentity, predict_record, run_identity
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
    """``["wandb"]`` (the Trainer's WandbCallback, configured through its environment variables) on rank 0, else
    ``[]``: no other rank ever starts wandb, or sets its variables.

    Offline, kept on disk for ``wandb sync``, without an API key; same project and group as the plain loop.
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


TRAINERS = ("hf", "trl", *STOCK_TRAINERS)  # the recipe's --trainer (see build_trainer)


def build_trainer(
    settings: RunSettings,
    info: DistInfo,
    trainer: str = "hf",
    stock_find_unused: str = "trainer",
    resolved: Resolved | None = None,
    parts: RunParts | None = None,
) -> BucketedTrainer:
    """Model (4-bit + LoRA on this rank's device), tokenized data and TrainingArguments from ``settings``.

    What the run trained with (``ddp_ft.training.resolve.Resolved``, the probe's micro-batch in it) is the returned
    trainer's ``resolved``: ``run_config.yaml`` is written from it.

    Args:
        settings (RunSettings): the run.
        info (DistInfo): this process.
        trainer (str): ``hf``: ``BucketedTrainer``; ``trl``: ``BucketedSFTTrainer`` (the ``[trl]`` extra) on
            the same tokenized rows and collator, with TRL's loss and metrics. TRL stores the adapters of a 4-bit
            model in bfloat16, so its run is not the ``hf`` one to the bit. ``stock-hf`` and ``stock-trl``: the
            same on ``transformers.Trainer`` and ``trl.SFTTrainer`` with torch DDP (``ddp_ft.integrations.stock``),
            the runs ddp_ft is measured against. Each evaluates every held-out row (``ddp_ft.integrations.recipe_eval``:
            ``dataloader_drop_last`` is for training only). Default: hf
        stock_find_unused (str): torch DDP's ``find_unused_parameters`` for a stock trainer: ``trainer`` (the
            Trainer's own choice), ``true`` or ``false``. Default: trainer
        resolved (Resolved | None): what ``resolve_run`` returned, where the caller ran it first (the recipe's
            command). Default: it runs here.
        parts (RunParts | None): what ``prepare_run`` built, where the caller built it (the recipe's command keeps
            the eval rows and the data record). Default: built here.

    Raises:
        ValueError: before the model loads, for an unknown ``trainer``, an Accelerate launch setting the recipe cannot
            honour (``ddp_ft.distributed.launch``), float16 on the CPU, a setting a stock trainer cannot honour
            (``check_stock_settings``), and for everything ``prepare_run`` refuses.
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
        # The rows are tokenized, labelled and truncated by ddp_ft.training.data already: TRL takes them as they are.
        arguments |= dict(max_length=None, packing=False, dataset_kwargs={"skip_prepare_dataset": True})
    data = dict(train_dataset=parts.train_set, eval_dataset=parts.eval_set, processing_class=parts.tokenizer)
    if trainer in STOCK_TRAINERS:
        stock = build_stock_trainer(
            trainer, arguments, settings, stock_find_unused, model=model, data_collator=parts.collate, **data
        )
        return with_step_progress(with_resolved(stock, resolved))
    trainer_class, args = BucketedTrainer, None
    if trainer == "trl":
        from .trl import BucketedSFTTrainer, SFTConfig  # the optional trl, imported here only

        trainer_class, args = BucketedSFTTrainer, SFTConfig(**arguments)
    bucketed = evaluating_every_row(trainer_class)(
        model=model,
        args=args or TrainingArguments(**arguments),
        data_collator=parts.hooks.wrap_collate(parts.collate),
        ddp_settings=settings.ddp,
        balance_ranks=t.balance_ranks,
        **data,
    )
    bucketed.accelerator.compute_dtype_fix = command_line_fix  # the dtype warning names --compute-dtype
    return with_step_progress(with_resolved(bucketed, resolved))  # the loss on rank 0's bar, not thirty keys


def probe_as_the_trainer_trains(
    model: torch.nn.Module,
    settings: RunSettings,
    info: DistInfo,
    resolved: Resolved,
    trainer: str = "hf",
    **overrides: object,
) -> Resolved:
    """``--micro-batch auto`` on the Trainer path: the probe (``ddp_ft.training.resolve.probe_run_micro_batch``) on the
    model as ``Trainer.train()`` will run it, before the Trainer exists (its batch size and accumulation are fixed
    then).

    - Liger: the Trainer patches the model instance when ``train()`` starts (``use_liger_kernel``); the same patch,
      transformers' ``apply_liger_kernel``, is applied here first, so the probe measures Liger's fused loss (the
      Trainer's second application replaces the patched methods with the same ones).
    - A stock trainer's torch DDP keeps its buckets beside the gradients (``gradient_as_bucket_view=False``): one
      more copy of the trainable bytes is added to the optimizer's.
    - Compilation: BucketedAccelerator compiles each decoder layer in place when the Trainer prepares the model
      (``ddp_ft.training.model.compilation``); done here first, with the Trainer's backend (inductor), so the probe
      measures the compiled layers, and the accelerator finds them compiled. A stock trainer's Accelerate compiles the
      whole wrapped model inside ``train()``, which cannot run before the Trainer exists: the probe measures the
      uncompiled model there, and says so.

    Args:
        model (torch.nn.Module): the unwrapped model ``build_model`` returned.
        settings (RunSettings): the run's.
        info (DistInfo): this rank.
        resolved (Resolved): the run's, with ``probe_pending``.
        trainer (str): the recipe's ``--trainer``. Default: hf
        **overrides: passed to ``probe_micro_batch`` (``device_bytes``, ``measure``: tests).

    Returns:
        Resolved: ``resolved`` with the probe's micro-batch and accumulation.
    """
    if settings.model.liger:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, None)
    if resolved.compile and trainer not in STOCK_TRAINERS:
        compile_repeated_blocks(model, backend="inductor")  # what BucketedAccelerator.prepare_model would do
    elif resolved.compile and info.is_main_process:
        logger.warning(
            "--micro-batch auto with --compile on the stock Trainer: Accelerate compiles the whole model inside "
            "train(), after the probe, so the probe measured the uncompiled model; compiled, the peak can be higher."
        )
    if trainer in STOCK_TRAINERS and "optimizer_state" not in overrides:
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        overrides["optimizer_state"] = 3 * trainable  # AdamW's two moments and torch DDP's gradient buckets
    return probe_run_micro_batch(model, settings, info, resolved, **overrides)


def with_resolved(trainer, resolved: Resolved):
    """``trainer`` carrying what the run resolved (``trainer.resolved``) and logging the probe's expected peak beside
    the measured one (:class:`ExpectedPeakCallback`)."""
    trainer.resolved = resolved
    return with_expected_peak(trainer, resolved.probe)


def with_expected_peak(trainer, probe: MicroBatchProbe | None):
    """``trainer`` logging the probe's expected peak beside the measured one (:class:`ExpectedPeakCallback`)."""
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
        run_name=identity.name,  # the wandb run's name too
        per_device_train_batch_size=resolved.micro_batch,
        per_device_eval_batch_size=resolved.micro_batch,
        gradient_accumulation_steps=resolved.accumulation,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": t.min_learning_rate},
        warmup_steps=t.warmup_ratio,  # a float < 1 is a ratio in transformers >= 5
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        optim="adamw_torch",
        logging_steps=1,
        save_steps=t.save_every or 10**9,
        save_total_limit=t.save_total_limit or None,
        eval_strategy="steps" if t.eval_every else "no",
        eval_steps=t.eval_every or None,
        seed=t.seed,
        bf16=precision.dtype == torch.bfloat16,  # Accelerate's autocast, in the dtype of the 4-bit layers
        fp16=precision.dtype == torch.float16,  # autocast and Accelerate's loss scaler
        use_cpu=not cuda,
        report_to=wandb_report_to(settings, identity, info),
        remove_unused_columns=False,
        activation_checkpointing=False,  # already enabled, non-reentrant, by load_qlora_model
        include_num_input_tokens_seen="non_padding",
        average_tokens_across_devices=True,
        # Whole rounds of batches: the plain loop's full steps (a short last one as stock's). Training only:
        # the recipe's trainers evaluate every row (recipe_eval).
        dataloader_drop_last=True,
        ddp_backend=("nccl" if cuda else "gloo") if info.is_distributed else None,
        ddp_timeout=settings.ddp.ddp_timeout,
        disable_tqdm=not info.is_main_process,
        use_liger_kernel=settings.model.liger,  # the Trainer patches the model at train(); checked before the load
        torch_compile=resolved.compile,  # Accelerate compiles the model, then BucketedAccelerator wraps it
    )


def trainer_precision(settings: RunSettings, info: DistInfo, trainer: str = "hf") -> Precision:
    """The run's precision (``ddp_ft.training.model.precision``), which the Trainer's ``bf16``/``fp16`` flags follow.

    Logged with the adapters' dtype where TRL's SFTTrainer casts a 4-bit model's LoRA adapters to bfloat16.

    Raises:
        ValueError: float16 on the CPU: Accelerate turns neither float16 autocast nor its loss scaler on there, so
            the flag would be dropped; naming the fixes.
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
    """``resume_from_checkpoint`` for ``Trainer.train``: ``--resume`` ('latest' becomes True, the newest
    ``checkpoint-N``), except after an elastic restart (``TORCHELASTIC_RESTART_COUNT`` > 0), which continues from
    the newest checkpoint in ``output_dir`` when there is one, with no flag."""
    from transformers.trainer_utils import get_last_checkpoint

    newest = get_last_checkpoint(output_dir) if restart_count > 0 and os.path.isdir(output_dir) else None
    if newest:
        logger.info("elastic restart %d: resuming from %s", restart_count, newest)
        return True
    return True if resume == "latest" else (resume or None)


def log_resume(checkpoint: str | Path | None, info: DistInfo) -> None:
    """Say once, on rank 0, which Trainer checkpoint the run resumes from and at which step (its
    ``trainer_state.json``); nothing without one."""
    if checkpoint is None or not info.is_main_process:
        return
    try:
        step = json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):  # the Trainer's load names what is wrong with it
        step = "unknown"
    logger.info("resuming from %s at step %s", checkpoint, step)


def trainer_checkpoint(resume: str | bool | None, output_dir: str) -> str | None:
    """The folder ``Trainer.train(resume_from_checkpoint=resume)`` will load, found before the model loads.

    Raises:
        FileNotFoundError: ``--resume latest`` with no ``checkpoint-N`` in ``output_dir``, or a ``--resume`` folder
            that does not exist, naming it.
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
    """``--predict`` for the recipe: rank 0 generates on the unwrapped model, so no collective starts.

    The predictions go to ``predictions.jsonl``; their count and ROUGE-L to ``metrics.jsonl``; both, and the rows as
    a table, to the Trainer's wandb run when it has one.
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
    sink = JsonlLogger(Path(t.output_dir) / "metrics.jsonl")
    sink.log(record)
    sink.close()
    log_to_active_wandb(sink.path, record, prediction_table(predictions))
    shown = "no answers to score" if score is None else f"ROUGE-L {score:.4f}"
    logger.info("predicted %d eval samples (%s): %s", len(predictions), shown, path)
