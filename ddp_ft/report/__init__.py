"""Run records, metrics, and the comparison of two runs."""
