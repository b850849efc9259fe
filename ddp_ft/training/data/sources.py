"""Sources: a hub id, a local file or folder, or the synthetic meetings, as ``train`` and ``eval`` splits.

Every check runs here, before a model loads.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .folders import file_columns, folder_files
from .formats import DataFormat, has_answer, resolve_format, standard_rows
from .settings import FILE_BUILDERS, DataSettings
from .synthetic import generate_synthetic_meetings

if TYPE_CHECKING:
    from datasets import DatasetDict

logger = logging.getLogger(__name__)


def check_local_file(settings: DataSettings) -> Path | None:
    """The local data file or folder, checked early; None for other sources.

    Raises:
        FileNotFoundError: no such file, naming ``--source`` or ``--eval-source``.
        ValueError: an empty file, or a folder whose files cannot be read as one source.
    """
    if settings.eval_source:
        _existing_file(settings.eval_source, "eval_source")
    if settings.source_kind == "folder":
        folder = Path(settings.source).expanduser()
        _one_format(folder_files(folder), settings, folder)
        return folder
    return _existing_file(settings.source, "source") if settings.source_kind == "file" else None


def _existing_file(source: str, name: str) -> Path:
    path = Path(source).expanduser()
    flag = f"--{name.replace('_', '-')}"
    if not path.is_file():
        raise FileNotFoundError(
            f"DataSettings.{name}={source!r}: no such file (resolved to {path.resolve()}); fix {flag}"
            + (" or use a hub dataset id or 'synthetic'." if name == "source" else ".")
        )
    if path.suffix.lower() not in FILE_BUILDERS:
        raise ValueError(f"DataSettings.{name}={source!r}: {flag} takes a {', '.join(FILE_BUILDERS)} file.")
    if path.stat().st_size == 0:
        raise ValueError(f"DataSettings.{name}={source!r}: the file is empty (split 'train' has no rows).")
    return path


def _one_format(files: dict[str, list[Path]], settings: DataSettings, folder: Path) -> None:
    """Refuse a folder whose files are in several formats; log what it will read."""
    formats: dict[str, list[str]] = {}
    for paths in files.values():
        for path in paths:
            columns = file_columns(path)
            where = f"--source {folder}: {path.relative_to(folder)}"
            formats.setdefault(resolve_format(dict.fromkeys(columns), settings, where).name, []).append(path.name)
    if len(formats) > 1:
        shown = "; ".join(f"{name}: {', '.join(names)}" for name, names in formats.items())
        raise ValueError(f"--source {folder}: its files are in several formats ({shown}); keep one format.")
    listed = "; ".join(
        f"{split}: {', '.join(str(p.relative_to(folder)) for p in paths)}" for split, paths in files.items()
    )
    logger.info("--source %s reads %s", folder, listed)


def _read(builder: str, data_files: dict[str, list[str]], where: str, cache_dir: str | None):
    from datasets import load_dataset

    try:
        return load_dataset(builder, data_files=data_files, cache_dir=cache_dir)
    except Exception as err:  # e.g. a CSV with only a header
        raise ValueError(
            f"{where}: no rows could be read as {builder} (empty or malformed file?): {type(err).__name__}: {err}"
        ) from err


def _load_source(settings: DataSettings, cache_dir: str | None):
    """The source as a DatasetDict; a file and the synthetic data have only 'train'."""
    from datasets import Dataset, DatasetDict, load_dataset

    kind = settings.source_kind
    if kind == "synthetic":
        rows = generate_synthetic_meetings(settings.num_synthetic, settings.data_seed)
        return DatasetDict({"train": Dataset.from_list(rows)})
    where = f"DataSettings.source={settings.source!r}"
    if kind == "file":
        path = check_local_file(settings)
        return _read(FILE_BUILDERS[path.suffix.lower()], {"train": [str(path)]}, where, cache_dir)
    if kind == "folder":
        files = folder_files(Path(settings.source).expanduser())
        _one_format(files, settings, Path(settings.source).expanduser())
        builder = FILE_BUILDERS[files["train"][0].suffix.lower()]
        return _read(builder, {split: [str(p) for p in paths] for split, paths in files.items()}, where, cache_dir)
    try:
        return load_dataset(settings.source, cache_dir=cache_dir)
    except Exception as err:
        raise RuntimeError(
            f"{where}: could not load it as a hub dataset ({type(err).__name__}: {err}). Offline? Use a local "
            ".jsonl/.json/.csv/.parquet file, a folder of them, or 'synthetic'."
        ) from err


def _check_columns(ds, settings: DataSettings, split: str) -> None:
    wanted = {"dialogue_column": settings.dialogue_column, "summary_column": settings.summary_column}
    missing = {name: col for name, col in wanted.items() if col not in ds.column_names}
    if missing:
        what = "; ".join(f"{col!r} (--{name.replace('_', '-')}, DataSettings.{name})" for name, col in missing.items())
        raise ValueError(
            f"DataSettings.source={settings.source!r}, split {split!r}: missing column(s) {what}. Available columns: "
            f"{ds.column_names}. Set the setting to the column that holds the transcript / summary, or name "
            "another format with --format (docs/own_data.md)."
        )


def _standardise(ds, fmt: DataFormat, settings: DataSettings, split: str):
    """The split's rows in their standard shape; rows with nothing to learn dropped, with a warning."""
    where = f"DataSettings.source={settings.source!r}, split {split!r}"
    if len(ds) == 0:
        raise ValueError(f"{where} is empty; nothing to train on.")
    if fmt.name == "pair":
        _check_columns(ds, settings, split)
    else:
        resolve_format(ds.features, settings, where)  # the format's columns are there
    try:
        ds = ds.map(standard_rows, batched=True, fn_kwargs={"fmt": fmt}, remove_columns=ds.column_names)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    before = len(ds)
    ds = ds.filter(has_answer, batched=True)
    if len(ds) < before:
        logger.warning(
            "split %r: dropped %d of %d rows with nothing to learn (an empty answer)", split, before - len(ds), before
        )
    if len(ds) == 0:
        empty = "an empty dialogue or summary" if fmt.name == "pair" else "no answer to learn"
        raise ValueError(f"DataSettings.source={settings.source!r}: all {before} rows of split {split!r} have {empty}.")
    return ds


