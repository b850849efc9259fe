"""``--micro-batch auto`` by measurement (``ddp_ft.training.model.probe``): probe steps on the built model against a
fake device.

No GPU here: the device's memory is given, and the peak is either a fake line in the micro-batch (the choice's
arithmetic) or measured on the CPU by ``ddp_ft.training.model.memory.step_peak_bytes`` on the tiny 4-bit model (the
real thing).
"""

import json

import pytest
import torch

from ddp_ft.distributed import DistInfo
from ddp_ft.training.config import settings_from_preset
from ddp_ft.training.model.memory import step_peak_bytes
from ddp_ft.training.model.probe import PROBE_MARGIN, fit_peak_line, largest_fitting_divisor, probe_micro_batch

from ..helpers.dist_harness import run_distributed

GB = 10**9
SEQ = 32


def _causal_lm(seed: int = 0) -> torch.nn.Module:
    """A causal LM that is no Qwen3 (GPT-2, two layers), its embedding frozen: the probe needs no known shape."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=SEQ, bos_token_id=0, eos_token_id=0)
    )
    model.transformer.wte.requires_grad_(False)
    return model


def _line(resident: int, per_sample: int):
    """A fake device's peak: ``resident + per_sample x micro-batch``; the step still runs (its gradients too)."""

    def measure(step, micro_batch):
        step()
        return resident + per_sample * micro_batch

    return measure


def _probe(model, effective_batch, device_bytes, measure, info=None, margin=0.1, **kwargs):
    """The probe with a 10% margin: round budgets for the fake lines below."""
    return probe_micro_batch(
        model,
        seq_len=SEQ,
        effective_batch=effective_batch,
        info=info or DistInfo(),
        device_bytes=device_bytes,
        measure=measure,
        margin=margin,
        **kwargs,
    )


