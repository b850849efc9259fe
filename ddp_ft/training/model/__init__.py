"""The QLoRA model and what decides its speed and memory, one module each:

* ``qlora``: ``ModelSettings``, ``LoraSettings``, ``load_qlora_model`` (4-bit NF4 base, LoRA adapters, non-reentrant
  checkpointing, this rank's device map) and the embedded tiny Qwen3;
* ``source``: where a model comes from (hub id or folder), checked before anything loads;
* ``precision``: the compute dtype this device runs (bf16, loss-scaled fp16, float32);
* ``kernels``: Liger's fused kernels; ``compilation``: the decoder layers compiled in place;
* ``memory``: the peak-memory arithmetic for Qwen3 shapes; ``probe``: the micro-batch measured on the built model.
"""