@dataclass(frozen=True)
class RawData:
    """A source's rows in their standard shape, and their format.

    Args:
        splits (datasets.DatasetDict): ``train`` and ``eval``.
        format (DataFormat): found from the columns or named by ``--format``.
    """

    splits: DatasetDict
    format: DataFormat

    def record(self, settings: DataSettings) -> dict:
        """The data settings as resolved, for ``ddp_ft_data.json``."""
        return asdict(replace(settings, format=self.format.name)) | {"shape": self.format.shape}


def settings_from_record(record: dict) -> tuple[DataSettings, str]:
    """The data settings and shape a run recorded; the chat template is left to the saved tokenizer."""
    known = {name: value for name, value in record.items() if name in DataSettings.__dataclass_fields__}
    known.pop("chat_template", None)
    settings = DataSettings(**known)
    return settings, record.get("shape") or ("pair" if settings.format in ("auto", "pair") else "chat")


def load_raw_splits(settings: DataSettings, cache_dir: str | None = None) -> DatasetDict:
    """The ``train`` and ``eval`` rows of ``load_source``."""
    return load_source(settings, cache_dir).splits


def load_source(settings: DataSettings, cache_dir: str | None = None) -> RawData:
    """Load ``settings.source`` as ``train`` and ``eval`` rows in its standard shape.

    Eval rows come from ``eval_source``, else ``eval_split``, else ``eval_fraction`` of train held out by seed.

    Args:
        settings (DataSettings): the source, its format, splits and seed.
        cache_dir (str | None): ``datasets`` cache folder. Default: the ``datasets`` default

    Returns:
        RawData: the splits and their format.

    Raises:
        FileNotFoundError: a local file that does not exist.
        ValueError: a missing split or column, an unknown format, or an empty split.
        RuntimeError: a hub dataset that cannot be loaded.

    Example:
        >>> raw = load_source(DataSettings(source="meetings.jsonl"))
    """
    from datasets import DatasetDict

    source = _load_source(settings, cache_dir)
    if settings.split not in source:
        raise ValueError(
            f"DataSettings.split={settings.split!r} not in {settings.source!r}; available splits: {list(source)}."
        )
    raw_train = source[settings.split]
    fmt = resolve_format(raw_train.features, settings, f"DataSettings.source={settings.source!r}")
    settings.check_format_settings(fmt.name)
    logger.info("data format %s: %s", fmt.describe(), "--format" if settings.format != "auto" else "from its columns")
    train = _standardise(raw_train, fmt, settings, settings.split)
    train, evaluation = _with_eval(source, train, fmt, settings, cache_dir)
    return RawData(DatasetDict({"train": train, "eval": evaluation}), fmt)


