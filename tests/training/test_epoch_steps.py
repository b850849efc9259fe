"""An epoch's optimizer steps with the balanced plan: the stock Trainer's (``EpochSteps`` with ``trainer_drop_last``)
against what stock does, Accelerate's ``BatchSamplerShard`` and ``Trainer._run_epoch``'s cut into steps; and the
plain loop's whole steps, with the samples it leaves out said once."""

import itertools
import math
import random
from collections import Counter

import pytest
import torch

from ddp_ft.training.data import EpochLoader, EpochSteps, StepBatchSampler

from ..helpers.dist_harness import run_distributed


def _stock_steps(n: int, micro: int, world: int, accumulation: int, drop_last: bool) -> list[list[list[int]]]:
    """What the stock Trainer trains in an epoch of ``n`` samples in order 0..n-1: per optimizer step, each rank's
    sample indices. The Trainer's ``DataLoader(batch_size=micro, drop_last=...)`` sharded by Accelerate
    (``even_batches=True``, the default), then cut into steps as ``Trainer._run_epoch`` does: ``accumulation``
    batches per step, the remainder in the last (``set_initial_training_values``: ceil(len / accumulation))."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    batches = BatchSampler(SequentialSampler(range(n)), micro, drop_last)
    shards = [list(BatchSamplerShard(batches, world, r) if world > 1 else batches) for r in range(world)]
    length = len(shards[0])
    assert all(len(shard) == length for shard in shards)
    steps = math.ceil(length / accumulation) if length else 0
    return [[shard[s * accumulation : (s + 1) * accumulation] for shard in shards] for s in range(steps)]


GRID = list(itertools.product(range(1, 30), (1, 2, 3), (1, 2, 3), (1, 2, 3), (False, True)))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_trainer_epoch_steps_equal_the_stock_trainers(world):
    """For every size of 1 to 29 samples, micro-batch 1-3, accumulation 1-3, ``dataloader_drop_last`` on and off:
    the steps, each step's micro-batches per rank and the samples of each step (repeats included, as positions of the
    epoch's order) are the stock Trainer's on Accelerate. Without drop_last every sample is trained; with it, the
    first ``samples`` are."""
    for n, micro, accumulation, drop_last in [g[:2] + g[3:] for g in GRID if g[2] == world]:
        stock = _stock_steps(n, micro, world, accumulation, drop_last)
        steps = EpochSteps(n, world, micro, accumulation, trainer_drop_last=drop_last)
        case = (n, micro, world, accumulation, drop_last)
        assert steps.steps == len(stock), case
        assert steps.micro_batches_per_rank == sum(len(s[0]) for s in stock), case
        order = steps.extend(list(range(n)))
        for s, ranks in enumerate(stock):
            assert all(len(batches) == steps.accumulation_of(s) for batches in ranks), (case, s)
            samples = [i for batches in ranks for batch in batches for i in batch]
            assert Counter(order[steps.positions(s)]) == Counter(samples), (case, s)
        trained = Counter(order)
        stock_samples = sum(len(b) for ranks in stock for batches in ranks for b in batches)
        assert sum(trained.values()) == steps.samples == stock_samples, case
        if not drop_last:
            assert set(trained) == set(range(n)) and steps.left_out == 0, case
            assert steps.repeated == steps.samples - n, case
            # the first of the order again (cycled: more than twice on a set smaller than one round of batches)
            assert all(trained[i] == steps.samples // n + (i < steps.samples % n) for i in range(n)), case


@pytest.mark.parametrize(
    ("world", "micro", "drop_last"), [(2, 1, False), (2, 2, False), (2, 1, True), (4, 1, False), (1, 2, False)]
)
def test_trainer_shard_gives_each_rank_every_step(world, micro, drop_last):
    """``BucketedTrainer``'s plan on 45 samples, effective batch 8 (a partial last step): Accelerate's shard of the
    ``StepBatchSampler`` gives each rank the plain loop's plan for that rank with the Trainer's steps, as many
    batches as stock, all full (on one process the last partial, as stock's); the samples of every step are
    ``step_samples``, and the epoch trains every sample (``dataloader_drop_last=False``)."""
    from accelerate.data_loader import BatchSamplerShard

    lengths = [random.Random(i).randint(10, 500) for i in range(45)]
    data = [{"input_ids": [i] * n} for i, n in enumerate(lengths)]
    accumulation = 8 // (micro * world)
    plans = EpochLoader(data, None, micro, 0, world, seed=5, effective_batch=8, trainer_drop_last=drop_last)
    sampler = StepBatchSampler(plans)
    stock = _stock_steps(45, micro, world, accumulation, drop_last)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        # Accelerate shards only several processes' loaders (prepare_data_loader)
        shards = [list(BatchSamplerShard(sampler, world, r) if world > 1 else sampler) for r in range(world)]
        for rank, shard in enumerate(shards):
            loop = EpochLoader(data, _ids, micro, rank, world, seed=5, effective_batch=8, trainer_drop_last=drop_last)
            assert len(shard) == len(loop) == sum(len(ranks[0]) for ranks in stock)
            assert all(len(b) == micro for b in shard[:-1]) and len(shard[-1]) == len(stock[-1][rank][-1])
            assert shard == list(loop.epoch(epoch)), (epoch, rank)
        trained = []
        for step, ranks in enumerate(stock):
            micro_steps = len(ranks[0])
            start = step * accumulation
            got = sorted(i for shard in shards for batch in shard[start : start + micro_steps] for i in batch)
            assert got == sorted(sampler.step_samples(epoch * len(stock) + step)), (epoch, step)
            trained += got
        assert len(trained) == sum(len(b) for ranks in stock for batches in ranks for b in batches)
        assert set(trained) == set(range(45)) or drop_last


def _ids(batch: list[dict]) -> list[int]:
    return [sample["input_ids"][0] for sample in batch]


def test_loop_keeps_whole_steps_and_reports_left_out():
    """The plain loop's policy is unchanged (floor(samples / effective batch) steps, the same on every world size, no
    sample twice); ``describe_epoch`` says what it leaves out and why, the line the loop logs once."""
    loader = EpochLoader([{"input_ids": [i]} for i in range(17)], _ids, 1, 0, 2, seed=0, effective_batch=4)
    assert (loader.steps.steps, loader.samples_per_epoch, loader.steps.left_out) == (4, 16, 1)
    line = loader.describe_epoch()
    assert "4 optimizer steps of 4 samples" in line and "1 of the 17" in line and "left out" in line, line
    whole = EpochLoader([{"input_ids": [i]} for i in range(16)], _ids, 1, 0, 2, seed=0, effective_batch=4)
    assert "left out" not in whole.describe_epoch()


# -- 2 real processes: the balanced trainers against the stock ones, 17 rows at effective batch 4 ---------------------

ROWS, EPOCHS = 17, 2
# Per-device batch 1 x accumulation 2 x 2 ranks: per epoch 9 batches a rank (the 17th row's round completed with
# the epoch's first row), so 5 optimizer steps, the last of one micro-batch. With dataloader_drop_last, accumulation
# 3 (effective batch 6): 8 batches a rank, 3 steps, the last of two micro-batches (the plan used to make 2).
# Micro-steps of each optimizer step of an epoch, on each rank, by dataloader_drop_last:
CUTS = {False: [2, 2, 2, 2, 1], True: [3, 3, 2]}
SCHEDULE = dict(
    num_train_epochs=EPOCHS,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=2,
    lr_scheduler_type="linear",
    warmup_steps=2,  # the learning rate of every step depends on the total steps
    learning_rate=0.1,
    optim="sgd",
    logging_steps=1,
    average_tokens_across_devices=True,
)


class _Seen:
    """A collator wrapper and callback recording, per epoch, the rows this rank trained (by ``key``)."""

    def __init__(self, collate, key):
        from transformers import TrainerCallback

        self.collate, self.key, self.epochs = collate, key, []
        seen = self

        class EpochMarker(TrainerCallback):
            def on_epoch_begin(self, args, state, control, **kwargs):
                seen.epochs.append([])

        self.callback = EpochMarker()

    def __call__(self, rows):
        if self.epochs:  # not the balanced plan's per-row count before training
            self.epochs[-1] += [self.key(row) for row in rows]
        return self.collate(rows)


def _record(trainer, seen: _Seen, model=None) -> dict:
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "steps": trainer.state.global_step,
        "learning_rates": [entry["learning_rate"] for entry in logs],
        "epochs": seen.epochs,
        # CausalTokens': (answer tokens, num_items_in_batch, loss) per micro-step
        "given": getattr(model, "seen", None),
    }


def _hf_run(trainer_cls, drop_last: bool, **kw) -> dict:
    """A 2-rank run of the Trainer test model that counts each micro-batch's answer tokens (``CausalTokens``)."""
    import tempfile

    from transformers import default_data_collator

    from ..helpers.trainers import CausalTokens, gloo_trainer_args, labelled_rows

    rows = labelled_rows()[:ROWS]
    for index, row in enumerate(rows):
        row["index"] = index
    seen = _Seen(
        lambda batch: default_data_collator([{k: v for k, v in r.items() if k != "index"} for r in batch]),
        key=lambda row: row["index"],
    )
    torch.manual_seed(0)
    model = CausalTokens()
    with tempfile.TemporaryDirectory() as out:
        schedule = {**SCHEDULE, "gradient_accumulation_steps": 3} if drop_last else SCHEDULE
        args = gloo_trainer_args(out, dataloader_drop_last=drop_last, **schedule)
        trainer = trainer_cls(
            model=model, args=args, train_dataset=rows, data_collator=seen, callbacks=[seen.callback], **kw
        )
        trainer.train()
    return _record(trainer, seen, model)


