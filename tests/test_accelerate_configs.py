"""Every shipped accelerate config parses as Accelerate's own config and shows its launch command."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "accelerate_configs").glob("*.yaml"))


def test_the_four_launch_setups_are_shipped():
    assert {p.stem for p in CONFIGS} == {"single", "2gpu", "2cpu_gloo", "multinode"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_in_accelerate_and_its_header_shows_the_launch_command(path):
    config = ClusterConfig.from_yaml_file(str(path))
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(f"accelerate launch --config_file accelerate_configs/{path.name}" in line for line in header)
    expected_processes = {"single": 1, "2gpu": 2, "2cpu_gloo": 2, "multinode": 4}[path.stem]
    assert config.num_processes == expected_processes
    if path.stem == "multinode":
        assert config.num_machines == 2
