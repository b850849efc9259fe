"""Typed settings, named presets, config files and the command line that fills them.

Settings become dataclasses once, at the edge (``parse_settings``). A preset is a YAML file in ``configs/``.
Precedence, lowest first: dataclass defaults, the preset, the ``--config`` file, command-line flags. A config
file holds fields flat or under their section. Unknown keys and wrong types are refused, naming the key. A run
writes its resolved settings to ``run_config.yaml``; ``--config`` on it reruns them.
"""

from __future__ import annotations

import argparse
import functools
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from ..ddp import DDPSettings
from ..ddp.autotune import AUTO
from ..ddp.ranges import check_ranges
from ..distributed import DistInfo
from .data import DataSettings
from .model.qlora import LoraSettings, ModelSettings
from .ranges import TRAIN_RANGES, brief_usage_error


@dataclass
class TrainSettings:
    """The optimisation: batch arithmetic, schedule, checkpoints, logging."""

    output_dir: str = field(default="runs/qwen3-4b-ami", metadata={"help": "Checkpoints, metrics (runs/<model>)."})
    effective_batch: int = field(
        default=16,
        metadata={"help": "Samples per optimizer step over all ranks; accumulation = effective / (micro x world)."},
    )
    micro_batch: int | str = field(
        default=AUTO,
        metadata={
            "help": "Samples per forward/backward per rank, or 'auto' (the default): on a GPU the largest that fits "
            "it with the effective batch unchanged, on the CPU 1; resolved and logged before training "
            "(ddp_ft.training.resolve). A number turns it off."
        },
    )
    balance_ranks: bool = field(
        default=True,
        metadata={
            "help": "Within each optimizer step, group similar lengths into micro-batches and give every rank about "
            "the same padded tokens (the step's samples, so its gradient, unchanged). --no-balance-ranks: strided."
        },
    )
    epochs: int = field(default=3, metadata={"help": "Passes over the training set."})
    max_steps: int = field(default=-1, metadata={"help": "Stop after this many optimizer steps (-1: run all epochs)."})
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak AdamW learning rate."})
    min_learning_rate: float = field(default=2e-5, metadata={"help": "Cosine decay floor."})
    warmup_ratio: float = field(default=0.03, metadata={"help": "Fraction of the steps spent in linear warmup."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."})
    seed: int = field(default=42, metadata={"help": "Seed of LoRA init, dropout and data order."})
    save_every: int = field(default=0, metadata={"help": "Checkpoint every N optimizer steps (0: only at the end)."})
    save_total_limit: int = field(default=2, metadata={"help": "Keep at most this many checkpoints (0: keep all)."})
    eval_every: int = field(default=0, metadata={"help": "Evaluate every N optimizer steps (0: only at the end)."})
    predict: int = field(
        default=0, metadata={"help": "Generate for N eval samples at the end: predictions.jsonl, wandb, ROUGE-L."}
    )
    max_new_tokens: int = field(default=256, metadata={"help": "--predict: the most tokens generated per sample."})
    resume: str = field(
        default="", metadata={"help": "Resume from a checkpoint folder, or 'latest' for the newest in output_dir."}
    )
    run_name: str = field(default="", metadata={"help": "Run name in logs (default: derived from the world size)."})
    report_to: str = field(
        default="wandb",
        metadata={"help": "wandb (offline without WANDB_API_KEY, kept for `wandb sync`) or none. Rank 0 only."},
    )
    wandb_project: str = field(default="ddp_ft", metadata={"help": "wandb project shared by the runs to compare."})
    wandb_group: str = field(
        default="", metadata={"help": "wandb group: one experiment's single and DDP runs (default: the preset)."}
    )

    def __post_init__(self) -> None:
        check_ranges(self, TRAIN_RANGES)  # each number's range, then their relations
        if self.report_to not in ("wandb", "none"):
            raise ValueError(f"report_to={self.report_to!r}: choose wandb or none.")
        if self.min_learning_rate > self.learning_rate:
            raise ValueError(
                f"min_learning_rate={self.min_learning_rate} is above learning_rate={self.learning_rate}, the peak the "
                f"cosine decays from: lower min_learning_rate to at most that (e.g. {self.learning_rate / 10:g})."
            )
        if not self.predict and self.max_new_tokens != type(self).__dataclass_fields__["max_new_tokens"].default:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} without predict: it sizes --predict's generations only. "
                "Give --predict N, or drop --max-new-tokens."
            )


