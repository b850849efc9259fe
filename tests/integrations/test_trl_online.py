"""TRL's online trainers on BucketedDDP: BucketedGRPOTrainer and BucketedRLOOTrainer against stock GRPOTrainer and
RLOOTrainer on torch DDP, tiny Qwen3, 2 real gloo processes, 2 optimizer steps per run.

One launch serves every test here (module fixture ``runs``): each case of ``CASES`` (GRPO with LoRA, accumulation 2
and a reward model beside a reward function; RLOO fully fine-tuned with its reference copy; RLOO with LoRA, its
reference the model with the adapter disabled, one generation serving two steps) trains with the stock
trainer and the bucketed one at the same seed, recording what the reward function was given, the collectives of
every step and the generations among them. The reward function scores a completion by its length, so the groups'
advantages differ from zero and the weights move. About 15 s on 2 CPU cores.
"""

import logging
import random
import tempfile
from dataclasses import dataclass

import pytest
import torch
from torch.testing import assert_close

from ..helpers.dist_harness import run_distributed
from ..helpers.trl_runs import cpu_arguments

pytest.importorskip("trl")
pytestmark = pytest.mark.distributed

WORDS = "meeting budget design remote control team project manager market user interface idea button colour".split()


@dataclass(frozen=True)
class Case:
    """One online run: the trainer, LoRA or full fine-tuning, accumulation, a reward model beside the function, and
    how many optimizer steps each generation serves (more than one: TRL computes the old log-probabilities)."""

    trainer: str  # "GRPO" or "RLOO"
    lora: bool
    accumulation: int
    reward_model: bool
    balance_ranks: bool  # passed to the bucketed trainer: it must be turned off
    steps_per_generation: int = 1

    @property
    def name(self) -> str:
        tuning = "lora" if self.lora else "full"
        extra = "-reward_model" if self.reward_model else ""
        return f"{self.trainer}-{tuning}-accum{self.accumulation}-gen{self.steps_per_generation}{extra}"

    @property
    def generations(self) -> list[int]:
        """Generations in each of the 2 optimizer steps."""
        return [1, 0] if self.steps_per_generation == 2 else [1, 1]


# RLOO's beta > 0 by default: a reference copy of the full model; with LoRA, the model with its adapter disabled.
CASES = (
    Case("GRPO", lora=True, accumulation=2, reward_model=True, balance_ranks=True),
    Case("RLOO", lora=False, accumulation=1, reward_model=False, balance_ranks=False),
    Case("RLOO", lora=True, accumulation=1, reward_model=False, balance_ranks=False, steps_per_generation=2),
)


@dataclass
class Run:
    """What one run left: its trained weights, the completions its rewards saw, its collectives per step."""

    weights: dict[str, torch.Tensor]  # the trained parameters
    completions: list[list[str]]  # what the reward function was given, per generation
    steps: list[list[str]]  # per optimizer step: its collectives and generation markers, in order
    buckets: int  # BucketedDDP's buckets (0 for torch DDP)
    moved: float  # the largest change of a trained parameter
    logs: list[dict]  # the Trainer's log history
    others: list[str]  # the types of the reward and reference models the trainer holds


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from ddp_ft.training.data.tokenizer import build_tiny_tokenizer, load_tokenizer
    from ddp_ft.training.model.qlora import build_tiny_qwen3

    root = tmp_path_factory.mktemp("trl_online")
    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    model = build_tiny_qwen3(root / "qwen3", vocab_size=len(load_tokenizer(str(tokenizer))), seed=0)
    return str(tokenizer), str(model)


def prompts(n: int = 8, seed: int = 0):
    """``n`` plain-text prompts of a few words."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))} for _ in range(n)])


def config(case: Case, out: str):
    """The trainer's config: CPU, gloo, 2 optimizer steps of 4 completions per rank, short sampled completions."""
    import trl

    config_class = {"GRPO": trl.GRPOConfig, "RLOO": trl.RLOOConfig}[case.trainer]
    return config_class(
        **cpu_arguments(out),
        per_device_train_batch_size=4 // case.accumulation,
        gradient_accumulation_steps=case.accumulation,
        steps_per_generation=case.accumulation * case.steps_per_generation,
        num_generations=2,
        max_completion_length=6,
    )


def _model(case: Case, model_path: str):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return model, lora if case.lora else None


