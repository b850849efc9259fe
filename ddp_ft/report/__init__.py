"""What a run reports, and what two runs compare to:

* ``records``: the records a run writes (config, train step, eval, stop, bucket choice) and its identity;
* ``metrics``: the throughput meter and the metric sink (rank 0's ``metrics.jsonl``, and wandb when asked);
* ``comparison/``: one run on 1 device against the same experiment on N, as a table, a JSON file and a figure.

Importing this package loads nothing; the training loop imports ``records`` and ``metrics`` only.
"""
