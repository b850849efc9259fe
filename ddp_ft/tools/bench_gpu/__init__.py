"""The GPU benchmark (``make bench-gpu``): Qwen3 QLoRA training speed per mode.

Modules, each importing only those before it: ``steps``, ``models``, ``modes``, ``result``, ``cli``.
"""