def _reward_model(model_path: str):
    """A tiny sequence classifier with one label, seeded: the same on every rank and run."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_path, num_labels=1, pad_token_id=0)
    torch.manual_seed(1)
    return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)


def recorded(trainer_class: type, log: list[str]) -> type:
    """``trainer_class`` marking its generations in ``log``, between the collectives :func:`record_collectives`
    writes there."""

    class Recorded(trainer_class):
        def _generate_single_turn(self, *args, **kwargs):
            log.append("generate")
            completions = super()._generate_single_turn(*args, **kwargs)
            log.append("generated")
            return completions

    return Recorded


def record_collectives(log: list[str], current: list) -> None:
    """Append every ``torch.distributed`` collective this process calls to ``log``: ``bucket_all_reduce`` for an
    all-reduce of a bucket of the BucketedDDP that the trainer in ``current`` trains, otherwise its name."""
    import torch.distributed as dist

    from ..helpers.trainers import COLLECTIVES

    def is_bucket(tensor) -> bool:
        buffers = getattr(current[0].model_wrapped, "bucket_buffers", []) if current else []
        return isinstance(tensor, torch.Tensor) and any(tensor.data_ptr() == b.data_ptr() for b in buffers)

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def call(*args, _name=name, _original=original, **kwargs):
            bucket = _name == "all_reduce" and is_bucket(args[0] if args else kwargs.get("tensor"))
            log.append("bucket_all_reduce" if bucket else _name)
            return _original(*args, **kwargs)

        setattr(dist, name, call)


def _rewards(case: Case, model_path: str, tokenizer, seen: list[list[str]]):
    """The reward functions and their tokenizers: completion length in characters, recording what it was given;
    with ``case.reward_model`` a tiny classifier first."""

    def reward_length(prompts, completions: list[str], **kwargs) -> list[float]:
        seen.append(list(completions))
        return [float(len(c)) for c in completions]

    if case.reward_model:
        return [_reward_model(model_path), reward_length], [tokenizer, None]
    return [reward_length], [None]


def train(trainer_class: type, case: Case, paths: tuple[str, str], log: list[str], current: list, **kw) -> Run:
    """Train ``case`` with ``trainer_class`` and return its :class:`Run`."""
    from transformers import AutoTokenizer, TrainerCallback

    class Marker(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            log.append("step_end")

    tokenizer_path, model_path = paths
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model, lora = _model(case, model_path)
    completions: list[list[str]] = []
    rewards, reward_tokenizers = _rewards(case, model_path, tokenizer, completions)
    with tempfile.TemporaryDirectory() as out:
        trainer = recorded(trainer_class, log)(
            model,
            rewards,
            config(case, out),  # positional, as TRL's signature has it: after reward_funcs
            train_dataset=prompts(),
            processing_class=tokenizer,
            reward_processing_classes=reward_tokenizers,
            peft_config=lora,
            callbacks=[Marker()],
            **kw,
        )
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        current[:] = [trainer]
        log.clear()
        trainer.train()
    steps, current = [], []
    for entry in log:
        if entry == "step_end":
            steps.append(current)
            current = []
        else:
            current.append(entry)
    trained = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    weights = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
    moved = max((weights[n] - initial[n]).abs().max().item() for n in weights)
    others = [type(m).__name__ for m in (*trainer.reward_funcs, trainer.ref_model) if isinstance(m, torch.nn.Module)]
    buckets = len(getattr(trainer.model_wrapped, "bucket_sizes", []))
    return Run(weights, completions, steps, buckets, moved, trainer.state.log_history, others)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train_cases(rank: int, world_size: int, paths: tuple[str, str]) -> dict:
    from ..helpers.trainers import as_accelerate_rank

    as_accelerate_rank(rank, world_size)
    import trl

    from ddp_ft.integrations import bucketed

    log: list[str] = []
    current: list = []
    record_collectives(log, current)

    warnings = _Warnings()
    logging.getLogger("ddp_ft.integrations.bucketed").addHandler(warnings)
    results: dict = {"warnings": warnings.messages}
    for case in CASES:
        stock = getattr(trl, f"{case.trainer}Trainer")
        results[case.name] = {
            "ours": train(bucketed(stock), case, paths, log, current, balance_ranks=case.balance_ranks),
            "stock": train(stock, case, paths, log, current),
        }
    return results


@pytest.fixture(scope="module")
def runs(paths):
    """Each rank's runs of each case, by trainer, and the warnings ddp_ft.integrations.bucketed logged."""
    return run_distributed(_train_cases, paths, timeout=300)


