"""Optimizers: AdamW with optional 8-bit block-quantized moments, the learning-rate schedule (jax + optax)."""
