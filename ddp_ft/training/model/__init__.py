"""The QLoRA model, its loading, precision, kernels, compilation and memory."""
