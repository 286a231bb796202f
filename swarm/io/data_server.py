"""A small HTTP server for a prepared corpus folder, with single-range ``Range`` requests (what
``swarm-coordinator serve --data DIR`` and ``swarm data serve`` run; any static file server with Range
support, e.g. nginx, serves a prepared folder as well)."""

from __future__ import annotations

import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from swarm.io import shards

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
_CHUNK = 1 << 20


class DataServer:
    """Serves the files a prepared folder's manifest names (and nothing else) until :meth:`close`."""

    def __init__(self, folder: str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.folder = Path(folder)
        self.manifest = shards.verify_folder(self.folder, deep=False)
        names = {shards.MANIFEST, *(s.name for s in self.manifest.shards)}
        if self.manifest.tokenizer["file"] is not None:
            names.add(self.manifest.tokenizer["file"])
        self.served_bytes = 0
        lock = threading.Lock()
        server = self

        class Handler(_RangeHandler):
            def resolve(self, name: str) -> Path | None:
                return server.folder / name if name in names else None

            def count(self, n: int) -> None:
                with lock:
                    server.served_bytes += n

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self.url = f"http://{host}:{self.port}/"
        self._thread = threading.Thread(target=self._http.serve_forever, name="data-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()

    def __enter__(self) -> DataServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def resolve(self, name: str) -> Path | None:
        raise NotImplementedError

    def count(self, n: int) -> None:
        raise NotImplementedError

    def log_message(self, format: str, *args: object) -> None:  # quiet: a node fetches often
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = self.resolve(self.path.lstrip("/").split("?")[0])
        if path is None or not path.is_file():
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        size = path.stat().st_size
        start, end, status = 0, size, HTTPStatus.OK
        wanted = self.headers.get("Range")
        if wanted is not None:
            m = _RANGE.match(wanted.strip())
            if m is None or int(m[1]) >= size:
                self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, end = int(m[1]), min(size, int(m[2]) + 1 if m[2] else size)
            status = HTTPStatus.PARTIAL_CONTENT
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start
            while left:
                chunk = f.read(min(_CHUNK, left))
                self.count(len(chunk))  # before sending: a client that has the bytes sees them counted
                self.wfile.write(chunk)
                left -= len(chunk)
