"""Settings: batch arithmetic, presets, command line, validation errors that name the setting and the fix."""

import pytest
import torch

from ddp_ft.ddp import settings as ddp_settings
from ddp_ft.training.batch import gradient_accumulation_steps
from ddp_ft.training.config import PRESETS, build_parser, parse_settings, settings_from_preset
from ddp_ft.training.model.qlora import check_device_map


@pytest.mark.parametrize("effective,micro,world,expected", [(16, 1, 1, 16), (16, 1, 2, 8), (16, 2, 2, 4), (8, 2, 4, 1)])
def test_accumulation_keeps_batch_for_any_world_size(effective, micro, world, expected):
    assert gradient_accumulation_steps(effective, micro, world) == expected
    assert expected * micro * world == effective


def test_impossible_batch_names_settings_and_fixes():
    with pytest.raises(ValueError) as error:
        gradient_accumulation_steps(16, 3, 2)
    message = str(error.value)
    assert "effective_batch=16" in message and "micro_batch=3" in message and "world_size=2" in message
    assert "--micro-batch one of [1, 2, 4, 8]" in message


def test_preset_applies_and_flags_override_it():
    settings = parse_settings(
        ["--preset", "tiny", "--micro-batch", "4", "--lora-r", "8", "--no-gradient-as-bucket-view"]
    )
    assert settings.preset == "tiny"
    assert settings.data.source == PRESETS["tiny"]["source"]
    assert settings.train.max_steps == PRESETS["tiny"]["max_steps"]
    assert settings.train.micro_batch == 4 and settings.lora.lora_r == 8
    assert settings.ddp.gradient_as_bucket_view is False
    assert parse_settings(["--preset", "tiny", "--upcast-frozen-weights"]).model.upcast_frozen_weights


def test_balanced_ranks_on_unless_no_balance_ranks():
    assert parse_settings(["--preset", "tiny"]).train.balance_ranks is True
    assert parse_settings(["--preset", "tiny", "--no-balance-ranks"]).train.balance_ranks is False
    assert parse_settings(["--preset", "tiny", "--no_balance_ranks"]).train.balance_ranks is False
    assert settings_from_preset("tiny", balance_ranks=False).train.balance_ranks is False
    assert "--balance_ranks" in build_parser().format_help()


def test_reference_preset_is_the_reference_run():
    s = settings_from_preset("qwen3-4b-ami")
    assert s.model.model_name_or_path == "Qwen/Qwen3-4B" and s.data.source == "knkarthick/AMI"
    assert (s.train.effective_batch, s.train.micro_batch, s.train.epochs) == (16, "auto", 3)  # on the CPU: 1
    assert s.model.compile == "auto" and s.data.packing == "auto"
    assert (s.train.learning_rate, s.train.min_learning_rate, s.data.max_seq_len) == (2e-4, 2e-5, 512)
    # dropout 0, not the write-up's 0.05: compiled dropout in checkpointed layers crashes Inductor on CUDA (docs/performance.md)
    assert (s.lora.lora_r, s.lora.lora_alpha, s.lora.lora_dropout, s.lora.lora_target_modules) == (
        16,
        32,
        0.0,
        "all-linear",
    )
    assert s.model.load_in_4bit and not s.model.use_reentrant and not s.model.upcast_frozen_weights


def test_unknown_preset_is_refused_listing_known_ones(capsys):
    with pytest.raises(SystemExit):
        parse_settings(["--preset", "qwen-huge"])
    err = capsys.readouterr().err
    assert "unknown --preset 'qwen-huge'" in err and "tiny" in err and "qwen3-4b-ami" in err


