"""The plugin never trains a multi-process run unwrapped: re-preparation, evaluation first, the Trainer's automatic
batch-size retry, and a guard for whatever else. 2 real gloo processes, Accelerate and the HF Trainer in-process."""

import tempfile

import pytest
import torch
from torch import nn

from ddp_ft.ddp import BucketedDDP

from ..helpers.dist_harness import gather_tensors, run_distributed
from ..helpers.models import Net, local_slice, make_batch
from ..helpers.trainers import (
    COLLECTIVES,
    Regressor,
    TokenRegressor,
    as_accelerate_rank,
    gloo_trainer_args,
    padded_rows,
    record_collectives,
    regression_rows,
)

pytestmark = pytest.mark.distributed


def _same_on_all_ranks(module: nn.Module) -> bool:
    copies = gather_tensors([p for p in module.parameters() if p.requires_grad])
    return all(torch.equal(a, b) for a, b in zip(copies[0], copies[1], strict=True))


def _train_steps(accelerator, model, optimizer, rank, world_size, steps=3):
    for step in range(steps):
        x, y = make_batch(step)
        local = local_slice(rank, world_size)
        loss = torch.nn.functional.mse_loss(model(x[local]), y[local])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def _reprepare(rank, world_size, how):
    as_accelerate_rank(rank, world_size)
    from ddp_ft.integrations import BucketedAccelerator

    accelerator = BucketedAccelerator(cpu=True)
    torch.manual_seed(0)
    inner = Net()
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)
    if how == "evaluation_first":
        accelerator.prepare_model(inner, evaluation_mode=True)
    elif how == "after_free_memory":
        first = accelerator.prepare(inner)
        _train_steps(accelerator, first, optimizer, rank, world_size, steps=1)
        accelerator.free_memory()
    elif how == "twice":
        first = accelerator.prepare(inner)
    model, optimizer = accelerator.prepare(inner, optimizer)
    assert isinstance(model, BucketedDDP), f"{how}: prepare returned a {type(model).__name__}"
    assert model.module is inner
    if how in ("after_free_memory", "twice"):
        assert model is first, "a second wrapper of the same module: its hooks would fight the first one's"
    _train_steps(accelerator, model, optimizer, rank, world_size)
    assert _same_on_all_ranks(inner), f"{how}: parameters differ across ranks"


@pytest.mark.parametrize("how", ["evaluation_first", "after_free_memory", "twice"])
def test_preparing_again_returns_its_bucketed_wrapper(how):
    """`prepare` decides by what the model is: an unwrapped training model is wrapped (or its existing wrapper is
    returned), whatever Accelerate's `_is_accelerate_prepared` flag says."""
    run_distributed(_reprepare, how, timeout=120)


def _trainer_run(rank, world_size, scenario):
    as_accelerate_rank(rank, world_size)

    from ddp_ft.integrations import BucketedTrainer

    torch.manual_seed(0)
    model = Regressor(out_of_memory_once=scenario == "auto_batch_size_after_oom")
    with tempfile.TemporaryDirectory() as out:
        args = gloo_trainer_args(
            out,
            max_steps=3,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            gradient_accumulation_steps=2,
            learning_rate=0.1,
            auto_find_batch_size=scenario == "auto_batch_size_after_oom",
            torch_compile=scenario.endswith("compile"),
            torch_compile_backend="aot_eager" if "compile" in scenario else None,
        )
        trainer = BucketedTrainer(
            model=model, args=args, train_dataset=regression_rows(), eval_dataset=regression_rows(16)
        )
        if scenario.startswith("evaluate_first"):
            trainer.evaluate()
        if scenario == "unwrapped":  # whatever path skips the wrap: the training step refuses, on every rank
            from accelerate import Accelerator

            trainer.accelerator.prepare_model = Accelerator.prepare_model.__get__(trainer.accelerator)  # torch DDP
            with pytest.raises(RuntimeError, match="not wrapped in BucketedDDP") as error:
                trainer.train()
            return str(error.value)
        trainer.train()
        if scenario == "train_twice":
            trainer.args.max_steps = 6
            trainer.train()
        assert isinstance(trainer.model_wrapped, BucketedDDP), type(trainer.model_wrapped).__name__
        assert _same_on_all_ranks(model), f"{scenario}: parameters differ across ranks"
        return trainer.state.global_step


@pytest.mark.parametrize(
    "scenario",
    ["evaluate_first", "auto_batch_size_after_oom", "train_twice", "torch_compile", "evaluate_first_compile"],
)
def test_trainer_wrapped_on_every_preparation_path(scenario):
    """trainer.evaluate() before train(), auto_find_batch_size retrying after an out-of-memory error and a second
    train() call all prepare the model again, and torch_compile prepares a compiled one; each must still train with
    BucketedDDP (parameters equal on every rank), not as independent single processes, nor crash."""
    steps = run_distributed(_trainer_run, scenario, timeout=180)
    assert steps == [6, 6] if scenario == "train_twice" else steps == [3, 3]


