"""A user's log is clean: no deprecation warning from transformers, peft or accelerate on either entry point."""

import warnings

import pytest

from ..helpers.runs import short_run


@pytest.mark.usefixtures("run_env")
@pytest.mark.parametrize("entry", ["loop", "trainer"])
def test_a_short_run_prints_no_deprecation_warning(entry, tmp_path):
    """pytest's configuration ignores DeprecationWarning and FutureWarning suite-wide; here every warning is kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert short_run(entry, tmp_path / entry, report_to="none") == 2
    deprecations = [
        f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
        for w in caught
        if issubclass(w.category, DeprecationWarning | FutureWarning) or "deprecat" in str(w.message)
    ]
    assert not deprecations, deprecations


def test_embedded_model_has_tokenizer_special_tokens(tmp_path, monkeypatch):
    """The tiny model's config holds its tokenizer's eos and pad ids, as a hub model does: the Trainer's
    ``align_special_tokens`` changes nothing and prints no 'new PAD/BOS/EOS tokens' warning on every rank. The ids
    go in after the weights are drawn, so the weights are those of a build without them."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_utils import align_special_tokens

    from ddp_ft.distributed import DistInfo
    from ddp_ft.training.model.qlora import build_tiny_qwen3
    from ddp_ft.training.setup import resolve_model_and_tokenizer

    model_dir, tokenizer_dir = resolve_model_and_tokenizer("embedded:tiny-qwen3", DistInfo())
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    before = (model.config.eos_token_id, model.config.pad_token_id, model.generation_config.pad_token_id)
    align_special_tokens(model, tokenizer)
    assert before == (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.pad_token_id)
    assert (model.config.eos_token_id, model.config.pad_token_id) == before[:2]

    plain = build_tiny_qwen3(tmp_path / "plain", vocab_size=len(tokenizer), seed=0)
    ours, theirs = load_file(f"{model_dir}/model.safetensors"), load_file(plain / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_bnb_notice_once_on_rank_0_log_level_checked(monkeypatch, caplog, capsys):
    import logging

    from ddp_ft import distributed

    root = logging.getLogger()  # setup_logging replaces the root handlers: put pytest's back afterwards
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(distributed, "_held_notices", [])
    distributed.hold_library_notices()
    notice = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        notice.warning("%s: No module named 'kernels'. Please pip install kernels", distributed._HUB_KERNEL_NOTICE)
        notice.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]  # held back, others pass
    assert distributed._held_notices == [f"{distributed._HUB_KERNEL_NOTICE}: No module named 'kernels'"]

    for rank, said in ((1, False), (0, True)):  # setup_logging replaces the root handlers: read stderr
        capsys.readouterr()
        monkeypatch.setenv(distributed.LOG_LEVEL_ENV, "info")
        distributed.setup_logging(distributed.DistInfo(rank=rank, local_rank=rank, world_size=2, local_world_size=2))
        assert ("its own CPU 4-bit path is used instead" in capsys.readouterr().err) is said
    monkeypatch.setenv(distributed.LOG_LEVEL_ENV, "loud")
    with pytest.raises(ValueError, match="DDP_FT_LOG_LEVEL='LOUD': choose one of DEBUG, INFO, WARNING, ERROR"):
        distributed.setup_logging(distributed.DistInfo())
    monkeypatch.setenv(distributed.LOG_LEVEL_ENV, "warning")
    distributed.setup_logging(distributed.DistInfo())
    assert logging.getLogger().level == logging.WARNING


def test_data_warnings_once_on_rank_0(monkeypatch, capsys):
    """Every rank prepares the same data, so what happened to it (rows dropped, say) is said by rank 0 alone; any
    other warning of ddp_ft still shows on every rank."""
    import logging

    from ddp_ft import distributed

    root, data = logging.getLogger(), logging.getLogger("ddp_ft.training.data.sources")
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(logging.getLogger("ddp_ft.training.data"), "level", logging.NOTSET)
    for rank, said in ((1, False), (0, True)):
        capsys.readouterr()
        distributed.setup_logging(distributed.DistInfo(rank=rank, local_rank=rank, world_size=2, local_world_size=2))
        data.warning("split 'train': dropped 2 of 30 rows with nothing to learn")
        logging.getLogger("ddp_ft.training.setup").warning("another warning")
        err = capsys.readouterr().err
        assert ("dropped 2 of 30 rows" in err) is said and "another warning" in err, (rank, err)


def test_upstream_notices_held_back_above_rank_0(monkeypatch, caplog):
    """The exact messages of ddp_ft.distributed's table, on RANK > 0 only: rank 0 and a single process keep them, and
    any other warning passes (tests/e2e/test_examples.py counts them on real 2-rank runs)."""
    import logging

    from ddp_ft import distributed

    notice = logging.getLogger("bitsandbytes.backends.cpu.ops")
    monkeypatch.setattr(notice, "filters", [])
    for rank, held in (("0", False), ("1", True)):
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger=notice.name):
            warnings.simplefilter("always")
            distributed.keep_upstream_notices_to_rank_zero({"RANK": rank})
            for message, category in (
                ("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning),
                ("torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly.", UserWarning),
                ("`is_gradient_checkpointing` is something else", UserWarning),  # not in the table: passes
            ):
                warnings.warn(message, category, stacklevel=1)
            notice.warning("%s: No module named 'kernels'", distributed._HUB_KERNEL_NOTICE)
        assert len(caught) == (1 if held else 3), [str(w.message) for w in caught]
        assert (distributed._HUB_KERNEL_NOTICE in caplog.text) is not held
        caplog.clear()


@pytest.mark.parametrize("ci", ["", "1"])
def test_transformers_warning_once_even_under_ci(ci):
    """transformers prints its records itself and, when ``CI`` is set (as CI services do), also passes them on to the
    root logger: after setup_logging, rank 0 prints a transformers warning once either way."""
    import os
    import subprocess
    import sys

    code = (
        "from transformers.utils import logging as hf\n"
        "from ddp_ft import distributed\n"
        "distributed.setup_logging(distributed.DistInfo())\n"
        "hf.get_logger('transformers.trainer_utils').warning('save_steps differ')\n"
    )
    env = {**os.environ, "CI": ci}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr.count("save_steps differ") == 1, run.stderr
