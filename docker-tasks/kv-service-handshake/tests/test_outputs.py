"""Grades kv-service-handshake from a fresh container on the task's network: the service holds `reply`, the
work folder holds the seed."""

import os
import time
import urllib.error
import urllib.request
from pathlib import Path

SEED = os.environ.get("KV_SEED", "amber-falcon-42")


def _get(key: str) -> str | None:
    for _ in range(50):  # the service may still be starting
        try:
            return urllib.request.urlopen(f"http://kv:8000/keys/{key}", timeout=5).read().decode()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the kv service did not answer")


def test_seed_file_holds_the_seed() -> None:
    path = Path("/app/seed.txt")
    assert path.is_file() and path.read_text() == SEED


def test_service_holds_the_reply() -> None:
    assert _get("reply") == SEED.upper()
