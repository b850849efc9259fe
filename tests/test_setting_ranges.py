"""Every numeric setting is checked for its own range first (ddp_ft.training.ranges), naming the setting and a valid
value, and the values it allows are ones the plain loop's optimizer and schedule and the Trainer's arguments take. Pure:
no model, no process group (the ``ddp-ft --nproc 2`` parent's refusal is a row of tests/commands/test_cli.py)."""

import math
import typing
from dataclasses import fields

import pytest
import torch

from ddp_ft.ddp.ranges import DDP_RANGES
from ddp_ft.distributed import DistInfo
from ddp_ft.training.config import SECTIONS, settings_from_preset
from ddp_ft.training.model.precision import choose_precision
from ddp_ft.training.ranges import DATA_RANGES, LORA_RANGES, SEED_MAX, TRAIN_RANGES

TABLES = {"train": TRAIN_RANGES, "lora": LORA_RANGES, "data": DATA_RANGES, "ddp": DDP_RANGES, "model": {}}
OWN_FLOOR = {"max_seq_len"}  # DataSettings explains its floor itself (tests/test_data.py)

# (setting, a value outside its own range): each row is refused naming the setting, with the setting's default as
# a valid value in the message.
REFUSED = [
    ("learning_rate", -0.001),
    ("learning_rate", 0.0),  # was a ZeroDivisionError from the scheduler, after the model loaded
    ("learning_rate", math.nan),
    ("learning_rate", math.inf),
    ("learning_rate", "fast"),
    ("min_learning_rate", -1e-5),
    ("warmup_ratio", -0.1),
    ("warmup_ratio", 1.0),
    ("weight_decay", -0.01),
    ("max_grad_norm", -1.0),
    ("seed", -1),
    ("seed", SEED_MAX + 1),
    ("effective_batch", 0),
    ("micro_batch", 0),
    ("micro_batch", "big"),
    ("epochs", 0),
    ("epochs", 1.5),
    ("max_steps", 0),
    ("max_steps", -2),
    ("save_every", -1),
    ("save_total_limit", -1),
    ("eval_every", -1),
    ("lora_r", 0),
    ("lora_alpha", 0),
    ("lora_dropout", -0.1),
    ("lora_dropout", 1.0),
    ("eval_fraction", 1.0),
    ("num_synthetic", 1),
    ("data_seed", -1),
    ("bucket_cap_mb", 0.0),
    ("bucket_cap_mb", "fast"),
    ("first_bucket_cap_mb", math.nan),
    ("powersgd_rank", 0),
    ("powersgd_start_iter", 1),
    ("ddp_timeout", 0),
    ("effective_batch", True),  # a bool is not a number of samples
]


def _numeric_fields():
    """(section, field) of every settings field declared int or float (also ``int | str``: ``auto``)."""
    for section, cls in SECTIONS.items():
        annotations = typing.get_type_hints(cls)
        for f in fields(cls):
            if {int, float} & set(typing.get_args(annotations[f.name]) or (annotations[f.name],)):
                yield section, f.name


def test_every_numeric_setting_of_every_section_has_a_range():
    missing = [(s, n) for s, n in _numeric_fields() if n not in TABLES[s] and n not in OWN_FLOOR]
    assert not missing, f"numeric settings without a range in ddp_ft.training.ranges: {missing}"
    assert {n for table in TABLES.values() for n in table} == {n for _, n in _numeric_fields()} - OWN_FLOOR


@pytest.mark.parametrize(("name", "value"), REFUSED, ids=[f"{n}={v!r}" for n, v in REFUSED])
def test_a_value_outside_its_own_range_is_refused_naming_the_setting_and_a_valid_value(name, value):
    default = next(f.default for cls in SECTIONS.values() for f in fields(cls) if f.name == name)
    with pytest.raises(ValueError) as refused:
        settings_from_preset("tiny", **{name: value})
    message = str(refused.value)
    assert message.split(":")[0].removeprefix("DataSettings.") == f"{name}={value!r}", message
    assert f"e.g. {name}={default!r}, the default" in message, message
    settings_from_preset("tiny", **{name: default})  # the value named is valid


def test_a_negative_learning_rate_is_refused_as_a_learning_rate_not_as_the_floor_above_it():
    """The issue's case: -0.001 was refused as "min_learning_rate=0.0001 is above learning_rate=-0.001: lower it"."""
    with pytest.raises(ValueError, match=r"^learning_rate=-0\.001: must be a positive number"):
        settings_from_preset("tiny", learning_rate=-0.001, min_learning_rate=1e-4)
    with pytest.raises(ValueError, match=r"min_learning_rate=0\.01 is above learning_rate=0\.001.*at most that"):
        settings_from_preset("tiny", learning_rate=1e-3, min_learning_rate=1e-2)  # both in range: the relation


EDGES = [  # the least (and most) each range allows, together: the run's schedule and the Trainer take them
    dict(learning_rate=1e-12, min_learning_rate=0.0, warmup_ratio=0.0, weight_decay=0.0, max_grad_norm=0.0, seed=0),
    dict(learning_rate=1e-3, min_learning_rate=1e-3, warmup_ratio=0.999, seed=SEED_MAX, max_steps=1, epochs=1),
    dict(save_every=0, save_total_limit=0, eval_every=0, max_steps=-1, micro_batch=1, effective_batch=1),
]


@pytest.mark.parametrize("edge", EDGES)
def test_the_edges_of_the_ranges_build_the_loops_schedule_and_the_trainers_arguments(edge, tmp_path):
    from transformers import TrainingArguments, get_cosine_with_min_lr_schedule_with_warmup, set_seed

    from ddp_ft.integrations.recipe import training_arguments
    from ddp_ft.training.resolve import Resolved

    settings = settings_from_preset("tiny", output_dir=str(tmp_path), report_to="none", **edge)
    t = settings.train
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=t.learning_rate, weight_decay=t.weight_decay)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, math.ceil(t.warmup_ratio * 8), 8, min_lr=t.min_learning_rate
    )  # as ddp_ft.training.loop builds it
    for _ in range(8):
        optimizer.step()
        schedule.step()
        assert 0.0 <= optimizer.param_groups[0]["lr"] <= t.learning_rate  # warmup starts below the floor
    assert optimizer.param_groups[0]["lr"] == pytest.approx(t.min_learning_rate)  # the decay ends on the floor
    set_seed(t.seed)  # numpy's seed range: what the Trainer does with it
    precision = choose_precision("float32", "cpu", None)
    resolved = Resolved(t.micro_batch, 1, False, precision, {"": "cpu"}, "the edge's", "off")
    args = TrainingArguments(**training_arguments(settings, DistInfo(), precision, resolved))
    assert (args.learning_rate, args.max_grad_norm, args.seed) == (t.learning_rate, t.max_grad_norm, t.seed)
