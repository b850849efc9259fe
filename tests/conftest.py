import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    """A ``DDP_FT_CACHE`` folder holding the embedded tiny tokenizer and model, built once per session (~4 s)."""
    from ddp_ft.distributed import DistInfo
    from ddp_ft.loop import resolve_model_and_tokenizer
    from ddp_ft.model import EMBEDDED_MODEL

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
