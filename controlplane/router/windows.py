"""The router's aggregate windows: every served request summed per deployment, arm, drafter version
and category into one window per ``window_s`` seconds, aligned to multiples of it since the epoch,
and each ended window rendered as the bodies the control plane takes (``edge-window/v1``).

Pure (the clock is passed in). A request is counted in the window its record was made in (after
its reply left). Each deployment has its own accumulator, whose number of draft positions is fixed
when the window first sees the deployment: the most any of its arms drafts, so no arm's positions
are cut. A window is one body; one that would pass ``max_body_bytes`` (or the control plane's
aggregate count) is split between deployments into parts, and since the control plane keys a
window by (edge id, window start), each part is sent under its own edge id, ``<edge id>-part<i>of<n>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from controlplane.ingest.aggregates import (
    MAX_AGGREGATES_PER_WINDOW,
    MAX_POSITIONS,
    EdgeWindow,
    WindowAccumulator,
    WindowAggregate,
)
from controlplane.ingest.record import AcceptanceRecord

# Draft positions of a deployment whose arms state none and whose first record carries none.
DEFAULT_POSITIONS = 4
# Bytes the body adds around its aggregates (format, edge id, start, commas): a generous bound.
_BODY_OVERHEAD = 1_024


@dataclass
class ClosedWindow:
    """One window's accumulators, no longer added to."""

    start: int  # epoch seconds
    window_s: int
    accumulators: dict[str, WindowAccumulator] = field(default_factory=dict)
    requests: int = 0

    @property
    def end(self) -> int:
        return self.start + self.window_s


class OpenWindows:
    """The window being filled, and the ended ones not yet taken."""

    def __init__(self, *, window_s: int) -> None:
        self.window_s = window_s
        self._current: ClosedWindow | None = None
        self._ended: list[ClosedWindow] = []
        # No window may start before this: one taken already is never opened again, even when
        # the wall clock steps back (its second body would conflict with the one sent).
        self._floor = 0

    @property
    def requests(self) -> int:
        """Requests counted in the current window so far."""
        return self._current.requests if self._current is not None else 0

    def add(self, deployment: str, record: AcceptanceRecord, positions: int | None, now: float) -> None:
        """Count one request; ``positions``: the most draft positions the deployment's arms draft."""
        second = int(now)
        start = max(second - second % self.window_s, self._floor)
        current = self._current
        if current is None or current.start < start:
            if current is not None:
                self._ended.append(current)
            current = self._current = ClosedWindow(start, self.window_s)
            self._floor = start
        accumulator = current.accumulators.get(deployment)
        if accumulator is None:
            k = positions or record.k or len(record.accepted_per_position) or DEFAULT_POSITIONS
            accumulator = current.accumulators[deployment] = WindowAccumulator(
                k=max(1, min(k, MAX_POSITIONS))
            )
        accumulator.add(deployment, record)
        current.requests += 1

    def take_ended(self, now: float) -> list[ClosedWindow]:
        """The windows that ended by ``now``, oldest first; each is taken once."""
        if self._current is not None and self._current.end <= now:
            self._close_current()
        taken, self._ended = self._ended, []
        return taken

    def take_all(self) -> list[ClosedWindow]:
        """Every window, the current one as it is (shutdown)."""
        if self._current is not None:
            self._close_current()
        taken, self._ended = self._ended, []
        return taken

    def _close_current(self) -> None:
        assert self._current is not None
        self._ended.append(self._current)
        self._floor = self._current.end
        self._current = None


def window_bodies(window: ClosedWindow, edge_id: str, max_body_bytes: int) -> list[dict[str, Any]]:
    """The bodies that carry ``window``: one, or parts under their own edge ids when too large."""
    parts: list[list[WindowAggregate]] = [[]]
    size = _BODY_OVERHEAD
    for deployment in sorted(window.accumulators):
        aggregates = window.accumulators[deployment].aggregates()
        sizes = [len(orjson.dumps(a.to_dict())) + 1 for a in aggregates]
        whole = sum(sizes)
        if parts[-1] and (
            size + whole > max_body_bytes or len(parts[-1]) + len(aggregates) > MAX_AGGREGATES_PER_WINDOW
        ):
            parts.append([])  # a deployment goes whole into a part when it fits in one
            size = _BODY_OVERHEAD
        for aggregate, aggregate_size in zip(aggregates, sizes, strict=True):
            if parts[-1] and (
                size + aggregate_size > max_body_bytes or len(parts[-1]) >= MAX_AGGREGATES_PER_WINDOW
            ):
                parts.append([])
                size = _BODY_OVERHEAD
            parts[-1].append(aggregate)
            size += aggregate_size
    start = datetime.fromtimestamp(window.start, UTC)
    if len(parts) == 1:
        return [EdgeWindow(edge_id, start, window.window_s, parts[0]).to_dict()]
    n = len(parts)
    return [
        EdgeWindow(f"{edge_id}-part{i}of{n}", start, window.window_s, part).to_dict()
        for i, part in enumerate(parts, 1)
    ]