def test_largest_whose_fitted_line_fits_less_margin():
    # 4 GB resident + 1 GB per sample: 8 needs 12 GB, 16 needs 20 GB; a 14 GB device leaves 12.6 GB.
    probe = _probe(_causal_lm(), 16, 14 * GB, _line(4 * GB, GB), optimizer_state=0)
    assert (probe.micro_batch, probe.accumulation, probe.world_size) == (8, 2, 1)
    assert probe.points == ((1, 5 * GB), (2, 6 * GB), (4, 8 * GB))  # measured small, extrapolated
    assert (probe.resident, probe.per_sample, probe.nonlinearity) == (4 * GB, GB, 0.0)
    assert probe.expected_peak == 12 * GB and probe.budget == int(14 * GB * 0.9)
    # the optimizer's state comes on top: 0.7 GB more and 8 no longer fits 12.6 GB
    assert _probe(_causal_lm(), 16, 14 * GB, _line(4 * GB, GB), optimizer_state=7 * GB // 10).micro_batch == 4
    # exactly the budget fits; a byte less does not
    device = -(-12 * GB * 10 // 9)
    assert _probe(_causal_lm(), 16, device, _line(4 * GB, GB), optimizer_state=0).micro_batch == 8
    assert _probe(_causal_lm(), 16, device - 2, _line(4 * GB, GB), optimizer_state=0).micro_batch == 4


def test_only_divisors_so_effective_batch_is_kept():
    # 12 per rank: 7 would fit 11.5 GB (11 GB) but does not divide 12; 6 does.
    assert largest_fitting_divisor(12, lambda m: 4 + m, 11) == 6
    assert largest_fitting_divisor(12, lambda m: 4 + m, 4) == 0
    info = DistInfo(rank=0, world_size=2)  # no process group: this rank's choice alone
    probe = _probe(_causal_lm(), 24, int(11.5 * GB / 0.9), _line(4 * GB, GB), info=info, optimizer_state=0)
    assert (probe.micro_batch, probe.accumulation) == (6, 2)
    assert probe.micro_batch * probe.accumulation * 2 == 24


def test_none_fitting_names_setting_numbers_and_fix():
    with pytest.raises(ValueError) as error:
        _probe(_causal_lm(), 16, 5 * GB, _line(4 * GB, GB), optimizer_state=0)  # 5 GB at 1 > 4.5 GB budget
    message = str(error.value)
    assert "--micro-batch auto: even micro-batch 1 does not fit on rank 0" in message
    assert "1: 5.000 GB" in message and "4.500 GB budget" in message
    assert "--max-seq-len" in message and "--micro-batch 1" in message


def test_fitted_line_is_above_points_on_steepest_part():
    assert fit_peak_line([(1, 5), (2, 6), (4, 8)]) == (4, 1, 0.0)
    resident, slope, off = fit_peak_line([(1, 10), (2, 12), (4, 20)])  # curving up: the last segment's slope 4
    assert slope == 4 and all(resident + slope * m >= p for m, p in [(1, 10), (2, 12), (4, 20)])
    assert off > 0.05
    assert fit_peak_line([(1, 7)]) == (0, 7, 0.0)  # one point: as if nothing were resident


def _tiny_qlora(dropout: float = 0.05):
    from ddp_ft.training.model.qlora import ModelSettings, load_qlora_model
    from ddp_ft.training.setup import resolve_model_and_tokenizer

    settings = settings_from_preset("tiny", lora_dropout=dropout)
    path, _ = resolve_model_and_tokenizer(settings.model.model_name_or_path, DistInfo())
    torch.manual_seed(0)
    return load_qlora_model(ModelSettings(model_name_or_path=path), settings.lora, {"": "cpu"}, 1)


def test_tiny_4bit_on_cpu_picks_the_one_that_fits():
    model = _tiny_qlora()
    measure = lambda step, m: step_peak_bytes(step, skip_matmuls=False)  # noqa: E731  (the allocator's real peak)
    roomy = _probe(model, 4, 100 * GB, measure, optimizer_state=0, margin=PROBE_MARGIN)
    peaks = dict(roomy.points)
    assert roomy.micro_batch == 4 and sorted(peaks) == [1, 2, 4]
    assert peaks[1] < peaks[2] < peaks[4] and roomy.nonlinearity < 0.05  # activations grow linearly in the batch
    # a device whose budget lies between the measured peaks at 2 and 4: 2 is chosen, 4 never run
    device = int((peaks[2] + peaks[4]) / 2 / (1 - PROBE_MARGIN))
    tight = _probe(model, 4, device, measure, optimizer_state=0, margin=PROBE_MARGIN)
    assert tight.micro_batch == 2 and tight.accumulation == 2
    assert peaks[2] <= tight.expected_peak <= tight.budget < peaks[4]


def test_probe_leaves_model_and_rng_state_as_they_were():
    model = _tiny_qlora(dropout=0.5)  # dropout draws from the generator in every probe step
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable[0].grad = torch.full_like(trainable[0], 3.0)  # as if a micro-step had accumulated into it
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    model.eval()
    rng = torch.get_rng_state()
    _probe(model, 4, 100 * GB, _line(GB, GB // 10))
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training
    assert torch.equal(trainable[0].grad, torch.full_like(trainable[0], 3.0))
    assert all(p.grad is None for p in trainable[1:])
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _two_ranks(rank, world_size):
    info = DistInfo(rank=rank, local_rank=rank, world_size=world_size)
    # 4 GB + 1 GB per sample, 8 per rank: 14 GB fits 8 (12 GB), 10 GB fits 4 (8 GB of 9)
    device = (14 if rank == 0 else 10) * GB
    agreed = _probe(_causal_lm(), 16, device, _line(4 * GB, GB), info=info, optimizer_state=0)

    def failing_on_rank_1(step, micro_batch):
        if rank == 1:
            raise RuntimeError("rank 1's probe broke")
        return _line(4 * GB, GB)(step, micro_batch)

    try:  # a rank that fails does not leave the other waiting in the all-reduce
        _probe(_causal_lm(), 16, 100 * GB, failing_on_rank_1, info=info)
        failed = None
    except RuntimeError as error:
        failed = str(error)
    return agreed.micro_batch, agreed.accumulation, failed


def test_two_ranks_take_smaller_device_share_failures():
    (m0, a0, failed0), (m1, a1, failed1) = run_distributed(_two_ranks, world_size=2, timeout=120)
    assert (m0, a0) == (m1, a1) == (4, 2)
    assert "the probe failed on another rank" in failed0
    assert failed1 == "rank 1's probe broke"


def _sharing_ranks(rank, world_size, shared: bool):
    """Each rank on a fake 20 GB GPU, both on the same one or each on its own; the probe's budget follows."""
    import ddp_ft.ddp.placement as placement
    import ddp_ft.training.model.probe as probe

    probe.device_total_bytes = lambda device: 20 * GB  # this forked rank's modules only
    placement.device_identity = lambda device: ("host", "GPU-0" if shared else f"GPU-{rank}")
    info = DistInfo(rank=rank, local_rank=rank, world_size=world_size)
    # 4 GB + 1 GB per sample, 8 per rank: 18 GB (20 less 10%) fits 8; a 9 GB half fits 4 (8 GB)
    chosen = _probe(_causal_lm(), 16, None, _line(4 * GB, GB), info=info, optimizer_state=0)
    try:  # 9 GB + 1 GB per sample: micro-batch 1 fits a GPU of its own only
        _probe(_causal_lm(), 16, None, _line(9 * GB, GB), info=info, optimizer_state=0)
        refused = None
    except ValueError as error:
        refused = str(error)
    return probe.device_share_bytes(info), chosen.micro_batch, chosen.budget, chosen.describe() + f" | {refused}"


def test_ranks_sharing_a_gpu_each_fill_an_equal_part():
    """gloo lets 2 ranks train on one GPU: each budgets half of it, so together they fit; on a GPU each, all of it."""
    for rank, (share, micro_batch, budget, said) in enumerate(run_distributed(_sharing_ranks, True)):
        assert share == (10 * GB, 2) and (micro_batch, budget) == (4, 9 * GB), rank
        assert "10.000 GB: this rank's 1/2 of a GPU the ranks share over gloo less 10%" in said
        assert "use a larger device, run fewer processes on the shared GPU, or give --micro-batch 1" in said
    for share, micro_batch, budget, said in run_distributed(_sharing_ranks, False):
        assert share == (20 * GB, 1) and (micro_batch, budget) == (8, 18 * GB)
        assert "(20.000 GB device less 10%)" in said and said.endswith("| None")


def _fake_cuda(monkeypatch, resident: int, per_sample: int, device_bytes: int) -> None:
    """The CPU run's auto as on a GPU of ``device_bytes`` whose step peaks on a line: no arithmetic first guess."""
    import ddp_ft.training.model.probe as probe
    import ddp_ft.training.resolve as resolve

    monkeypatch.setattr(resolve, "resolve_micro_batch", lambda settings, info: None)
    # the device's defaults as on a GPU for the micro-batch (auto kept for the probe), compile off (the CPU's)
    on_a_gpu = resolve.DeviceDefaults(False, "off", "auto", "auto")
    monkeypatch.setattr(resolve, "resolve_device_defaults", lambda settings, info: on_a_gpu)
    monkeypatch.setattr(probe, "device_total_bytes", lambda device: device_bytes)
    monkeypatch.setattr(probe, "cuda_peak_bytes", lambda device: _line(resident, per_sample))


def test_loop_trains_at_probed_size_and_logs_peak(tmp_path, monkeypatch):
    from ddp_ft.training.loop import train

    _fake_cuda(monkeypatch, 4 * GB, GB, 10 * GB)  # budget 8.5 GB: 4 (8 GB) of the tiny preset's effective batch 8
    settings = settings_from_preset("tiny", micro_batch="auto", output_dir=str(tmp_path), max_steps=1)
    train(settings, DistInfo())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    config, step = records[0], next(r for r in records if r["type"] == "train")
    assert (config["micro_batch"], config["accumulation"], config["effective_batch"]) == (4, 2, 8)
    assert config["micro_batch_probe"]["points"] == [[1, 5.0], [2, 6.0], [4, 8.0]]
    expected = config["micro_batch_probe"]["expected_peak_gb"]
    assert expected == step["expected_peak_gb"] > 8.0  # 8 GB and AdamW's moments of the LoRA weights
    assert "micro_batch: 4\n" in (tmp_path / "run_config.yaml").read_text()  # a rerun gets the number chosen


def test_trainer_takes_probed_size_and_logs_peak(tmp_path, monkeypatch):
    from ddp_ft.integrations.callbacks import ExpectedPeakCallback
    from ddp_ft.integrations.recipe import build_trainer

    _fake_cuda(monkeypatch, 4 * GB, GB, 10 * GB)
    settings = settings_from_preset("tiny", micro_batch="auto", output_dir=str(tmp_path), report_to="none")
    from ddp_ft.training.resolve import resolve_run

    resolved = resolve_run(settings, DistInfo())  # as the recipe's _train does first: the first guess, 1
    assert resolved.micro_batch == 1 and resolved.probe_pending
    trainer = build_trainer(settings, DistInfo(), resolved=resolved)
    assert (trainer.resolved.micro_batch, trainer.resolved.accumulation) == (4, 2)  # what run_config.yaml records
    assert settings.train.micro_batch == "auto"  # the settings as parsed
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 2)
    first = trainer.callback_handler.callbacks[0]
    assert isinstance(first, ExpectedPeakCallback) and first.expected_peak_gb > 8.0
    logs = {"loss": 1.0}
    first.on_log(trainer.args, trainer.state, trainer.control, logs=logs)
    assert logs["expected_peak_gb"] == first.expected_peak_gb


class _CountingProfiler:
    """An idle device (busy 20%) that counts the steps it was asked to measure."""

    def __init__(self):
        self.starts = 0

    def start(self):
        self.starts += 1

    def stop(self):
        from ddp_ft.training.perf_traps.idle import StepUsage

        return StepUsage(0.2, 2 * GB, 3 * GB, 80 * GB)


def _profiled(monkeypatch) -> _CountingProfiler:
    import ddp_ft.training.perf_traps.idle as idle

    profiler = _CountingProfiler()
    monkeypatch.setattr(idle, "step_profiler", lambda device: profiler)
    return profiler


def test_loop_profiles_no_step_probe_sized(tmp_path, monkeypatch):
    """The probe already sized the micro-batch, so the idle check's profiled step would only slow the run.
    A fixed micro-batch is profiled (tests/integrations/test_perf_traps.py)."""
    from ddp_ft.training.loop import train

    _fake_cuda(monkeypatch, 4 * GB, GB, 10 * GB)
    profiler = _profiled(monkeypatch)
    settings = settings_from_preset("tiny", micro_batch="auto", output_dir=str(tmp_path), max_steps=4)
    train(settings, DistInfo())
    assert profiler.starts == 0


def test_trainer_profiles_no_step_probe_sized(tmp_path, monkeypatch):
    from ddp_ft.integrations.recipe import build_trainer
    from ddp_ft.training.resolve import resolve_run

    _fake_cuda(monkeypatch, 4 * GB, GB, 10 * GB)
    profiler = _profiled(monkeypatch)
    settings = settings_from_preset(
        "tiny", micro_batch="auto", output_dir=str(tmp_path), report_to="none", max_steps=4, save_every=0
    )
    trainer = build_trainer(settings, DistInfo(), resolved=resolve_run(settings, DistInfo()))
    trainer.train()
    assert trainer.state.global_step == 4 and profiler.starts == 0
