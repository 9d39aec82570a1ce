"""A bounded on-disk spool of report batches the control plane has not taken yet.

Each batch is one file, written whole (temporary file, fsync, rename), so a crash leaves either
the batch or nothing, never half of one. Files are named ``<sequence>-<kind>-<items>-<deployment>.json``
(records and traces) or ``<sequence>-window-<due>.json`` (one aggregate window's body, not to be
sent before the epoch second ``due``: the control plane refuses a window that has not ended) and
taken oldest first. The spool never holds more than ``max_bytes``: a batch that would cross it
evicts the oldest batches, and the items and windows dropped are counted (an operator sees them in
the router's ``/metrics``), because a router that fills its disk would stop serving, which is worse.

Several router processes may share one spool directory (``--workers``): each claims a slot,
``<spool_dir>/slot-<n>``, under an exclusive ``flock`` held for its lifetime, so no two write or
send the same batches. A slot whose lock is free belongs to no live process (a worker that died,
or a run with more workers): the next spool to start moves its batches into its own slot and
sends them. ``max_bytes`` bounds each slot.

Blocking file I/O: the reporter calls it from a worker thread, never on the event loop.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SLOT = re.compile(r"^slot-(\d+)$")
_FILE = re.compile(r"^(\d{12})-(?:(acceptance|traces)-(\d+)-([a-z0-9][a-z0-9-]*)|window-(\d+))\.json$")
WINDOW_KIND = "aggregates"


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    path: Path
    kind: str
    deployment: str
    items: int
    size: int
    due_at: float = 0.0  # epoch seconds; only windows wait for their end


def _batch(path: Path, match: re.Match[str], size: int) -> SpooledBatch:
    if match.group(5) is not None:
        return SpooledBatch(path, WINDOW_KIND, "", 1, size, float(match.group(5)))
    return SpooledBatch(path, match.group(2), match.group(4), int(match.group(3)), size)


class DiskSpool:
    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        base = Path(directory)
        base.mkdir(parents=True, exist_ok=True)
        self.directory, self._lock = _claim_slot(base)
        self.max_bytes = max_bytes
        self.dropped_items = 0
        self.dropped_windows = 0
        for stale in self.directory.glob("*.tmp"):
            stale.unlink(missing_ok=True)  # a write a crash interrupted: never renamed, never taken
        batches = self.batches()
        self._sequence = max((int(b.path.name[:12]) for b in batches), default=0)
        self._bytes = sum(b.size for b in batches)
        # Windows by file name: (due, size), so what may not be sent yet is known without a listing.
        self._windows = {b.path.name: (b.due_at, b.size) for b in batches if b.kind == WINDOW_KIND}
        self._adopt_orphans(base)

    def close(self) -> None:
        """Give the slot up (a process that exits gives it up anyway)."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def _adopt_orphans(self, base: Path) -> None:
        for slot in sorted(base.iterdir()):
            if slot == self.directory or not _SLOT.match(slot.name) or not slot.is_dir():
                continue
            lock = _try_lock(slot)
            if lock is None:
                continue  # a live router process owns it
            try:
                for path in sorted(slot.iterdir()):
                    match = _FILE.match(path.name)
                    if match is None:
                        continue
                    self._sequence += 1
                    target = self.directory / f"{self._sequence:012d}{path.name[12:]}"
                    os.replace(path, target)
                    size = target.stat().st_size
                    self._bytes += size
                    if match.group(5) is not None:
                        self._windows[target.name] = (float(match.group(5)), size)
            finally:
                os.close(lock)

    @property
    def bytes(self) -> int:
        return self._bytes

    def waiting_bytes(self, now: float) -> int:
        """Bytes of windows that may not be sent before a later time (they hold nothing up)."""
        return sum(size for due, size in self._windows.values() if due > now)

    def batches(self) -> list[SpooledBatch]:
        """Every complete batch, oldest first."""
        out = []
        for path in sorted(self.directory.iterdir()):
            match = _FILE.match(path.name)
            if match is None:
                continue
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            out.append(_batch(path, match, size))
        return out

    def put(self, deployment: str, kind: str, items: list[dict[str, Any]]) -> None:
        data = json.dumps(
            {"deployment": deployment, "kind": kind, "items": items}, separators=(",", ":")
        ).encode()
        if self._make_room(len(data)):
            self._write(f"{kind}-{len(items)}-{deployment}", data)
        else:
            self.dropped_items += len(items)  # one batch larger than the whole spool

    def put_window(self, body: dict[str, Any], due_at: float) -> None:
        """One window's body, sent as it is (a resend is then a duplicate, never a conflict)."""
        data = json.dumps({"kind": WINDOW_KIND, "items": [body]}, separators=(",", ":")).encode()
        due = math.ceil(due_at)
        if self._make_room(len(data)):
            name = self._write(f"window-{due}", data)
            self._windows[name] = (float(due), len(data))
        else:
            self.dropped_windows += 1

    def _make_room(self, size: int) -> bool:
        while self._bytes + size > self.max_bytes:
            oldest = self.batches()
            if not oldest:
                return False
            self.remove(oldest[0], dropped=True)
        return True

    def _write(self, name: str, data: builtins.bytes) -> str:
        self._sequence += 1
        final = self.directory / f"{self._sequence:012d}-{name}.json"
        tmp = final.with_suffix(".tmp")
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        self._bytes += len(data)
        return final.name

    def read(self, batch: SpooledBatch) -> list[dict[str, Any]]:
        body = json.loads(batch.path.read_bytes())
        items = body.get("items")
        return items if isinstance(items, list) else []

    def remove(self, batch: SpooledBatch, *, dropped: bool = False) -> None:
        try:
            batch.path.unlink()
        except FileNotFoundError:
            return
        self._bytes -= batch.size
        self._windows.pop(batch.path.name, None)
        if dropped and batch.kind == WINDOW_KIND:
            self.dropped_windows += 1
        elif dropped:
            self.dropped_items += batch.items


def _try_lock(slot: Path) -> int | None:
    """An exclusive lock on ``slot`` (its open descriptor), or None when another process holds it."""
    fd = os.open(slot / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _claim_slot(base: Path) -> tuple[Path, int]:
    """The lowest-numbered slot no live process holds, locked for this process's lifetime."""
    for number in range(4096):
        slot = base / f"slot-{number}"
        slot.mkdir(exist_ok=True)
        lock = _try_lock(slot)
        if lock is not None:
            return slot, lock
    raise RuntimeError(f"{base}: every spool slot is held by a live process")
