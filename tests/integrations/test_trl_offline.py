"""BucketedDPOTrainer, BucketedKTOTrainer and BucketedRewardTrainer against one process on the global batch and
against TRL's stock classes on torch DDP: tiny Qwen3 with LoRA, 2 real gloo processes, 2 optimizer steps per run.

Two launches serve the distributed tests (module fixture ``runs``): 2 processes train every case of ``CASES``, and
stock TRL on torch DDP the cases of ``STOCK``; then 1 process trains the cases of ``ONE_PROCESS`` on the same global
batches (accumulation 4 instead of 2 per rank).
"""

from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from ..helpers.dist_harness import run_distributed
from ..helpers.trl_offline_runs import Case, OfflineRun, config, models, rows, train
from ..helpers.trl_runs import tiny_paths

pytest.importorskip("trl")
pytestmark = pytest.mark.distributed

CASES = (
    Case("dpo-adapter-ref", "DPO"),
    Case("dpo-4bit-ref-model", "DPO", reference="ref_model", four_bit=True),
    Case("dpo-precomputed-ref", "DPO", config={"precompute_ref_log_probs": True}),
    Case("kto-unpaired-no-kl", "KTO", config={"loss_type": "apo_zero_unpaired"}),
    Case("kto-precomputed-ref", "KTO", config={"loss_type": "apo_zero_unpaired", "precompute_ref_log_probs": True}),
    # KTO's default loss estimates its KL term from a mean all-gathered over the ranks at every micro-step: it
    # depends on how the rows fall into micro-batches, so only stock KTOTrainer on the same ranks is its reference.
    Case("kto-kl", "KTO"),
    Case("reward", "Reward"),
    # QLoRA: each trainer on a 4-bit NF4 base, DPO with both of TRL's references
    Case("dpo-4bit-adapter-ref", "DPO", four_bit=True),
    Case("kto-4bit", "KTO", four_bit=True, config={"loss_type": "apo_zero_unpaired"}),
    Case("reward-4bit", "Reward", four_bit=True, bf16=True),
)
# Trained again with balance_ranks=True on 2 processes only, against the stock order's single process: the plan
# regroups each step's rows, so this needs a loss that is a mean over each micro-batch's rows (KTO without KL, in
# random order: KTOConfig's default sequential order is one the plan refuses).
KTO_RANDOM = Case(
    "kto-random-order", "KTO", config={"loss_type": "apo_zero_unpaired", "train_sampling_strategy": "random"}
)
BALANCED = {"dpo-adapter-ref-balanced": "dpo-adapter-ref", "reward-balanced": "reward", "kto-balanced": KTO_RANDOM.name}
CASES += (
    replace(CASES[0], name="dpo-adapter-ref-balanced", balance=True),
    replace(next(c for c in CASES if c.name == "reward"), name="reward-balanced", balance=True),
    replace(KTO_RANDOM, name="kto-balanced", balance=True),
)
ONE_PROCESS = [case for case in CASES if case.name != "kto-kl" and not case.balance]
STOCK = [case for case in CASES if case.name in ("dpo-adapter-ref", "kto-kl", "reward")]
# Logged values that time the run, not train it
TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}
# One process vs two on the same global batches: each adapter tensor within this fraction of its largest entry
# (float32 adapters; the bfloat16 ones TRL makes for a 4-bit base differ by a bf16 rounding, as in tests/integrations/test_trl.py).
ONE_PROCESS_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
BF16_MODEL_TOL = 4e-2  # a bfloat16 model: forward and backward round in bf16 too, not only the adapters


def _tolerance(case: Case, weight: torch.Tensor) -> float:
    return BF16_MODEL_TOL if case.bf16 else ONE_PROCESS_TOL[weight.dtype]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_paths(tmp_path_factory.mktemp("trl_offline"))


def _train_cases(rank: int, world_size: int, paths: tuple[str, str]) -> dict[str, dict[str, OfflineRun]]:
    from ..helpers.trainers import as_accelerate_rank, record_collectives

    as_accelerate_rank(rank, world_size)
    import trl

    from ddp_ft.integrations import bucketed

    log: list[str] = []
    record_collectives(log)
    results = {}
    for case in CASES if world_size > 1 else [*ONE_PROCESS, KTO_RANDOM]:
        stock = getattr(trl, f"{case.trainer}Trainer")
        results[case.name] = {"ours": train(bucketed(stock), paths, case, world_size, log)}
        if world_size > 1 and case in STOCK:
            results[case.name]["stock"] = train(stock, paths, case, world_size, log)
    return results


@pytest.fixture(scope="module")
def runs(paths):
    """Each case's runs: ``two`` (one per rank) and ``one`` (the single process), by trainer."""
    two = run_distributed(_train_cases, paths, timeout=300)
    (one,) = run_distributed(_train_cases, paths, world_size=1, timeout=300)
    return two, one


