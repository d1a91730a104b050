"""A key-value store over HTTP on port 8000: GET /keys/NAME reads, PUT /keys/NAME writes the request body.
Starts holding one key, `seed`, set from KV_SEED."""

import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STORE = {"seed": os.environ.get("KV_SEED", "")}


class Handler(BaseHTTPRequestHandler):
    def _key(self) -> str | None:
        return self.path[len("/keys/"):] if self.path.startswith("/keys/") and len(self.path) > 6 else None

    def _reply(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        key = self._key()
        if key is None or key not in STORE:
            self._reply(404, "no such key\n")
        else:
            self._reply(200, STORE[key])

    def do_PUT(self) -> None:
        key = self._key()
        if key is None:
            self._reply(400, "expected /keys/NAME\n")
            return
        STORE[key] = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        self._reply(204, "")


ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