@dataclass
class RunSettings:
    """Everything one run needs."""

    model: ModelSettings
    lora: LoraSettings
    data: DataSettings
    ddp: DDPSettings
    train: TrainSettings
    preset: str = ""


SECTIONS = {
    "model": ModelSettings,
    "lora": LoraSettings,
    "data": DataSettings,
    "ddp": DDPSettings,
    "train": TrainSettings,
}

CONFIG_DIR = Path(__file__).with_name("configs")  # the presets, shipped as package data
RUN_CONFIG = "run_config.yaml"
# Field types as written (strings) -> accepted YAML types.
_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "bool": (bool,),
    "int": (int,),
    "float": (int, float),
    "str | None": (str, type(None)),
    "float | str": (int, float, str),
    "int | str": (int, str),
    "bool | str": (bool, str),
}
_OR_AUTO = {"int | str": "a int", "bool | str": "true, false"}  # fields that also take "auto"


def _kind(annotation: object) -> str:
    """A field's type as written, e.g. ``"float | str"``."""
    if isinstance(annotation, str):
        return annotation
    if annotation is type(None):
        return "None"
    args = typing.get_args(annotation)
    return " | ".join(_kind(a) for a in args) if args else getattr(annotation, "__name__", str(annotation))


def _fields() -> dict[str, tuple[str, str]]:
    """Every settings field: name -> (section, type as written).

    Read from the annotations, since HfArgumentParser rewrites ``Field.type`` in place.
    """
    found = {}
    for section, cls in SECTIONS.items():
        annotations = {
            k: v for klass in reversed(cls.__mro__) for k, v in vars(klass).get("__annotations__", {}).items()
        }
        found |= {f.name: (section, _kind(annotations.get(f.name, f.type))) for f in fields(cls)}
    return found


def _checked(key: str, kind: str, value: object, where: str) -> object:
    """A YAML value of field ``key`` in its field's type, or ValueError naming the key and the type it takes."""
    if isinstance(value, str) and kind in ("float", "float | str"):
        try:
            return float(value)  # PyYAML reads 2e-4 as a string
        except ValueError:
            if kind == "float | str":
                return value  # bucket_cap_mb: auto
    if kind in _OR_AUTO and isinstance(value, str) and value != AUTO:
        raise ValueError(f"{where}: {key}: {value!r} is a str; {key} takes {_OR_AUTO[kind]} or {AUTO!r}.")
    ok = isinstance(value, _TYPES[kind]) and not (isinstance(value, bool) and kind not in ("bool", "bool | str"))
    if not ok:
        raise ValueError(f"{where}: {key}: {value!r} is a {type(value).__name__}; {key} takes a {kind}.")
    return float(value) if kind == "float" else value


def config_values(data: object, where: str) -> dict[str, object]:
    """A parsed config file -> checked field values, flat; ``preset`` kept if given.

    Args:
        data (object): what ``yaml.safe_load`` returned.
        where (str): the file, named in errors.

    Raises:
        ValueError: not a mapping, an unknown or repeated key, or a wrong type.
    """
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of settings (key: value), got a {type(data).__name__}.")
    known = _fields()
    flat: dict[str, tuple[str | None, object]] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, Mapping):
            for name, inner in value.items():
                if known.get(name, ("",))[0] != key:
                    allowed = ", ".join(f.name for f in fields(SECTIONS[key]))
                    raise ValueError(f"{where}: unknown key {key}.{name}; the keys of {key}: are: {allowed}.")
                flat.setdefault(name, (key, inner))
                if flat[name] != (key, inner):
                    raise ValueError(f"{where}: {name} is given twice (flat and under {key}:); keep one.")
        elif key in known or key == "preset":
            if key in flat:
                raise ValueError(f"{where}: {key} is given twice (flat and under {flat[key][0]}:); keep one.")
            flat[key] = (None, value)
        else:
            raise ValueError(
                f"{where}: unknown key {key!r}. Allowed: preset, the sections {', '.join(SECTIONS)}, "
                f"or these fields: {', '.join(known)}."
            )
    kinds = {key: "str" if key == "preset" else known[key][1] for key in flat}
    return {key: _checked(key, kinds[key], value, where) for key, (_, value) in flat.items()}