def _sft_run(trainer_cls, paths: tuple[str, str], drop_last: bool) -> dict:
    import tempfile

    from transformers import AutoTokenizer

    from ..helpers.trl_runs import Case, model_and_peft_config, rows, sft_config

    case = Case("prompt_completion", False, "peft_config", False)
    model, peft_config = model_and_peft_config(paths[1], case, 2)
    with tempfile.TemporaryDirectory() as out:
        args = sft_config(out, case, 2, max_steps=-1, dataloader_drop_last=drop_last, **SCHEDULE)
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=rows(case.data, n=ROWS),
            processing_class=AutoTokenizer.from_pretrained(paths[0]),
            peft_config=peft_config,
        )
        seen = _Seen(trainer.data_collator, key=lambda row: tuple(row["input_ids"]))
        trainer.data_collator = seen
        trainer.add_callback(seen.callback)
        trainer.train()
        distinct = len({tuple(row["input_ids"]) for row in trainer.train_dataset})
    return {**_record(trainer, seen), "distinct": distinct}


def _stock_and_balanced(rank, world_size, paths):
    from ..helpers.trainers import as_accelerate_rank

    as_accelerate_rank(rank, world_size)
    from transformers import Trainer
    from trl import SFTTrainer

    from ddp_ft.integrations import BucketedSFTTrainer, BucketedTrainer

    runs = {}
    for drop_last in (False, True):
        runs["hf", "stock", drop_last] = _hf_run(Trainer, drop_last)
        runs["hf", "balanced", drop_last] = _hf_run(BucketedTrainer, drop_last, balance_ranks=True)
    runs["trl", "stock", False] = _sft_run(SFTTrainer, paths, False)
    runs["trl", "balanced", False] = _sft_run(BucketedSFTTrainer, paths, False)  # its default: balance_ranks
    return runs


