"""The widths the balanced plan reads from TRL's preference rows (``ddp_ft.integrations.trainer_rows``) against the
widths TRL's own collators pad each micro-batch to; no process group."""

import random

import pytest

pytest.importorskip("trl")


def _ids(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(3, 50) for _ in range(rng.randint(low, high))]


# Each kind's id columns, with the (fewest, most) tokens a row draws for each.
COLUMNS = {
    "dpo": {"prompt_ids": (1, 20), "chosen_ids": (1, 30), "rejected_ids": (1, 30)},
    "reward": {"chosen_ids": (1, 30), "rejected_ids": (1, 30)},
    "kto": {"prompt_ids": (1, 20), "completion_ids": (1, 30)},
}


def _rows(kind: str, rng: random.Random):
    from datasets import Dataset

    rows = [{name: _ids(rng, *span) for name, span in COLUMNS[kind].items()} for _ in range(24)]
    if kind == "kto":
        rows = [{**row, "label": True} for row in rows]
    return Dataset.from_list(rows)


def _collators():
    from trl.trainer.dpo_trainer import DataCollatorForPreference as DPO
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference as KTO
    from trl.trainer.reward_trainer import DataCollatorForPreference as Reward

    return {
        "dpo-cut": ("dpo", DPO(0, max_length=32)),
        "dpo-keep-end-multiple": ("dpo", DPO(0, max_length=40, truncation_mode="keep_end", pad_to_multiple_of=8)),
        "reward-multiple": ("reward", Reward(0, pad_to_multiple_of=8)),
        "kto-cut": ("kto", KTO(0, max_length=30)),
    }


@pytest.mark.parametrize("name", ["dpo-cut", "dpo-keep-end-multiple", "reward-multiple", "kto-cut"])
def test_row_widths_are_the_collators_batch_widths(name):
    """Any micro-batch TRL's collator pads is as wide as its widest row by ``row_lengths``: chosen and rejected in
    one batch, cut at ``max_length``, rounded up to ``pad_to_multiple_of``."""
    from ddp_ft.integrations.trainer_rows import row_lengths

    rng = random.Random(0)
    kind, collator = _collators()[name]
    rows = _rows(kind, rng)
    widths = row_lengths(rows, collator)
    for _ in range(50):
        batch = rng.sample(range(len(rows)), rng.randint(1, 4))
        assert collator([rows[i] for i in batch])["input_ids"].shape[1] == max(widths[i] for i in batch), batch


def test_other_collator_or_kl_rows_are_not_costed():
    """A subclass of TRL's collator may read other columns, and KTO rows with KL completions have a KL term that
    regrouping would change: neither is costed, and the refusal names why."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    from ddp_ft.integrations.trainer_rows import can_cost, row_lengths, uncostable_reason

    class Custom(DataCollatorForPreference):
        pass

    rng = random.Random(0)
    pairs, kto = _rows("dpo", rng), _rows("kto", rng)
    kl = kto.add_column("KL_completion_ids", kto["completion_ids"])
    assert not can_cost(pairs, Custom(0)) and row_lengths(pairs, Custom(0)) is None
    assert "Custom is not one whose batches" in uncostable_reason(pairs, Custom(0))
    assert not can_cost(kl, DataCollatorForUnpairedPreference(0))
    assert "KL term" in uncostable_reason(kl, DataCollatorForUnpairedPreference(0))
