"""Padding-free packing (``DataSettings.packing``, ``ddp_ft.training.data.packing``): packed rows keep sequences apart,
give the padded run's loss and gradients on 2 ranks, keep the ranks balanced, and are refused where attention would mix
them."""

import random
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from ddp_ft.distributed import DistInfo
from ddp_ft.training.config import config_values, parse_settings
from ddp_ft.training.data import (
    IGNORE_INDEX,
    DataSettings,
    PackedCollator,
    answer_tokens,
    balanced_plan,
    check_packed_model,
    count_tokens,
    pack_rows,
    packed_cost,
    packing_problem,
    rank_costs,
    resolve_packing,
    strided_plan,
)

from ..helpers.dist_harness import run_distributed
from ..helpers.meetings import write_mixed_length_meetings

PAD = 0


def _samples(lengths, seed=0):
    """Samples of these lengths: random ids (never the pad id), the first third of each a prompt (labels -100)."""
    g = random.Random(seed)
    out = []
    for n in lengths:
        ids = [g.randrange(1, 500) for _ in range(n)]
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (n // 3) + ids[n // 3 :]})
    return out


def _padded(samples):
    """Right-padded batch, as ``make_collator`` makes it."""
    width = max(len(s["input_ids"]) for s in samples)
    pad = [width - len(s["input_ids"]) for s in samples]
    return {
        "input_ids": torch.tensor([s["input_ids"] + [PAD] * p for s, p in zip(samples, pad, strict=True)]),
        "attention_mask": torch.tensor(
            [[1] * len(s["input_ids"]) + [0] * p for s, p in zip(samples, pad, strict=True)]
        ),
        "labels": torch.tensor([s["labels"] + [IGNORE_INDEX] * p for s, p in zip(samples, pad, strict=True)]),
    }


# -- the pure parts --------------------------------------------------------------------------------------------------


def test_pack_rows_places_each_sample_once_in_a_row():
    lengths = [90, 20, 60, 100, 35, 10, 128, 70]
    rows = pack_rows(lengths, 128)
    assert sorted(p for row in rows for p in row) == list(range(len(lengths)))
    assert all(sum(lengths[p] for p in row) <= 128 for row in rows)
    assert rows == [[6], [3, 1], [0, 4], [7, 5], [2]]  # first-fit decreasing: 513 tokens need 5 rows of 128
    assert packed_cost(lengths, 128) == len(rows) * 128 < len(lengths) * max(lengths)  # padded: 8 x 128
    assert pack_rows([300, 5], 128) == [[0], [1]]  # longer than a row: a row of its own


def test_samples_fitting_one_row_fill_two():
    """A micro-batch of two or more samples always packs into two rows or more, the longest first to the shorter
    row: a compiled layer that saw a batch of several rows would compile again for a batch of one."""
    assert pack_rows([10, 20, 5], 128) == [[1], [0, 2]]  # 35 tokens: fits one row, spread over two
    assert pack_rows([9, 9, 9, 9], 128) == [[0, 2], [1, 3]]
    assert pack_rows([7], 128) == [[0]]  # one sample: one row
    assert packed_cost([10, 20, 5], 128) == 2 * 24  # widths a multiple of 8: two rows of 24, not one of 40


PACKED_BATCHES = ([40, 30, 20], [12, 9], [40, 24, 10], [25, 30, 50, 7])  # sample lengths, rows of 64


def packed_graphs(device: str, backend: str) -> tuple[list[tuple[int, int]], int]:
    """Each of :data:`PACKED_BATCHES` packed, training through regionally compiled sdpa layers: the (rows, width)
    of each, and the graphs compiled. The second fits one row; the longest rows are 60, 12, 64 and 57 tokens."""
    from torch._dynamo.utils import counters
    from transformers import Qwen3ForCausalLM

    from ddp_ft.training.model.compilation import compile_repeated_blocks
    from ddp_ft.training.model.qlora import tiny_qwen3_config

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(500, num_hidden_layers=2)).to(device).train()
    compile_repeated_blocks(model, backend=backend)
    collate, shapes = PackedCollator(PAD, 64), []
    try:
        for lengths in PACKED_BATCHES:
            batch = {name: tensor.to(device) for name, tensor in collate(_samples(lengths)).items()}
            model(**batch, use_cache=False).loss.backward()
            shapes.append(tuple(batch["input_ids"].shape))
        return shapes, counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()


