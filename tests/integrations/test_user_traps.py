"""The traps ddp_ft removes from its own entry points, caught when a user's own loop makes them.

A model split over devices, two ranks on one GPU, a step after backward passes that all ran under ``no_sync``, an
accumulation loop without ``no_sync``, ``find_unused_parameters=True`` with nothing unused, reentrant checkpointing
that starves the adapters: each stops with an error naming the fix, or, where the run stays correct but slow, warns
once with what it costs. Real gloo processes where communication is involved.
"""

import logging
import weakref
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddp_ft.ddp import BucketedDDP
from ddp_ft.ddp.placement import device_identity, model_device, shared_device

from ..helpers.dist_harness import gather_tensors, run_distributed
from ..helpers.models import Net, local_slice, make_batch
from ..helpers.trainers import as_accelerate_rank

# ---------------------------------------------------------------- placement


def _split_model(rank, world_size):
    model = Net()
    model.frozen.to("meta")  # offloaded, as device_map="auto" leaves layers that do not fit
    with pytest.raises(RuntimeError) as error:
        BucketedDDP(model)
    return str(error.value)


@pytest.mark.distributed
def test_spread_model_refused_naming_device_map():
    for message in run_distributed(_split_model):
        assert "spread over 2 devices" in message and "meta" in message and "device_map={'': local_rank}" in message


class _FakeParams(nn.Module):
    def __init__(self, *devices: str):
        super().__init__()
        self._devices = devices

    def named_parameters(self, *args, **kwargs):
        return [(f"p{i}", SimpleNamespace(device=torch.device(d))) for i, d in enumerate(self._devices)]


