"""Every DDP setting a user passes, through ddp_ft, the Trainer or Accelerate, is honoured or refused, never dropped."""

import pytest
import torch
from accelerate.utils import DistributedDataParallelKwargs
from transformers import TrainingArguments

from ddp_ft.ddp import DDPSettings
from ddp_ft.integrations.settings import describe_sources, resolve_ddp_settings

from ..helpers.dist_harness import run_distributed
from ..helpers.trainers import Regressor, as_accelerate_rank, regression_rows


def _args(tmp_path, **kwargs):
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def test_training_arguments_mapped_naming_the_source(tmp_path):
    args = _args(tmp_path, ddp_bucket_cap_mb=5, ddp_find_unused_parameters=True, ddp_broadcast_buffers=False)
    settings, sources = resolve_ddp_settings(DDPSettings(), args)
    assert (settings.bucket_cap_mb, settings.find_unused_parameters, settings.broadcast_buffers) == (5, True, False)
    assert sources["bucket_cap_mb"] == "TrainingArguments.ddp_bucket_cap_mb"
    line = describe_sources(settings, sources)
    assert "find_unused_parameters=True (TrainingArguments.ddp_find_unused_parameters)" in line
    assert "gradient_as_bucket_view=True (default)" in line


def test_backend_unlike_the_group_refused_at_wrap():
    """The group starts before the wrap, so a backend it does not run is refused there, not dropped."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"backend='nccl' but the process group runs gloo: .*ddp_backend"):
            DDPSettings(backend="nccl").wrap(torch.nn.Linear(2, 2))
        assert DDPSettings(backend="gloo").wrap(torch.nn.Linear(2, 2)).world_size == 1
    finally:
        dist.destroy_process_group()


def test_accelerate_kwargs_mapped_with_comm_hooks():
    kwargs = DistributedDataParallelKwargs(bucket_cap_mb=10, gradient_as_bucket_view=True, comm_hook="bf16")
    settings, sources = resolve_ddp_settings(None, None, kwargs)
    assert (settings.bucket_cap_mb, settings.comm_hook) == (10, "bf16")
    # accelerate's default gradient_as_bucket_view is False; True is ours too, so nothing changes and nothing clashes
    assert settings.gradient_as_bucket_view and sources["gradient_as_bucket_view"].startswith("DistributedDataParallel")
    settings, _ = resolve_ddp_settings(None, None, DistributedDataParallelKwargs(gradient_as_bucket_view=False))
    assert settings.gradient_as_bucket_view  # accelerate's default is not a request: ours stays


def test_disagreeing_sources_raise_naming_both(tmp_path):
    with pytest.raises(ValueError, match=r"DDPSettings.bucket_cap_mb=10.*TrainingArguments.ddp_bucket_cap_mb=5"):
        resolve_ddp_settings(DDPSettings(bucket_cap_mb=10), _args(tmp_path, ddp_bucket_cap_mb=5))
    with pytest.raises(ValueError, match=r"TrainingArguments.ddp_timeout"):
        resolve_ddp_settings(DDPSettings(ddp_timeout=60), _args(tmp_path))
    same, _ = resolve_ddp_settings(DDPSettings(bucket_cap_mb=5), _args(tmp_path, ddp_bucket_cap_mb=5))
    assert same.bucket_cap_mb == 5


def test_auto_cap_kept_trainer_cap_beside_conflicts(tmp_path):
    settings, sources = resolve_ddp_settings(DDPSettings(bucket_cap_mb="auto"), _args(tmp_path))
    assert settings.bucket_cap_mb == "auto" and sources["bucket_cap_mb"] == "ddp_ft DDPSettings.bucket_cap_mb"
    with pytest.raises(ValueError, match=r"DDPSettings.bucket_cap_mb='auto'.*TrainingArguments.ddp_bucket_cap_mb=5"):
        resolve_ddp_settings(DDPSettings(bucket_cap_mb="auto"), _args(tmp_path, ddp_bucket_cap_mb=5))


@pytest.mark.parametrize(
    "source",
    [
        {"training_args": {"ddp_static_graph": True}},
        {"ddp_kwargs": {"static_graph": True}},
        {"ddp_kwargs": {"comm_wrapper": "fp16"}},
        {"ddp_kwargs": {"check_reduction": True}},
    ],
    ids=["ddp_static_graph", "static_graph", "comm_wrapper without a hook", "check_reduction"],
)
def test_settings_without_meaning_refused_by_name(tmp_path, source):
    args = _args(tmp_path, **source["training_args"]) if "training_args" in source else None
    kwargs = DistributedDataParallelKwargs(**source["ddp_kwargs"]) if "ddp_kwargs" in source else None
    name = next(iter(source.get("training_args", source.get("ddp_kwargs"))))
    with pytest.raises(ValueError, match=name):
        resolve_ddp_settings(None, args, kwargs)


def _trainer_with_ddp_arguments(rank, world_size, arguments):
    import tempfile

    as_accelerate_rank(rank, world_size)
    from ddp_ft.integrations import BucketedTrainer

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            report_to=[],
            max_steps=1,
            per_device_train_batch_size=4,
            save_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
            ddp_backend="gloo",
            **arguments,
        )
        torch.manual_seed(0)  # the same frozen weights on both ranks
        try:
            trainer = BucketedTrainer(model=Regressor(), args=args, train_dataset=regression_rows())
        except ValueError as error:
            return str(error)
        trainer.train()
        wrapped = trainer.model_wrapped
        return wrapped.find_unused_parameters, wrapped.broadcast_buffers, trainer.accelerator.ddp_settings.bucket_cap_mb


@pytest.mark.distributed
def test_trainer_arguments_reach_ddp_or_stop_the_run():
    honoured = run_distributed(
        _trainer_with_ddp_arguments,
        {"ddp_find_unused_parameters": True, "ddp_broadcast_buffers": False, "ddp_bucket_cap_mb": 1},
        timeout=180,
    )
    assert honoured == [(True, False, 1)] * 2
    refused = run_distributed(_trainer_with_ddp_arguments, {"ddp_static_graph": True}, timeout=180)
    assert all("static_graph" in message for message in refused)
