"""The API's in-process cache: one load per key at a time, refresh ahead of expiry, no stale
writes after a clear."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.api.deps import TtlCache


class CountingLoader:
    """A load that takes ``delay_s`` and returns the next number, counting its calls."""

    def __init__(self, delay_s: float = 0.02) -> None:
        self.calls = 0
        self.delay_s = delay_s

    async def __call__(self) -> int:
        self.calls += 1
        value = self.calls
        await asyncio.sleep(self.delay_s)
        return value


def test_concurrent_misses_share_one_load() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=10)
    load = CountingLoader()

    async def run() -> list[int | None]:
        return await asyncio.gather(*(cache.get_or_load("k", load) for _ in range(50)))

    assert asyncio.run(run()) == [1] * 50
    assert load.calls == 1
    assert cache.get("k") == 1


def test_a_hot_entry_is_refreshed_by_one_caller_before_it_expires() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=0.2)
    load = CountingLoader(delay_s=0.01)

    async def run() -> tuple[int | None, list[int | None], int | None]:
        first = await cache.get_or_load("k", load)
        await asyncio.sleep(0.15)  # past the refresh point, before expiry
        # The first of these reloads; the others keep the cached value meanwhile.
        during = await asyncio.gather(*(cache.get_or_load("k", load) for _ in range(5)))
        return first, list(during), await cache.get_or_load("k", load)

    assert asyncio.run(run()) == (1, [2, 1, 1, 1, 1], 2)
    assert load.calls == 2


def test_a_refresh_that_finds_nothing_evicts_the_entry() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=0.2)
    answers: list[int | None] = [1, None]

    async def revoked_later() -> int | None:
        return answers.pop(0)

    async def run() -> list[int | None]:
        seen = [await cache.get_or_load("k", revoked_later)]
        await asyncio.sleep(0.15)
        seen.append(await cache.get_or_load("k", revoked_later))
        return seen

    assert asyncio.run(run()) == [1, None]
    assert cache.get("k") is None


def test_a_failed_refresh_keeps_serving_the_entry_until_it_expires() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=0.2)
    calls = 0

    async def flaky() -> int:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise ConnectionError("database restarting")
        return 7

    async def run() -> list[int | None]:
        seen = [await cache.get_or_load("k", flaky)]
        await asyncio.sleep(0.15)
        seen.append(await cache.get_or_load("k", flaky))
        await asyncio.sleep(0.1)  # expired now: the error reaches the caller
        try:
            await cache.get_or_load("k", flaky)
        except ConnectionError:
            seen.append(None)
        return seen

    assert asyncio.run(run()) == [7, 7, None]


def test_an_expired_entry_is_never_served() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=0.05)
    load = CountingLoader(delay_s=0.0)

    async def run() -> list[int | None]:
        first = await cache.get_or_load("k", load)
        await asyncio.sleep(0.08)
        return [first, await cache.get_or_load("k", load)]

    assert asyncio.run(run()) == [1, 2]


def test_a_load_started_before_a_clear_does_not_store_its_value() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=10)
    load = CountingLoader(delay_s=0.05)

    async def run() -> tuple[int | None, int | None]:
        started = asyncio.ensure_future(cache.get_or_load("k", load))
        await asyncio.sleep(0.01)
        cache.clear()  # e.g. the key was revoked while its lookup was in flight
        before_clear = await started
        return before_clear, await cache.get_or_load("k", load)

    assert asyncio.run(run()) == (1, 2)
    assert load.calls == 2


def test_a_failed_load_reaches_every_waiter_and_is_retried() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=10)
    calls = 0

    async def failing() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        raise LookupError("no such deployment")

    async def run() -> list[BaseException | int | None]:
        return await asyncio.gather(
            *(cache.get_or_load("k", failing) for _ in range(5)), return_exceptions=True
        )

    outcomes = asyncio.run(run())
    assert all(isinstance(o, LookupError) for o in outcomes)
    assert calls == 1
    with pytest.raises(LookupError):
        asyncio.run(cache.get_or_load("k", failing))
    assert calls == 2


def test_none_is_not_cached() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=10)
    calls = 0

    async def unknown() -> int | None:
        nonlocal calls
        calls += 1
        return None

    assert asyncio.run(cache.get_or_load("k", unknown)) is None
    assert asyncio.run(cache.get_or_load("k", unknown)) is None
    assert calls == 2
