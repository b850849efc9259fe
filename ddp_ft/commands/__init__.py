"""The entry points' bodies, so a pip-installed ddp_ft has them too."""

from ..distributed import hold_library_notices, keep_upstream_notices_to_rank_zero


def quiet_upstream_notices() -> None:
    """Hold bitsandbytes' import notice and keep such notices to rank 0; call it first."""
    hold_library_notices()
    keep_upstream_notices_to_rank_zero()