def load_prompt_rows(settings: DataSettings, path: str, cache_dir: str | None = None):
    """A file's rows in standard shape, answerless rows kept: prompts to generate from.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_source`.
    """
    file = _existing_file(path, "source")
    where = f"--source {path}"
    rows = _read(FILE_BUILDERS[file.suffix.lower()], {"train": [str(file)]}, where, cache_dir)["train"]
    fmt = resolve_format(rows.features, settings, where)
    if fmt.name == "pair":
        _check_columns(rows, settings, "train")
    return rows.map(standard_rows, batched=True, fn_kwargs={"fmt": fmt}, remove_columns=rows.column_names)


def _with_eval(source, train, fmt: DataFormat, settings: DataSettings, cache_dir: str | None):
    """(train, eval): eval from ``eval_source``, ``eval_split``, or held out of ``train``."""
    if settings.eval_source:
        if settings.eval_split in source and settings.eval_split != settings.split:
            if settings.eval_split != "validation":
                raise ValueError(
                    f"DataSettings.eval_source={settings.eval_source!r} and eval_split={settings.eval_split!r} both "
                    "name what to evaluate on: keep one."
                )
            logger.warning(
                "--eval-source %s is evaluated on, not the source's split 'validation'", settings.eval_source
            )
        path = _existing_file(settings.eval_source, "eval_source")
        where = f"DataSettings.eval_source={settings.eval_source!r}"
        rows = _read(FILE_BUILDERS[path.suffix.lower()], {"train": [str(path)]}, where, cache_dir)["train"]
        return train, _standardise(rows, fmt, settings, f"eval_source {path.name}")
    if settings.eval_split and settings.eval_split in source and settings.eval_split != settings.split:
        return train, _standardise(source[settings.eval_split], fmt, settings, settings.eval_split)
    if settings.eval_split != "validation" and settings.eval_split is not None:
        raise ValueError(
            f"DataSettings.eval_split={settings.eval_split!r} not in {settings.source!r}; available splits: "
            f"{list(source)}. Name one of them, give a file with --eval-source, or hold out --eval-fraction."
        )
    if settings.eval_fraction == 0.0:
        return train, train.select([])
    n_eval = max(1, round(settings.eval_fraction * len(train)))
    if n_eval >= len(train):
        raise ValueError(
            f"DataSettings.eval_fraction={settings.eval_fraction}: holding out {n_eval} of {len(train)} rows "
            "leaves nothing to train on; lower it or give an eval_split."
        )
    parts = train.train_test_split(test_size=n_eval, shuffle=True, seed=settings.data_seed)
    logger.info("no eval split %r: held out %d train rows (seed %d)", settings.eval_split, n_eval, settings.data_seed)
    return parts["train"], parts["test"]
