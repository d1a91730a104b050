"""Host side of a sandbox's route to the gateway: a Unix socket in the state folder whose connections are piped
to the gateway's TCP port. The inside half is relay_inside.py, which the sandbox runs on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from services.harness.sandbox_spec import SandboxError


class GatewayBridge:
    """Pipes each connection to `socket_path` to (target_host, target_port), on a thread and event loop of its own."""

    def __init__(self, socket_path: Path, target_host: str, target_port: int) -> None:
        self.socket_path = socket_path
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, name=f"gw-bridge-{socket_path.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise SandboxError(f"gateway bridge on {socket_path} did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_unix_server(self._handle, path=str(self.socket_path)))
        # The sandbox uid must be able to connect; the folder above keeps other users out of the state dir.
        os.chmod(self.socket_path, 0o777)
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self.socket_path.unlink(missing_ok=True)
