"""A checkpoint directory served over HTTP for replica tests and the bench:
GET and HEAD with byte ranges (``Range: bytes=a-b``, as object stores and
nginx serve them), optionally a flaky mirror that flips one byte of each
data file's first response, one that cuts each data file's first response
off after some bytes, or one that serves no ranges (as
``python -m http.server``). Run as a script it serves a directory:
``python tests/_http_source.py DIR PORT [--corrupt-first [--corrupt-when
FILE]] [--addr A]``."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        name = self.path.lstrip("/").split("?", 1)[0]
        path = os.path.join(self.server.root, name)
        if "/" in name or name.startswith(".") or not os.path.isfile(path):
            self.send_error(404)
            return
        size = os.path.getsize(path)
        start, end, status = 0, size, 200
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m and self.server.ranges:
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            status = 206
        first = False
        if body and name != "manifest.json" and end > start:
            with self.server.lock:
                first = name not in self.server.corrupted
                self.server.corrupted.add(name)
        armed = self.server.corrupt_when is None or os.path.exists(self.server.corrupt_when)
        corrupt = first and self.server.corrupt_first and armed
        cut = first and self.server.cut_first is not None
        count = max(0, end - start)
        if cut:
            count = min(count, self.server.cut_first or 0)
            self.close_connection = True
        with self.server.lock:
            self.server.requests.append((name, start, end))
            if body:
                self.server.bytes_sent += count
        self.send_response(status)
        self.send_header("Content-Length", str(max(0, end - start)))
        self.send_header("Accept-Ranges", "bytes" if self.server.ranges else "none")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return
        with open(path, "rb") as f, contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if not corrupt:
                # As a file server does: the kernel copies the file to the
                # socket (no pass through this process's memory).
                self.wfile.flush()
                if count:
                    self.connection.sendfile(f, start, count)
            else:
                f.seek(start)
                piece = bytearray(f.read(count))
                piece[len(piece) // 2] ^= 0x01
                self.wfile.write(piece)
            if cut:
                # A cut after the bytes arrived (a client may drop what it
                # holds once it sees the close).
                self.wfile.flush()
                time.sleep(0.2)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        root: str,
        addr: str,
        port: int,
        corrupt_first: bool,
        ranges: bool,
        cut_first: int | None = None,
    ) -> None:
        super().__init__((addr, port), _Handler)
        self.root, self.corrupt_first, self.ranges = root, corrupt_first, ranges
        self.cut_first = cut_first
        #: With corrupt_first, corrupt only while this file exists.
        self.corrupt_when: str | None = None
        self.lock = threading.Lock()
        self.corrupted: set[str] = set()
        self.requests: list[tuple[str, int, int]] = []
        self.bytes_sent = 0


class HttpSource:
    """Serves ``root`` at ``url`` from a thread until ``close()``."""

    def __init__(
        self,
        root: str,
        *,
        addr: str = "127.0.0.1",
        port: int = 0,
        corrupt_first: bool = False,
        ranges: bool = True,
        cut_first: int | None = None,
    ) -> None:
        self.server = _Server(os.fspath(root), addr, port, corrupt_first, ranges, cut_first)
        self.url = f"http://{addr}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> HttpSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("root")
    p.add_argument("port", type=int)
    p.add_argument("--addr", default="0.0.0.0")
    p.add_argument("--corrupt-first", action="store_true")
    p.add_argument("--corrupt-when", help="corrupt only while this file exists")
    args = p.parse_args()
    server = _Server(args.root, args.addr, args.port, args.corrupt_first, True)
    server.corrupt_when = args.corrupt_when
    print(f"serving {args.root} at http://{args.addr}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