@pytest.mark.parametrize("case", ONE_PROCESS, ids=lambda c: c.name)
def test_2_ranks_equal_1_on_the_global_batch(runs, case: Case):
    """Two processes (accumulation 2 each) train as one process on the same 8 rows per step (accumulation 4): the
    adapters within ONE_PROCESS_TOL on both ranks, equal across ranks, the logged loss within 1e-5 (a bfloat16
    model: one bf16 rounding). DPO's and
    reward's losses are means over each micro-batch's pairs, KTO's (without its KL term) over its rows, so the
    step's gradient is the same mean of micro-batch means on any split of the same micro-batches."""
    two, one = runs
    reference = one[case.name]["ours"]
    assert any(w.abs().max() > 0 for n, w in reference.adapters.items() if "lora_B" in n), "nothing trained"
    for rank, rank_runs in enumerate(two):
        ours = rank_runs[case.name]["ours"]
        assert ours.adapters.keys() == reference.adapters.keys() and ours.adapters
        for name, weight in ours.adapters.items():
            atol = _tolerance(case, weight) * reference.adapters[name].abs().max().item()
            message = f"rank {rank}: {name}"
            assert_close(weight, reference.adapters[name], rtol=0, atol=atol, msg=lambda m, s=message: f"{s}: {m}")
            assert_close(weight, two[0][case.name]["ours"].adapters[name], rtol=0, atol=0)
    rel = 2**-8 if case.bf16 else 1e-5
    for mine, single in zip(two[0][case.name]["ours"].logs, reference.logs, strict=True):
        assert mine["loss"] == pytest.approx(single["loss"], rel=rel), (mine, single)


@pytest.mark.parametrize("name", BALANCED)
def test_balanced_pairs_train_as_1_in_stock_order(runs, name: str):
    """``balance_ranks=True`` on 2 processes regroups each step's rows by their padded width (DPO and reward: the
    wider of chosen and rejected; KTO: prompt plus completion), and trains as 1 process with the stock sampler on
    the same 8 rows per step: the plan keeps the step's rows, and the loss is a mean over equal micro-batches.
    Premise: the first step's plan differs from the strided split and its slowest rank pads no more tokens."""
    two, one = runs
    reference = one[BALANCED[name]]["ours"]
    for rank, rank_runs in enumerate(two):
        ours = rank_runs[name]["ours"]
        assert ours.reordered, f"rank {rank}: the plan kept the strided split"
        assert ours.plan_costs[0] <= ours.plan_costs[1], ours.plan_costs
        assert ours.adapters.keys() == reference.adapters.keys() and ours.adapters
        for key, weight in ours.adapters.items():
            atol = ONE_PROCESS_TOL[weight.dtype] * reference.adapters[key].abs().max().item()
            message = f"rank {rank}: {key}"
            assert_close(weight, reference.adapters[key], rtol=0, atol=atol, msg=lambda m, s=message: f"{s}: {m}")
            assert_close(weight, two[0][name]["ours"].adapters[key], rtol=0, atol=0)
    for mine, single in zip(two[0][name]["ours"].logs, reference.logs, strict=True):
        assert mine["loss"] == pytest.approx(single["loss"], rel=1e-5), (mine, single)


@pytest.mark.parametrize("case", STOCK, ids=lambda c: c.name)
def test_adapters_bitwise_stock_trl_on_torch_ddp(runs, case: Case):
    """Same data, model, seed: the adapters after training are stock TRL's on torch DDP bit for bit, on both ranks,
    KTO's KL term included (its cross-rank mean is TRL's own gather, untouched)."""
    two, _ = runs
    for rank_runs in two:
        ours, stock = rank_runs[case.name]["ours"], rank_runs[case.name]["stock"]
        assert ours.adapters.keys() == stock.adapters.keys() and ours.adapters
        for name, weight in ours.adapters.items():
            assert_close(weight, stock.adapters[name], rtol=0, atol=0, msg=name)
        assert len(ours.logs) == len(stock.logs)
        for mine, theirs in zip(ours.logs, stock.logs, strict=True):  # every metric stock logs, as stock logs it
            logged = {key: value for key, value in theirs.items() if key not in TIMING}
            assert {key: mine.get(key) for key in logged} == pytest.approx(logged, rel=1e-6), (mine, theirs)


def test_ref_model_never_wrapped_never_communicates(runs):
    """DPO with a ``ref_model`` beside the LoRA policy on a 4-bit base: after training the reference is the plain
    model, none of its parameters has a gradient hook or a gradient, and each step all-reduces exactly the policy's
    buckets, once each, as the run whose reference is the disabled adapter does."""
    two, _ = runs
    for rank_runs in two:
        ours = rank_runs["dpo-4bit-ref-model"]["ours"]
        assert ours.ref_type == "Qwen3ForCausalLM", ours.ref_type
        assert (ours.ref_hooked, ours.ref_grads) == (0, 0)
        assert ours.buckets and len(ours.steps) == 2
        for step in ours.steps:
            assert step.count("all_reduce") == ours.buckets, step
        adapter_ref = rank_runs["dpo-adapter-ref"]["ours"]
        assert [step.count("all_reduce") for step in adapter_ref.steps] == [adapter_ref.buckets] * 2


def test_balance_ranks_refused_for_kto_kl_term(paths, tmp_path):
    """KTO's default loss estimates its KL term from each micro-step's rows: a plan that regroups them would change
    the gradient, so ``balance_ranks=True`` is refused before training, naming the setting, the columns and why."""
    import trl
    from transformers import AutoTokenizer

    from ddp_ft.integrations import bucketed

    case = Case("kto", "KTO")
    model, lora, _ = models(paths[1], case)
    args = config(str(tmp_path), case, world_size=1, ddp_backend=None)
    refusal = r"balance_ranks=True needs training rows.*these rows have .*KL_completion_ids.*KL term"
    with pytest.raises(ValueError, match=refusal):
        bucketed(trl.KTOTrainer)(
            model=model,
            args=args,
            train_dataset=rows("KTO", n=4),
            processing_class=AutoTokenizer.from_pretrained(paths[0]),
            peft_config=lora,
            balance_ranks=True,
        )
