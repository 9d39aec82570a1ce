"""Sends the router's acceptance records, aggregate windows and sampled traces to the control plane,
and loses none.

The request path only appends to an in-memory buffer. A background task posts the buffer every
``interval_s`` in batches per deployment and kind (``.../acceptance`` with ``{"records": [...]}``,
``.../traces`` with ``{"traces": [...]}``). A batch the control plane does not take (unreachable,
5xx, 429, or a key it does not accept yet) goes to the on-disk spool, and a drain task sends the
spool back, oldest first, with backoff while the control plane stays away; while the spool holds
anything, new batches queue behind it there. Records are idempotent by request id, so a batch sent
again after a lost reply is stored once. A batch the control plane refuses as invalid (other 4xx)
would be refused again: it is dropped and counted, with the reason logged. On shutdown the buffer
is spooled, so a restarted router sends it.

Aggregate windows (``controlplane.router.windows``) take the same road with one difference: each
ended window's body is written to the spool first and posted from there (``.../aggregates``), so
a window is never held only in memory once it has ended, and every send of it, however often
retried, is the same body: a retry after a lost reply is a duplicate, never a conflict. On
shutdown the current window is sealed as it is and spooled to be sent once it has ended (the
control plane refuses a window before its end), by this process if it is still up, else by the
next router on this spool. Its edge id carries this process's boot id, so the next process's own
window of the same start is another (edge id, window) and both are stored. A window refused as
naming deployments the account does not have is sent again without them (they are counted);
"not ended yet" (the clocks disagree) is retried; any other refusal drops the window, counted.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import orjson

from controlplane.ingest.record import AcceptanceRecord
from controlplane.router.spool import WINDOW_KIND, DiskSpool, SpooledBatch
from controlplane.router.windows import ClosedWindow, OpenWindows, window_bodies

log = logging.getLogger(__name__)

BODY_KEY: Final = {"acceptance": "records", "traces": "traces"}
# The traces route takes at most 1,000 items per batch; records allow 10,000.
MAX_BATCH: Final = {"acceptance": 2_000, "traces": 200}
# Statuses worth sending again later: the control plane is away, busy, or does not know the key yet.
_RETRYABLE: Final = frozenset({401, 403, 408, 425, 429})
_JSON: Final = {"Content-Type": "application/json"}
# How the aggregates route names a deployment it does not know (controlplane.ingest.aggregate_store).
_UNKNOWN_DEPLOYMENT: Final = re.compile(r"^no deployment named '([a-z0-9][a-z0-9-]*)'$")
# It names at most 20 per refusal, so a window is sent again without those named, at most this often.
_MAX_SENDS_PER_WINDOW: Final = 50


@dataclass
class ReporterStats:
    # Items the control plane took, by kind; for "aggregates", window bodies.
    posted: dict[str, int] = field(default_factory=lambda: {"acceptance": 0, "traces": 0, "aggregates": 0})
    spooled: int = 0
    rejected: int = 0
    last_error: str | None = None
    windows_sealed: int = 0
    windows_duplicate: int = 0  # taken before (a retry after a lost reply)
    windows_rejected: int = 0
    # Aggregates left out of a window for naming a deployment the account does not have.
    aggregates_rejected: int = 0
    # Requests counted only in the aggregates (their raw record not sampled).
    records_not_sampled: int = 0


class ControlPlaneReporter:
    def __init__(
        self,
        *,
        base_url: str,
        account: str,
        api_key: str | None,
        spool: DiskSpool,
        interval_s: float = 0.5,
        batch: int = 500,
        timeout_s: float = 5.0,
        window_s: int = 0,
        edge_id: str = "",
        max_window_bytes: int = 32 * 1024 * 1024,
    ) -> None:
        self._base = f"{base_url.rstrip('/')}/v1/accounts/{account}/deployments"
        self._aggregates_url = f"{base_url.rstrip('/')}/v1/accounts/{account}/aggregates"
        # None: no windows, every request is sent as a raw record.
        self.windows = OpenWindows(window_s=window_s) if window_s else None
        # Ended windows not yet in the spool: each leaves this list only once it is written.
        self._unsealed: list[ClosedWindow] = []
        self.edge_id = edge_id
        self._max_window_bytes = max_window_bytes
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.spool = spool
        self._interval = interval_s
        self._batch = batch
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._pending: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._wake_drain = asyncio.Event()
        self.stats = ReporterStats()

    # ------------------------------------------------------------------ request path (no waiting)
    def record(self, deployment: str, record: dict[str, Any]) -> None:
        self._pending[(deployment, "acceptance")].append(record)

    def aggregate(self, deployment: str, record: AcceptanceRecord, positions: int | None) -> None:
        """Count a request in the current window (``positions``: its deployment's most draft positions)."""
        assert self.windows is not None
        self.windows.add(deployment, record, positions, time.time())

    def trace(
        self,
        deployment: str,
        prompt: str,
        completion: str,
        category: str | None,
        document: str | None = None,
        messages: list[dict[str, str]] | None = None,
    ) -> None:
        """Buffer one trace: a chat goes as its ``messages`` (ingestion renders them with the
        target's chat template), anything else as its ``prompt``."""
        item: dict[str, Any] = {"completion": completion}
        if messages is not None:
            item["messages"] = messages
        else:
            item["prompt"] = prompt
        if category is not None:
            item["category"] = category
        if document is not None:
            item["document"] = document
        self._pending[(deployment, "traces")].append(item)

    @property
    def buffered(self) -> int:
        return sum(len(items) for items in self._pending.values())

    # ---------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        self._tasks = [asyncio.create_task(self._flush_loop()), asyncio.create_task(self._drain_loop())]
        if self.spool.batches():
            self._wake_drain.set()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop; spool every window (the current one as it is), post what is buffered and the
        windows that have ended once, and leave whatever did not go in the spool."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.windows is not None:
            self._unsealed.extend(self.windows.take_all())
            await self._seal()

        async def last_sends() -> None:
            await self._flush(spool_only=not await self._spool_empty())
            while await self._drain_one():
                pass

        try:
            await asyncio.wait_for(last_sends(), timeout_s)
        except TimeoutError:
            pass
        await self._spill_all()
        self.spool.close()
        if self._session is not None:
            await self._session.close()

    async def flush(self) -> None:
        """Post everything buffered now (tests and shutdown)."""
        await self._flush(spool_only=False)

    # -------------------------------------------------------------------------------- background
    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self._flush(spool_only=not await self._spool_empty())
                if self.windows is not None:
                    self._unsealed.extend(self.windows.take_ended(time.time()))
                    await self._seal()
            except Exception:  # noqa: BLE001 - the reporter must outlive any one bad batch
                log.exception("report flush failed")

    async def _spool_empty(self) -> bool:
        """Nothing in the spool that could be sent now (a window waiting for its end holds none up)."""
        return self.spool.bytes - self.spool.waiting_bytes(time.time()) <= 0

    async def _seal(self) -> None:
        """Ended windows into the spool, rendered off the event loop (a fleet's window is large).
        A window cut short (shutdown, a failed write) stays listed and is written again whole: the
        same accumulators render the same bodies, so a part written twice is a duplicate."""
        while self._unsealed:
            window = self._unsealed[0]
            bodies = await asyncio.to_thread(window_bodies, window, self.edge_id, self._max_window_bytes)
            for body in bodies:
                await asyncio.to_thread(self.spool.put_window, body, float(window.end))
            self._unsealed.pop(0)
            self.stats.windows_sealed += len(bodies)
            self._wake_drain.set()

    def _take(self) -> list[tuple[str, str, list[dict[str, Any]]]]:
        taken, self._pending = self._pending, defaultdict(list)
        out: list[tuple[str, str, list[dict[str, Any]]]] = []
        for (deployment, kind), items in taken.items():
            size = min(self._batch, MAX_BATCH[kind])
            out.extend((deployment, kind, items[i : i + size]) for i in range(0, len(items), size))
        return out

    async def _flush(self, *, spool_only: bool) -> None:
        taken = self._take()
        for i, (deployment, kind, items) in enumerate(taken):
            try:
                if spool_only or not await self._post(deployment, kind, items):
                    await asyncio.to_thread(self.spool.put, deployment, kind, items)
                    self.stats.spooled += len(items)
                    self._wake_drain.set()
            except asyncio.CancelledError:
                # Stopped mid-way (shutdown's time ran out): what was not sent goes back to the
                # buffer, which the shutdown spools (a batch posted already is stored once).
                for rest_deployment, rest_kind, rest_items in taken[i:]:
                    self._pending[(rest_deployment, rest_kind)].extend(rest_items)
                raise

    async def _spill_all(self) -> None:
        for deployment, kind, items in self._take():
            await asyncio.to_thread(self.spool.put, deployment, kind, items)
            self.stats.spooled += len(items)

    async def _drain_loop(self) -> None:
        delay = 0.25
        while True:
            await self._wake_drain.wait()
            # Cleared before the listing: a batch spooled after it sets the event again.
            self._wake_drain.clear()
            batches = await asyncio.to_thread(self.spool.batches)
            now = time.time()
            batch = next((b for b in batches if b.due_at <= now), None)
            if batch is None:
                delay = 0.25
                if batches:  # only windows that have not ended: wake at the first one's end
                    wake = min(b.due_at for b in batches) - now
                    asyncio.get_running_loop().call_later(wake, self._wake_drain.set)
                continue
            self._wake_drain.set()
            if await self._send_spooled(batch):
                delay = 0.25
            else:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _drain_one(self) -> bool:
        """Send the oldest batch that may go now; True when it went (the shutdown's last pass)."""
        batches = await asyncio.to_thread(self.spool.batches)
        now = time.time()
        batch = next((b for b in batches if b.due_at <= now), None)
        return batch is not None and await self._send_spooled(batch)

    async def _send_spooled(self, batch: SpooledBatch) -> bool:
        """Post one spooled batch and remove it once taken (or refused for good)."""
        try:
            items = await asyncio.to_thread(self.spool.read, batch)
        except (OSError, ValueError) as exc:
            log.error("unreadable spool file %s dropped: %s", batch.path, exc)
            await asyncio.to_thread(self.spool.remove, batch, dropped=True)
            return True
        if batch.kind == WINDOW_KIND:
            body = items[0] if items and isinstance(items[0], dict) else None
            sent = body is None or await self._post_window(body)  # a file with no body sends nothing
        else:
            sent = await self._post(batch.deployment, batch.kind, items)
        if sent:
            await asyncio.to_thread(self.spool.remove, batch)
        return sent

    async def _post(self, deployment: str, kind: str, items: list[dict[str, Any]]) -> bool:
        """True when the control plane took the batch, or refused it for good (then dropped)."""
        assert self._session is not None
        url = f"{self._base}/{deployment}/{kind}"
        try:
            body = orjson.dumps({BODY_KEY[kind]: items})
            async with self._session.post(url, data=body, headers=_JSON) as resp:
                if resp.status < 400:
                    self.stats.posted[kind] += len(items)
                    return True
                text = (await resp.text())[:300]
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.stats.last_error = f"{kind} POST failed: {exc!r}"
            return False
        self.stats.last_error = f"{kind} POST {resp.status}: {text}"
        if resp.status >= 500 or resp.status in _RETRYABLE:
            return False
        log.error("control plane refused %d %s item(s) for %s: %s", len(items), kind, deployment, text)
        self.stats.rejected += len(items)
        return True

    async def _post_window(self, body: dict[str, Any]) -> bool:
        """True when the control plane took the window (or a retry of it), or refused it for good."""
        assert self._session is not None
        for _ in range(_MAX_SENDS_PER_WINDOW):
            where = f"window {body.get('window_start')} of {body.get('edge_id')}"
            try:
                async with self._session.post(
                    self._aggregates_url, data=orjson.dumps(body), headers=_JSON
                ) as resp:
                    status, text = resp.status, await resp.text()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self.stats.last_error = f"aggregates POST failed: {exc!r}"
                return False
            if status < 400:
                self.stats.posted[WINDOW_KIND] += 1
                if _reply(text).get("duplicate") is True:
                    self.stats.windows_duplicate += 1
                return True
            self.stats.last_error = f"aggregates POST {status}: {text[:300]}"
            if status >= 500 or status in _RETRYABLE:
                return False
            problems = _problems(text) if status == 422 else []
            if any(p.get("field") == "window_start" and "not ended" in p["message"] for p in problems):
                return False  # this clock runs ahead of the control plane's: send it again later
            unknown = {m.group(1) for p in problems if (m := _UNKNOWN_DEPLOYMENT.match(p.get("message", "")))}
            if not unknown or len(unknown) < len(problems):
                log.error("control plane refused %s (%d): %s", where, status, text[:1000])
                self.stats.windows_rejected += 1
                return True
            kept = [a for a in body.get("aggregates", []) if a.get("deployment") not in unknown]
            self.stats.aggregates_rejected += len(body.get("aggregates", [])) - len(kept)
            log.error(
                "%s: deployment(s) %s unknown to the control plane; their aggregates are dropped",
                where,
                ", ".join(sorted(unknown)),
            )
            if not kept:
                return True
            body = {**body, "aggregates": kept}
        self.stats.windows_rejected += 1
        return True


def _reply(text: str) -> dict[str, Any]:
    try:
        reply = orjson.loads(text)
    except orjson.JSONDecodeError:
        return {}
    return reply if isinstance(reply, dict) else {}


def _problems(text: str) -> list[dict[str, str]]:
    """The ``details`` of an API error: ``[{"field", "message"}, ...]``."""
    error = _reply(text).get("error")
    details = error.get("details") if isinstance(error, dict) else None
    if not isinstance(details, list):
        return []
    return [d for d in details if isinstance(d, dict) and isinstance(d.get("message"), str)]