def test_one_row_micro_batch_reuses_compiled_layers():
    """One graph for every packed micro-batch, one short enough for a single row among them: a batch of one row
    would compile a second (Dynamo specialises sizes of 1). Dynamo's guards and graphs, no codegen."""
    shapes, graphs = packed_graphs("cpu", backend="eager")
    assert graphs == 1, shapes
    assert shapes == [(2, 64), (2, 16), (2, 64), (2, 64)]  # (rows, width), widths a multiple of 8


@pytest.mark.cuda
def test_compiled_sdpa_packed_rows_compile_once(run_on_gpu):
    """The same through TorchInductor on a GPU, where sdpa's mask must be aligned to 8 elements and Inductor
    guards on it: widths off that multiple would compile the layers again."""
    run_on_gpu(
        "from tests.training.test_packing import packed_graphs\n"
        "shapes, graphs = packed_graphs('cuda', backend='inductor')\n"
        "assert graphs == 1, (graphs, shapes)"
    )


def test_packed_collator_restarts_positions_and_labels():
    samples = _samples([40, 7, 25, 12])
    packed, padded = PackedCollator(PAD, 64)(samples), _padded(samples)
    assert "attention_mask" not in packed, "a mask would turn transformers' packed-sequence detection off"
    assert packed["input_ids"].shape == (2, 64)  # first fit: rows [40, 7, 12] and [25]; widths a multiple of 8
    positions, labels = packed["position_ids"][0].tolist(), packed["labels"][0].tolist()
    assert positions == list(range(40)) + list(range(7)) + list(range(12)) + list(range(5))
    assert labels[0] == labels[40] == labels[47] == IGNORE_INDEX, "no token predicts the next sequence's first"
    assert labels[48:59] == samples[3]["labels"][1:]
    assert packed["labels"][1, 25:].eq(IGNORE_INDEX).all() and packed["input_ids"][1, 25:].eq(PAD).all()
    assert packed["position_ids"][1, 25:].tolist() == list(range(39))  # the padding: a block of its own, last
    assert packed["input_ids"][0, 59:].eq(PAD).all() and packed["labels"][0, 59:].eq(IGNORE_INDEX).all()
    assert answer_tokens(packed) == answer_tokens(padded)
    assert count_tokens(packed, PAD) == count_tokens(padded) == 84 < packed["input_ids"].numel()


@pytest.mark.parametrize(("micro", "accumulation"), [(4, 4), (8, 1)])
def test_balance_on_packed_costs_evens_packed_tokens(micro, accumulation):
    """Two ranks, lengths 60..512 packed into rows of 512. With one micro-batch per rank the sorted cut would give one
    rank the short samples and the other the long ones (3.5x the packed tokens at worst on these draws): the plan
    then deals the sorted samples in a snake, mixing them."""
    g, spreads = random.Random(1), []
    for step in range(30):
        lengths = [g.randint(60, 512) for _ in range(2 * micro * accumulation)]
        indices = list(range(100 * step, 100 * step + len(lengths)))
        length_of = dict(zip(indices, lengths, strict=True))

        def cost(ls):
            return packed_cost(ls, 512)

        plan = balanced_plan(indices, lengths, 2, micro, accumulation, cost)
        assert sorted(i for rank in plan for batch in rank for i in batch) == indices
        costs = rank_costs(plan, length_of, cost)
        assert max(costs) <= max(rank_costs(strided_plan(indices, 2, micro, accumulation), length_of, cost))
        spreads.append(max(costs) / min(costs))
    assert sum(spreads) / len(spreads) <= 1.1 and max(spreads) <= 1.3, spreads


def test_packing_setting_is_true_false_or_auto_only():
    assert DataSettings().packing == "auto"
    assert parse_settings(["--packing", "true"]).data.packing is True
    assert parse_settings(["--packing", "off"]).data.packing is False
    with pytest.raises(ValueError, match="DataSettings.packing=.yes.: choose true, false or .auto."):
        DataSettings(packing="yes")
    with pytest.raises(ValueError, match="packing: 'yes' is a str; packing takes true, false or 'auto'"):
        config_values({"packing": "yes"}, "run.yaml")
    with pytest.raises(SystemExit):
        parse_settings(["--packing", "maybe"])
    assert resolve_packing("auto", "cpu", None)[0] is False  # the CPU keeps its padded defaults
    assert resolve_packing("auto", "cuda", None)[0] is True
    on, why = resolve_packing("auto", "cuda", "the reason")
    assert not on and "the reason" in why  # auto never packs where it cannot: it says why instead
    with pytest.raises(
        ValueError, match=r"--packing true cannot keep packed sequences apart: the reason\. .*--packing false"
    ):
        resolve_packing(True, "cpu", "the reason")