def test_other_ranks_gpu_refused_naming_set_device(monkeypatch):
    """Every process's model on cuda:0 while this process's device is cuda:1 (the script never chose a device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with pytest.raises(RuntimeError, match=r"on cuda:0 but this process's device is cuda:1.*set_device"):
        model_device(_FakeParams("cuda:0", "cuda:0"))
    assert model_device(_FakeParams("cuda:1")) == torch.device("cuda:1")
    with pytest.raises(RuntimeError, match=r"spread over 2 devices: cuda:0 .*cuda:1"):
        model_device(_FakeParams("cuda:0", "cuda:1"))  # device_map="auto" over two GPUs


def test_ranks_seeing_own_gpu_as_cuda0_not_shared(monkeypatch):
    """Under SLURM's --gpus-per-task=1 every rank calls its own GPU cuda:0: the physical GPU decides."""
    from types import SimpleNamespace

    uuids = iter(["aaaa", "bbbb", "aaaa"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=next(uuids)))
    ranks = [device_identity(torch.device("cuda", 0)) for _ in range(2)]
    assert shared_device(ranks) is None
    assert shared_device([*ranks, device_identity(torch.device("cuda", 0))]) == (0, 2, f"GPU-aaaa of {ranks[0][0]}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace())  # no UUID read
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert device_identity(torch.device("cuda", 1))[1] == "GPU 5"


def test_2_ranks_on_1_gpu_found_cpu_ranks_not():
    assert shared_device([("a", "cuda:0"), ("a", "cuda:1"), ("a", "cuda:0")]) == (0, 2, "cuda:0 of a")
    assert shared_device([("a", "cuda:0"), ("b", "cuda:0")]) is None  # two hosts
    assert shared_device([None, None]) is None  # CPU processes share the machine by design


# ---------------------------------------------------------------- the loop around the optimizer


class _Records(logging.Handler):
    """ddp_ft's warnings from now on, in place of whatever handler an earlier run in this process left."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        library = logging.getLogger("ddp_ft")
        for handler in list(library.handlers):
            library.removeHandler(handler)
        library.addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


def _loop(rank, world_size, mistake):
    records = _Records()
    torch.manual_seed(0)
    model = BucketedDDP(Net(), find_unused_parameters=mistake == "find_unused")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = local_slice(rank, world_size)
    before = [p.detach().clone() for p in model.parameters()]
    error = None
    for step in range(4):
        x, y = make_batch(step)
        try:
            for micro in range(2):  # accumulation 2
                quiet = model.no_sync() if micro == 0 or mistake == "never_synced" else nullcontext()
                if mistake == "no_no_sync":
                    quiet = nullcontext()
                with quiet:
                    half = slice(local.start + micro * 2, local.start + micro * 2 + 2)
                    nn.functional.mse_loss(model(x[half]), y[half]).backward()
            optimizer.step()
        except RuntimeError as raised:
            error = str(raised)
            break
        optimizer.zero_grad()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    copies = gather_tensors(list(model.parameters()))
    same = all(torch.equal(a, b) for a, b in zip(copies[0], copies[1], strict=True))
    return records.messages, error, unchanged, same, len(model.bucket_sizes)


def _loops(rank, world_size, mistakes):
    """Each loop in turn in the same 2 processes (a fresh model and logger handler each)."""
    return {mistake: _loop(rank, world_size, mistake) for mistake in mistakes}


@pytest.fixture(scope="module")
def loops():
    """Every rank's result of each loop: {mistake: [rank 0's, rank 1's]}."""
    mistakes = ("none", "never_synced", "no_no_sync", "find_unused")
    per_rank = run_distributed(_loops, mistakes)
    return {mistake: [ranks[mistake] for ranks in per_rank] for mistake in mistakes}


@pytest.mark.distributed
def test_accumulation_loop_checked_each_optimizer_step(loops):
    """Per optimizer step: a step after backwards that all ran under no_sync is an error before the step (the
    gradients were never averaged; parameters untouched, on every rank); a loop without no_sync warns once on rank
    0 with the all-reduces it wastes; the correct loop is silent."""
    results = loops
    for messages, error, _, same, _ in results["none"]:
        assert messages == [] and error is None and same
    for _, error, unchanged, _, _ in results["never_synced"]:
        assert error is not None and "all ran under no_sync()" in error and "accumulate" in error, error
        assert unchanged, "the step ran on gradients that were never averaged"
    (warnings, error, _, same, buckets), (others, _, _, _, _) = results["no_no_sync"]
    assert error is None and same and others == []  # correct, and only rank 0 speaks
    assert len(warnings) == 1, warnings
    assert f"2 synced backward passes per optimizer step: 1 x {buckets} all-reduces" in warnings[0]
    assert "no_sync" in warnings[0]


@pytest.mark.distributed
def test_needless_find_unused_warns_once_with_cost(loops):
    (warnings, error, _, same, _), (others, *_) = loops["find_unused"]
    assert error is None and same and others == []
    assert len(warnings) == 1 and "find_unused_parameters=True" in warnings[0] and "=False" in warnings[0], warnings


# ---------------------------------------------------------------- reentrant checkpointing on a frozen base


def _lora_qwen3(reentrant: bool, input_grads: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    from ddp_ft.training.model.qlora import tiny_qwen3_config

    torch.manual_seed(0)
    base = Qwen3ForCausalLM(tiny_qwen3_config(64))
    base.requires_grad_(False)
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    if not input_grads:  # transformers and peft each register the hook; a user's code can take them away
        for hook in list(base.get_input_embeddings()._forward_hooks):
            base.get_input_embeddings()._forward_hooks.pop(hook)
    return model


def _prepare_checkpointed(rank, world_size):
    as_accelerate_rank(rank, world_size)
    from ddp_ft.integrations import BucketedAccelerator

    accelerator = BucketedAccelerator(cpu=True)
    with pytest.raises(ValueError) as error:
        accelerator.prepare(_lora_qwen3(reentrant=True, input_grads=False))
    wrapped = [type(accelerator.prepare(_lora_qwen3(r, g))).__name__ for r, g in ((True, True), (False, False))]
    return str(error.value), wrapped


@pytest.mark.distributed
def test_starving_reentrant_ckpt_refused_naming_fix():
    """Reentrant checkpointing on a frozen base with input grads disabled: the LoRA weights of every checkpointed
    layer would get no gradient. `prepare` refuses, naming enable_input_require_grads; with the input-grad hook, or
    non-reentrant, it wraps."""
    for message, wrapped in run_distributed(_prepare_checkpointed):
        assert "enable_input_require_grads()" in message and "use_reentrant': False" in message, message
        assert wrapped == ["BucketedDDP", "BucketedDDP"]


# ---------------------------------------------------------------- the data side


class _Rows(torch.utils.data.Dataset):
    """16 (x, y) rows; each read takes ``delay_s`` (a slow decode or tokenization on the fly)."""

    def __init__(self, delay_s: float = 0.0):
        self.x, self.y = make_batch(0, global_batch=16)
        self.delay_s = delay_s

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def _epoch_runs(rank, world_size, runs):
    return [_epochs(rank, world_size, *run) for run in runs]


def _epochs(rank, world_size, set_epoch, delay_s):
    from torch.utils.data import DataLoader, DistributedSampler

    records = _Records()
    torch.manual_seed(0)
    model = BucketedDDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dead = [weakref.proxy(_Rows())]  # a weak proxy whose referent is gone: the watch's scan must step around it
    sampler = DistributedSampler(_Rows(delay_s), shuffle=True, seed=0)
    loader = DataLoader(sampler.dataset, batch_size=2, sampler=sampler)  # 4 steps per epoch on each of 2 ranks
    for epoch in range(3):
        if set_epoch:
            sampler.set_epoch(epoch)
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert len(dead) == 1
    return records.messages


@pytest.mark.distributed
def test_stale_sampler_epoch_and_data_wait_warned_once():
    """A DistributedSampler without set_epoch repeats the first epoch's order: warned once, on rank 0, when its
    second pass starts. Rows that take 30 ms each to read make the host wait between optimizer.step() and the next
    forward for most of each step: warned once with the share and num_workers. The same loop with set_epoch and
    fast rows is silent. A dead weak proxy on the heap does not break the scan for samplers (it did, in CI)."""
    rank0, rank1 = run_distributed(_epoch_runs, [(True, 0.0), (False, 0.0), (True, 0.03)])
    (quiet, forgot, slow), other_rank = rank0, rank1[1]
    assert quiet == []
    assert other_rank == [] and len(forgot) == 1, forgot
    assert "set_epoch(epoch)" in forgot[0] and "its epoch still 0" in forgot[0] and "more than its 8" in forgot[0]
    assert len(slow) == 1 and "passes between optimizer.step() and the next forward" in slow[0], slow
    assert "num_workers in this process: [0]" in slow[0], slow


# ---------------------------------------------------------------- 4-bit weights and evaluation


def _trainer_steps(rank, world_size, out, evaluate: bool):
    as_accelerate_rank(rank, world_size)
    from ddp_ft.distributed import DistInfo
    from ddp_ft.integrations import BucketedTrainer
    from ddp_ft.training.model.qlora import EMBEDDED_MODEL
    from ddp_ft.training.setup import resolve_model_and_tokenizer

    from ..helpers.trainers import collate_tokens, gloo_trainer_args, token_rows, user_qlora_model

    model_dir, _ = resolve_model_and_tokenizer(EMBEDDED_MODEL, DistInfo())
    evaluating = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 2} if evaluate else {}
    args = gloo_trainer_args(out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3, **evaluating)
    trainer = BucketedTrainer(
        model=user_qlora_model(model_dir),
        args=args,
        train_dataset=token_rows(),
        eval_dataset=token_rows(4),
        data_collator=collate_tokens,
    )
    trainer.train()
    history = trainer.state.log_history
    return [(e["loss"], e["grad_norm"]) for e in history if "loss" in e], sum("eval_loss" in e for e in history)


def test_trainer_eval_leaves_4bit_training_unchanged(tmp_path):
    """A user's 4-bit model in a BucketedTrainer that evaluates after every step: each step's loss and gradient
    norm equal those of the run that never evaluates (one process). bitsandbytes repacks 4-bit weights for CPU
    inference at the first evaluation on CPUs with AVX-512 bf16, and training on them went wrong."""
    (plain, _), (evaluated, evaluations) = (
        run_distributed(_trainer_steps, str(tmp_path / str(flag)), flag, world_size=1, timeout=240)[0]
        for flag in (False, True)
    )
    assert evaluations >= 2 and len(plain) == 3, (evaluations, plain, evaluated)
    torch.testing.assert_close(torch.tensor(evaluated), torch.tensor(plain), rtol=1e-6, atol=0.0)