def test_multi_process_step_unwrapped_is_an_error():
    messages = run_distributed(_trainer_run, "unwrapped", timeout=180)
    for message in messages:
        assert "not wrapped in BucketedDDP" in message and "world size 2" in message


def _collectives_per_step(rank, world_size):
    as_accelerate_rank(rank, world_size)
    from transformers import TrainerCallback

    from ddp_ft.integrations import BucketedTrainer

    log: list[str] = []
    record_collectives(log)
    for name in ("item", "tolist"):  # host reads: each waits for the device
        original = getattr(torch.Tensor, name)

        def read(self, *args, _name=name, _original=original, **kwargs):
            log.append(_name)
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)

    class Marker(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            log.append("step_begin")

        def on_substep_end(self, args, state, control, **kwargs):
            log.append("substep_end")  # after each micro-step but the last of the optimizer step

        def on_step_end(self, args, state, control, **kwargs):
            log.append("step_end")

    torch.manual_seed(0)
    rows = padded_rows()
    with tempfile.TemporaryDirectory() as out:
        args = gloo_trainer_args(
            out, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=4, learning_rate=0.1
        )
        trainer = BucketedTrainer(model=TokenRegressor(), args=args, train_dataset=rows, callbacks=[Marker()])
        trainer.train()
        buckets = len(trainer.model_wrapped.bucket_sizes)
    steps, current = [], None
    for entry in log:
        if entry == "step_begin":
            current = []
        elif entry == "step_end":
            steps.append(current)
            current = None
        elif current is not None:
            current.append(entry)
    total_tokens = sum(int(r["attention_mask"].sum()) for r in rows)  # max_steps x 16 samples = the whole set
    return steps, buckets, trainer.state.num_input_tokens_seen, total_tokens


def test_no_collective_per_micro_step_tokens_once():
    """Accumulation 4: per optimizer step, the bucket all-reduces and one all-gather of the token count (with the stop
    flag and the compute time), whatever the accumulation; nothing at all (collective or ``.item()``/``.tolist()``)
    on the ``no_sync`` micro-steps, and on the synced one the buckets' all-reduces, then the all-gather, then one
    host read (no ``all_gather_into_tensor``: the Trainer's per-micro-step token gather). The token count is still
    exact: every non-padding token of the epoch, once."""
    for steps, buckets, seen, total in run_distributed(_collectives_per_step, timeout=180):
        assert len(steps) == 2
        for calls in steps:
            assert sum(calls.count(name) for name in COLLECTIVES) == buckets + 1, calls
            assert calls.count("broadcast") == 0, calls  # the model's buffers never change: no re-broadcast
            # The no_sync micro-steps (all but the last of 4): no collective and no host read (.item/.tolist).
            micro = " ".join(calls).split("substep_end")
            assert len(micro) == 4 and all(not m.strip() for m in micro[:3]), calls
            assert micro[3].split() == ["all_reduce"] * buckets + ["all_gather", "tolist"], calls
        assert seen == total


def _compiled(rank, world_size, backend):
    as_accelerate_rank(rank, world_size)
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from ddp_ft.integrations import BucketedAccelerator

    accelerator = BucketedAccelerator(cpu=True, dynamo_backend=backend)
    torch.manual_seed(0)
    reference = Net()
    theirs = TorchDDP(copy.deepcopy(reference))  # eager torch DDP: the reference
    ours = accelerator.prepare(copy.deepcopy(reference))
    # no repeated layers to compile one by one: compiled whole, in place, inside the wrapper (never around it)
    assert isinstance(ours, BucketedDDP) and type(ours.module) is Net and ours.module._compiled_call_impl is not None
    local = local_slice(rank, world_size)
    for step in range(3):
        x, y = make_batch(step)
        for model in (ours, theirs):
            accelerator.backward(torch.nn.functional.mse_loss(model(x[local]), y[local]))
        assert ours.last_comm_stats().allreduce_calls == len(ours.bucket_sizes)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dynamo_compiles_inside_with_torch_ddp_grads(backend):
    """Accelerate's `dynamo_backend` (and so TrainingArguments(torch_compile=True)) on a model without repeated layers
    compiles it whole in place, inside BucketedDDP; its hooks still fire on every parameter, and the gradients equal
    eager torch DDP's. (Models with decoder layers are compiled layer by layer:
    tests/training/test_compile_overlap.py.)"""
    run_distributed(_compiled, backend, timeout=240)
