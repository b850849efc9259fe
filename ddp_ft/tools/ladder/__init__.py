"""The DDP ladder: small reference implementations of data parallelism, up to BucketedDDP.

Not public API. Each rung is written to be read and measured (``scripts/ladder.py``).
"""
