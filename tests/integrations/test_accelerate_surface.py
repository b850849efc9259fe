"""Accelerate's API surface that touches DDP, with BucketedDDP, against stock Accelerate with torch DDP.

Each Accelerate method that special-cases torch's DDP class or the distributed type either behaves as it does with
torch DDP (gradients, norms, restored weights equal) or refuses by name. 2 real gloo processes; the reference is
stock Accelerate preparing torch DDP in the same processes, on the same data.
"""

import copy
import os
import tempfile

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ft.ddp import BucketedDDP

from ..helpers.dist_harness import gather_tensors, run_distributed
from ..helpers.models import Net, local_slice, make_batch
from ..helpers.trainers import as_accelerate_rank

pytestmark = pytest.mark.distributed


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _assert_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- a launch that Accelerate does not see


def _world_of_one(rank, world_size, out):
    as_accelerate_rank(rank, world_size)
    from transformers import TrainingArguments

    from ddp_ft.integrations import BucketedAccelerator, BucketedTrainer

    errors = {}
    with pytest.raises(RuntimeError) as error:
        BucketedAccelerator()  # no cpu=True on a machine without CUDA: Accelerate sees one process
    errors["accelerator"] = str(error.value)
    touched = []

    def model_init():
        touched.append(True)
        return Net()

    args = TrainingArguments(output_dir=out, report_to=[], disable_tqdm=True)  # no use_cpu=True
    with pytest.raises(RuntimeError) as error:
        BucketedTrainer(model_init=model_init, args=args)
    errors["trainer"] = str(error.value)
    from trl import SFTConfig

    from ddp_ft.integrations import BucketedSFTTrainer

    with pytest.raises(RuntimeError) as error:  # before TRL loads the model named here (it does not exist)
        BucketedSFTTrainer(
            model="no/such-model", args=SFTConfig(output_dir=out, report_to=[], bf16=False), train_dataset=[]
        )
    errors["trl"] = str(error.value)
    return errors, touched


def test_world_of_one_stops_before_model_is_touched(tmp_path):
    """Launched with WORLD_SIZE=2, an Accelerator without cpu=True (or TrainingArguments / SFTConfig without
    use_cpu=True) on a machine without CUDA sees one process: each rank would train alone on all the data. All three
    raise, naming the fix, before the Trainer builds the model (or TRL loads it)."""
    for rank, (errors, touched) in enumerate(run_distributed(_world_of_one, str(tmp_path))):
        assert f"rank {rank} of WORLD_SIZE=2" in errors["accelerator"], errors
        assert "BucketedAccelerator(cpu=True)" in errors["accelerator"], errors
        assert "use_cpu=True" in errors["trainer"] and "SFTConfig" in errors["trainer"], errors
        assert f"rank {rank} of WORLD_SIZE=2" in errors["trl"] and "SFTConfig(use_cpu=True)" in errors["trl"], errors
        assert touched == [], "the Trainer built the model before refusing"


# ---------------------------------------------------------------- trigger_sync_in_backward


def _trigger_sync(rank, world_size):
    as_accelerate_rank(rank, world_size)
    from ddp_ft.integrations import BucketedAccelerator

    accelerator = BucketedAccelerator(cpu=True)
    torch.manual_seed(0)
    reference = Net()
    ours, theirs = accelerator.prepare(copy.deepcopy(reference)), TorchDDP(copy.deepcopy(reference))
    assert isinstance(ours, BucketedDDP)
    local = local_slice(rank, world_size)
    (xa, ya), (xb, yb) = make_batch(0), make_batch(1)
    grads = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        with accelerator.no_sync(model):  # two forwards, neither syncing
            loss_a = nn.functional.mse_loss(model(xa[local]), ya[local])
            loss_b = nn.functional.mse_loss(model(xb[local]), yb[local])
        accelerator.backward(loss_a)  # accumulates locally
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)  # averages a + b over the ranks
        grads[name] = _grads(model)
    _assert_equal(grads["ours"], grads["theirs"], "BucketedDDP vs torch DDP")
    copies = gather_tensors(grads["ours"])
    _assert_equal(copies[0], copies[1], "rank 0 vs rank 1")
    calls = ours.last_comm_stats().allreduce_calls
    _local_sgd(accelerator, ours, theirs, local)
    return calls, len(ours.bucket_sizes)


