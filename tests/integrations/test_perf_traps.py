"""Performance traps in a user's own script (``ddp_ft.training.perf_traps``): warned once, on rank 0, with the fix.

4-bit layers left at BitsAndBytesConfig's float32 compute dtype in a bf16 run, and a device idle for most of a step
while a larger micro-batch would fit. The device is measured on CUDA only: here a fake profiler stands in for it (the
module's ``step_profiler``), and without one nothing is measured on the CPU.
"""

import pytest
import torch
from torch import nn

import ddp_ft.training.perf_traps.idle as idle
from ddp_ft.training.perf_traps import (
    StepUsage,
    accelerate_fix,
    busy_ns,
    check_4bit_compute_dtype,
    command_line_fix,
    larger_micro_batch,
    watch_idle_device,
)

from ..helpers.dist_harness import run_distributed
from ..helpers.trainers import as_accelerate_rank
from .test_user_traps import _Records

GB = 10**9
_REAL_PROFILER = idle.step_profiler
DTYPE_FIX = "bnb_4bit_compute_dtype=torch.bfloat16"


class _FakeProfiler:
    """A device busy ``busy`` of the step, 2 GB resident, 3 GB peak, 80 GB in all."""

    def __init__(self, busy: float):
        self.busy, self.starts, self.running = busy, 0, False

    def start(self):
        self.starts, self.running = self.starts + 1, True

    def stop(self):
        self.running = False
        return StepUsage(self.busy, 2 * GB, 3 * GB, 80 * GB)


def _fake_device(busy: float | None) -> None:
    """This process's steps measured by a fake profiler (None: the real choice, which measures nothing on a CPU)."""
    idle.step_profiler = (lambda device: _FakeProfiler(busy)) if busy is not None else _REAL_PROFILER


def _ours(messages: list[str]) -> dict[str, list[str]]:
    return {
        "dtype": [m for m in messages if "bnb_4bit_compute_dtype" in m],
        "idle": [m for m in messages if "the device was busy" in m],
    }


# ---------------------------------------------------------------- the rules, in process


