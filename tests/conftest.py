import os

# The suite is a CPU suite: it compares processes over gloo, reads CPU metrics (peak_rss_gb) and expects the CPU
# defaults (preset tiny, MULTI_CPU). On a GPU host, CUDA is hidden from this process and every process a test starts
# (set before torch initialises CUDA), or 2 processes on 1 GPU would fail and 2 on 2 GPUs would take NCCL. Tests
# marked ``cuda`` start their processes with ``gpu_environment`` (the original value) and are skipped without CUDA.
os.environ.setdefault("DDP_FT_TEST_CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# One OpenMP thread per process, as torchrun sets for several processes per node and as one GPU per process is: a
# launch the suite starts with one process per node (the two-node loopback test) would otherwise run two spinning
# thread pools per core, and its collectives would wait on descheduled threads (a 2-step run took 22 s, not 1 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest  # noqa: E402


def _gpu_environment() -> dict[str, str]:
    """The environment with CUDA visible as it was before the suite hid it (for ``cuda`` tests' processes)."""
    env = dict(os.environ)
    original = env["DDP_FT_TEST_CUDA_VISIBLE_DEVICES"]
    if original == "unset":
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = original
    return env


def _host_has_cuda() -> bool:
    """Asked in a child process: this one has CUDA hidden for good (torch reads the variable once)."""
    import shutil
    import subprocess
    import sys

    if shutil.which("nvidia-smi") is None:  # no NVIDIA driver: no need to start torch to know
        return False
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], env=_gpu_environment(), timeout=120).returncode == 0


def pytest_collection_modifyitems(config, items):
    cuda_tests = [item for item in items if "cuda" in item.keywords]
    if cuda_tests and not _host_has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this host)")
        for item in cuda_tests:
            item.add_marker(skip)


@pytest.fixture
def gpu_environment() -> dict[str, str]:
    """For ``cuda`` tests: the environment to start GPU processes with (CUDA as the suite found it)."""
    return _gpu_environment()


@pytest.fixture
def run_on_gpu():
    """For ``cuda`` tests: runs Python source in a process that sees the GPU and imports the repository; fails on a
    non-zero exit."""
    import subprocess
    import sys

    from .helpers.dist_harness import PYTHONPATH

    def run(code: str) -> None:
        env = {**_gpu_environment(), "PYTHONPATH": PYTHONPATH}
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)

    return run


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    """A ``DDP_FT_CACHE`` folder holding the embedded tiny tokenizer and model, built once per session (~4 s)."""
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training.model.qlora import EMBEDDED_MODEL
    from ddp_ft.training.setup import resolve_model_and_tokenizer

    cache = tmp_path_factory.mktemp("ddp_ft_cache")
    previous = os.environ.get("DDP_FT_CACHE")
    os.environ["DDP_FT_CACHE"] = str(cache)
    try:
        resolve_model_and_tokenizer(EMBEDDED_MODEL, DistInfo())
    finally:
        if previous is None:
            del os.environ["DDP_FT_CACHE"]
        else:
            os.environ["DDP_FT_CACHE"] = previous
    return str(cache)


@pytest.fixture(scope="session", autouse=True)
def _one_tiny_cache_for_the_session(tiny_cache):
    """Every test, and every process a test launches, reads the tiny model and tokenizer from one cache, built once
    (each launch used to build its own: several seconds per test). A test that needs its own sets DDP_FT_CACHE."""
    previous = os.environ.get("DDP_FT_CACHE")
    os.environ["DDP_FT_CACHE"] = tiny_cache
    yield
    if previous is None:
        os.environ.pop("DDP_FT_CACHE", None)
    else:
        os.environ["DDP_FT_CACHE"] = previous


@pytest.fixture
def run_env(tmp_path, monkeypatch, tiny_cache):
    """One in-process run's environment: wandb offline with every folder of its own under ``tmp_path``, and the
    variables the Trainer recipe sets (``os.environ`` directly) restored afterwards.

    wandb reads its environment once per process, at its first setup: ``wandb.teardown()`` before and after makes
    it read this test's, and leaves this test's folders to no other. ``wandb.finish()`` ends the runs teardown
    leaves in ``wandb.run`` (disabled ones, those a failure left open), which a WandbCallback would take over.
    """
    import wandb

    monkeypatch.setenv("DDP_FT_CACHE", str(tiny_cache))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    (tmp_path / "wandb-dir").mkdir()
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    for name in ("WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_JOB_TYPE", "WANDB_API_KEY", "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)
    wandb.finish()
    wandb.teardown()
    yield
    wandb.finish()
    wandb.teardown()


@pytest.fixture
def rank_1_of_2(monkeypatch):
    """Rank 1 of 2 with init_process_group recorded instead of run; CUDA absent unless a test mocks it."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    return calls
