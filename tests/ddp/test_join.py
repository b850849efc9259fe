"""Uneven inputs through torch's Join protocol: BucketedDDP against torch DDP's join and one process on the same
samples, and Accelerate's ``join_uneven_inputs`` with ``BucketedAccelerator``. 2 real gloo processes."""

import contextlib
import copy
import tempfile

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ft.ddp import BucketedDDP, bf16_compress_hook

from ..helpers.dist_harness import gather_tensors, run_distributed
from ..helpers.models import Net
from ..helpers.trainers import as_accelerate_rank

pytestmark = pytest.mark.distributed

PER_RANK = 4  # samples per batch on each rank


class _Normed(nn.Module):
    """A BatchNorm between two layers: its running statistics are buffers written by every training forward."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.embed(x))))


def _batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(PER_RANK, 16, generator=g), torch.randn(PER_RANK, 4, generator=g)) for _ in range(count)]


def _train(model, batches, join, accumulation=1, trigger=False):
    """SGD with momentum over ``batches`` inside ``join``; all micro-steps of an optimizer step but the last under
    ``no_sync``, or (``trigger``) every forward under ``no_sync`` and the step's backward in
    ``trigger_sync_in_backward``."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    with join:
        for start in range(0, len(batches), accumulation):
            group = batches[start : start + accumulation]
            if trigger:
                with model.no_sync():
                    losses = [nn.functional.mse_loss(model(x), y) for x, y in group]
                with model.trigger_sync_in_backward():
                    sum(losses).backward()
            for i, (x, y) in enumerate(group if not trigger else []):
                with model.no_sync() if i < len(group) - 1 else contextlib.nullcontext():
                    nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return [t.detach().clone() for t in model.module.state_dict().values()]


def _one_process(reference: nn.Module, counts: list[int], divide_by_initial_world_size: bool):
    """The same samples on one process: each step's loss sums the per-element losses of the ranks that still have a
    batch, over the samples of every rank (divide by the initial world size) or of those ranks only."""
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    per_rank = [_batches(rank, count) for rank, count in enumerate(counts)]
    for step in range(max(counts)):
        present = [batches[step] for batches in per_rank if step < len(batches)]
        ranks = len(counts) if divide_by_initial_world_size else len(present)
        total = sum(nn.functional.mse_loss(model(x), y, reduction="sum") for x, y in present)
        (total / (ranks * PER_RANK * 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [t.detach().clone() for t in model.state_dict().values()]


# Each case: model, batches per rank, join arguments, accumulation, DDP keyword arguments.
CASES = {
    "buffers": (_Normed, (5, 2), {}, 1, {}),
    "divide_by_initial_world_size": (Net, (2, 5), {}, 1, {}),
    "divide_by_ranks_training": (Net, (5, 2), {"divide_by_initial_world_size": False}, 1, {}),
    "no_sync_and_unused": (lambda: Net(unused_branch=True), (6, 2), {}, 2, {"find_unused_parameters": True}),
}


def _against_torch_ddp(rank, world_size):
    results = {}
    for case, (make, counts, join_kwargs, accumulation, ddp_kwargs) in CASES.items():
        torch.manual_seed(0)
        reference = make()
        batches = _batches(rank, counts[rank])
        ours, theirs = (
            BucketedDDP(copy.deepcopy(reference), **ddp_kwargs),
            TorchDDP(copy.deepcopy(reference), **ddp_kwargs),
        )
        join = ours.join(**join_kwargs) if case != "divide_by_ranks_training" else Join([ours], **join_kwargs)
        mine = _train(ours, batches, join, accumulation)
        torch_result = _train(theirs, batches, theirs.join(**join_kwargs), accumulation)
        on_ranks = gather_tensors(mine)
        single = None
        if accumulation == 1 and make is Net:
            single = _one_process(reference, list(counts), join_kwargs.get("divide_by_initial_world_size", True))
        results[case] = (mine, torch_result, on_ranks, single)
    # The joined rank learns of a backward made synced after its forwards ran under no_sync.
    torch.manual_seed(0)
    reference = Net()
    batches = _batches(rank, (6, 2)[rank])
    ours = BucketedDDP(copy.deepcopy(reference))
    triggered = _train(ours, batches, ours.join(), 2, trigger=True)
    theirs = TorchDDP(copy.deepcopy(reference))
    results["trigger_sync_in_backward"] = (triggered, _train(theirs, batches, theirs.join(), 2), None, None)
    return results, _refusals(rank)


def _refusals(rank):
    """Each combination that cannot work is refused on every rank, before any rank waits on another."""
    errors = {}
    torch.manual_seed(0)
    model = BucketedDDP(Net())
    model.register_comm_hook(None, bf16_compress_hook)
    with pytest.raises(ValueError, match=r"divide_by_initial_world_size=False\) with a comm hook") as error:
        model.join(divide_by_initial_world_size=False)
    errors["divisor"] = str(error.value)
    # Accelerate's accumulate() syncs at each rank's own last batch: with uneven batches the micro-steps drift apart.
    model, batches = BucketedDDP(Net()), _batches(rank, (3, 4)[rank])
    with pytest.raises(RuntimeError, match="sync this backward") as error:
        with model.join():
            for i, (x, y) in enumerate(batches):
                last = i % 2 == 1 or i == len(batches) - 1
                with model.no_sync() if not last else contextlib.nullcontext():
                    nn.functional.mse_loss(model(x), y).backward()
    errors["drift"] = str(error.value)
    model = BucketedDDP(Net(), bucket_cap_mb="auto")
    assert model.bucket_choice is None  # the trial runs
    with pytest.raises(RuntimeError, match="still timing layouts") as error:
        with model.join():
            for x, y in _batches(rank, (1, 2)[rank]):
                nn.functional.mse_loss(model(x), y).backward()
    errors["auto"] = str(error.value)
    return errors


def _assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str, exact: bool = True) -> None:
    tolerance = {"rtol": 0, "atol": 0} if exact else {}
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **tolerance, msg=lambda m: f"{what}: {m}")


