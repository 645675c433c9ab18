"""Reading http(s):// files that survive the network: a seekable, read-only file over HTTP Range requests.

A `RemoteFile` streams one URL and, when the connection drops mid-body, times out, is reset, or the
server answers 429 or 5xx, waits (exponential backoff with jitter, or the server's Retry-After) and
asks again from the exact byte it had reached (`Range: bytes=N-`), so the bytes, hence the documents
and the token stream, are the same as without the fault. Each retry is one log line. A permanent
answer (404, 410, 401, 403, ...) or an exhausted retry budget is a one-line DatasetError naming the
URL. Seeking (Parquet reads its footer first) opens a new ranged request at the next read.

Stdlib only (urllib): none of our dependencies resumes a cut body at its byte offset, and the loader
must stay free of jax and of network stacks it does not need.
"""

from __future__ import annotations

import email.utils
import http.client
import io
import logging
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from slm.errors import DatasetError

_log = logging.getLogger(__name__)
TRANSIENT_STATUS = (408, 425, 429, 500, 502, 503, 504)


@dataclass
class RetryPolicy:
    """Bounded exponential backoff with jitter: wait min(cap, base * 2**k) * U(0.5, 1.5) before retry k+1
    (or the server's Retry-After, capped), at most `retries` times in a row without progress."""

    retries: int = 8
    base_s: float = 1.0
    cap_s: float = 60.0
    timeout_s: float = 30.0  # per connect / read
    sleep: Callable[[float], None] = time.sleep
    log: Callable[[str], None] = field(default=lambda msg: _log.warning("%s", msg))
    rng: random.Random = field(default_factory=random.Random)

    def wait(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(self.cap_s, max(0.0, retry_after))
        return min(self.cap_s, self.base_s * 2**attempt) * self.rng.uniform(0.5, 1.5)


def _retry_after(headers) -> float | None:
    """Retry-After as seconds: an integer, or an HTTP date."""
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        when = email.utils.parsedate_to_datetime(value)
        return None if when is None else when.timestamp() - time.time()


class RemoteFile(io.RawIOBase):
    """A read-only, seekable file over HTTP(S) that retries transient failures from the byte it reached."""

    def __init__(self, url: str, policy: RetryPolicy | None = None):
        self.url, self.policy = url, policy or RetryPolicy()
        self.pos, self.response, self.size = 0, None, None
        self.retries = 0  # total, for tests and logs

    # -- io.RawIOBase ---------------------------------------------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        new = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset, io.SEEK_END: self.length() + offset}[whence]
        if new != self.pos:
            self._drop()
            self.pos = new
        return self.pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        if self.size is not None and self.pos >= self.size:
            return 0
        failures = 0
        while True:
            try:
                if self.response is None:
                    self.response = self._open()
                    if self.response is None:  # past the end (416)
                        return 0
                n = self.response.readinto(view)
                if n == 0 and self.size is not None and self.pos < self.size:
                    raise http.client.IncompleteRead(b"", self.size - self.pos)  # closed early, no error raised
                self.pos += n
                return n
            except (http.client.IncompleteRead, ConnectionError, TimeoutError, OSError) as e:
                self._drop()
                failures = self._backoff(failures, f"{type(e).__name__} at byte {self.pos:,}", None)

    def close(self) -> None:
        self._drop()
        super().close()

    # -- HTTP -----------------------------------------------------------------------------------

    def length(self) -> int:
        """The file's size in bytes (a HEAD request, retried like reads)."""
        if self.size is None:
            failures = 0
            while self.size is None:
                try:
                    with urllib.request.urlopen(urllib.request.Request(self.url, method="HEAD"),
                                                timeout=self.policy.timeout_s) as r:
                        self.size = int(r.headers.get("Content-Length", -1))
                except urllib.error.HTTPError as e:
                    failures = self._status(e, failures)
                except (ConnectionError, TimeoutError, urllib.error.URLError, OSError) as e:
                    failures = self._backoff(failures, type(e).__name__, None)
        return self.size

    def _open(self):
        """A response streaming the body from self.pos; None when self.pos is at or past the end."""
        failures = 0
        while True:
            headers = {"Range": f"bytes={self.pos}-"} if self.pos else {}
            try:
                r = urllib.request.urlopen(urllib.request.Request(self.url, headers=headers),
                                           timeout=self.policy.timeout_s)
            except urllib.error.HTTPError as e:
                if e.code == 416:  # nothing left from this offset
                    return None
                failures = self._status(e, failures)
                continue
            except (ConnectionError, TimeoutError, urllib.error.URLError, OSError) as e:
                failures = self._backoff(failures, f"{type(e).__name__}: {getattr(e, 'reason', e)}", None)
                continue
            return self._positioned(r)

    def _positioned(self, r):
        """Check the response starts at self.pos: a 206 for our range, or a 200 we skip forward in."""
        total = r.headers.get("Content-Length")
        if r.status == 206:
            crange = r.headers.get("Content-Range", "")  # bytes START-END/SIZE
            start = int(crange.split()[1].split("-")[0]) if crange.startswith("bytes ") else self.pos
            if start != self.pos:
                r.close()
                raise DatasetError(f"{self.url}: the server answered range {crange} for byte {self.pos}; "
                                   f"it does not support resuming: download the file and pass its path")
            if "/" in crange and crange.rsplit("/", 1)[1].isdigit():
                self.size = int(crange.rsplit("/", 1)[1])
            return r
        if total is not None:
            self.size = int(total)
        skip = self.pos  # no Range support: read and drop the bytes already consumed
        while skip:
            chunk = r.read(min(skip, 1 << 20))
            if not chunk:
                raise http.client.IncompleteRead(b"", skip)
            skip -= len(chunk)
        return r

    def _status(self, e: urllib.error.HTTPError, failures: int) -> int:
        if e.code in TRANSIENT_STATUS:
            return self._backoff(failures, f"HTTP {e.code}", _retry_after(e.headers))
        hint = {404: "check the URL", 410: "check the URL", 401: "it needs credentials: download it and pass its path",
                403: "access is denied: download it and pass its path"}.get(e.code, "check the URL and the server")
        raise DatasetError(f"{self.url}: HTTP {e.code} {e.reason}; {hint}")

    def _backoff(self, failures: int, why: str, retry_after: float | None) -> int:
        self.retries += 1
        return backoff(self.policy, self.url, failures, why, retry_after)

    def _drop(self) -> None:
        if self.response is not None:
            try:
                self.response.close()
            except OSError:
                pass
            self.response = None


def backoff(policy: RetryPolicy, what: str, failures: int, why: str, retry_after: float | None) -> int:
    """Log one line and wait before retry `failures + 1`; a DatasetError once the budget is spent."""
    if failures >= policy.retries:
        raise DatasetError(f"{what}: gave up after {failures} retries in a row ({why}); check the "
                           f"network or the server, then --resume the run")
    wait = policy.wait(failures, retry_after)
    policy.log(f"[data] {what}: {why}; retry {failures + 1}/{policy.retries} in {wait:.1f}s")
    policy.sleep(wait)
    return failures + 1


def _chain(e: BaseException):
    """The exception and its causes/contexts (libraries wrap the network error they met)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def http_status(e: BaseException) -> int | None:
    """The HTTP status behind an exception from urllib, httpx or huggingface_hub, if there is one."""
    for x in _chain(e):
        code = getattr(x, "code", None) if isinstance(x, urllib.error.HTTPError) else None
        response = getattr(x, "response", None)
        code = code or getattr(response, "status_code", None) or getattr(x, "status_code", None)
        if isinstance(code, int):
            return code
    return None


def retry_after_of(e: BaseException) -> float | None:
    for x in _chain(e):
        headers = getattr(x, "headers", None) or getattr(getattr(x, "response", None), "headers", None)
        if headers is not None and (value := _retry_after(headers)) is not None:
            return value
    return None


_TRANSIENT_NAMES = ("Timeout", "ConnectError", "ReadError", "RemoteProtocolError", "IncompleteRead",
                    "ChunkedEncodingError", "ServerDisconnected", "ClientPayloadError")


def transient(e: BaseException) -> bool:
    """A failure worth retrying: 408/425/429/5xx, a timeout, a reset or a body cut short."""
    status = http_status(e)
    if status is not None:
        return status in TRANSIENT_STATUS
    return any(isinstance(x, (ConnectionError, TimeoutError, http.client.IncompleteRead))
               or any(n in type(x).__name__ for n in _TRANSIENT_NAMES) for x in _chain(e))


def is_url(spec: str) -> bool:
    return spec.lower().startswith(("http://", "https://"))


def open_url(url: str, mode: str = "rb", policy: RetryPolicy | None = None, **text_kwargs):
    """`open()` for a URL: buffered binary, or text (encoding/errors/newline as for open) over it."""
    raw = io.BufferedReader(RemoteFile(url, policy), buffer_size=256 << 10)
    return raw if "b" in mode else io.TextIOWrapper(raw, **text_kwargs)
