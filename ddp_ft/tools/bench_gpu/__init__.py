"""The GPU benchmark (``make bench-gpu``): Qwen3 QLoRA training speed per mode."""
