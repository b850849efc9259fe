"""``--micro-batch auto``: the largest micro-batch whose expected peak fits the device, the effective batch unchanged.

Pure arithmetic (``ddp_ft.training.model.memory.auto_micro_batch``), the settings that accept ``auto``, and its
resolution in ``ddp_ft.training.resolve`` with the device memory given (no GPU here, no process group).
"""

import dataclasses
import logging

import pytest

from ddp_ft.distributed import DistInfo
from ddp_ft.training.batch import gradient_accumulation_steps
from ddp_ft.training.config import parse_settings, settings_from_preset
from ddp_ft.training.model.memory import AUTO_MARGIN, QWEN3_4B, MicroBatchChoice, auto_micro_batch, estimate

GB = 10**9

# Expected peaks of Qwen3-4B (bf16, kept layout, r=16), GB, by micro-batch: at 512 tokens 1: 4.281, 2: 5.314,
# 4: 7.380, 8: 11.513, 16: 19.777; at 2048 tokens 1: 7.381, 2: 11.513, 4: 19.778, 8: 36.308, 16: 69.367.
# Budgets with the 15% margin: 16 GB -> 13.6, 24 GB -> 20.4, 80 GB -> 68.0.
CASES = [
    # seq_len, world_size, device GB, micro-batch
    (512, 1, 16, 8),  # 16 would need 19.8 GB
    (512, 1, 24, 16),  # all of the effective batch in one forward
    (512, 1, 80, 16),
    (512, 2, 16, 8),  # 8 per rank is the most the effective batch allows
    (512, 2, 80, 8),
    (2048, 1, 16, 2),  # 4 would need 19.8 GB
    (2048, 1, 24, 4),  # 8 would need 36.3 GB
    (2048, 1, 80, 8),  # 16 would need 69.4 GB of a 68.0 GB budget
    (2048, 2, 16, 2),
    (2048, 2, 24, 4),
    (2048, 2, 80, 8),
]


@pytest.mark.parametrize("seq_len,world_size,device_gb,micro_batch", CASES)
def test_largest_fitting_keeping_the_effective_batch(seq_len, world_size, device_gb, micro_batch):
    choice = auto_micro_batch(QWEN3_4B, seq_len, 16, world_size, device_gb * GB)
    assert choice.micro_batch == micro_batch
    assert choice.micro_batch * choice.accumulation * world_size == 16
    assert choice.accumulation == gradient_accumulation_steps(16, choice.micro_batch, world_size)
    assert choice.expected_peak == estimate(QWEN3_4B, seq_len, micro_batch).peak <= choice.budget
    assert choice.budget == int(device_gb * GB * (1 - AUTO_MARGIN))


def test_only_divisors_of_per_rank_batch_are_chosen():
    # Effective batch 12 on one rank: 5 fits 13.6 GB at 512 tokens (9.4 GB) and so would 6 (10.5), but 8 does not
    # divide 12; the candidates are 1, 2, 3, 4, 6, 12.
    choice = auto_micro_batch(QWEN3_4B, 512, 12, 1, 16 * GB)
    assert (choice.micro_batch, choice.accumulation) == (6, 2)
    assert estimate(QWEN3_4B, 512, 12).peak > choice.budget
    # Effective batch 10 on 2 ranks: 5 per rank, divisors 1 and 5; 5 does not fit 8 GB, so 1, not 2.
    assert auto_micro_batch(QWEN3_4B, 512, 10, 2, 8 * GB).micro_batch == 1


