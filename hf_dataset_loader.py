"""Dataset sources and the full-load path: the hub, local files, directories, globs, the built-in corpus.

    from hf_dataset_loader import resolve_source, prepare_sequences
    source = resolve_source("data.jsonl")                 # or "roneneldan/TinyStories", "shards/*.parquet"
    for doc in source.documents(): ...

The code is in slm/data/ (sources.py, readers.py, packing.py); no jax.
"""

from slm.data.packing import encode_documents, pack_rows, prepare_sequences
from slm.data.readers import (
    LOCAL_EXTENSIONS,
    REPLACED_BYTES,
    TEXT_COLUMNS,
    pick_text_column,
    read_file,
)
from slm.data.sources import (
    BUILTIN_DATASET,
    DEFAULT_DATASET,
    HubDataset,
    ListSource,
    LocalFiles,
    TextSource,
    builtin_corpus,
    hub_reachable,
    local_paths,
    resolve_source,
    shard_of,
)
from slm.errors import DatasetError

__all__ = ["BUILTIN_DATASET", "DEFAULT_DATASET", "LOCAL_EXTENSIONS", "REPLACED_BYTES", "TEXT_COLUMNS", "DatasetError",
           "HubDataset", "ListSource", "LocalFiles", "TextSource", "builtin_corpus", "encode_documents",
           "hub_reachable", "local_paths", "pack_rows", "pick_text_column", "prepare_sequences", "read_file",
           "resolve_source", "shard_of"]
