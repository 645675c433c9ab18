"""slm: a streaming small-language-model trainer in JAX/Flax.

Layers, lowest first; a module imports only from its own layer or lower ones (tests/test_layering.py):

    errors   the UserError family (one-line messages, exit code 2)
    data     sources, readers, tokenizer, packing, the streaming loader     numpy + tokenizers + datasets, no jax
    model    sizing (pure Python), the Flax transformer, KV-cache decoding    no files, no flags
    optim    AdamW with 8-bit state, the learning-rate schedule               jax + optax only
    memory   the memory estimate and pre-flight arithmetic (pure Python), the RSS monitor
    io       orbax checkpoints, metrics and tracking sinks, the Hugging Face export writer
    train    Config, devices, the builder, the step, the loop and its callbacks, train()
    cli      flags and config files, the train / generate / export entry points

The top-level scripts (train_optimized.py, generate.py, export_hf.py) and modules
(streaming_data_loader, model_sizing, hf_dataset_loader) are thin entry points onto these.
"""

__version__ = "0.2.0"
