"""What the tests share: the real-process harness, tiny models and data, fault injection, and the bodies of the
multi-process runs that the tests start."""