# Logged by TRL or the Trainer from the host clock: these differ between any two runs.
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
# Logged by BucketedTrainer only: the count of tokens seen, which GRPO and RLOO keep themselves (``num_tokens``).
OURS_ONLY = {"num_input_tokens_seen", "train_tokens_per_second"}  # and train_runtime with them at each step
LOSS_RTOL = 1e-6  # the logged loss, ours vs stock (ours: a float64 mean of the ranks' losses, the Trainer's float32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_completions_and_weights_bitwise_stock(runs, case: Case):
    """Same model, data and seed: each rank generates the same completions as the stock trainer on torch DDP, and
    the trained weights are the same bit for bit, on both ranks. (The averaged gradients are torch DDP's bit for bit,
    so nothing differs to tolerate; ``balance_ranks=True``, turned off, changes nothing.)"""
    for rank_runs in runs:
        ours, stock = rank_runs[case.name]["ours"], rank_runs[case.name]["stock"]
        assert ours.completions == stock.completions and len(ours.completions) == sum(case.generations)
        assert ours.weights.keys() == stock.weights.keys() and ours.weights and ours.moved > 1e-3
        for name, weight in ours.weights.items():
            assert_close(weight, stock.weights[name], rtol=0, atol=0, msg=name)
    for name, weight in runs[0][case.name]["ours"].weights.items():
        assert_close(weight, runs[1][case.name]["ours"].weights[name], rtol=0, atol=0, msg=f"ranks differ: {name}")
    assert runs[0][case.name]["ours"].completions != runs[1][case.name]["ours"].completions  # each its own prompts


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_logged_metrics_are_the_stock_trainers(runs, case: Case):
    """Rewards, lengths, entropy, KL, clip ratios, grad norm, token count: exactly what the stock trainer logs; the
    loss within LOSS_RTOL. Ours adds the Trainer's ``num_input_tokens_seen``, equal to TRL's ``num_tokens``."""
    ours, stock = runs[0][case.name]["ours"].logs, runs[0][case.name]["stock"].logs
    assert len(ours) == len(stock) == 3
    for mine, theirs in zip(ours, stock, strict=True):
        assert mine.keys() - OURS_ONLY - {"train_runtime"} == theirs.keys() - {"train_runtime"}
        for key in theirs.keys() - TIMINGS - {"loss", "train_loss"}:
            assert mine[key] == theirs[key], (key, mine, theirs)
        for key in {"loss", "train_loss"} & theirs.keys():
            assert mine[key] == pytest.approx(theirs[key], rel=LOSS_RTOL, abs=1e-12), key
        if "num_tokens" in mine:
            assert mine["num_input_tokens_seen"] == mine["num_tokens"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_generation_no_collective_steps_one_per_bucket(runs, case: Case):
    """Generation runs on the unwrapped model: nothing at all is communicated while it generates. Each optimizer step
    all-reduces each bucket once (accumulation included: ``no_sync`` on the other micro-steps); the rest of the
    step's collectives are TRL's gathers of rewards and metrics, as in the stock run, and our one step gather."""
    for rank_runs in runs:
        ours = rank_runs[case.name]["ours"]
        assert len(ours.steps) == 2 and ours.buckets >= 1
        for step, generations in zip(ours.steps, case.generations, strict=True):
            assert step.count("generate") == generations
            if generations:
                assert step[step.index("generate") + 1] == "generated", step
            assert step.count("bucket_all_reduce") == ours.buckets, step
        stock = rank_runs[case.name]["stock"]
        assert all("bucket_all_reduce" not in step for step in stock.steps)


def test_reward_and_reference_models_are_never_wrapped(runs):
    """The reward model (GRPO) and the reference model RLOO copies for its KL term (``beta`` > 0) are prepared for
    evaluation: plain modules on both ranks, never BucketedDDP (with LoRA there is no copy)."""
    for rank_runs in runs:
        assert rank_runs[CASES[0].name]["ours"].others == ["Qwen3ForSequenceClassification"]
        assert rank_runs[CASES[1].name]["ours"].others == ["Qwen3ForCausalLM"]
        assert rank_runs[CASES[2].name]["ours"].others == []


def test_balance_ranks_off_and_logged_once_on_rank_0(runs):
    """``balance_ranks=True`` on an online trainer: one warning on rank 0 naming it, none on rank 1; the run trains
    with TRL's sampler (bitwise the stock run, above)."""
    rank0, rank1 = runs[0]["warnings"], runs[1]["warnings"]
    assert len(rank0) == 1 and rank1 == []
    assert rank0[0].startswith("Recorded: balance_ranks=True is off"), rank0  # named by the test's subclass


def test_grpo_rloo_subclasses_generate_online_dpo_not():
    """Which made classes turn ``balance_ranks`` off: TRL's GRPO and RLOO and any subclass of theirs."""
    import trl

    from ddp_ft.integrations import bucketed
    from ddp_ft.integrations.bucketed import generates_online

    class MyGRPOTrainer(trl.GRPOTrainer):
        pass

    assert generates_online(MyGRPOTrainer) and generates_online(trl.RLOOTrainer)
    assert not generates_online(trl.DPOTrainer) and not generates_online(trl.SFTTrainer)
    assert "balance_ranks=True`` is off" in bucketed(MyGRPOTrainer).__doc__