def test_help_documents_every_setting():
    text = build_parser().format_help()
    for flag in [
        "--effective_batch",
        "--micro_batch",
        "--max_steps",
        "--bucket_cap_mb",
        "--comm_hook",
        "--backend",
        "--lora_r",
        "--model_name_or_path",
        "--upcast_frozen_weights",
        "--source",
        "--dialogue_column",
        "--max_seq_len",
        "--resume",
        "--preset",
    ]:
        assert flag in text, flag
    assert "Samples per optimizer step over all ranks" in text


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"max_steps": 0}, "max_steps=0"),
        ({"micro_batch": 0}, "micro_batch=0"),
        ({"min_learning_rate": 1.0}, "min_learning_rate=1.0"),
        ({"comm_hook": "int8"}, "comm_hook='int8'"),
        ({"backend": "mpi"}, "backend='mpi': choose one of auto, nccl, gloo."),
        ({"lora_dropout": 1.5}, "lora_dropout=1.5"),
        ({"compute_dtype": "fp8"}, "compute_dtype='fp8'"),
        ({"bucket_cap_mb": "fast"}, "bucket_cap_mb='fast'"),
        ({"bucket_cap_mb": "auto", "comm_hook": "powersgd"}, "bucket_cap_mb='auto' with comm_hook='powersgd'"),
    ],
)
def test_bad_settings_fail_naming_the_field(overrides, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        settings_from_preset("tiny", **overrides)


@pytest.mark.parametrize("device_map", ["auto", "balanced", {"model.layers.0": 0, "lm_head": 1}])
def test_splitting_device_map_refused_under_ddp(device_map):
    with pytest.raises(ValueError, match=r"device_map=\{'': local_rank\}"):
        check_device_map(device_map, world_size=2)
    check_device_map({"": 0}, world_size=2)
    check_device_map("auto", world_size=1)  # a single process may shard over its GPUs


def test_recipe_help_lists_trainer_and_shared_flags():
    """`recipes/qwen_ami.py --help` documents `--trainer` (parsed by the recipe itself) beside every shared setting;
    it did not before the recipe passed its parser in."""
    import subprocess
    import sys
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen_ami.py"
    run = subprocess.run([sys.executable, str(recipe), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--trainer {hf,trl,stock-hf,stock-trl}" in run.stdout and "BucketedSFTTrainer" in run.stdout, run.stdout[
        :500
    ]
    assert "--stock-find-unused {trainer,true,false}" in run.stdout
    assert "--micro_batch" in run.stdout and "--preset" in run.stdout


def test_bucket_cap_mb_takes_a_number_or_auto(capsys):
    assert parse_settings(["--preset", "tiny", "--bucket-cap-mb", "auto"]).ddp.bucket_cap_mb == "auto"
    assert parse_settings(["--bucket_cap_mb", "5"]).ddp.bucket_cap_mb == 5.0
    assert settings_from_preset("tiny", bucket_cap_mb="auto").ddp.bucket_cap_mb == "auto"
    with pytest.raises(SystemExit):
        parse_settings(["--bucket-cap-mb", "fast"])
    err = capsys.readouterr().err
    assert "--bucket-cap-mb" in err and "'fast' is neither a number of MiB nor 'auto'" in err


# Config files: the presets are files, --config sits between the preset and the flags, errors name the key.


def _yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_presets_are_shipped_yaml_shown_in_configs():
    from pathlib import Path

    from ddp_ft.training.config import CONFIG_DIR, load_config
    from ddp_ft.training.model.qlora import EMBEDDED_MODEL

    assert sorted(PRESETS) == ["qwen3-4b-ami", "tiny"]
    assert PRESETS["tiny"]["model_name_or_path"] == EMBEDDED_MODEL
    for name in PRESETS:
        shipped = CONFIG_DIR / f"{name}.yaml"
        assert shipped.read_text().startswith("# ") and load_config(shipped) == PRESETS[name]
        in_repo = Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml"
        assert in_repo.read_text() == shipped.read_text()
    assert "about a minute on 2 CPU cores" in (CONFIG_DIR / "tiny.yaml").read_text()


def test_file_overrides_preset_and_flags_override_file(tmp_path):
    path = _yaml(tmp_path, "preset: tiny\nmicro_batch: 4\ntrain:\n  learning_rate: 5e-4\nlora:\n  lora_r: 4\n")
    s = parse_settings(["--config", path])
    assert s.preset == "tiny" and s.data.source == "synthetic" and s.train.max_steps == PRESETS["tiny"]["max_steps"]
    assert (s.train.micro_batch, s.train.learning_rate, s.lora.lora_r) == (4, 5e-4, 4)  # 5e-4: YAML 1.1 reads a str
    s = parse_settings(["--config", path, "--micro-batch", "1", "--preset", "qwen3-4b-ami"])
    assert s.preset == "qwen3-4b-ami" and s.data.source == "knkarthick/AMI"  # --preset names the base preset
    assert s.train.micro_batch == 1 and s.lora.lora_r == 4  # flag over file, file over preset


def test_own_model_runs_in_a_folder_named_after_it(tmp_path):
    """With no preset, a run's folder is named after its model (flag over file), not after a preset it did not use;
    --output-dir and a preset's own folder still win."""

    def folder(*argv: str) -> str:
        return parse_settings(list(argv)).train.output_dir

    assert folder("--model-name-or-path", "./models/my-llama/") == "runs/my-llama"
    assert folder("--model-name-or-path", "meta-llama/Llama-3.2-1B") == "runs/Llama-3.2-1B"
    assert folder("--model-name-or-path", "./my-llama", "--output-dir", "out") == "out"
    assert folder("--preset", "tiny", "--model-name-or-path", "./my-llama") == PRESETS["tiny"]["output_dir"]
    path = _yaml(tmp_path, "model_name_or_path: ./models/from-file\n")
    assert (folder("--config", path), folder("--config", path, "--model-name-or-path", "x/flag")) == (
        "runs/from-file",
        "runs/flag",
    )


@pytest.mark.parametrize(
    "text,needles",
    [
        ("micro_batches: 2\n", ["unknown key 'micro_batches'", "micro_batch", "sections model, lora"]),
        ("lora:\n  micro_batch: 2\n", ["unknown key lora.micro_batch", "lora_r, lora_alpha"]),
        ("micro_batch: two\n", ["micro_batch: 'two' is a str", "takes a int or 'auto'"]),
        ("learning_rate: fast\n", ["learning_rate: 'fast' is a str", "takes a float"]),
        ("balance_ranks: 1\n", ["balance_ranks: 1 is a int", "takes a bool"]),
        ("micro_batch: 2\ntrain:\n  micro_batch: 4\n", ["micro_batch is given twice"]),
        ("- micro_batch\n", ["expected a mapping"]),
    ],
)
def test_file_unknown_key_or_type_refused_naming_it(tmp_path, capsys, text, needles):
    with pytest.raises(SystemExit) as error:
        parse_settings(["--config", _yaml(tmp_path, text)])
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert "run.yaml" in err and all(n in err for n in needles), err


def test_file_bad_choice_names_key_and_choices(tmp_path):
    with pytest.raises(ValueError, match=r"comm_hook='int8': choose one of allreduce"):
        parse_settings(["--config", _yaml(tmp_path, "ddp:\n  comm_hook: int8\n")])
    with pytest.raises(ValueError, match=r"report_to='tensorboard': choose wandb or none"):
        parse_settings(["--config", _yaml(tmp_path, "report_to: tensorboard\n")])


def test_written_run_config_reruns_the_same_settings(tmp_path):
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training.config import RUN_CONFIG, write_run_config

    argv = ["--preset", "tiny", "--output-dir", str(tmp_path / "run"), "--lora-r", "4", "--bucket-cap-mb", "auto"]
    argv += ["--no-balance-ranks", "--eval-split", "test"]
    settings = parse_settings(argv)
    path = write_run_config(settings, DistInfo())
    assert path == tmp_path / "run" / RUN_CONFIG and not list(path.parent.glob(".*tmp*"))
    assert parse_settings(["--config", str(path)]) == settings
    other_rank = DistInfo(rank=1, local_rank=1, world_size=2, local_world_size=2)
    write_run_config(settings_from_preset("tiny", output_dir=str(tmp_path / "r1")), other_rank)
    assert not (tmp_path / "r1").exists()  # rank 0 only


def test_run_config_records_resolved_over_parsed(tmp_path):
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training.config import write_run_config

    settings = parse_settings(["--preset", "tiny", "--output-dir", str(tmp_path), "--micro-batch", "auto"])
    resolved = {"model": {"compile": False}, "train": {"micro_batch": 4}, "data": {"packing": False}}
    rerun = parse_settings(["--config", str(write_run_config(settings, DistInfo(), resolved))])
    assert (rerun.train.micro_batch, rerun.model.compile, rerun.data.packing) == (4, False, False)
    assert (settings.train.micro_batch, settings.model.compile, settings.data.packing) == ("auto", "auto", "auto")


def test_run_config_records_the_backend_that_ran(tmp_path):
    from ddp_ft.distributed import DistInfo
    from ddp_ft.distributed.devices import BACKEND_CHOICES
    from ddp_ft.training.config import write_run_config

    assert BACKEND_CHOICES == ddp_settings.BACKEND_CHOICES  # one list: DDPSettings and the device rule
    settings = parse_settings(["--preset", "tiny", "--output-dir", str(tmp_path)])
    ran = DistInfo(world_size=2, local_world_size=2, device=torch.device("cuda", 0), backend="gloo")
    rerun = parse_settings(["--config", str(write_run_config(settings, ran))])
    assert (settings.ddp.backend, rerun.ddp.backend) == ("auto", "gloo")
    one = parse_settings(["--config", str(write_run_config(settings, DistInfo()))])
    assert one.ddp.backend == "auto"  # one process: no group, nothing ran


def test_generation_settings_without_run_are_refused():
    with pytest.raises(ValueError, match=r"max_new_tokens=32 without predict: .*Give --predict N"):
        parse_settings(["--max-new-tokens", "32"])
    assert parse_settings(["--predict", "2", "--max-new-tokens", "32"]).train.max_new_tokens == 32
    from ddp_ft.commands import generate

    with pytest.raises(SystemExit):
        generate.parse_args(["runs/x", "--prompt", "hi", "--limit", "2"])
