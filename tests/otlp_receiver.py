"""A local OTLP/HTTP receiver for tests: a real HTTP server on a free port that keeps every
request (path, protobuf body), as an OpenTelemetry collector would receive them."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """(endpoint URL, the requests received so far) while the server runs."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", server.received
    finally:
        server.shutdown()


def exported(received: list[tuple[str, bytes]], path: str, request_type) -> list:
    """The `request_type` messages (e.g. ExportTraceServiceRequest) received at `path`; any
    request to another path fails the test."""
    assert {p for p, _ in received} <= {path}, [p for p, _ in received]
    return [request_type.FromString(body) for _, body in received]
