"""Model: sizing (pure Python), the Flax transformer and its KV-cache decoder. No files, no flags."""