def test_uneven_join_weights_as_torch_and_one_process():
    """A rank out of batches shadows the others' bucket all-reduces with zeros inside `model.join()` / torch's `Join`:
    final parameters and buffers (BatchNorm's running statistics, broadcast from the highest rank still training)
    bitwise torch DDP's join, with the divisor as torch's (the initial world size, or the ranks still training with
    `divide_by_initial_world_size=False`), with `no_sync` accumulation and `find_unused_parameters`, and with a
    backward made synced by `trigger_sync_in_backward`; the same as one process on the same samples where the
    arithmetic is the same; the ranks end with the same model. What cannot work is refused on every rank (no hang):
    the divisor with a comm hook, ranks whose micro-steps drift apart, the `bucket_cap_mb="auto"` trial."""
    outcomes = run_distributed(_against_torch_ddp)
    for rank, (results, errors) in enumerate(outcomes):
        for case, (ours, theirs, on_ranks, single) in results.items():
            _assert_same(ours, theirs, f"rank {rank} {case} against torch DDP")
            if on_ranks is not None:
                _assert_same(*on_ranks, f"{case}: rank 0 against rank 1")
            if single is not None:
                _assert_same(ours, single, f"rank {rank} {case} against one process", exact=False)
        assert set(errors) == {"divisor", "drift", "auto"}, errors
    assert outcomes[0][1] == outcomes[1][1]  # the same refusal on both ranks


# ---------------------------------------------------------------- Accelerate's join_uneven_inputs


