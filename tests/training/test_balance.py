"""Balanced ranks: a step's samples split over ranks and micro-batches by length, the step itself unchanged."""

import itertools
import random

import pytest

from ddp_ft.training.data import (
    DataSettings,
    EpochLoader,
    StepBatchSampler,
    balanced_plan,
    load_raw_splits,
    micro_batch_cost,
    rank_costs,
    strided_plan,
    tokenize_dataset,
)
from ddp_ft.training.data.tokenizer import build_tiny_tokenizer, load_tokenizer

from ..helpers.dist_harness import run_distributed
from ..helpers.meetings import write_mixed_length_meetings

SHAPES = [(2, 1, 8), (2, 2, 4), (2, 4, 2), (3, 2, 2), (4, 1, 4), (1, 2, 8), (2, 1, 1)]  # world, micro, accumulation


def _step(rng: random.Random, world: int, micro: int, accumulation: int) -> tuple[list[int], dict[int, int]]:
    n = world * micro * accumulation
    indices = rng.sample(range(1000), n)
    return indices, {i: int(rng.lognormvariate(5, 0.8)) + 1 for i in indices}


def _plans(indices, length_of, world, micro, accumulation):
    lengths = [length_of[i] for i in indices]
    return balanced_plan(indices, lengths, world, micro, accumulation), strided_plan(
        indices, world, micro, accumulation
    )


def _spread(costs: list[int]) -> int:
    return max(costs) - min(costs)


@pytest.mark.parametrize("world,micro,accumulation", SHAPES)
def test_plan_partitions_the_step_into_micro_batches(world, micro, accumulation):
    rng = random.Random(0)
    for _ in range(50):
        indices, length_of = _step(rng, world, micro, accumulation)
        plan, _ = _plans(indices, length_of, world, micro, accumulation)
        assert len(plan) == world and all(len(batches) == accumulation for batches in plan)
        assert all(len(batch) == micro for batches in plan for batch in batches)
        used = [i for batches in plan for batch in batches for i in batch]
        assert sorted(used) == sorted(indices), "every sample of the step exactly once"


@pytest.mark.parametrize("world,micro,accumulation", SHAPES)
def test_balanced_ranks_never_worse_than_strided(world, micro, accumulation):
    rng = random.Random(1)
    for _ in range(200):
        indices, length_of = _step(rng, world, micro, accumulation)
        balanced, strided = (rank_costs(p, length_of) for p in _plans(indices, length_of, world, micro, accumulation))
        assert max(balanced) <= max(strided), "the slowest rank is never slower"
        assert sum(balanced) <= sum(strided), "no more padded tokens in all"


def test_a_skewed_step_is_strictly_better_balanced():
    # global order long, short, long, short...: strided gives rank 0 every long sample
    indices = list(range(8))
    length_of = {i: 504 if i % 2 == 0 else 48 for i in indices}  # multiples of 8, the batch widths
    balanced, strided = (rank_costs(p, length_of) for p in _plans(indices, length_of, 2, 2, 2))
    assert strided == [2016, 192]
    assert balanced == [1104, 1104]


def _fewest_padded_tokens_on_the_slowest_rank(lengths: list[int], world: int, micro: int, accumulation: int) -> int:
    """The exact optimum, by enumeration: over every cut of the samples into micro-batches of ``micro`` and every
    deal of those to ``world`` ranks of ``accumulation`` each, the least padded tokens of the most loaded rank."""

    def cuts(rest: list[int]):  # every partition of ``rest`` into micro-batches of ``micro`` (as lists of costs)
        if not rest:
            yield []
            return
        head, tail = rest[0], rest[1:]
        for partners in itertools.combinations(range(len(tail)), micro - 1):
            group = [head, *(tail[i] for i in partners)]
            others = [x for i, x in enumerate(tail) if i not in partners]
            for more in cuts(others):
                yield [micro_batch_cost(group), *more]

    def deal(costs: list[int], loads: list[int], left: list[int]) -> int:  # the least max load over the deals
        if not costs:
            return max(loads)
        best, tried = None, set()
        for rank in range(world):
            if left[rank] and (loads[rank], left[rank]) not in tried:  # equal ranks: one is enough
                tried.add((loads[rank], left[rank]))
                loads[rank] += costs[0]
                left[rank] -= 1
                found = deal(costs[1:], loads, left)
                loads[rank] -= costs[0]
                left[rank] += 1
                best = found if best is None else min(best, found)
        return best

    return min(deal(sorted(c, reverse=True), [0] * world, [accumulation] * world) for c in cuts(sorted(lengths)))


