"""BucketedSFTTrainer (TRL's SFTTrainer on BucketedDDP) against stock SFTTrainer with torch DDP and against one
process on the global batch: tiny Qwen3, 2 real gloo processes, 2 optimizer steps per run.

Two launches serve every test here (module fixture ``runs``): 2 processes train each case of ``CASES`` (prompt-
completion and conversational data, packing on and off, ``peft_config`` and a ready ``PeftModel``, 4-bit and not;
each pair of settings in all four combinations) with stock SFTTrainer and BucketedSFTTrainer, and BALANCED also with
``balance_ranks``; then 1 process trains the Bucketed ones on the same global batches. About 50 s on 2 CPU cores.
"""

import pytest
import torch
from torch.testing import assert_close

from ..helpers.dist_harness import run_distributed
from ..helpers.trl_runs import CASES, Case, Run, sft_config, tiny_paths, train

pytest.importorskip("trl")
pytestmark = pytest.mark.distributed

# One process vs two on the same global batches (SGD, see trl_runs.sft_config): after 2 steps, each adapter tensor
# within this fraction of its largest entry. Measured on this CPU: float32 adapters within 7.1e-7 (lora_B; lora_A
# 6e-8); the bfloat16 adapters TRL makes for a 4-bit base (it casts them, trl/trainer/sft_trainer.py) within 1.0e-2
# (lora_B; lora_A 3.9e-3, one bf16 rounding of its largest entry): each rank sums its micro-steps' gradients in bf16
# before the all-reduce averages them, one process sums all of them, and the roundings differ.
ONE_PROCESS_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
# Trained also with the default, balance_ranks=True: rows whose labels mask the prompt, padded and packed (4-bit).
BALANCED = CASES[:2]
LOSS_RTOL = 1e-6  # the logged loss, ours vs stock (ours: a float64 mean of the ranks' losses, the Trainer's float32)
# The logged loss and grad norm, 1 vs 2 processes, by adapter dtype (measured: 3.3e-8 and 8.9e-8 in float32; in
# bfloat16 the loss of the second step within 1.7e-6, after the first step's bf16 roundings, the grad norm equal).
ONE_PROCESS_LOSS_RTOL = {torch.float32: 1e-6, torch.bfloat16: 1e-5}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_paths(tmp_path_factory.mktemp("trl"))


def _train_cases(rank: int, world_size: int, paths: tuple[str, str]) -> dict[str, dict[str, Run]]:
    from ..helpers.trainers import as_accelerate_rank, record_collectives

    as_accelerate_rank(rank, world_size)
    from trl import SFTTrainer

    from ddp_ft.integrations import BucketedSFTTrainer

    log: list[str] = []
    record_collectives(log)
    results = {}
    for case in CASES:
        runs = {"ours": train(BucketedSFTTrainer, paths, case, world_size, log, balance_ranks=False)}
        if case in BALANCED:
            runs["balanced"] = train(BucketedSFTTrainer, paths, case, world_size, log)  # the default
        if world_size > 1:
            runs["stock"] = train(SFTTrainer, paths, case, world_size, log)
        results[case.name] = runs
    return results


@pytest.fixture(scope="module")
def runs(paths):
    """Each case's runs: ``two`` (one per rank) and ``one`` (the single process), by trainer."""
    two = run_distributed(_train_cases, paths, timeout=300)
    (one,) = run_distributed(_train_cases, paths, world_size=1, timeout=300)
    return two, one


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_adapters_bitwise_stock_sft_on_torch_ddp(runs, case: Case):
    """Same data, model, seed: BucketedDDP's averaged gradients are torch DDP's bit for bit, so are the adapters after
    training, on both ranks (float32 adapters, and the bfloat16 ones TRL makes for a 4-bit base)."""
    two, _ = runs
    for rank_runs in two:
        ours, stock = rank_runs[case.name]["ours"], rank_runs[case.name]["stock"]
        assert ours.adapters.keys() == stock.adapters.keys() and ours.adapters
        for name, weight in ours.adapters.items():
            assert_close(weight, stock.adapters[name], rtol=0, atol=0, msg=name)
    for name, weight in two[0][case.name]["ours"].adapters.items():
        assert_close(weight, two[1][case.name]["ours"].adapters[name], rtol=0, atol=0, msg=f"ranks differ: {name}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_logged_trl_metrics_are_stock_sft_trainers(runs, case: Case):
    """entropy, mean_token_accuracy and num_tokens, summed from the step's one all-gather instead of TRL's gathers on
    every micro-step, are exactly what stock SFTTrainer logs at every step; the loss (a float64 mean of the ranks'
    running losses, the Trainer's is float32) within LOSS_RTOL."""
    two, _ = runs
    ours, stock = two[0][case.name]["ours"].logs, two[0][case.name]["stock"].logs
    assert len(ours) == len(stock) == 2
    for mine, theirs in zip(ours, stock, strict=True):
        for key in ("entropy", "mean_token_accuracy", "num_tokens", "grad_norm", "learning_rate"):
            assert mine[key] == theirs[key], (key, mine, theirs)
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=LOSS_RTOL)
        assert mine["num_input_tokens_seen"] == mine["num_tokens"]  # the Trainer's count, on the same step's gather


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_step_collectives_buckets_and_one_all_gather(runs, case: Case):
    """Per optimizer step (accumulation 2 on each rank): nothing on the ``no_sync`` micro-step; on the synced one the
    bucket all-reduces, then one all-gather carrying TRL's metrics with the Trainer's counts. Without
    ``balance_ranks`` the Trainer's own all-gather of the step's answer-token count comes first (the loss divides by
    it before the first forward); with it that count is summed from the plan, and there is nothing else. Stock
    SFTTrainer, recorded the same way, all-gathers on the no_sync micro-step (what the recorder must see)."""
    two, _ = runs
    for rank_runs in two:
        runs_here = rank_runs[case.name]
        ours = runs_here["ours"]
        synced = ["substep_end"] + ["all_reduce"] * ours.buckets + ["all_gather"]
        assert ours.steps == [["all_gather", *synced]] * 2, ours.steps
        if "balanced" in runs_here:
            assert runs_here["balanced"].steps == [synced] * 2, runs_here["balanced"].steps
        stock_no_sync = runs_here["stock"].steps[1][: runs_here["stock"].steps[1].index("substep_end")]
        assert stock_no_sync.count("all_gather") >= 4, runs_here["stock"].steps


