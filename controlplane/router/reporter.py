"""Sends the router's acceptance records and sampled traces to the control plane, and loses none.

The request path only appends to an in-memory buffer. A background task posts the buffer every
``interval_s`` in batches per deployment and kind (``.../acceptance`` with ``{"records": [...]}``,
``.../traces`` with ``{"traces": [...]}``). A batch the control plane does not take (unreachable,
5xx, 429, or a key it does not accept yet) goes to the on-disk spool, and a drain task sends the
spool back, oldest first, with backoff while the control plane stays away; while the spool holds
anything, new batches queue behind it there. Records are idempotent by request id, so a batch sent
again after a lost reply is stored once. A batch the control plane refuses as invalid (other 4xx)
would be refused again: it is dropped and counted, with the reason logged. On shutdown the buffer
is spooled, so a restarted router sends it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import orjson

from controlplane.router.spool import DiskSpool

log = logging.getLogger(__name__)

BODY_KEY: Final = {"acceptance": "records", "traces": "traces"}
# The traces route takes at most 1,000 items per batch; records allow 10,000.
MAX_BATCH: Final = {"acceptance": 2_000, "traces": 200}
# Statuses worth sending again later: the control plane is away, busy, or does not know the key yet.
_RETRYABLE: Final = frozenset({401, 403, 408, 425, 429})
_JSON: Final = {"Content-Type": "application/json"}


@dataclass
class ReporterStats:
    posted: dict[str, int] = field(default_factory=lambda: {"acceptance": 0, "traces": 0})
    spooled: int = 0
    rejected: int = 0
    last_error: str | None = None


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
    ) -> None:
        self._base = f"{base_url.rstrip('/')}/v1/accounts/{account}/deployments"
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

    def trace(self, deployment: str, prompt: str, completion: str, category: str | None) -> None:
        item: dict[str, Any] = {"prompt": prompt, "completion": completion}
        if category is not None:
            item["category"] = category
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
        """Stop; post what is buffered once, and spool whatever did not go."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self._flush(spool_only=not await self._spool_empty()), timeout_s)
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
            except Exception:  # noqa: BLE001 - the reporter must outlive any one bad batch
                log.exception("report flush failed")

    async def _spool_empty(self) -> bool:
        return self.spool.bytes == 0

    def _take(self) -> list[tuple[str, str, list[dict[str, Any]]]]:
        taken, self._pending = self._pending, defaultdict(list)
        out: list[tuple[str, str, list[dict[str, Any]]]] = []
        for (deployment, kind), items in taken.items():
            size = min(self._batch, MAX_BATCH[kind])
            out.extend((deployment, kind, items[i : i + size]) for i in range(0, len(items), size))
        return out

    async def _flush(self, *, spool_only: bool) -> None:
        for deployment, kind, items in self._take():
            if spool_only or not await self._post(deployment, kind, items):
                await asyncio.to_thread(self.spool.put, deployment, kind, items)
                self.stats.spooled += len(items)
                self._wake_drain.set()

    async def _spill_all(self) -> None:
        for deployment, kind, items in self._take():
            await asyncio.to_thread(self.spool.put, deployment, kind, items)
            self.stats.spooled += len(items)

    async def _drain_loop(self) -> None:
        delay = 0.25
        while True:
            await self._wake_drain.wait()
            batches = await asyncio.to_thread(self.spool.batches)
            if not batches:
                self._wake_drain.clear()
                delay = 0.25
                continue
            batch = batches[0]
            try:
                items = await asyncio.to_thread(self.spool.read, batch)
            except (OSError, ValueError) as exc:
                log.error("unreadable spool file %s dropped: %s", batch.path, exc)
                await asyncio.to_thread(self.spool.remove, batch, dropped=True)
                continue
            if await self._post(batch.deployment, batch.kind, items):
                await asyncio.to_thread(self.spool.remove, batch)
                delay = 0.25
            else:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

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
