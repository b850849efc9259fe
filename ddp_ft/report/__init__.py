"""What a run reports, and how two runs compare.

* ``records``: the records a run writes, and its identity.
* ``metrics``: the throughput meter and rank 0's metric sinks.
* ``forecast/``: a one-process run forecast on N ranks.
* ``comparison/``: one run on 1 device against the same experiment on N.

Importing this package loads nothing, so the training loop loads only what it uses.
"""
