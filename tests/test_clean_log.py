"""A user's log is clean: no deprecation warning from transformers, peft or accelerate on either entry point."""

import warnings

import pytest

from .test_side_services import _run, run_env  # noqa: F401  (run_env is a fixture)


@pytest.mark.usefixtures("run_env")
@pytest.mark.parametrize("entry", ["loop", "trainer"])
def test_a_short_run_prints_no_deprecation_warning(entry, tmp_path):
    """pytest's configuration ignores DeprecationWarning and FutureWarning suite-wide; here every warning is kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _run(entry, tmp_path / entry, report_to="none") == 2
    deprecations = [
        f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
        for w in caught
        if issubclass(w.category, DeprecationWarning | FutureWarning) or "deprecat" in str(w.message)
    ]
    assert not deprecations, deprecations
