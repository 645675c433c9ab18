"""A local HTTP file server on 127.0.0.1 that supports Range requests and injects faults on chosen GETs.

    with FaultServer(directory, faults={2: "503", 3: "429", 4: "cut:5000", 6: "reset"}) as server:
        url = server.url("data.jsonl")

Faults, by 1-based GET number (a dict, or a function of the number): "503"/"500"/"404"/"401"/"403" answer that status; "429" answers 429 with
Retry-After: 1; "cut:N" sends the headers for the whole range, then N bytes of it, then closes the
connection; "reset" closes the connection without answering. `server.gets` lists (path, range) of every GET.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def _file(self) -> str | None:
        path = os.path.join(self.server.directory, self.path.split("?")[0].lstrip("/"))
        return path if os.path.isfile(path) else None

    def do_HEAD(self) -> None:
        path = self._file()
        if path is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(os.path.getsize(path)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.count += 1
            n = self.server.count
            self.server.gets.append((self.path, self.headers.get("Range")))
        faults = self.server.faults
        fault = faults(n) if callable(faults) else faults.get(n, "")
        if fault == "reset":
            self.close_connection = True
            self.connection.close()
            return
        if fault.isdigit():
            self.send_response(int(fault))
            if fault == "429":
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = self._file()
        if path is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        self._send(path, fault)

    def _send(self, path: str, fault: str) -> None:
        size = os.path.getsize(path)
        start, status = 0, 200
        ranged = self.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            start = int(ranged[len("bytes="):].split("-")[0])
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(size - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read()
        if fault.startswith("cut:"):
            self.wfile.write(body[: int(fault[4:])])
            self.wfile.flush()
            self.close_connection = True
            self.connection.close()
            return
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, directory: str, faults):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.directory, self.faults = directory, faults
        self.count, self.gets, self.lock = 0, [], threading.Lock()


class FaultServer:
    def __init__(self, directory: str, faults: dict[int, str] | Callable[[int], str] | None = None):
        self.server = _Server(str(directory), faults or {})
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    @property
    def gets(self) -> list:
        return self.server.gets

    def __enter__(self) -> FaultServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