def _assert_agree(two: Run, one: Run, what: str) -> None:
    for name, weight in two.adapters.items():
        reference = one.adapters[name]
        atol = ONE_PROCESS_TOL[weight.dtype] * reference.abs().max().item()
        assert_close(weight, reference, rtol=0, atol=atol, msg=lambda m, name=name: f"{what}: {name}: {m}")
    rtol = ONE_PROCESS_LOSS_RTOL[next(iter(two.adapters.values())).dtype]
    for mine, single in zip(two.logs, one.logs, strict=True):
        assert mine["num_tokens"] == single["num_tokens"], (what, mine, single)
        assert mine["loss"] == pytest.approx(single["loss"], rel=rtol), (what, mine, single)
        assert mine["grad_norm"] == pytest.approx(single["grad_norm"], rel=rtol), (what, mine, single)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_2_ranks_equal_1_on_the_global_batch(runs, case: Case):
    """Two processes (accumulation 2 each) train as one process on the same 8 rows per step (accumulation 4): the
    adapters within ONE_PROCESS_TOL (float32: 1e-8; the bfloat16 adapters of a 4-bit base: one bf16 rounding),
    the loss and grad norm within ONE_PROCESS_LOSS_RTOL, the same token count. (TRL's entropy and token accuracy are
    means of per-micro-batch ratios, so they depend on how the rows fall into micro-batches, on any trainer.)"""
    two, one = runs
    _assert_agree(two[0][case.name]["ours"], one[case.name]["ours"], case.name)


@pytest.mark.parametrize("case", BALANCED, ids=lambda c: c.name)
def test_balanced_ranks_train_as_1_on_the_same_plan(runs, case: Case):
    """With ``balance_ranks`` (the default) each step's rows are split over ranks and micro-batches by the plain
    loop's plan, the same steps on any world size, padded or packed: two processes agree with one as the stock-order
    runs do, both ranks' adapters are equal, and the loss's divisor, summed from each row as TRL's collator makes its
    labels (the first token of each packed sequence masked), matched the ranks' batches at every step
    (``BucketedTrainer`` stops the run otherwise)."""
    two, one = runs
    _assert_agree(two[0][case.name]["balanced"], one[case.name]["balanced"], case.name)
    for name, weight in two[0][case.name]["balanced"].adapters.items():
        assert_close(weight, two[1][case.name]["balanced"].adapters[name], rtol=0, atol=0, msg=name)


def test_recipe_refuses_unknown_trainer_naming_choices(tmp_path):
    """``build_trainer(trainer=...)`` (the recipe's ``--trainer``): anything but hf or trl is an error before the
    data or the model load."""
    from ddp_ft.distributed import DistInfo
    from ddp_ft.integrations.recipe import build_trainer
    from ddp_ft.training.config import settings_from_preset

    settings = settings_from_preset("tiny", output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"--trainer 'sft': choose one of hf, trl"):
        build_trainer(settings, DistInfo(), "sft")


def test_iterable_dataset_balance_refused_unset_trains(tmp_path):
    """An iterable dataset has no plan: an explicit balance_ranks=True is refused before the model loads, naming the
    setting (it was dropped with an info log); left unset, the trainer takes the stock order."""
    from datasets import Dataset

    from ddp_ft.integrations import BucketedSFTTrainer

    iterable = Dataset.from_list([{"prompt": "a", "completion": " b"}]).to_iterable_dataset()
    args = sft_config(str(tmp_path), CASES[0], world_size=1, ddp_backend=None)
    with pytest.raises(ValueError, match=r"balance_ranks=True with an iterable train_dataset"):
        BucketedSFTTrainer(model="never loaded", args=args, train_dataset=iterable, balance_ranks=True)
    with pytest.raises(OSError):  # past the check: TRL goes on to load the model named here
        BucketedSFTTrainer(model="never/loaded", args=args, train_dataset=iterable)
