"""What BucketedDDP would do on N processes, from a finished one-process run (``ddp-ft forecast``).

The run's ``backward`` records say when each bucket was ready. A link says what an all-reduce costs.
Modules, each importing only those before it:

* ``links``: the links and the ring's cost;
* ``schedule``: the Reducer's schedule replayed (pure);
* ``build``: records in, rows out (pure);
* ``render``: the markdown and the files.
"""

from .build import Forecast, ForecastRow, forecast_run, measured_steps, split_batch
from .links import LINK_CHOICES, MEASURED, PRESETS, PROBE_FILE, Link, fit_link, load_probe, ring_allreduce_ms
from .render import FORECAST_FILE, load_forecast, markdown, write_forecast
from .schedule import (
    BucketSchedule,
    MeasuredStep,
    PredictedStep,
    expected_max_of_normals,
    predict_step,
    rank_wait_ms,
    schedule_buckets,
)

__all__ = [
    "FORECAST_FILE",
    "LINK_CHOICES",
    "MEASURED",
    "PRESETS",
    "PROBE_FILE",
    "BucketSchedule",
    "Forecast",
    "ForecastRow",
    "Link",
    "MeasuredStep",
    "PredictedStep",
    "fit_link",
    "forecast_run",
    "load_forecast",
    "load_probe",
    "markdown",
    "measured_steps",
    "expected_max_of_normals",
    "predict_step",
    "rank_wait_ms",
    "ring_allreduce_ms",
    "schedule_buckets",
    "split_batch",
    "write_forecast",
]
