"""Ports a run picks for its own processes, chosen below the kernel's ephemeral range.

A port that is free when it is picked is not reserved: it is bound later by the process it is given to, and a
port in the ephemeral range may be handed meanwhile to any socket that binds port 0 or connects out (vLLM's
engines, PyTorch's rendezvous, every HTTP client). On a loaded machine that happened: a cell's rollout worker
found its health port taken by such a socket minutes after the run chose it. The kernel never hands out a port
below `ip_local_port_range`, so a port picked there stays free unless someone picks it on purpose.

Nor is a port reserved against the picker itself: a run picks its processes' ports one after another and none is
bound until its process starts, so each was free when the next was picked, and two of one run's processes were
once given the same port (the second could never start). A process never hands out a port twice.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from pathlib import Path

LOWEST = 10_000  # below: well-known and registered services (NATS 4222, PostgreSQL 5432, Prometheus 9090, …)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_FIRST = 32_768  # Linux's default when the file cannot be read
_rng = random.Random()  # its own: a program that seeds the `random` module does not make two pickers agree
_given: set[int] = set()  # every port this process handed out, free then, perhaps still unbound
_lock = threading.Lock()


def ephemeral_first() -> int:
    """The first port the kernel may hand out on its own."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_FIRST


def free_port_block(count: int = 1, *, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """The first of `count` consecutive ports, all free now, below the ephemeral range and none of them handed out
    by this process before."""
    top = ephemeral_first() - count
    if top <= LOWEST:
        raise OSError(f"no room for {count} ports between {LOWEST} and the ephemeral range ({ephemeral_first()})")
    with _lock:
        for _ in range(attempts):
            base = _rng.randint(LOWEST, top)
            block = range(base, base + count)
            if _given.intersection(block):
                continue
            try:
                with contextlib.ExitStack() as stack:
                    for port in block:
                        sock = stack.enter_context(socket.socket())
                        sock.bind((host, port))
            except OSError:
                continue
            _given.update(block)
            return base
    raise OSError(f"no block of {count} free ports found below {ephemeral_first()} in {attempts} attempts")


def free_port(*, host: str = "127.0.0.1") -> int:
    """A port free now, below the ephemeral range."""
    return free_port_block(1, host=host)
