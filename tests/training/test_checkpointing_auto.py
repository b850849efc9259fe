"""``gradient_checkpointing: auto`` (``ddp_ft.training.resolve.probe_run_micro_batch``): checkpointing stays on unless
the probe measures that the whole per-rank batch fits without it; then nothing is recomputed.

No GPU here: the device's memory is given, and its peak is a fake line whose slope depends on whether the model's
decoder layers are checkpointed (3 GB per sample without, 1 GB with), measured on the model as the probe leaves it.
"""

import json

import pytest
import torch

from ddp_ft.distributed import DistInfo
from ddp_ft.training.config import settings_from_preset
from ddp_ft.training.resolve import probe_run_micro_batch, resolve_run

from ..helpers.dist_harness import run_distributed

GB = 10**9


def _checkpointed(model) -> bool:
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    return all(m.gradient_checkpointing for m in layers)


def _line(model, calls: list | None = None):
    """Peak ``4 GB + per sample x micro-batch``: 1 GB per sample checkpointed, 3 GB without; the step still runs."""

    def measure(step, micro_batch):
        on = _checkpointed(model)
        if calls is not None:
            calls.append(on)
        step()
        return 4 * GB + (1 if on else 3) * GB * micro_batch

    return measure


def _on_a_gpu(monkeypatch) -> None:
    """``micro_batch: auto`` resolved as on a GPU (auto kept for the probe, no arithmetic guess); compile off."""
    import ddp_ft.training.resolve as resolve

    monkeypatch.setattr(resolve, "resolve_micro_batch", lambda settings, info: None)
    on_a_gpu = resolve.DeviceDefaults(False, "off", "auto", "auto")
    monkeypatch.setattr(resolve, "resolve_device_defaults", lambda settings, info: on_a_gpu)


def _probed(monkeypatch, device_gb: float, info: DistInfo | None = None, **overrides):
    """The tiny 4-bit model built as the loop builds it, probed on a ``device_gb`` device with a 10% margin.
    The preset's effective batch is 8: 8 samples per rank on one process."""
    from ddp_ft.training.setup import build_model, prepare_run

    _on_a_gpu(monkeypatch)
    info = info or DistInfo()
    settings = settings_from_preset("tiny", micro_batch="auto", report_to="none", **overrides)
    parts = prepare_run(settings, info, resolve_run(settings, info))
    model = build_model(settings, info, parts)
    calls: list[bool] = []
    device = int(device_gb * GB)
    resolved = probe_run_micro_batch(
        model, settings, info, parts.resolved, device_bytes=device, measure=_line(model, calls), margin=0.1
    )
    return model, resolved, calls


def test_off_when_the_whole_batch_fits_without_it(monkeypatch):
    # budget 45 GB less AdamW's moments: 8 samples need 12 GB checkpointed, 28 GB without
    model, resolved, calls = _probed(monkeypatch, 50)
    assert (resolved.micro_batch, resolved.accumulation) == (8, 1)
    assert not resolved.checkpointing and "fits without it" in resolved.checkpointing_why
    assert not _checkpointed(model) and model.get_base_model()._require_grads_hooks  # one graph per compiled layer
    assert resolved.probe.expected_peak > 28 * GB  # the line without checkpointing: what the run will hold
    assert resolved.as_config()["model"]["gradient_checkpointing"] is False  # what run_config.yaml records
    assert calls[0] and not calls[-1]  # measured with it first, then without


def test_probe_measures_the_widest_micro_batch(monkeypatch):
    """Micro-batches are a multiple of 8 tokens wide, so at --max-seq-len 100 the widest is 104: the probe measures
    that, not 100."""
    _, resolved, _ = _probed(monkeypatch, 50, max_seq_len=100)
    assert resolved.probe.seq_len == 104


