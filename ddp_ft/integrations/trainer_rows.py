"""What the balanced plan balances for TRL's preference rows: each row's padded width.

A right-padding collator makes every sequence as wide as the batch's widest.
TRL's pair collators put chosen and rejected in one forward, the same factor for every micro-batch.
So the plan balances the wider of the two, prompt included.
Only TRL's own collators are costed, by exact class.
"""

from __future__ import annotations

from collections.abc import Callable

# TRL's text collators the plan can cost (trl 1.16).
_DPO = ("trl.trainer.dpo_trainer", "DataCollatorForPreference")
_REWARD = ("trl.trainer.reward_trainer", "DataCollatorForPreference")
_KTO = ("trl.trainer.kto_trainer", "DataCollatorForUnpairedPreference")


def row_lengths(dataset, collator) -> list[int] | None:
    """Each row's padded width in a micro-batch of ``collator``, for TRL's DPO, reward or KTO rows.

    Args:
        dataset: the training rows, as the trainer prepared them.
        collator: the trainer's ``data_collator``.

    Returns:
        list[int] | None: one width per row, or None for rows the plan cannot cost.
    """
    found = _width_of(collator, getattr(dataset, "column_names", None) or [])
    if found is None:
        return None
    names, width = found
    multiple = getattr(collator, "pad_to_multiple_of", None) or 1
    widths = [width(*row) for row in zip(*(dataset[name] for name in names), strict=True)]
    return [-(-w // multiple) * multiple for w in widths]


def can_cost(dataset, collator) -> bool:
    """Whether :func:`row_lengths` costs these rows, without reading them."""
    return _width_of(collator, getattr(dataset, "column_names", None) or []) is not None


def uncostable_reason(dataset, collator) -> str:
    """Why :func:`row_lengths` cannot cost these rows, for the refusal."""
    if _kind(collator) == _KTO and "KL_completion_ids" in (getattr(dataset, "column_names", None) or []):
        return (
            "KTO's KL term is a mean over each micro-step's rows, gathered over the ranks, so regrouping the rows "
            "would change the gradient (a loss_type without it, such as apo_zero_unpaired, can be balanced)"
        )
    return (
        f"the collator {type(collator).__name__} is not one whose batches the plan can cost (TRL's DPO, reward or "
        "KTO collator), so counting these columns could balance the wrong tokens"
    )


def _kind(collator) -> tuple[str, str]:
    return type(collator).__module__, type(collator).__qualname__


def _width_of(collator, columns: list[str]) -> tuple[tuple[str, ...], Callable[..., int]] | None:
    """The id columns a row's width is read from, and how; None for rows it cannot cost."""
    cap = getattr(collator, "max_length", None) or float("inf")
    kind, present = _kind(collator), set(columns)
    if kind == _DPO and {"prompt_ids", "chosen_ids", "rejected_ids"} <= present:
        names = ("prompt_ids", "chosen_ids", "rejected_ids")
        return names, lambda prompt, chosen, rejected: int(min(cap, len(prompt) + max(len(chosen), len(rejected))))
    if kind == _REWARD and {"chosen_ids", "rejected_ids"} <= present:
        return ("chosen_ids", "rejected_ids"), lambda chosen, rejected: max(len(chosen), len(rejected))
    if kind == _KTO and {"prompt_ids", "completion_ids"} <= present and "KL_completion_ids" not in present:
        return ("prompt_ids", "completion_ids"), lambda prompt, completion: int(min(cap, len(prompt) + len(completion)))
    return None
