"""The DDP ladder: small reference implementations of data parallelism, from a naive all-reduce to BucketedDDP.

Not part of ddp_ft's public API. Each rung is written to be read and measured (``scripts/ladder.py``); the product is
:class:`ddp_ft.ddp.BucketedDDP`. Also here: the ring all-reduce as a comm hook, and the collective benchmark.
"""
