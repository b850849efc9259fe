"""Variable-length meeting data for tests: real padding in every micro-batch, uneven answer lengths."""

from ddp_ft.training.data.synthetic import write_mixed_length_meetings

__all__ = ["write_mixed_length_meetings"]