def load_config(path: str | Path) -> dict[str, object]:
    """The checked field values of a YAML config file (see :func:`config_values`).

    Raises:
        ValueError: a missing or unreadable file, invalid YAML, or what :func:`config_values` refuses.
    """
    try:
        text = Path(path).read_text()
    except OSError as error:
        name = Path(path).stem  # configs/ exists in a clone only: elsewhere, hint --preset
        shipped = not Path(path).exists() and (CONFIG_DIR / f"{name}.yaml").is_file()
        hint = f" {name} is a preset ddp_ft ships: use --preset {name}." if shipped else ""
        raise ValueError(f"--config {path}: cannot read it ({error.strerror or error}).{hint}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path}: not valid YAML: {error}") from None
    return config_values(data, str(path))


def _presets() -> dict[str, dict[str, object]]:
    found = {path.stem: load_config(path) for path in sorted(CONFIG_DIR.glob("*.yaml"))}
    for name, values in found.items():
        if "preset" in values:
            raise ValueError(f"{CONFIG_DIR / name}.yaml: a preset cannot name another preset.")
    return found


PRESETS: dict[str, dict[str, object]] = _presets()  # name -> field overrides


def settings_as_config(
    settings: RunSettings, resolved: Mapping[str, Mapping[str, object]] | None = None
) -> dict[str, object]:
    """RunSettings as a config mapping that :func:`load_config` reads back to the same settings.

    Args:
        settings (RunSettings): the settings as parsed.
        resolved (Mapping | None): resolved values by section, written over them. Default: None
    """
    data: dict[str, object] = {"preset": settings.preset} if settings.preset else {}
    resolved = resolved or {}
    return data | {name: asdict(getattr(settings, name)) | dict(resolved.get(name, {})) for name in SECTIONS}


def write_run_config(
    settings: RunSettings, info: DistInfo, resolved: Mapping[str, Mapping[str, object]] | None = None
) -> Path:
    """Write the settings, ``resolved`` and the group's backend to ``run_config.yaml`` on rank 0, atomically."""
    path = Path(settings.train.output_dir) / RUN_CONFIG
    if info.backend is not None:
        resolved = {"ddp": {"backend": info.backend}, **(resolved or {})}
    if info.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        header = "# Resolved settings of this run; rerun them with --config THIS_FILE (ddp-ft train or recipe, or their scripts)\n"
        body = yaml.safe_dump(settings_as_config(settings, resolved), sort_keys=False)
        tmp = path.with_name(f".{RUN_CONFIG}.tmp{os.getpid()}")
        tmp.write_text(header + body)
        os.replace(tmp, path)
    return path