@pytest.mark.parametrize(
    "world,micro,accumulation,draws", [(2, 2, 2, 100), (4, 2, 1, 100), (2, 2, 3, 12), (2, 3, 2, 12)]
)
def test_micro_batches_of_2_plus_reach_exact_optimum(world, micro, accumulation, draws):
    """No split of a step's samples over ranks and micro-batches makes the slowest rank pad less: the balanced
    plan's step time (in padded tokens) is the best possible, so DDP / pair's plan ceiling is a true bound."""
    rng = random.Random(world * 100 + micro * 10 + accumulation)
    for _ in range(draws):
        indices, length_of = _step(rng, world, micro, accumulation)
        plan, _ = _plans(indices, length_of, world, micro, accumulation)
        lengths = [length_of[i] for i in indices]
        assert max(rank_costs(plan, length_of)) == _fewest_padded_tokens_on_the_slowest_rank(
            lengths, world, micro, accumulation
        ), lengths


def test_micro_batches_of_1_within_4pc_of_optimum():
    """Micro-batch 1 is number partitioning (no padding to share): the heuristic is not always exact."""
    rng = random.Random(7)
    ratios = []
    for _ in range(150):
        indices, length_of = _step(rng, 2, 1, 4)
        plan, _ = _plans(indices, length_of, 2, 1, 4)
        optimum = _fewest_padded_tokens_on_the_slowest_rank([length_of[i] for i in indices], 2, 1, 4)
        ratios.append(max(rank_costs(plan, length_of)) / optimum)
    assert max(ratios) <= 1.04 and sum(ratios) / len(ratios) <= 1.015, (max(ratios), sum(ratios) / len(ratios))


def test_plan_is_deterministic_by_length_then_position():
    indices, lengths = [7, 3, 9, 1, 5, 2, 8, 4], [30, 10, 30, 20, 10, 40, 20, 30]
    plan = balanced_plan(indices, lengths, 2, 2, 2)
    assert plan == balanced_plan(list(indices), list(lengths), 2, 2, 2)
    # by (length, position): 3 5 | 1 8 | 7 9 | 4 2, costs 20 40 60 80; LPT: 80->r0, 60->r1, 40->r1, 20->r0
    assert plan == [[[4, 2], [3, 5]], [[7, 9], [1, 8]]]


def test_one_rank_still_groups_similar_lengths():
    indices = list(range(8))
    length_of = {i: 400 if i % 2 else 40 for i in indices}
    balanced, strided = (rank_costs(p, length_of) for p in _plans(indices, length_of, 1, 2, 4))
    assert strided == [3200] and balanced == [1760]  # 2x400 + 2x400 + 2x40 + 2x40 is 1760 padded tokens


def test_plan_sizes_not_making_the_step_are_refused():
    with pytest.raises(ValueError, match="not world_size=2 x micro_batch=2 x accumulation=2"):
        balanced_plan(list(range(6)), [1] * 6, 2, 2, 2)
    with pytest.raises(ValueError, match="one length per sample"):
        balanced_plan(list(range(8)), [1] * 7, 2, 2, 2)


def _loader_steps(loader: EpochLoader, epoch: int) -> list[list[int]]:
    return [sorted(i for batches in plan for batch in batches for i in batch) for plan in loader.plans(epoch)]


def _ids(batch: list[dict]) -> list[int]:
    return [sample["input_ids"][0] for sample in batch]


def test_balanced_loader_trains_the_unbalanced_steps():
    lengths = [random.Random(i).randint(10, 500) for i in range(61)]
    data = [{"input_ids": [i] * n} for i, n in enumerate(lengths)]
    reference = _loader_steps(EpochLoader(data, _ids, 8, 0, 1, seed=3, effective_batch=8, balance=False), 2)
    assert len(reference) == 7
    for world, micro in [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2)]:
        loaders = [EpochLoader(data, _ids, micro, r, world, seed=3, effective_batch=8) for r in range(world)]
        assert loaders[0].lengths == lengths
        assert _loader_steps(loaders[0], 2) == reference, (world, micro)
        accumulation = 8 // (micro * world)
        for rank, loader in enumerate(loaders):  # each rank reads its part of the one plan every rank computes
            assert list(loader.plans(2)) == list(loaders[0].plans(2))
            assert list(loader.epoch(2)) == [b for plan in loader.plans(2) for b in plan[rank]]
            resumed = list(loader.epoch(2, start_sample=3 * 8))
            assert resumed == [b for plan in loader.plans(2, 3) for b in plan[rank]]
            assert len(resumed) == 4 * accumulation


