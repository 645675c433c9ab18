"""Data: sources (hub, local files, built-in corpus), readers, tokenizer, instruction examples, packing and the
streaming loader.

numpy + tokenizers + datasets only, no jax: the loader works for any framework.
"""
