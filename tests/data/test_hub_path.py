"""The Hugging Face `datasets` code path (HubDataset), exercised offline on a local dataset directory.

`datasets.load_dataset(<directory>)` runs the same builder, streaming and split logic as a hub id, so
this covers what the trainer does with `--dataset-id owner/name` apart from the download itself.
"""

import json

import pytest

from slm.data.sources import HubDataset
from slm.errors import DatasetError


@pytest.fixture()
def hub_like_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "my_dataset"
    d.mkdir()
    with open(d / "train.jsonl", "w") as f:
        for i in range(50):
            f.write(json.dumps({"id": i, "story": f"Story number {i}. Once upon a time."}) + "\n")
    with open(d / "validation.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"id": i, "story": f"Held-out story {i}."}) + "\n")
    return d


@pytest.mark.parametrize("streaming", [True, False])
def test_hub_dataset_reads_documents_and_detects_column(hub_like_dir, streaming):
    src = HubDataset(str(hub_like_dir), streaming=streaming)
    docs = list(src.documents())
    assert docs[0] == "Story number 0. Once upon a time." and len(docs) == 50


def test_hub_dataset_finds_validation_split(hub_like_dir):
    val = HubDataset(str(hub_like_dir)).validation()
    assert val is not None and val.split == "validation"
    assert list(val.documents()) == [f"Held-out story {i}." for i in range(5)]


def test_hub_dataset_shuffle_seed_keeps_every_document(hub_like_dir):
    src = HubDataset(str(hub_like_dir))
    assert sorted(src.documents(shuffle_seed=3)) == sorted(src.documents())


def test_hub_dataset_wrong_column_and_missing_split_are_clear_errors(hub_like_dir):
    with pytest.raises(DatasetError, match="--text-column"):
        list(HubDataset(str(hub_like_dir), text_column="body").documents())
    with pytest.raises(DatasetError, match="could not load"):
        list(HubDataset(str(hub_like_dir), split="nope").documents())


@pytest.mark.parametrize("streaming", [True, False])
def test_hub_dataset_processes_read_disjoint_parts(hub_like_dir, streaming):
    src = HubDataset(str(hub_like_dir), streaming=streaming)
    everything = list(src.documents())
    parts = [list(src.documents(shard=(i, 2))) for i in (0, 1)]  # datasets.distributed.split_dataset_by_node
    assert not set(parts[0]) & set(parts[1]) and sorted(parts[0] + parts[1]) == sorted(everything)
    # With a held-out head, the head of the whole stream is skipped first, then the rest is split.
    parts = [list(src.documents(skip_head=7, shard=(i, 2))) for i in (0, 1)]
    assert parts[0] == everything[7::2] and parts[1] == everything[8::2]
