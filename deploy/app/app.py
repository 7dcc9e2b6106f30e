#!/usr/bin/env python3
"""The sample app behind each region's proxy (standard library only).

    python app.py --listen 0.0.0.0:8001 --region us-east

Every request (any method, any path) gets 200 and a small JSON body naming the
region, and is counted, except two paths the proxy does not limit:

* ``GET /healthz``: ``{"ok": true}`` (the container's health check);
* ``GET /stats``: ``{"region": ..., "served": N, "by_path": {...}}``, what reached
  the app: the smoke test checks that denied requests never did.

SIGTERM (or SIGINT) stops it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

_lock = threading.Lock()
_served: dict[str, int] = {}


class Handler(BaseHTTPRequestHandler):
    server_version = "geolimit-sample-app/1"
    protocol_version = "HTTP/1.1"
    region = "unknown"

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode() + b"\n"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        path = self.path.split("?", 1)[0]
        if self.command == "GET" and path == "/healthz":
            return self._reply(200, {"ok": True})
        if self.command == "GET" and path == "/stats":
            with _lock:
                return self._reply(200, {"region": self.region, "served": sum(_served.values()), "by_path": dict(_served)})
        with _lock:
            _served[path] = _served.get(path, 0) + 1
            count = _served[path]
        self._reply(200, {"region": self.region, "method": self.command, "path": path, "served": count})

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

    def log_message(self, format: str, *args: Any) -> None:  # one line per request, on stderr
        sys.stderr.write(f"app {self.region}: {self.address_string()} {format % args}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="geolimit's sample upstream app")
    parser.add_argument("--listen", default="127.0.0.1:8001", help="HOST:PORT (default: %(default)s)")
    parser.add_argument("--region", default="local")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    Handler.region = args.region
    server = ThreadingHTTPServer((host.strip("[]"), int(port)), Handler)
    server.daemon_threads = True

    def stop(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.stderr.write(f"app {args.region}: listening on http://{host}:{port}\n")
    sys.stderr.flush()
    server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