def test_one_row_or_cache_attention_is_a_problem():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(use_cache=False)
    assert packing_problem(config, Qwen3ForCausalLM) is None
    config._attn_implementation = "flash_attention_2"  # reads boundaries from position_ids only in a batch of 1 row
    assert "only in a batch of one row" in packing_problem(config, Qwen3ForCausalLM)
    assert "use_cache" in packing_problem(Qwen3Config(use_cache=True), Qwen3ForCausalLM)
    assert "masking_utils" in packing_problem(config=SimpleNamespace(use_cache=False), model_class=torch.nn.Linear)


# -- attention on the tiny Qwen3 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from ddp_ft.training.model.qlora import build_tiny_qwen3

    return str(build_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "qwen3", vocab_size=512, seed=0))


def _load(path, attention):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, dtype=torch.float32)
    model.config.use_cache = False  # as load_qlora_model sets it
    return model


def _logits_of_b(model, a, b):
    """B's logits packed after A (a row with padding below it), and B's alone."""
    samples = _samples([len(a), len(b), len(a) + len(b) + 5])
    samples[0]["input_ids"], samples[1]["input_ids"] = a, b
    batch = PackedCollator(PAD, len(a) + len(b) + 5)(samples)
    assert batch["input_ids"].shape[0] == 2 and batch["input_ids"][1, : len(a)].tolist() == a  # A then B, in row 1
    batch.pop("labels")
    packed = model(**batch).logits[1, len(a) : len(a) + len(b)]
    alone = model(input_ids=torch.tensor([b])).logits[0]
    return packed, alone


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_sequence_cannot_attend_its_neighbour(tiny_path, attention):
    model = _load(tiny_path, attention)
    check_packed_model(model)  # accepted
    a, other_a, b = list(range(1, 30)), list(range(100, 140)), list(range(200, 217))
    for training, grad in ((True, True), (False, False)):
        model.train(training)
        with torch.set_grad_enabled(grad):
            packed, alone = _logits_of_b(model, a, b)
            packed_other, _ = _logits_of_b(model, other_a, b)
        assert_close(packed, alone, rtol=1e-5, atol=1e-5)  # B's logits packed after A are B's logits alone
        assert_close(packed_other, packed, rtol=1e-5, atol=1e-5)  # and another A changes nothing in B


def test_all_labels_no_prediction_across_a_boundary(tiny_path):
    """Samples labelled on every token (no prompt to mask): the first label of each packed sample must be dropped,
    as the padded batch drops it by the shift, or the last token of one sample would learn to predict the next."""
    model = _load(tiny_path, "sdpa")
    samples = [{"input_ids": s["input_ids"], "labels": list(s["input_ids"])} for s in _samples([30, 9, 21, 14])]
    packed, padded = PackedCollator(PAD, 64)(samples), _padded(samples)
    assert packed["input_ids"].shape[0] < len(samples), "the premise: some row holds several samples"
    answers = answer_tokens(padded)
    assert answer_tokens(packed) == answers == sum(len(s["input_ids"]) - 1 for s in samples)
    with torch.no_grad():
        losses = [model(**batch, num_items_in_batch=answers).loss for batch in (packed, padded)]
    assert_close(losses[0], losses[1], rtol=1e-6, atol=0)


def test_packing_refuses_attention_ignoring_the_mask(tiny_path):
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def causal_only(module, query, key, value, attention_mask, **kwargs):  # a kernel that knows only is_causal
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    AttentionInterface.register("causal_only", causal_only)
    AttentionMaskInterface.register("causal_only", sdpa_mask)
    model = _load(tiny_path, "causal_only")
    a, other_a, b = list(range(1, 30)), list(range(100, 140)), list(range(200, 217))
    with torch.no_grad():
        packed, _ = _logits_of_b(model, a, b)
        packed_other, _ = _logits_of_b(model, other_a, b)
    assert (packed - packed_other).abs().max() > 1e-2, "the premise: this kernel lets B attend to A"
    with pytest.raises(ValueError, match=r"--packing true cannot keep packed sequences apart: .*'causal_only'"):
        check_packed_model(model)