def build_parser(parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """One flag per dataclass field, plus an entry point's own flags from ``parents``."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        list(SECTIONS.values()), prog=prog, description="QLoRA fine-tuning with BucketedDDP.", parents=list(parents)
    )
    parser.error = functools.partial(brief_usage_error, parser.prog)  # argparse's own prints the whole usage first
    parser.add_argument(
        "--preset",
        default="",
        help=f"Named settings to start from: {', '.join(PRESETS)} (ddp_ft/training/configs/NAME.yaml). "
        "Precedence, lowest first: defaults, preset, --config, flags.",
    )
    parser.add_argument(
        "--config",
        default="",
        metavar="FILE.yaml",
        help="YAML settings over the preset and under the flags: field names flat or under model:/lora:/data:/ddp:/"
        "train:, and optionally preset:. A run's <output_dir>/run_config.yaml reruns it.",
    )
    switch = {"type": _switch_arg, "metavar": "{true,false,auto}"}
    or_auto = {  # HfArgumentParser drops the str of `float | str`: take "auto"
        "bucket_cap_mb": {"type": _number_or_auto(float, "a number of MiB")},
        "micro_batch": {"type": _number_or_auto(int, "a whole number of samples")},
        "compile": switch,  # bare --compile: true
        "gradient_checkpointing": switch,
        "packing": {**switch, "nargs": None, "const": None},  # a yes/no word or "auto"
    }
    for action in parser._actions:
        for name, value in or_auto.get(action.dest, {}).items():
            setattr(action, name, value)
    parser.add_argument("--no-compile", "--no_compile", dest="compile", action="store_false", help="--compile false.")
    parser.add_argument(
        "--no-gradient-checkpointing",
        "--no_gradient_checkpointing",
        dest="gradient_checkpointing",
        action="store_false",
        help="--gradient-checkpointing false.",
    )
    return parser


def _number_or_auto(cast: type, what: str):
    """An argparse type: ``auto``, or ``what`` read by ``cast`` (``--bucket-cap-mb``, ``--micro-batch``)."""

    def parse(text: str) -> int | float | str:
        if text == AUTO:
            return text
        try:
            return cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither {what} nor {AUTO!r}") from None

    return parse


_SWITCH_WORDS = dict.fromkeys(("true", "yes", "on", "1"), True) | dict.fromkeys(("false", "no", "off", "0"), False)


def _switch_arg(text: str) -> bool | str:
    """``--compile``, ``--packing``: true/false (also yes/no, on/off, 1/0) or ``auto``."""
    word = text.lower()
    if word != AUTO and word not in _SWITCH_WORDS:
        raise argparse.ArgumentTypeError(f"{text!r} is neither true, false nor {AUTO!r}")
    return _SWITCH_WORDS.get(word, AUTO)


def parse_settings(
    argv: list[str] | None = None,
    parents: Sequence[argparse.ArgumentParser] = (),
    default_preset: str = "",
    prog: str | None = None,
) -> RunSettings:
    """Command line -> RunSettings: defaults, then the preset, then ``--config``, then explicit flags.

    Args:
        argv (list[str] | None): the command line. Default: ``sys.argv[1:]``
        parents (Sequence[argparse.ArgumentParser]): an entry point's own flags.
        default_preset (str): the preset when none is named. Default: none
        prog (str | None): the command named in usage and errors. Default: the script's name

    Raises:
        SystemExit: an unknown preset or flag, or a bad config file.
        ValueError: a value the settings dataclasses refuse.

    Example:
        >>> settings = parse_settings(["--preset", "tiny", "--micro-batch", "2"])
    """
    parser = build_parser(parents, prog)
    pre, _ = parser.parse_known_args(argv)
    try:
        from_file = load_config(pre.config) if pre.config else {}
    except ValueError as error:
        parser.error(str(error))
    preset = pre.preset or str(from_file.get("preset", "")) or default_preset
    from_file.pop("preset", None)
    if preset:
        if preset not in PRESETS:
            parser.error(f"unknown --preset {preset!r}; choose one of: {', '.join(PRESETS)}")
        parser.set_defaults(**PRESETS[preset], preset=preset)
    parser.set_defaults(**from_file)
    if not preset and "output_dir" not in from_file:  # a model of your own: runs/<its name>, not a preset's folder
        named = parser.parse_known_args(argv)[0].model_name_or_path
        parser.set_defaults(output_dir=str(Path("runs") / (Path(named.rpartition(":")[2]).name or "run")))
    namespace = parser.parse_args(argv)
    values = vars(namespace)
    sections = {name: cls(**{f.name: values[f.name] for f in fields(cls)}) for name, cls in SECTIONS.items()}
    return RunSettings(**sections, preset=values["preset"])


def settings_from_preset(preset: str, **overrides: object) -> RunSettings:
    """RunSettings of a preset with field overrides, for code and tests (no command line)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    values = {**PRESETS[preset], **overrides}
    known = {f.name for cls in SECTIONS.values() for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    sections = {
        name: cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values}) for name, cls in SECTIONS.items()
    }
    return RunSettings(**sections, preset=preset)
