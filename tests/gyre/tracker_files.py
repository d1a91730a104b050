"""Reading back what the experiment trackers wrote, for tests: W&B's offline run file and TensorBoard's events."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

WANDB_HEADER = b":W&B\xe1\xbe\x00"  # ident, magic, version
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[bytes]:
    """The records of a `.wandb` file: a LevelDB-style log of 32 KiB blocks, each record's chunks behind a 7-byte
    header (checksum, length, type), a block's tail too short for a header left as padding."""
    data = path.read_bytes()
    assert data.startswith(WANDB_HEADER), data[:8]
    records: list[bytes] = []
    pending = b""
    at = len(WANDB_HEADER)
    while at + 7 <= len(data):
        left_in_block = BLOCK - at % BLOCK
        if left_in_block < 7:
            at += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        chunk = data[at + 7:at + 7 + length]
        at += 7 + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
            pending = b""
        elif kind == 0 and length == 0:
            at += BLOCK - at % BLOCK if at % BLOCK else 0  # zero padding to the block's end
    return records


def wandb_run(run_dir: Path, *, wait_s: float = 60.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The history rows (one per logged step, `_step` included) and the config of the offline W&B run. W&B's
    own process writes the file; once, in a loaded full suite, a read right after `finish()` found no rows
    (likely written late; not confirmed), so an empty history is read again until `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        rows, config = _wandb_file(run_dir)
        if rows or time.monotonic() > deadline:
            return rows, config
        time.sleep(0.5)


def _wandb_file(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for raw in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    return rows, config


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard holds for the run: (step, value) per tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