@pytest.fixture(scope="module")
def stock_and_balanced(tmp_path_factory):
    pytest.importorskip("trl")
    from ddp_ft.training.data.tokenizer import build_tiny_tokenizer, load_tokenizer
    from ddp_ft.training.model.qlora import build_tiny_qwen3

    root = tmp_path_factory.mktemp("steps")
    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    model = build_tiny_qwen3(root / "qwen3", vocab_size=len(load_tokenizer(str(tokenizer))), seed=0)
    return run_distributed(_stock_and_balanced, (str(tokenizer), str(model)), timeout=300)


def _epochs(ranks: list[dict]) -> list[Counter]:
    """Per epoch, how often each row was trained over both ranks."""
    return [sum((Counter(r["epochs"][e]) for r in ranks), Counter()) for e in range(EPOCHS)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("trainer", "drop_last"), [("hf", False), ("hf", True), ("trl", False)], ids=["Trainer", "Trainer-drop_last", "SFT"]
)
def test_balanced_trainers_train_the_stock_epoch(stock_and_balanced, trainer, drop_last):
    """17 rows, effective batch 4 on 2 ranks, 2 epochs: ``BucketedTrainer(balance_ranks=True)`` against the stock
    ``Trainer`` and ``BucketedSFTTrainer`` (its default plan) against ``SFTTrainer`` on torch DDP make the same
    optimizer steps (5 an epoch, the last of one micro-batch) at the same learning rates, and train as many rows per
    epoch: all 17, one twice, as stock completes the last round. With ``dataloader_drop_last=True`` (effective batch
    6, where stock's short last step differs from whole steps only): 3 steps, the last of two micro-batches, the 16
    rows of whole rounds. Which row is repeated or left out is not stock's: the plan's order is its own shuffle."""
    stock = [r[trainer, "stock", drop_last] for r in stock_and_balanced]
    ours = [r[trainer, "balanced", drop_last] for r in stock_and_balanced]
    expected_steps = EPOCHS * len(CUTS[drop_last])
    for mine, theirs in zip(ours, stock, strict=True):
        assert mine["steps"] == theirs["steps"] == expected_steps
        assert mine["learning_rates"] == theirs["learning_rates"] and len(set(mine["learning_rates"])) > 2
    if trainer == "trl":
        assert stock[0]["distinct"] == ROWS  # every row told apart by its tokens
    for mine, theirs in zip(_epochs(ours), _epochs(stock), strict=True):
        assert sum(mine.values()) == sum(theirs.values()) == (16 if drop_last else 18)
        assert len(mine) == len(theirs) == (16 if drop_last else ROWS)


