"""Outputs of a run: orbax checkpoints, metrics.jsonl and trackers, and the Hugging Face export writer."""
