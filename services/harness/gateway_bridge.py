"""Host side of a sandbox's route to the gateway: a Unix socket in the state folder whose connections are piped
to the gateway's TCP port. The inside half is relay_inside.py, which the sandbox runs on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from services.harness.sandbox_spec import SandboxError


# A Unix socket's path holds at most 107 bytes; a run folder nested deep (a runs_dir of its own, long execution ids)
# passes that. Such a socket is bound through a descriptor of its folder, /proc/self/fd/N/<name>: the same file.
_MAX_SOCKET_PATH = 100


@contextlib.contextmanager
def _bindable(path: Path) -> Iterator[str]:
    """A path `bind` accepts for the socket at `path`, however deep its folder."""
    if len(os.fsencode(str(path))) <= _MAX_SOCKET_PATH:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


class GatewayBridge:
    """Pipes each connection to `socket_path` to (target_host, target_port), on a thread and event loop of its own."""

    def __init__(self, socket_path: Path, target_host: str, target_port: int) -> None:
        self.socket_path = socket_path
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"gw-bridge-{socket_path.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            cause = f": {type(self._error).__name__}: {self._error}" if self._error is not None else ""
            raise SandboxError(f"gateway bridge on {socket_path} did not start{cause}")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            with _bindable(self.socket_path) as path:
                self._server = self._loop.run_until_complete(asyncio.start_unix_server(self._handle, path=path))
            # The sandbox uid must be able to connect; the folder above keeps other users out of the state dir.
            os.chmod(self.socket_path, 0o777)
        except BaseException as exc:  # told to the constructor, which raises it as the sandbox's error
            self._error = exc
            self._ready.set()
            return
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