def test_busy_time_is_union_of_kernel_intervals():
    assert busy_ns([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert busy_ns([]) == 0


def test_micro_batch_advised_only_idle_with_memory():
    idle = StepUsage(0.2, 2 * GB, 3 * GB, 80 * GB)  # 0.5 GB per sample at micro-batch 2
    advice = larger_micro_batch(idle, micro_batch=2, accumulation=8)
    assert (advice.micro_batch, advice.accumulation, advice.keeps_effective_batch) == (16, 1, True)
    assert advice.expected_peak == 10 * GB and advice.gain == pytest.approx(5.0)  # min(16 / 2, 1 / 0.2)
    assert larger_micro_batch(StepUsage(0.6, 2 * GB, 3 * GB, 80 * GB), 2, 8) is None  # busy enough
    tight = StepUsage(0.2, 2 * GB, 3 * GB, 4 * GB)  # 3.4 GB budget: micro-batch 2 (3 GB) is all that fits
    assert larger_micro_batch(tight, 2, 8) is None
    grows = larger_micro_batch(idle, micro_batch=2, accumulation=1)  # no accumulation left to trade
    assert not grows.keeps_effective_batch and grows.accumulation == 1 and grows.micro_batch > 2


def _linear4bit(compute_dtype):
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit(16, 16, compute_dtype=compute_dtype)


class _FourBitLM(nn.Module):
    """Embeddings in ``stream`` dtype, one 4-bit layer, one trainable layer."""

    def __init__(self, compute_dtype, stream=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(8, 16).to(stream).requires_grad_(False)
        self.proj = _linear4bit(compute_dtype)
        self.adapter = nn.Linear(16, 16)

    def get_input_embeddings(self):
        return self.embed


def test_4bit_dtype_warns_fp32_in_half_run_or_bf16_gpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    f32, bf16 = torch.float32, torch.bfloat16

    def check(model, mixed, device=cpu, capability=None):
        return check_4bit_compute_dtype(model, mixed, device, False, capability)

    assert DTYPE_FIX in check(_FourBitLM(f32), "bf16")
    assert check(_FourBitLM(bf16), "bf16") is None
    assert check(_FourBitLM(f32), "no") is None  # float32 throughout on a CPU: the user's plain choice
    assert "bf16=True" in check(_FourBitLM(f32), "no", gpu, (8, 0))  # a GPU with bf16 tensor cores
    assert check(_FourBitLM(f32), "no", gpu, (7, 5)) is None  # a T4: no native bf16
    assert DTYPE_FIX in check(_FourBitLM(None), "bf16")  # None: takes the float32 stream's dtype
    assert check(_FourBitLM(None, stream=bf16), "no") is None  # None in a bf16 model: computes in bf16
    assert DTYPE_FIX in check(_FourBitLM(f32, stream=bf16), "no")  # a bf16 model left at the default
    assert "torch.float16" in check(_FourBitLM(f32), "fp16")


def test_dtype_warning_names_trl_cast_and_cli_flag():
    """TRL's SFTTrainer casts a 4-bit model's adapters to bfloat16 in a float32 run: the warning says so, and to a
    ddp-ft user it names --compute-dtype, not a BitsAndBytesConfig they never wrote."""
    model = _FourBitLM(torch.float32)
    model.adapter.to(torch.bfloat16)
    script = check_4bit_compute_dtype(model, "no", torch.device("cpu"), False)
    assert "the trained weights are in bfloat16 (TRL's SFTTrainer casts" in script and DTYPE_FIX in script
    command = check_4bit_compute_dtype(model, "no", torch.device("cpu"), False, fix=command_line_fix)
    assert "Pass --compute-dtype bfloat16" in command and "BitsAndBytesConfig" not in command


def test_cpu_measures_nothing_without_fake_device():
    assert watch_idle_device(nn.Linear(2, 2), torch.device("cpu"), True, str) is None


def test_only_whole_steps_measured_no_profiler_between(monkeypatch):
    """The measurement starts at the first training forward after step 3 (an evaluation between steps starts nothing),
    an evaluation inside the step drops it, the next step is measured; then the hooks go."""
    fake = _FakeProfiler(0.2)
    monkeypatch.setattr(idle, "step_profiler", lambda device: fake)
    records = _Records()
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch_idle_device(model, torch.device("cpu"), True, accelerate_fix)

    def step(evaluate_inside: bool = False):
        for micro in range(2):
            model(torch.ones(3, 4)).sum().backward()
            if evaluate_inside and micro == 0:
                with torch.no_grad():
                    model(torch.ones(5, 4))
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
        with torch.no_grad():
            model(torch.ones(5, 4))  # an evaluation between steps
    assert fake.starts == 0
    step(evaluate_inside=True)
    assert fake.starts == 1 and not fake.running and records.messages == []
    step()
    assert fake.starts == 2 and not fake.running
    assert len(records.messages) == 1 and "optimizer step 5 (2 micro-batch(es) of 3" in records.messages[0]
    model(torch.ones(1, 4))
    assert not model._forward_pre_hooks


# ---------------------------------------------------------------- users' scripts, 2 ranks


def _qlora(model_path: str, compute_dtype: torch.dtype | None):
    """The user's QLoRA model: BitsAndBytesConfig with or without a compute dtype, peft's k-bit preparation."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = {} if compute_dtype is None else {"bnb_4bit_compute_dtype": compute_dtype}
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", **dtype)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quantization, device_map={"": "cpu"})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(prepare_model_for_kbit_training(base), lora)


def _rows(vocab: int, n: int, seq: int = 8) -> list[torch.Tensor]:
    return list(torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(0)))


def _accelerate_script(model_path, compute_dtype, mixed_precision, busy):
    """An Accelerate loop: micro-batch 2, accumulation 2, 4 optimizer steps; the model prepared twice."""
    from accelerate.state import AcceleratorState, GradientState

    from ddp_ft.integrations import BucketedAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    records = _Records()
    _fake_device(busy)
    accelerator = BucketedAccelerator(cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=2)
    model = _qlora(model_path, compute_dtype)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    accelerator.prepare(model)  # again (as after an evaluation): no second warning
    rows = torch.stack(_rows(model.config.vocab_size, 16))
    for micro in range(8):
        with accelerator.accumulate(wrapped):
            batch = rows[2 * micro : 2 * micro + 2]
            accelerator.backward(wrapped(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    return _ours(records.messages)


def _trainer_script(model_path, compute_dtype, bf16, busy, out):
    """A BucketedTrainer script: micro-batch 2, accumulation 2, 4 optimizer steps."""
    from accelerate.state import AcceleratorState, GradientState
    from datasets import Dataset
    from transformers import TrainingArguments, default_data_collator

    from ddp_ft.integrations import BucketedTrainer

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    records = _Records()
    _fake_device(busy)
    model = _qlora(model_path, compute_dtype)
    rows = [r.tolist() for r in _rows(model.config.vocab_size, 32)]
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        bf16=bf16,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    train_set = Dataset.from_dict({"input_ids": rows, "labels": rows})
    BucketedTrainer(model=model, args=args, train_dataset=train_set, data_collator=default_data_collator).train()
    return _ours(records.messages)


def _scripts(rank, world_size, out):
    from ddp_ft.embedded import tiny_qwen3_and_meetings

    as_accelerate_rank(rank, world_size)
    model_path = tiny_qwen3_and_meetings(n_meetings=1).model_path
    return {
        "accelerate, default dtype, bf16, idle": _accelerate_script(model_path, None, "bf16", 0.2),
        "accelerate, bf16 dtype, bf16, busy": _accelerate_script(model_path, torch.bfloat16, "bf16", 0.9),
        "accelerate, default dtype, fp32, cpu": _accelerate_script(model_path, None, "no", None),
        "trainer, default dtype, bf16, idle": _trainer_script(model_path, None, True, 0.2, f"{out}/bad"),
        "trainer, bf16 dtype, bf16, busy": _trainer_script(model_path, torch.bfloat16, True, 0.9, f"{out}/good"),
    }


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """Each script's warnings of the two traps on each rank: {script: [rank 0's, rank 1's]}."""
    per_rank = run_distributed(_scripts, str(tmp_path_factory.mktemp("trainer")))
    return {name: [ranks[name] for ranks in per_rank] for name in per_rank[0]}


@pytest.mark.distributed
def test_4bit_fp32_compute_in_bf16_run_warned_once(scripts):
    """BitsAndBytesConfig(load_in_4bit=True) with Accelerator(mixed_precision="bf16") or TrainingArguments(bf16=True):
    one warning on rank 0 at prepare (the model prepared twice), naming the compute dtype to load with; none on rank
    1. A bf16 compute dtype in a bf16 run, and float32 throughout on the CPU, are silent."""
    for name in ("accelerate, default dtype, bf16, idle", "trainer, default dtype, bf16, idle"):
        (rank0, rank1) = scripts[name]
        assert len(rank0["dtype"]) == 1 and rank1["dtype"] == [], (name, rank0, rank1)
        assert DTYPE_FIX in rank0["dtype"][0] and "mixed_precision='bf16'" in rank0["dtype"][0]
    for name in ("accelerate, bf16 dtype, bf16, busy", "accelerate, default dtype, fp32, cpu"):
        assert [ranks["dtype"] for ranks in scripts[name]] == [[], []], name
    assert [ranks["dtype"] for ranks in scripts["trainer, bf16 dtype, bf16, busy"]] == [[], []]


@pytest.mark.distributed
def test_idle_device_warned_once_naming_its_setting(scripts):
    """A step measured 20% busy at micro-batch 2 x 2, 0.5 GB per sample, 80 GB device: micro-batch 4 x 1 fits, up to
    2x; said once on rank 0 in the entry point's own terms (the DataLoader's batch_size, per_device_train_batch_size).
    A busy device, and a CPU run with no fake device, are silent."""
    (rank0, rank1) = scripts["accelerate, default dtype, bf16, idle"]
    assert len(rank0["idle"]) == 1 and rank1["idle"] == [], (rank0, rank1)
    assert "busy 20% of optimizer step 4 (2 micro-batch(es) of 2" in rank0["idle"][0]
    assert "Micro-batch 4 x 1 would fit" in rank0["idle"][0] and "up to 2.0x" in rank0["idle"][0]
    assert "batch_size=4" in rank0["idle"][0] and "gradient_accumulation_steps=1" in rank0["idle"][0]
    (rank0, rank1) = scripts["trainer, default dtype, bf16, idle"]
    assert len(rank0["idle"]) == 1 and rank1["idle"] == [], (rank0, rank1)
    assert "per_device_train_batch_size=4, gradient_accumulation_steps=1" in rank0["idle"][0]
    for name in ("accelerate, bf16 dtype, bf16, busy", "accelerate, default dtype, fp32, cpu"):
        assert [ranks["idle"] for ranks in scripts[name]] == [[], []], name
    assert [ranks["idle"] for ranks in scripts["trainer, bf16 dtype, bf16, busy"]] == [[], []]


def test_plain_loop_warns_idle_naming_micro_batch_auto(tmp_path, monkeypatch):
    """ddp_ft's own loop (tiny preset: micro-batch 2 x accumulation 4) on a fake idle device, one process."""
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training.config import settings_from_preset
    from ddp_ft.training.loop import train

    records = _Records()
    monkeypatch.setattr(idle, "step_profiler", lambda device: _FakeProfiler(0.2))
    settings = settings_from_preset(
        "tiny", output_dir=str(tmp_path / "run"), max_steps=4, num_synthetic=40, eval_fraction=0.0, max_seq_len=128
    )
    train(settings, DistInfo())
    warned = _ours(records.messages)["idle"]
    assert len(warned) == 1 and "(4 micro-batch(es) of 2" in warned[0], records.messages
    assert "Micro-batch 8 x 1 would fit" in warned[0] and "--micro-batch auto" in warned[0]