# -- gradients: 2 packed ranks against 1 padded process ------------------------------------------------------------


def _packed_against_padded(rank, world_size, cache, source):
    from ddp_ft.ddp import BucketedDDP
    from ddp_ft.training.data import EpochLoader
    from ddp_ft.training.steps import forward_backward, step_counts

    from .test_train import _setup

    model, data, _, seed = _setup(world_size, rank, cache, source)
    single, _, padded_collate, _ = _setup(world_size, rank, cache, source)
    collate = PackedCollator(PAD, 256)
    micro, accumulation = 4, 2
    effective = world_size * micro * accumulation
    loader = EpochLoader(data, collate, micro, rank, world_size, seed, effective_batch=effective, cost=collate.cost)
    plan = next(loader.plans(0))
    group = list(loader.epoch(0))[:accumulation]
    assert all("attention_mask" not in batch for batch in group)
    info = DistInfo(rank, rank, world_size)
    loss, counts = forward_backward(BucketedDDP(model), group, info, step_counts(group, info, pad_token_id=PAD))
    # one process, the step's samples in one padded micro-batch
    step = sorted(i for batches in plan for batch in batches for i in batch)
    padded = padded_collate([data[i] for i in step])
    assert padded["attention_mask"].eq(0).any(), "the premise: the padded batch carries padding"
    single_loss, single_counts = forward_backward(single, [padded], DistInfo())
    assert counts.tolist() == single_counts.tolist()  # answer tokens (the divisor) and input tokens
    assert loss.item() == pytest.approx(single_loss.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), single.parameters(), strict=True):
        if p.requires_grad:
            assert torch.count_nonzero(p.grad) > 0, name
            assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * q.grad.abs().max().item(), msg=name)
    length_of = {i: len(data[i]["input_ids"]) for i in step}
    return rank_costs(plan, length_of, collate.cost), sum(b["input_ids"].numel() for b in group)


@pytest.mark.distributed
@pytest.mark.slow
def test_2_packed_ranks_give_1_padded_rank_gradients(tmp_path):
    """2 ranks with BucketedDDP, each on packed micro-batches of the balanced plan, against one process on the step's
    samples in one right-padded batch: same token counts, loss and gradients (fp32), and each rank computes the
    packed tokens the plan gave it, about the same on both."""
    source = write_mixed_length_meetings(tmp_path / "mixed.jsonl")
    (costs, mine), (_, theirs) = run_distributed(_packed_against_padded, str(tmp_path), source, timeout=300)
    assert [mine, theirs] == costs  # the plan's packed cost is what each rank computed
    assert max(costs) <= 1.15 * min(costs), costs


# -- the entry points: the plain loop and the Trainer recipe ---------------------------------------------------------


def _run(kind, tmp_path, source, packing):
    from ddp_ft.integrations.recipe import build_trainer
    from ddp_ft.training.config import settings_from_preset
    from ddp_ft.training.loop import train

    out = tmp_path / f"{kind}-{packing}"
    settings = settings_from_preset(
        "tiny", output_dir=str(out), source=source, packing=packing, max_steps=2, lora_dropout=0.0, report_to="none"
    )
    if kind == "loop":
        result = train(settings, DistInfo())
        return [result.first_loss, result.last_loss, result.eval_loss], None
    trainer = build_trainer(settings, DistInfo())
    assert isinstance(trainer.data_collator, PackedCollator) == packing
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses + [trainer.evaluate()["eval_loss"]], trainer.state.num_input_tokens_seen


@pytest.mark.parametrize("kind", ["loop", "recipe"])
def test_packed_loop_and_trainer_train_padded_losses(tmp_path, monkeypatch, tiny_cache, kind):
    monkeypatch.setenv("DDP_FT_CACHE", tiny_cache)
    source = write_mixed_length_meetings(tmp_path / "mixed.jsonl")
    packed, packed_tokens = _run(kind, tmp_path, source, True)
    padded, padded_tokens = _run(kind, tmp_path, source, False)
    # the two steps' train losses, then the eval loss after them: summation order only, which AdamW's first steps
    # (about lr x sign(g)) carry into the weights (measured on the loop: 0 and 0, then 1.1e-5 relative)
    assert packed == pytest.approx(padded, rel=1e-4)
    assert packed_tokens == padded_tokens  # the Trainer's non-padding count: None for the loop (from the samples)