def test_budget_is_device_less_margin_to_the_byte():
    peak = estimate(QWEN3_4B, 512, 4).peak
    exact = auto_micro_batch(QWEN3_4B, 512, 16, 1, peak, margin=0.0)
    assert (exact.micro_batch, exact.expected_peak, exact.budget) == (4, peak, peak)
    assert auto_micro_batch(QWEN3_4B, 512, 16, 1, peak - 1, margin=0.0).micro_batch == 2
    device = -(-peak * 10 // 9)  # the smallest device whose 10% margin leaves the peak
    assert auto_micro_batch(QWEN3_4B, 512, 16, 1, device, margin=0.1).micro_batch == 4
    assert auto_micro_batch(QWEN3_4B, 512, 16, 1, device - 2, margin=0.1).micro_batch == 2


@pytest.mark.parametrize("seq_len,world_size,smallest_gb", [(512, 1, 5.5), (2048, 1, 9), (2048, 2, 9)])
def test_more_memory_never_chooses_a_smaller_one(seq_len, world_size, smallest_gb):
    sizes = [smallest_gb + half / 2 for half in range(240)]  # every half GB up to about 120 GB
    chosen = [auto_micro_batch(QWEN3_4B, seq_len, 16, world_size, int(gb * GB)).micro_batch for gb in sizes]
    assert chosen == sorted(chosen)
    assert chosen[0] == 1 and chosen[-1] == 16 // world_size  # spans the whole range


def test_run_settings_change_the_estimate():
    # peft's float32 layout (upcast) and a larger rank need more memory: a smaller micro-batch on the same device.
    kept = auto_micro_batch(QWEN3_4B, 512, 16, 1, 16 * GB)
    upcast = auto_micro_batch(QWEN3_4B, 512, 16, 1, 16 * GB, upcast_frozen_weights=True)
    assert upcast.expected_peak == estimate(QWEN3_4B, 512, upcast.micro_batch, upcast_frozen_weights=True).peak
    assert upcast.micro_batch < kept.micro_batch
    fp32 = auto_micro_batch(QWEN3_4B, 512, 16, 1, 16 * GB, compute_dtype="float32")
    assert fp32.expected_peak == estimate(QWEN3_4B, 512, fp32.micro_batch, compute_dtype="float32").peak


def test_1_not_fitting_is_refused_naming_the_numbers():
    with pytest.raises(ValueError) as error:
        auto_micro_batch(QWEN3_4B, 2048, 16, 1, 8 * GB)
    message = str(error.value)
    assert "--micro-batch auto" in message and "micro-batch 1 does not fit" in message
    assert "7.381 GB" in message and "6.800 GB" in message and "--max-seq-len" in message
    with pytest.raises(ValueError, match=r"effective_batch=15 is not divisible by micro_batch=1 x world_size=2"):
        auto_micro_batch(QWEN3_4B, 512, 15, 2, 80 * GB)  # the one divisibility check (ddp_ft.training.batch)


def test_describe_is_one_line_with_choice_and_peak():
    text = MicroBatchChoice(4, 2, 2, 7_380_000_000, 20_400_000_000, 24 * GB).describe()
    assert "\n" not in text
    assert text.startswith("--micro-batch auto: 4 (x 2 accumulation x 2 rank(s) = effective batch 16)")
    assert "expected peak 7.380 GB of a 20.400 GB budget (24.000 GB device)" in text


# The setting: "auto" on the command line and in config files, anything else refused naming micro_batch.


def test_takes_a_number_or_auto_from_flags_and_files(tmp_path, capsys):
    assert parse_settings(["--preset", "tiny", "--micro-batch", "auto"]).train.micro_batch == "auto"
    assert parse_settings(["--preset", "tiny", "--micro_batch", "4"]).train.micro_batch == 4
    config = tmp_path / "run.yaml"
    config.write_text("preset: tiny\ntrain:\n  micro_batch: auto\n")
    assert parse_settings(["--config", str(config)]).train.micro_batch == "auto"
    assert settings_from_preset("tiny", micro_batch="auto").train.micro_batch == "auto"
    with pytest.raises(SystemExit):
        parse_settings(["--micro-batch", "big"])
    err = capsys.readouterr().err
    assert "--micro-batch" in err and "'big' is neither a whole number of samples nor 'auto'" in err
    config.write_text("micro_batch: big\n")
    with pytest.raises(SystemExit):
        parse_settings(["--config", str(config)])
    err = capsys.readouterr().err
    assert "run.yaml: micro_batch: 'big' is a str; micro_batch takes a int or 'auto'" in err
    with pytest.raises(ValueError, match=r"micro_batch='big': must be a whole number >= 1 or 'auto'"):
        settings_from_preset("tiny", micro_batch="big")
    with pytest.raises(ValueError, match=r"micro_batch=0: must be >= 1"):
        settings_from_preset("tiny", micro_batch=0)


# Resolution, where both entry points pass first (ddp_ft.training.resolve.resolve_run).


def test_cpu_is_1_with_effective_batch_kept_up_front():
    """The CPU has no GPU memory to fill: auto (the default) keeps the CPU's micro-batch 1 there, accumulation
    following from the effective batch, resolved before the data or the model."""
    from ddp_ft.training.resolve import resolve_run

    settings = settings_from_preset("tiny", micro_batch="auto")
    resolved = resolve_run(settings, DistInfo())
    assert (resolved.micro_batch, resolved.accumulation) == (1, settings.train.effective_batch)
    assert not resolved.probe_pending and resolved.micro_batch_why.startswith("auto on cpu")


def test_resolution_reads_model_config_logs_choice(tmp_path, caplog):
    from ddp_ft.training.model.qlora import build_tiny_qwen3
    from ddp_ft.training.resolve import resolve_micro_batch

    folder = build_tiny_qwen3(tmp_path / "tiny", vocab_size=1000)
    settings = settings_from_preset("tiny", micro_batch="auto", model_name_or_path=str(folder), effective_batch=8)
    with caplog.at_level(logging.INFO, logger="ddp_ft.training.resolve"):
        choice = resolve_micro_batch(settings, DistInfo(world_size=2), device_bytes=GB)
    assert (choice.micro_batch, choice.accumulation) == (4, 1)  # a few MB of model: all of the batch per forward
    assert choice.describe() in caplog.text
    # the same shape as the folder's config.json, seen through the budget: 1 fits, 2 does not
    from transformers import AutoConfig

    from ddp_ft.training.model.memory import Qwen3Shape

    shape = Qwen3Shape.from_config(AutoConfig.from_pretrained(folder))
    seq = settings.data.max_seq_len
    one, two = (
        estimate(shape, seq, m, compute_dtype=settings.model.precision(DistInfo().device).name).peak for m in (1, 2)
    )
    tight = resolve_micro_batch(settings, DistInfo(world_size=2), device_bytes=int((one + two) / 2 / (1 - AUTO_MARGIN)))
    assert tight.micro_batch == 1
    with caplog.at_level(logging.INFO, logger="ddp_ft.training.resolve"):
        caplog.clear()
        resolve_micro_batch(settings, DistInfo(rank=1, world_size=2), device_bytes=GB)
    assert "--micro-batch auto" not in caplog.text  # rank 0 only


def test_guess_reads_the_widest_micro_batch():
    """The arithmetic guess sizes micro-batches 104 tokens wide at --max-seq-len 100: widths are a multiple of 8."""
    from ddp_ft.training.resolve import resolve_micro_batch

    settings = settings_from_preset("tiny", micro_batch="auto", max_seq_len=100, effective_batch=16)
    choice = resolve_micro_batch(settings, DistInfo(), shape=QWEN3_4B, device_bytes=80 * GB)
    dtype = settings.model.precision(DistInfo().device).name
    assert choice.expected_peak == estimate(QWEN3_4B, 104, choice.micro_batch, compute_dtype=dtype).peak


def test_resolve_run_makes_an_int_settings_untouched(monkeypatch):
    import ddp_ft.training.resolve as resolve

    chosen = MicroBatchChoice(2, 2, 2, 1, 2, 3)
    monkeypatch.setattr(resolve, "resolve_micro_batch", lambda settings, info: chosen)
    on_a_gpu = resolve.DeviceDefaults(False, "off", "auto", "auto")  # auto left for the arithmetic, as on a GPU
    monkeypatch.setattr(resolve, "resolve_device_defaults", lambda settings, info: on_a_gpu)
    settings = settings_from_preset("tiny", micro_batch="auto")  # effective batch 8
    resolved = resolve.resolve_run(settings, DistInfo(world_size=2))
    assert resolved.micro_batch == 2 and isinstance(resolved.micro_batch, int)
    assert resolved.accumulation == 2 and resolved.probe_pending  # a first guess: the probe on the model decides
    assert resolved.micro_batch_why == chosen.describe()
    assert settings.train.micro_batch == "auto"  # the user's settings are never written to
    assert resolved.as_config()["train"] == {"micro_batch": 2}  # run_config.yaml records the number
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen: a later step makes a new value
        resolved.micro_batch = 4