def test_balance_cuts_slowest_rank_and_padding(tmp_path):
    """Tokenized mixed-length meetings (60 to 256 tokens), 2 ranks, micro-batch 2, effective batch 16: per step,
    the rank with the most padded tokens sets the step time."""
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path / "tok")))
    settings = DataSettings(source=write_mixed_length_meetings(tmp_path / "m.jsonl", n=96), max_seq_len=256)
    data, _ = tokenize_dataset(load_raw_splits(settings)["train"], tokenizer, settings)
    length_of = dict(enumerate(len(ids) for ids in data["input_ids"]))
    costs = {}
    for balance in (False, True):
        loader = EpochLoader(data, None, 2, 0, 2, seed=0, effective_batch=16, balance=balance)
        costs[balance] = [rank_costs(plan, length_of) for epoch in (0, 1) for plan in loader.plans(epoch)]
    slowest = {b: sum(max(step) for step in steps) for b, steps in costs.items()}
    spread = {b: sum(_spread(step) for step in steps) for b, steps in costs.items()}
    padded = {b: sum(sum(step) for step in steps) for b, steps in costs.items()}
    assert all(max(b) <= max(s) for b, s in zip(costs[True], costs[False], strict=True))
    assert slowest[True] < 0.9 * slowest[False], slowest
    assert spread[True] < 0.25 * spread[False], spread
    assert padded[True] < padded[False], padded


@pytest.mark.parametrize("world,micro", [(1, 2), (2, 1), (2, 2), (4, 1)])
def test_trainer_sampler_shard_is_the_loop_plan(world, micro):
    """What ``BucketedTrainer(balance_ranks=True)`` feeds Accelerate: its shard (batch i to rank i % world) gives each
    rank the batches ``EpochLoader`` gives that rank, with the stock Trainer's steps (``dataloader_drop_last=True``
    here: 45 rows make 5 whole steps of 8 and a short one); skipping ``n * accumulation`` batches (the Trainer's
    resume) is resuming ``n`` steps later."""
    from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler

    lengths = [random.Random(i).randint(10, 500) for i in range(45)]
    data = [{"input_ids": [i] * n} for i, n in enumerate(lengths)]
    accumulation = 8 // (micro * world)
    sampler = StepBatchSampler(
        EpochLoader(data, None, micro, 0, world, seed=5, effective_batch=8, trainer_drop_last=True)
    )
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        for rank in range(world):
            loop = EpochLoader(data, _ids, micro, rank, world, seed=5, effective_batch=8, trainer_drop_last=True)
            shard = (
                BatchSamplerShard(sampler, world, rank, split_batches=False, even_batches=True)
                if world > 1
                else sampler
            )
            assert len(shard) == len(loop) == 45 // micro // world and loop.steps.steps == 6
            assert [[i for i in batch] for batch in shard] == list(loop.epoch(epoch)), (epoch, rank)
            resumed = SkipBatchSampler(shard, skip_batches=2 * accumulation)
            assert list(resumed) == list(loop.epoch(epoch, start_sample=2 * 8)), (epoch, rank)


def _trainer_batches(rank, world_size):
    import tempfile

    import torch
    from accelerate import skip_first_batches
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ddp_ft.integrations import BucketedTrainer

    from ..helpers.trainers import Regressor, as_accelerate_rank

    as_accelerate_rank(rank, world_size)
    lengths = [random.Random(i).randint(10, 500) for i in range(45)]
    data = [{"input_ids": [i] * n} for i, n in enumerate(lengths)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            seed=5,
            remove_unused_columns=False,
            dataloader_drop_last=True,
            ddp_backend="gloo",
            disable_tqdm=True,
        )
        trainer = BucketedTrainer(
            model=Regressor(),
            args=args,
            train_dataset=data,
            data_collator=lambda batch: {"index": torch.tensor([s["input_ids"][0] for s in batch])},
            balance_ranks=True,
        )
        loader = trainer.get_train_dataloader()
        loop = EpochLoader(data, _ids, 2, rank, world_size, seed=5, effective_batch=8, trainer_drop_last=True)
        assert len(loader) == len(loop) == 11  # the stock Trainer's 45 // 2 // 2 batches a rank: 6 steps
        state, control = TrainerState(), TrainerControl()
        for epoch in (0, 1):  # as the Trainer runs an epoch: callbacks, then set_epoch on the loader
            state.global_step = epoch * 6
            trainer.callback_handler.on_epoch_begin(args, state, control)
            loader.set_epoch(epoch)
            assert [b["index"].tolist() for b in loader] == list(loop.epoch(epoch)), (rank, epoch)
        # a resume 2 steps into epoch 1: the Trainer skips 2 x accumulation batches of a loader it then re-epochs
        loader = trainer.get_train_dataloader()  # a resumed train() builds its loader, then begins the epoch
        state.global_step = 6 + 2
        trainer.callback_handler.on_epoch_begin(args, state, control)
        resumed = skip_first_batches(loader, 2 * 2)
        resumed.set_epoch(1)
        assert [b["index"].tolist() for b in resumed] == list(loop.epoch(1, start_sample=2 * 8)), rank
    return True


@pytest.mark.distributed
def test_bucketed_trainer_ranks_get_the_loop_plan():
    assert run_distributed(_trainer_batches, timeout=180) == [True, True]