def _local_sgd(accelerator, ours, theirs, local):
    """Accelerate's LocalSGD (no_sync throughout, parameters averaged every 2 steps) on both wrappers."""
    from accelerate.local_sgd import LocalSGD

    for model in (ours, theirs):
        model.zero_grad(set_to_none=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with LocalSGD(accelerator, model, local_sgd_steps=2) as local_sgd:
            for step in range(3):
                x, y = make_batch(10 + step)
                accelerator.backward(nn.functional.mse_loss(model(x[local]), y[local]))
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
    _assert_equal(list(ours.parameters()), list(theirs.parameters()), "LocalSGD parameters")


def test_trigger_sync_after_no_sync_forwards_as_torch():
    """Accelerate's `trigger_sync_in_backward` acts on torch DDP only; with BucketedDDP the synced backward after
    two `no_sync` forwards averaged nothing and the ranks kept their own gradients. Now it reduces what both
    backwards accumulated, bitwise as torch DDP, one all-reduce per bucket. Accelerate's LocalSGD (no_sync, then
    parameter averaging) gives torch DDP's parameters too."""
    for calls, buckets in run_distributed(_trigger_sync):
        assert calls == buckets


# ---------------------------------------------------------------- save_state / load_state


class _Tied(nn.Module):
    """An embedding tied to the output head, as in Qwen3 with tie_word_embeddings."""

    def __init__(self, vocab: int = 32, dim: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _round_trip(accelerator, rank, world_size, out):
    torch.manual_seed(0)
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.arange(8).view(2, 4) + 4 * rank
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    accelerator.backward(loss)
    optimizer.step()
    saved = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    accelerator.save_state(out)
    accelerator.wait_for_everyone()  # rank 0 writes, every rank reads
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.load_state(out)
    restored = accelerator.unwrap_model(model).state_dict()
    assert restored["head.weight"].data_ptr() == restored["embed.weight"].data_ptr(), "the tie was broken"
    return type(model).__name__, {k: torch.equal(v, restored[k]) for k, v in saved.items()}


def _save_load_tied(rank, world_size, out):
    as_accelerate_rank(rank, world_size)
    from accelerate import Accelerator

    from ddp_ft.integrations import BucketedAccelerator

    theirs = _round_trip(Accelerator(cpu=True), rank, world_size, os.path.join(out, "stock"))
    ours = _round_trip(BucketedAccelerator(cpu=True), rank, world_size, os.path.join(out, "ours"))
    return theirs, ours


def test_save_load_state_round_trip_tied_weights():
    """`save_state` stores a tied weight once; `load_state` (safetensors' `load_model`) expects it missing under the
    model's own key. BucketedDDP reported it as `module.head.weight` and the load failed ("Missing key(s)"); stock
    Accelerate with torch DDP round-trips. Now both restore every tensor exactly, the tie kept."""
    with tempfile.TemporaryDirectory() as out:
        for (stock_type, theirs), (our_type, ours) in run_distributed(_save_load_tied, out):
            assert (stock_type, our_type) == ("DistributedDataParallel", "BucketedDDP")
            assert theirs == ours and all(ours.values()), ours
            assert set(ours) == {"embed.weight", "mix.weight", "mix.bias", "head.weight"}


# ---------------------------------------------------------------- the training and evaluation surface


def _training_surface(rank, world_size):
    as_accelerate_rank(rank, world_size)
    from torch.utils.data import DataLoader

    from ddp_ft.integrations import BucketedAccelerator

    accelerator = BucketedAccelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    reference = Net()
    ours, theirs = accelerator.prepare(copy.deepcopy(reference)), TorchDDP(copy.deepcopy(reference))
    # Accelerate joins on GPU-like devices only (on the CPU join_uneven_inputs is a no-op with a warning): take its
    # multi-GPU path, where a stock Join over BucketedDDP failed even with even batches before BucketedDDP was a
    # torch Joinable (BucketedAccelerator joins on CPU processes too).
    BucketedAccelerator.multi_device = property(lambda self: True)
    opt_ours, opt_theirs = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs))
    opt_ours, opt_theirs = accelerator.prepare(opt_ours, opt_theirs)
    local, synced = local_slice(rank, world_size), 0
    with accelerator.join_uneven_inputs([ours]), accelerator.join_uneven_inputs([theirs]):  # even batches: no join
        for step in range(4):
            x, y = make_batch(step)
            with accelerator.accumulate(ours, theirs):  # no_sync on the first micro-step of each pair
                for model in (ours, theirs):
                    accelerator.backward(nn.functional.mse_loss(model(x[local]), y[local]))
                _assert_equal(_grads(ours), _grads(theirs), f"gradients at micro-step {step}")
                if accelerator.sync_gradients:
                    synced += 1
                    norms = [accelerator.clip_grad_norm_(m.parameters(), 0.05) for m in (ours, theirs)]
                    _assert_equal([norms[0]], [norms[1]], "clip_grad_norm_")
                    for model in (ours, theirs):
                        accelerator.clip_grad_value_(model.parameters(), 0.01)
                    _assert_equal(_grads(ours), _grads(theirs), "clipped gradients")
                for optimizer in (opt_ours, opt_theirs):
                    optimizer.step()
                    optimizer.zero_grad()
    _assert_equal(list(ours.parameters()), list(theirs.parameters()), "parameters after training")
    loader = accelerator.prepare(DataLoader(torch.randn(7, 16, generator=torch.Generator().manual_seed(3)), 2))
    predictions = {"ours": [], "theirs": []}
    with torch.no_grad():
        for batch in loader:
            for name, model in (("ours", ours), ("theirs", theirs)):
                predictions[name].append(accelerator.gather_for_metrics(model(batch)))
    _assert_equal(predictions["ours"], predictions["theirs"], "gather_for_metrics")
    return synced, sum(len(p) for p in predictions["ours"])


def test_accumulate_clip_join_gather_match_torch_ddp():
    """`accumulate` (no_sync on all but the last micro-step), `backward`, `clip_grad_norm_`, `clip_grad_value_`,
    `join_uneven_inputs` with even batches (on its multi-GPU path: no join, as Accelerate) and `gather_for_metrics` on an uneven eval set:
    gradients, norms, parameters and gathered predictions bitwise equal to torch DDP's under the same accelerator.
    Uneven batches under `join_uneven_inputs(even_batches=False)`: `tests/ddp/test_join.py`."""
    for synced, gathered in run_distributed(_training_surface):
        assert synced == 2 and gathered == 7
