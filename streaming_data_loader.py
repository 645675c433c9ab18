"""StreamingDataLoader and estimate_memory_usage, where the seed guide imports them from.

    from streaming_data_loader import StreamingDataLoader, estimate_memory_usage
    loader = StreamingDataLoader(dataset_id="data.txt", tokenizer=tok, seq_len=128, batch_size=32)
    for batch in loader:            # one epoch
        batch["input_ids"], batch["targets"]   # numpy int32, (batch_size, seq_len)
    estimate_memory_usage(100_000, 128, 32)                           # the data side, in MB
    estimate_memory_usage(0, 256, 16, target_params=20_000_000)       # the whole run, per device and host RSS
    estimate_memory_usage(0, 256, 1, model="config.json", lora_rank=16, base_dtype="float16", platform="gpu")
    fit_to_budget("24GB", 512, 2, 8, model="config.json", lora_rank=16)  # --auto-fit's choice, from a notebook

The loader is slm/data/stream.py (no jax); the arithmetic is slm/memory/estimate.py (pure Python).
"""

from slm.data.stream import StreamingDataLoader
from slm.memory.estimate import estimate_memory_usage, fit_to_budget

__all__ = ["StreamingDataLoader", "estimate_memory_usage", "fit_to_budget"]
