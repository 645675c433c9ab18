"""slm.data.remote and http(s) datasets (issue 14): against a local server on 127.0.0.1 that serves files
with Range support and injects 503, 429, cut bodies and resets, the documents equal the local file's, each
retry is one log line, and permanent errors or an exhausted budget are one-line errors naming the URL."""

from __future__ import annotations

import shutil

import pytest
from fault_server import FaultServer
from helpers import read_docs

from slm.data.readers import read_file
from slm.data.remote import RemoteFile, RetryPolicy, open_url
from slm.data.sources import HubDataset, UrlFile, resolve_source
from slm.errors import DatasetError

FILES = ["tinystories_valid.jsonl", "tinystories_valid.parquet", "tinyshakespeare_val.txt"]


def fast_policy(waits: list, logs: list, retries: int = 8) -> RetryPolicy:
    return RetryPolicy(retries=retries, base_s=0.5, cap_s=4.0, timeout_s=5.0, sleep=waits.append, log=logs.append)


@pytest.fixture(scope="module")
def served(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("served")
    for name in FILES:
        shutil.copy(data_dir / name, root / name)
    return root


def test_bytes_survive_503_429_a_cut_body_and_a_reset(served):
    faults = {1: "503", 2: "429", 3: "cut:70000", 4: "reset", 5: "500"}
    waits, logs = [], []
    with FaultServer(served, faults) as server:
        with open_url(server.url("tinyshakespeare_val.txt"), policy=fast_policy(waits, logs)) as f:
            got = f.read()
        ranges = [r for _, r in server.gets]
    assert got == (served / "tinyshakespeare_val.txt").read_bytes()
    assert len(logs) == 5 and all(line.startswith("[data] http://127.0.0.1:") for line in logs)
    assert "HTTP 503" in logs[0] and "HTTP 429" in logs[1] and "IncompleteRead at byte 70,000" in logs[2]
    # resumed at the exact byte each time: after the cut the next request asks from byte 70,000
    assert ranges[:4] == [None, None, None, "bytes=70000-"]
    assert waits[1] == 1.0  # the server's Retry-After
    assert all(0.25 <= w <= 4.0 * 1.5 for w in waits)  # backoff with jitter, capped


@pytest.mark.parametrize("name", FILES)
def test_url_documents_equal_the_local_files_under_faults(served, name):
    waits, logs = [], []
    faults = {2: "503", 3: "cut:30000", 4: "429", 7: "reset"}
    with FaultServer(served, faults) as server:
        source = UrlFile(server.url(name), policy=fast_policy(waits, logs))
        docs = list(source.documents())
        assert source.size_bytes == (served / name).stat().st_size
    assert docs == read_docs(served / name) and len(docs) > 50
    assert logs  # faults were met and retried


def test_resolve_source_takes_a_url_and_refuses_an_unsupported_one(served):
    with FaultServer(served) as server:
        source = resolve_source(server.url("tinystories_valid.jsonl?download=1"))
        assert isinstance(source, UrlFile) and next(source.documents()).startswith(
            read_docs(served / "tinystories_valid.jsonl")[0][:20])
    with pytest.raises(DatasetError, match=r"--dataset-id https://example.com/x.bin: a URL must name a"):
        resolve_source("https://example.com/x.bin")


@pytest.mark.parametrize("status, hint", [("404", "check the URL"), ("401", "needs credentials"),
                                          ("403", "access is denied")])
def test_permanent_errors_stop_at_once_in_one_line(served, status, hint):
    waits, logs = [], []
    with FaultServer(served, {1: status}) as server:
        url = server.url("tinystories_valid.jsonl")
        with pytest.raises(DatasetError) as info:
            list(read_file(url, opener=lambda p, m, **kw: open_url(p, m, policy=fast_policy(waits, logs), **kw)))
    msg = str(info.value)
    assert msg.startswith(f"{url}: HTTP {status} ") and hint in msg and "\n" not in msg
    assert waits == [] and logs == []  # no retry of a permanent error


def test_a_missing_file_is_a_404_and_an_exhausted_budget_is_one_line(served):
    waits, logs = [], []
    with FaultServer(served) as server:
        with pytest.raises(DatasetError, match=r"HTTP 404"):
            RemoteFile(server.url("nope.jsonl"), fast_policy(waits, logs)).read(10)
    with FaultServer(served, {i: "503" for i in range(1, 10)}) as server:
        url = server.url("tinystories_valid.jsonl")
        with pytest.raises(DatasetError) as info:
            RemoteFile(url, fast_policy(waits, logs, retries=3)).read(10)
    assert str(info.value) == (f"{url}: gave up after 3 retries in a row (HTTP 503); check the network or the "
                               f"server, then --resume the run")
    assert len(logs) == 3


def test_nothing_listening_is_retried_then_reported(served):
    waits, logs = [], []
    with FaultServer(served) as server:
        url = server.url("tinystories_valid.jsonl")
    with pytest.raises(DatasetError, match="gave up after 2 retries"):
        RemoteFile(url, fast_policy(waits, logs, retries=2)).read(10)
    assert len(logs) == 2 and "URLError" in logs[0]


class _Status(Exception):
    """Like huggingface_hub's HfHubHTTPError: the response rides on the exception."""

    def __init__(self, code: int, retry_after: str | None = None):
        super().__init__(f"{code} Server Error")
        self.response = type("R", (), {"status_code": code, "headers": {"Retry-After": retry_after} if retry_after
                                       else {}})()


class FlakyHub(HubDataset):
    """A hub dataset whose n-th opened stream fails after some rows (no network: `_load` is the seam)."""

    def __init__(self, rows, failures):
        self.waits, self.logs = [], []
        super().__init__("owner/flaky", policy=fast_policy(self.waits, self.logs))
        self.rows, self.failures, self.opened = rows, list(failures), 0

    def _load(self, split):
        self.opened += 1
        plan = self.failures.pop(0) if self.failures else None

        def stream():
            for i, row in enumerate(self.rows):
                if plan is not None and i == plan[0]:
                    raise plan[1]
                yield row
        return stream()


def test_hub_stream_reopens_after_transient_failures_at_the_exact_document():
    rows = [{"text": f"document {i}"} for i in range(50)]
    wrapped = RuntimeError("streaming read failed")
    wrapped.__cause__ = ConnectionResetError("Connection reset by peer")
    hub = FlakyHub(rows, [(10, _Status(503)), (25, _Status(429, "7")), (30, wrapped), (40, TimeoutError())])
    assert list(hub.documents()) == [r["text"] for r in rows]  # no document lost or repeated
    assert hub.opened == 5 and len(hub.logs) == 4 and hub.waits[1] == 4.0  # Retry-After 7, capped at 4
    assert "_Status after 10 documents" in hub.logs[0] and "RuntimeError after 30 documents" in hub.logs[2]


def test_hub_stream_permanent_error_is_one_line():
    hub = FlakyHub([{"text": "a"}] * 5, [(3, _Status(404))])
    with pytest.raises(DatasetError) as info:
        list(hub.documents())
    assert str(info.value) == ("--dataset-id owner/flaky: streaming failed after 3 documents (HTTP 404); check the "
                               "id, your access (HF_TOKEN) and the network")
    assert hub.logs == []