def _accelerate_join(rank, world_size):
    as_accelerate_rank(rank, world_size)
    from accelerate import DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_ft.integrations import BucketedAccelerator

    def loader(accelerator, n):
        data = TensorDataset(torch.randn(n, 16, generator=torch.Generator().manual_seed(n)), torch.randn(n, 4))
        return accelerator.prepare(DataLoader(data, batch_size=2))

    def train(accelerator, model, data, join):
        """Train over ``data`` inside ``join``; returns the trainable parameters and the batches seen."""
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        seen = []
        with join:
            for x, y in data:
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                seen.append((x, y))
        return [p.detach().clone() for p in model.parameters() if p.requires_grad], seen

    results = {}
    for samples in (10, 8):  # 5 batches of 2: rank 0 three, rank 1 two (even_batches=False); 4 batches: two each
        accelerator = BucketedAccelerator(cpu=True)
        torch.manual_seed(0)
        reference = Net()
        data = loader(accelerator, samples)
        ours = accelerator.prepare(copy.deepcopy(reference))
        assert isinstance(ours, BucketedDDP)
        mine, seen = train(accelerator, ours, data, accelerator.join_uneven_inputs([ours], even_batches=False))
        assert data.batch_sampler.even_batches is True  # the override ends with the context
        theirs = TorchDDP(copy.deepcopy(reference))
        stock = train(accelerator, theirs, seen, Join([theirs]))[0]
        results[f"override, {samples} samples"] = (mine, stock, len(seen))
    # even_batches=False from the Accelerator's own configuration, on even data: the join runs and changes nothing.
    accelerator = BucketedAccelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
    torch.manual_seed(0)
    reference = Net()
    data = loader(accelerator, 8)
    ours = accelerator.prepare(copy.deepcopy(reference))
    mine, seen = train(accelerator, ours, data, accelerator.join_uneven_inputs([ours]))
    theirs = TorchDDP(copy.deepcopy(reference))
    results["configured, even data"] = (mine, train(accelerator, theirs, seen, contextlib.nullcontext())[0], len(seen))
    return results


def test_accelerator_joins_uneven_inputs_as_torch_ddp():
    """`accelerator.join_uneven_inputs([model], even_batches=False)` (refused before) trains the ranks' uneven
    batches of a prepared loader (3 against 2 here) to torch DDP's joined weights, on CPU processes too (stock
    Accelerate joins on GPUs only), and restores the loader's `even_batches`; `even_batches=False` in the
    Accelerator's `DataLoaderConfiguration` with even data joins and gives torch DDP's weights without a join."""
    for rank, results in enumerate(run_distributed(_accelerate_join)):
        for case, (ours, theirs, _) in results.items():
            _assert_same(ours, theirs, f"rank {rank} {case} against torch DDP")
        assert [results[case][2] for case in results] == [3 - rank, 2, 2]


# ---------------------------------------------------------------- the HF Trainer, which never joins


def _trainer_even_batches_off(rank, world_size):
    as_accelerate_rank(rank, world_size)
    from ddp_ft.integrations import BucketedTrainer

    from ..helpers.trainers import Regressor, gloo_trainer_args, regression_rows

    outcomes = {}
    for samples in (20, 16):  # 5 batches of 4: rank 0 three, rank 1 two; 4 batches: two each
        torch.manual_seed(0)
        model = Regressor()
        before = [p.detach().clone() for p in model.parameters()]
        with tempfile.TemporaryDirectory() as out:
            args = gloo_trainer_args(
                out,
                per_device_train_batch_size=4,
                num_train_epochs=1,
                dataloader_drop_last=False,
                accelerator_config={"even_batches": False},
            )
            trainer = BucketedTrainer(model=model, args=args, train_dataset=regression_rows(samples))
            try:
                trainer.train()
                outcomes[samples] = trainer.state.global_step
            except ValueError as error:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
                outcomes[samples] = str(error)
    return outcomes


def test_trainer_refuses_even_batches_off_if_uneven():
    """`TrainingArguments(accelerator_config={"even_batches": False})`: the Trainer never joins, so a loader giving
    the ranks 3 and 2 batches is refused on every rank before any step (the stock Trainer with torch DDP goes out of
    step); with even data the setting trains."""
    for outcomes in run_distributed(_trainer_even_batches_off):
        assert "gives the ranks [3, 2] batches" in outcomes[20], outcomes[20]
        assert outcomes[16] == 2
