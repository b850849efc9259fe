"""Sources: a hub id, a local file or the embedded synthetic meetings, as ``train`` and ``eval`` splits of
``dialogue``/``summary`` columns, every check before a model loads."""

from __future__ import annotations

import logging
from pathlib import Path

from .settings import FILE_BUILDERS, DataSettings
from .synthetic import generate_synthetic_meetings

logger = logging.getLogger(__name__)


def check_local_file(settings: DataSettings) -> Path | None:
    """A local data file that exists and is not empty (``ddp-ft`` checks it before any worker starts); None for a
    source that is no file.

    Raises:
        FileNotFoundError: no such file, naming ``--source``.
        ValueError: an empty file.
    """
    if settings.source_kind != "file":
        return None
    path = Path(settings.source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"DataSettings.source={settings.source!r}: no such file (resolved to {path.resolve()}); "
            "fix --source or use a hub dataset id or 'synthetic'."
        )
    if path.stat().st_size == 0:
        raise ValueError(f"DataSettings.source={settings.source!r}: the file is empty (split 'train' has no rows).")
    return path


def _load_source(settings: DataSettings, cache_dir: str | None):
    """The source as a DatasetDict (files and synthetic data have one split, 'train')."""
    from datasets import Dataset, DatasetDict, load_dataset

    kind = settings.source_kind
    if kind == "synthetic":
        rows = generate_synthetic_meetings(settings.num_synthetic, settings.data_seed)
        return DatasetDict({"train": Dataset.from_list(rows)})
    if kind == "file":
        path = check_local_file(settings)
        builder = FILE_BUILDERS[path.suffix.lower()]
        try:
            return load_dataset(builder, data_files={"train": str(path)}, cache_dir=cache_dir)
        except Exception as err:  # e.g. a CSV with only a header: "corresponds to no data"
            raise ValueError(
                f"DataSettings.source={settings.source!r}: no rows could be read as {builder} (empty or malformed "
                f"file?): {type(err).__name__}: {err}"
            ) from err
    try:
        return load_dataset(settings.source, cache_dir=cache_dir)
    except Exception as err:  # re-raised with the setting to change
        raise RuntimeError(
            f"DataSettings.source={settings.source!r}: could not load it as a hub dataset or local dataset folder "
            f"({type(err).__name__}: {err}). Offline? Use a local .jsonl/.json/.csv/.parquet file or 'synthetic'."
        ) from err


def _check_columns(ds, settings: DataSettings, split: str) -> None:
    wanted = {"dialogue_column": settings.dialogue_column, "summary_column": settings.summary_column}
    missing = {name: col for name, col in wanted.items() if col not in ds.column_names}
    if missing:
        what = "; ".join(f"{col!r} (--{name.replace('_', '-')}, DataSettings.{name})" for name, col in missing.items())
        raise ValueError(
            f"DataSettings.source={settings.source!r}, split {split!r}: missing column(s) {what}. Available columns: "
            f"{ds.column_names}. Set the setting to the column that holds the transcript / summary."
        )


def _non_empty(batch: dict[str, list]) -> list[bool]:
    pairs = zip(batch["dialogue"], batch["summary"], strict=True)
    return [bool(str(d or "").strip() and str(s or "").strip()) for d, s in pairs]


def _standardise(ds, settings: DataSettings, split: str):
    """Keep the two columns, named ``dialogue`` and ``summary``; drop rows where either is empty."""
    if len(ds) == 0:
        raise ValueError(f"DataSettings.source={settings.source!r}: split {split!r} is empty; nothing to train on.")
    _check_columns(ds, settings, split)
    ds = ds.select_columns([settings.dialogue_column, settings.summary_column])
    renames = {settings.dialogue_column: "dialogue", settings.summary_column: "summary"}
    ds = ds.rename_columns({k: v for k, v in renames.items() if k != v})
    before = len(ds)
    ds = ds.filter(_non_empty, batched=True)
    if len(ds) < before:
        logger.warning(
            "split %r: dropped %d of %d rows with an empty dialogue or summary", split, before - len(ds), before
        )
    if len(ds) == 0:
        raise ValueError(
            f"DataSettings.source={settings.source!r}: all {before} rows of split {split!r} have an empty dialogue "
            "or summary."
        )
    return ds


def load_raw_splits(settings: DataSettings, cache_dir: str | None = None):
    """Load ``settings.source`` as a DatasetDict with ``train`` and ``eval``, columns ``dialogue`` and ``summary``.

    The eval split is ``settings.eval_split`` when the source has it; otherwise (and when it is None)
    ``eval_fraction`` of train is held out, the same rows for the same seed (0: an empty eval split).
    Every check runs here, before any model is loaded.

    Args:
        settings (DataSettings): the source, columns, splits and seed.
        cache_dir (str | None): ``datasets`` cache folder. Default: None (the ``datasets`` default)

    Returns:
        datasets.DatasetDict: ``train`` and ``eval``.

    Raises:
        FileNotFoundError: a local file that does not exist.
        ValueError: a missing split or column (naming the setting to change), an empty split.
        RuntimeError: a hub dataset that cannot be loaded (e.g. offline).
    """
    from datasets import DatasetDict

    source = _load_source(settings, cache_dir)
    if settings.split not in source:
        raise ValueError(
            f"DataSettings.split={settings.split!r} not in {settings.source!r}; available splits: {list(source)}."
        )
    train = _standardise(source[settings.split], settings, settings.split)
    if settings.eval_split and settings.eval_split in source and settings.eval_split != settings.split:
        evaluation = _standardise(source[settings.eval_split], settings, settings.eval_split)
    elif settings.eval_fraction == 0.0:
        evaluation = train.select([])
    else:
        n_eval = max(1, round(settings.eval_fraction * len(train)))
        if n_eval >= len(train):
            raise ValueError(
                f"DataSettings.eval_fraction={settings.eval_fraction}: holding out {n_eval} of {len(train)} rows "
                "leaves nothing to train on; lower it or give an eval_split."
            )
        parts = train.train_test_split(test_size=n_eval, shuffle=True, seed=settings.data_seed)
        train, evaluation = parts["train"], parts["test"]
        logger.info(
            "no eval split %r: held out %d train rows (seed %d)", settings.eval_split, n_eval, settings.data_seed
        )
    return DatasetDict({"train": train, "eval": evaluation})