def test_kept_and_restored_when_only_it_lets_batch_fit(monkeypatch):
    # budget 18 GB: 8 samples fit checkpointed (12 GB), not without (28 GB)
    model, resolved, calls = _probed(monkeypatch, 20)
    assert (resolved.micro_batch, resolved.accumulation) == (8, 1)
    assert resolved.checkpointing and "fits only with it" in resolved.checkpointing_why
    assert resolved.probe.expected_peak < 13 * GB  # the checkpointed line's expected peak, not the other's
    assert _checkpointed(model) and model.get_base_model()._require_grads_hooks
    assert False in calls  # it was measured without


def test_not_tried_off_when_batch_needs_accumulation(monkeypatch):
    # budget 9 GB: 4 samples checkpointed (8 GB), 8 would need 12
    model, resolved, calls = _probed(monkeypatch, 10)
    assert (resolved.micro_batch, resolved.accumulation) == (4, 2)
    assert resolved.checkpointing and "below the per-rank batch" in resolved.checkpointing_why
    assert all(calls) and _checkpointed(model)


@pytest.mark.parametrize("setting", [True, False])
def test_explicit_setting_is_honoured_and_not_probed(monkeypatch, setting):
    model, resolved, calls = _probed(monkeypatch, 50, gradient_checkpointing=setting)
    assert resolved.checkpointing is setting and set(calls) == {setting}
    assert _checkpointed(model) is setting


def _two_ranks(rank, world_size):
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        # 4 samples per rank: rank 0 fits them without checkpointing (16 GB), rank 1 only with it (8 GB of 13)
        device_gb = 50 if rank == 0 else 15
        info = DistInfo(rank=rank, local_rank=rank, world_size=world_size)
        model, resolved, _ = _probed(monkeypatch, device_gb, info=info)
        return resolved.checkpointing, resolved.micro_batch, _checkpointed(model)


def test_two_ranks_that_disagree_both_keep_it():
    assert run_distributed(_two_ranks, world_size=2, timeout=180) == [(True, 4, True)] * 2


def test_loop_trains_without_it_and_records_it(tmp_path, monkeypatch):
    import ddp_ft.training.model.probe as probe
    from ddp_ft.training.loop import train

    _on_a_gpu(monkeypatch)
    monkeypatch.setattr(probe, "device_total_bytes", lambda device: 100 * GB)
    monkeypatch.setattr(probe, "cuda_peak_bytes", lambda device: lambda step, m: step() or 4 * GB + GB * m)
    settings = settings_from_preset("tiny", micro_batch="auto", output_dir=str(tmp_path), max_steps=1)
    train(settings, DistInfo())
    config = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert (config["micro_batch"], config["accumulation"]) == (8, 1)
    assert "gradient_checkpointing: false" in (tmp_path / "run_config.yaml").read_text()


def test_off_and_on_again_gives_untouched_gradients(monkeypatch):
    from ddp_ft.training.model.qlora import set_checkpointing

    model, _, _ = _probed(monkeypatch, 20)  # probed without checkpointing, then restored
    fresh, _, _ = _probed(monkeypatch, 10)  # never without
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for m in (model, fresh):
        torch.manual_seed(0)
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad for p in m.parameters() if p.requires_grad])
    assert all(g is not None and torch.equal(g, h) for g, h in zip(*grads, strict=True))
    set_checkpointing(model, False)
    assert not _checkpointed(model)


def test_trainer_recipe_trains_without_it_and_logs_it(tmp_path, monkeypatch):
    import ddp_ft.training.model.probe as probe
    from ddp_ft.integrations.recipe import build_trainer

    _on_a_gpu(monkeypatch)
    monkeypatch.setattr(probe, "device_total_bytes", lambda device: 100 * GB)
    monkeypatch.setattr(probe, "cuda_peak_bytes", lambda device: lambda step, m: step() or 4 * GB + GB * m)
    settings = settings_from_preset("tiny", micro_batch="auto", output_dir=str(tmp_path), report_to="none", max_steps=1)
    trainer = build_trainer(settings, DistInfo(), resolved=resolve_run(settings, DistInfo()))
    assert not trainer.resolved.checkpointing and not _checkpointed(trainer.model)
    trainer.train()
    config = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert config["gradient_checkpointing"] is False and config["micro_batch"] == 8