@pytest.mark.distributed
@pytest.mark.parametrize("drop_last", [False, True], ids=["all", "drop_last"])
def test_short_last_step_divides_by_its_own_tokens(stock_and_balanced, drop_last):
    """Exact data parallelism on every step, the last one of a single micro-batch per rank included: each micro-step
    of both ranks gets as ``num_items_in_batch`` the answer tokens of that step's micro-batches over both ranks (the
    balanced plan's count, summed from the rows with no collective), as stock's gathered count is."""
    for kind in ("stock", "balanced"):
        ranks = [r["hf", kind, drop_last]["given"] for r in stock_and_balanced]
        cuts = CUTS[drop_last] * EPOCHS
        assert all(len(given) == sum(cuts) for given in ranks), kind
        start = 0
        for cut in cuts:
            micro = [entry for given in ranks for entry in given[start : start + cut]]
            total = sum(answers for answers, _, _ in micro)
            assert total > 0 and all(items == total for _, items, _ in micro), (kind, start, micro)
            start += cut


def test_replaced_sampling_strategy_is_refused(tmp_path):
    """``train_sampling_strategy`` other than ``random`` orders the samples its own way, which the plan's seeded
    shuffle would replace: refused when the loader is built (before any step), naming ``balance_ranks=False``."""
    from transformers import TrainingArguments

    from ddp_ft.integrations import BucketedTrainer

    from ..helpers.trainers import Regressor, regression_rows

    for strategy in ("sequential", "group_by_length"):
        args = TrainingArguments(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to=[],
            remove_unused_columns=False,
            train_sampling_strategy=strategy,
        )
        trainer = BucketedTrainer(model=Regressor(), args=args, train_dataset=regression_rows(8), balance_ranks=True)
        with pytest.raises(ValueError, match=rf"balance_ranks=True cannot honour train_sampling_strategy='{strategy}'"):
            trainer.get_train_dataloader()


@pytest.mark.parametrize(
    ("split", "even", "rows", "drop_last", "refused"),
    [
        (True, True, 16, False, "split_batches=True"),
        (False, False, 17, False, "even_batches=False on 17 rows"),
        (False, False, 16, False, None),  # every rank gets whole batches: stock's split, kept
        (False, False, 17, True, None),  # the partial round dropped, as stock does
    ],
)
def test_unkeepable_loader_settings_are_refused(split, even, rows, drop_last, refused):
    """On 2 processes Accelerate's ``split_batches=True`` would split the plan's micro-batches again, and
    ``even_batches=False`` gives the ranks unequal batches where the rows do not fill every rank (the plan completes
    them): refused, naming ``balance_ranks=False``; ``even_batches=False`` on rows that fill them changes nothing."""
    from types import SimpleNamespace

    from ddp_ft.integrations.trainer_plan import check_plan_settings

    args = SimpleNamespace(
        train_sampling_strategy="random", per_device_train_batch_size=2, world_size=2, dataloader_drop_last=drop_last
    )
    accelerator = SimpleNamespace(split_batches=split, even_batches=even)
    if refused is None:
        check_plan_settings(args, accelerator, rows)
        return
    with pytest.raises(ValueError, match=refused) as error:
        check_plan_settings(args, accelerator, rows)
    assert "balance_ranks=False" in str(error.value)
