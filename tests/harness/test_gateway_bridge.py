"""The host half of a sandbox's route to the gateway: a Unix socket piped to the gateway's TCP port, also when the
run's folder is nested deeper than a socket path may be (107 bytes)."""

from __future__ import annotations

import socket
import socketserver
import threading
from pathlib import Path

import pytest

from services.harness.gateway_bridge import GatewayBridge, _bindable
from services.harness.sandbox_spec import SandboxError


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(b"echo:" + self.request.recv(1024))


@pytest.mark.parametrize("depth", [1, 12], ids=["short", "past-the-socket-path-limit"])
def test_the_bridge_pipes_a_connection_to_the_gateway(tmp_path: Path, depth: int) -> None:
    folder = tmp_path.joinpath(*["a-rather-long-folder-name"] * depth)
    folder.mkdir(parents=True)
    path = folder / "gw.sock"
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bridge = GatewayBridge(path, "127.0.0.1", server.server_address[1])
    try:
        assert path.is_socket() and (depth == 1 or len(str(path)) > 107)
        with socket.socket(socket.AF_UNIX) as client, _bindable(path) as address:
            client.connect(address)
            client.sendall(b"hi")
            assert client.recv(1024) == b"echo:hi"
    finally:
        bridge.close()
        server.shutdown()


def test_a_bridge_that_cannot_listen_says_why(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="did not start: FileNotFoundError"):
        GatewayBridge(tmp_path / "no-such-folder" / "gw.sock", "127.0.0.1", 9)
