"""Keeps each deployment's serving config current: conditional polls of ``GET .../serving-config``.

Every ``interval_s`` (1 s by default, so a change applies within that plus one request) it sends
``If-None-Match`` with the last ETag; 304 costs the control plane one small query and no body. A
failed poll keeps the last config: the fleet goes on serving the split it knew while the control
plane restarts. Until the first config arrives a deployment serves only its live arm.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ArmSpec:
    name: str
    weight: float
    drafter_version: int | None


@dataclass(frozen=True, slots=True)
class FollowedConfig:
    arms: tuple[ArmSpec, ...]
    trace_sample_rate: float
    backends: tuple[tuple[str, str, str, int | None], ...]
    version: str | None
    fetched_at: float
    # The most draft positions any arm drafts (None: not stated): the k of the deployment's window.
    draft_positions: int | None = None
    # The share of requests sent as raw records besides the aggregates, when the control plane
    # states one (else the router's file decides).
    raw_record_sample_rate: float | None = None


DEFAULT = FollowedConfig((ArmSpec("live", 1.0, None),), 0.0, (), None, 0.0)


def parse_serving_config(body: Mapping[str, Any], fetched_at: float) -> FollowedConfig:
    """The parts the router uses; ``ValueError`` on a body it cannot use (then it keeps the old)."""
    arms = []
    positions = [int(raw["k"]) for raw in body.get("arms") or [] if raw.get("k")]
    for raw in body.get("arms") or []:
        version = raw.get("drafter_version")
        arms.append(
            ArmSpec(str(raw["arm"]), float(raw.get("weight", 0.0)), int(version) if version else None)
        )
    if not arms or sum(a.weight for a in arms) <= 0.0:
        raise ValueError("serving config has no arm of positive weight")
    backends = []
    for raw in body.get("backends") or []:
        version = raw.get("drafter_version")
        backends.append(
            (
                str(raw["name"]),
                str(raw["pool"]),
                str(raw["url"]).rstrip("/"),
                int(version) if version else None,
            )
        )
    raw_rate = body.get("raw_record_sample_rate")
    return FollowedConfig(
        tuple(arms),
        float(body.get("trace_sample_rate") or 0.0),
        tuple(backends),
        str(body.get("config_version") or "") or None,
        fetched_at,
        max(positions) if positions else None,
        min(max(float(raw_rate), 0.0), 1.0) if raw_rate is not None else None,
    )


class ServingConfigFollower:
    def __init__(
        self,
        *,
        base_url: str,
        account: str,
        api_key: str | None,
        deployments: list[str],
        interval_s: float,
        timeout_s: float,
        on_change: Callable[[str, FollowedConfig], None],
    ) -> None:
        self._base = f"{base_url.rstrip('/')}/v1/accounts/{account}/deployments"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._deployments = deployments
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._on_change = on_change
        self._etags: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.polls = 0
        self.changes = 0
        self.last_error: str | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        await self.poll_all()  # serve the current split from the first request when reachable
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.poll_all()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(name) for name in self._deployments))

    async def follow(self, name: str) -> int | None:
        """Start following one more deployment (a request named it); its first poll's status
        (200, 404 for a deployment the control plane does not know, None when unreachable)."""
        status = await self._poll(name)
        if status == 200 and name not in self._deployments:
            self._deployments.append(name)
        return status

    async def _poll(self, name: str) -> int | None:
        assert self._session is not None
        headers = {"If-None-Match": self._etags[name]} if name in self._etags else {}
        self.polls += 1
        try:
            async with self._session.get(f"{self._base}/{name}/serving-config", headers=headers) as resp:
                if resp.status == 304:
                    return 304
                if resp.status != 200:
                    self.last_error = (
                        f"{name}: serving-config answered {resp.status}: {(await resp.text())[:200]}"
                    )
                    return resp.status
                body = await resp.json()
                config = parse_serving_config(body, time.monotonic())
                etag = resp.headers.get("ETag")
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError) as exc:
            self.last_error = f"{name}: {exc!r}"
            return None
        if etag:
            self._etags[name] = etag
        self.changes += 1
        self._on_change(name, config)
        return 200
