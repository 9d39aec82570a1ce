"""The router's aggregate windows without processes: alignment and rollover, the bodies (split into
parts under their own edge ids when too large), the spool's windows that wait for their end, and
the reporter's answers to what the aggregates route says (taken, a retry's duplicate, unknown
deployments, a window that has not ended by the control plane's clock, a conflict)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from controlplane.ingest.aggregates import WindowAccumulator, parse_edge_window
from controlplane.ingest.record import AcceptanceRecord
from controlplane.router.app import process_edge_id
from controlplane.router.config import RouterConfigError, parse_config
from controlplane.router.follower import parse_serving_config
from controlplane.router.reporter import ControlPlaneReporter
from controlplane.router.spool import DiskSpool
from controlplane.router.windows import OpenWindows, window_bodies

K = 4
BASE = 1_800_000_000  # a multiple of 10 and of 60 seconds since the epoch


def served(rng: random.Random, arm: str = "live", category: str | None = None) -> AcceptanceRecord:
    steps = rng.randint(4, 12)
    per_step = [min(K, int(rng.expovariate(0.5))) for _ in range(steps)]
    return AcceptanceRecord(
        request_id=f"r{rng.random()}",
        drafted_tokens=steps * K,
        accepted_tokens=sum(per_step),
        verify_steps=steps,
        generated_tokens=sum(per_step) + steps,
        accepted_per_position=[sum(1 for a in per_step if a > j) for j in range(K)],
        k=K,
        ttft_ms=rng.uniform(10, 30),
        total_ms=rng.uniform(100, 300),
        prompt_tokens=rng.randint(10, 100),
        arm=arm,
        category=category,
    )


def test_requests_are_counted_in_the_window_aligned_to_the_epoch_that_they_finish_in() -> None:
    rng = random.Random(3)
    windows = OpenWindows(window_s=10)
    for moment in (BASE + 0.1, BASE + 9.99, BASE + 10.0, BASE + 19.5):
        windows.add("chat", served(rng), K, moment)
    assert windows.requests == 2 and windows.take_ended(BASE + 19.9) != []
    [second] = windows.take_ended(BASE + 20.0)
    assert (second.start, second.end, second.requests) == (BASE + 10, BASE + 20, 2)
    assert windows.take_ended(BASE + 100) == []
    # A wall clock that steps back never reopens a window that was taken: the request is counted
    # in the next window instead (whose body the control plane has not seen).
    windows.add("chat", served(rng), K, BASE + 5)
    [late] = windows.take_all()
    assert late.start == BASE + 20


def test_a_window_body_holds_every_deployment_and_its_sums_are_the_requests() -> None:
    rng = random.Random(5)
    windows = OpenWindows(window_s=60)
    records = {
        name: [served(rng, rng.choice(["live", "baseline"]), "c") for _ in range(30)] for name in "abc"
    }
    for name, batch in records.items():
        for record in batch:
            windows.add(name, record, K, BASE + 30)
    [window] = windows.take_all()
    [body] = window_bodies(window, "edge/boot", 32 * 1024 * 1024)
    parsed = parse_edge_window(body, now=datetime.fromtimestamp(BASE + 61, UTC))
    assert parsed.edge_id == "edge/boot" and parsed.window_start == datetime.fromtimestamp(BASE, UTC)
    for name, batch in records.items():
        mine = [a for a in parsed.aggregates if a.deployment == name]
        assert sum(a.requests for a in mine) == len(batch)
        assert sum(a.drafted_tokens for a in mine) == sum(r.drafted_tokens for r in batch)
        assert sum(a.accepted_tokens for a in mine) == sum(r.accepted_tokens for r in batch)
        reference = WindowAccumulator(k=K)
        for record in batch:
            reference.add(name, record)
        assert sorted(a.to_dict()["requests"] for a in mine) == sorted(
            a.requests for a in reference.aggregates()
        )


def test_a_window_too_large_for_one_body_is_sent_in_parts_each_under_its_own_edge_id() -> None:
    rng = random.Random(7)
    windows = OpenWindows(window_s=60)
    for name in ("a", "b", "c", "d"):
        for category in range(10):
            windows.add(name, served(rng, category=f"c{category}"), K, BASE)
    [window] = windows.take_all()
    one = len(orjson.dumps(window_bodies(window, "e", 10**9)[0]))
    bodies = window_bodies(window, "e", one // 3)
    assert [b["edge_id"] for b in bodies] == ["e-part1of4", "e-part2of4", "e-part3of4", "e-part4of4"]
    assert all(len(orjson.dumps(b)) <= one // 3 for b in bodies)
    # A deployment goes whole into one part while it fits in one, else it is cut between parts.
    assert [sorted({a["deployment"] for a in b["aggregates"]}) for b in bodies] == [
        ["a"],
        ["b"],
        ["c"],
        ["d"],
    ]
    cut = window_bodies(window, "e", one // 8)
    assert len(cut) >= 8 and sum(len(b["aggregates"]) for b in cut) == 40
    assert window_bodies(window, "e", one // 3) == bodies  # the same window renders the same parts


def test_a_deployment_takes_the_most_draft_positions_of_its_arms_else_its_records() -> None:
    rng = random.Random(9)
    windows = OpenWindows(window_s=60)
    windows.add("wide", served(rng), 6, BASE)
    windows.add("own", served(rng), None, BASE)
    [window] = windows.take_all()
    assert window.accumulators["wide"].k == 6 and window.accumulators["own"].k == K


def test_spooled_windows_wait_for_their_end_and_survive_a_restart(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, max_bytes=10_000)
    spool.put_window({"edge_id": "e", "aggregates": []}, BASE + 60.2)
    spool.put("chat", "acceptance", [{"request_id": "a"}])
    [window, records] = spool.batches()
    assert (window.kind, window.due_at, records.due_at) == ("aggregates", BASE + 61, 0.0)
    assert spool.read(window) == [{"edge_id": "e", "aggregates": []}]
    assert spool.waiting_bytes(BASE) == window.size and spool.waiting_bytes(BASE + 61) == 0
    spool.close()
    reopened = DiskSpool(tmp_path, max_bytes=window.size + 10)
    assert reopened.waiting_bytes(BASE) == window.size
    reopened.put_window({"edge_id": "f", "aggregates": []}, BASE + 70)  # evicts the oldest
    assert reopened.dropped_windows == 1 and reopened.waiting_bytes(BASE) == reopened.bytes
    reopened.close()


def test_the_configuration_takes_windows_that_divide_a_day_and_plain_edge_ids() -> None:
    base: dict[str, object] = {"control_plane": {"url": "http://cp"}, "deployments": [{"name": "chat"}]}
    config = parse_config(base)
    assert config.router.aggregate_window_s == 0 and config.deployments[0].raw_record_sample_rate == 1.0
    assert parse_config({**base, "router": {"aggregate_window_s": 60}}).router.aggregate_window_s == 60
    for bad in ({"aggregate_window_s": 7}, {"aggregate_window_s": 7200}, {"edge_id": "a b"}):
        with pytest.raises(RouterConfigError):
            parse_config({**base, "router": bad})
    with pytest.raises(RouterConfigError, match="raw_record_sample_rate"):
        parse_config({**base, "deployments": [{"name": "chat", "raw_record_sample_rate": 1.5}]})
    followed = parse_serving_config(
        {
            "arms": [{"arm": "live", "weight": 1.0, "k": 4}, {"arm": "canary:2", "weight": 0.2, "k": 6}],
            "raw_record_sample_rate": 0.1,
        },
        0.0,
    )
    assert followed.draft_positions == 6 and followed.raw_record_sample_rate == 0.1
    assert (
        parse_serving_config({"arms": [{"arm": "live", "weight": 1.0}]}, 0.0).raw_record_sample_rate is None
    )


def test_each_router_process_sends_under_its_own_edge_id() -> None:
    first, second = process_edge_id("edge-eu-1"), process_edge_id("edge-eu-1")
    assert first != second and first.startswith("edge-eu-1/") and second.startswith("edge-eu-1/")
    assert process_edge_id(None).split("/")[0]  # the host's name when none is configured


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _with_control_plane(
    handler: Handler, check: Callable[[ControlPlaneReporter], Awaitable[None]], spool: Path
) -> None:
    async def run() -> None:
        app = web.Application()
        app.router.add_post("/v1/accounts/default/aggregates", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        reporter = ControlPlaneReporter(
            base_url=f"http://127.0.0.1:{port}",
            account="default",
            api_key=None,
            spool=DiskSpool(spool, 1_000_000),
            interval_s=0.05,
            window_s=10,
            edge_id="edge/boot",
            timeout_s=2.0,
        )
        await reporter.start()
        try:
            await check(reporter)
        finally:
            await reporter.close(timeout_s=1.0)
            await runner.cleanup()

    asyncio.run(run())


def _ended_window(reporter: ControlPlaneReporter, names: tuple[str, ...] = ("chat",)) -> None:
    """Fill a window that ended a minute ago, as if the router had served it then."""
    assert reporter.windows is not None
    rng = random.Random(11)
    start = int((datetime.now(UTC) - timedelta(minutes=1)).timestamp()) // 10 * 10
    for name in names:
        reporter.windows.add(name, served(rng), K, start + 1)


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the reporter did not get there"
        await asyncio.sleep(0.02)


def test_a_lost_reply_is_resent_as_the_same_body_and_taken_as_a_duplicate(tmp_path: Path) -> None:
    bodies: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.read())
        if len(bodies) == 1:
            assert request.transport is not None
            request.transport.close()  # stored, and the reply lost on the way
        return web.json_response({"stored": len(bodies) == 1, "duplicate": len(bodies) > 1})

    async def check(reporter: ControlPlaneReporter) -> None:
        _ended_window(reporter)
        # The counter moves when the reply arrives, the spool file goes a moment later.
        await _until(lambda: reporter.stats.posted["aggregates"] == 1 and reporter.spool.bytes == 0)
        assert reporter.stats.windows_duplicate == 1

    _with_control_plane(handler, check, tmp_path)
    assert len(bodies) == 2 and orjson.loads(bodies[0]) == orjson.loads(bodies[1])


def test_unknown_deployments_are_left_out_and_the_rest_of_the_window_is_sent(tmp_path: Path) -> None:
    seen: list[list[str]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        names = sorted(a["deployment"] for a in body["aggregates"])
        seen.append(names)
        if "gone" in names:
            details = [{"field": "aggregates.deployment", "message": "no deployment named 'gone'"}]
            error = {"code": "ValidationProblem", "message": "unknown", "details": details}
            return web.json_response({"error": error}, status=422)
        return web.json_response({"stored": True, "duplicate": False})

    async def check(reporter: ControlPlaneReporter) -> None:
        _ended_window(reporter, ("chat", "gone"))
        await _until(lambda: reporter.stats.posted["aggregates"] == 1)
        assert reporter.stats.aggregates_rejected == 1 and reporter.stats.windows_rejected == 0

    _with_control_plane(handler, check, tmp_path)
    assert seen == [["chat", "gone"], ["chat"]]


def test_a_window_early_by_the_control_planes_clock_is_sent_again_and_a_conflict_is_dropped(
    tmp_path: Path,
) -> None:
    answers = [
        (422, [{"field": "window_start", "message": "the window has not ended yet"}]),
        (503, None),
        (200, None),
        (409, None),
    ]

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        status, details = answers.pop(0)
        if status == 200:
            return web.json_response({"stored": True, "duplicate": False})
        return web.json_response({"error": {"code": "x", "message": "m", "details": details}}, status=status)

    async def check(reporter: ControlPlaneReporter) -> None:
        _ended_window(reporter)
        await _until(lambda: reporter.stats.posted["aggregates"] == 1)
        assert reporter.stats.windows_rejected == 0
        assert reporter.windows is not None
        reporter.windows.add("chat", served(random.Random(1)), K, datetime.now(UTC).timestamp() - 30)
        await _until(lambda: reporter.stats.windows_rejected == 1)
        # Refused for good: dropped, counted. The counter moves before the spool's file is
        # removed, so a loaded machine can see the two apart for a moment (949 bytes once).
        await _until(lambda: reporter.spool.bytes == 0)

    _with_control_plane(handler, check, tmp_path)
    assert answers == []


def test_the_current_window_is_spooled_on_shutdown_to_be_sent_after_its_end(tmp_path: Path) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        raise AssertionError("a window that has not ended is never posted")

    async def check(reporter: ControlPlaneReporter) -> None:
        assert reporter.windows is not None
        reporter.windows.add("chat", served(random.Random(2)), K, datetime.now(UTC).timestamp())

    _with_control_plane(handler, check, tmp_path)
    spool = DiskSpool(tmp_path, 1_000_000)
    [batch] = spool.batches()
    [body] = spool.read(batch)
    assert batch.kind == "aggregates" and batch.due_at > datetime.now(UTC).timestamp() - 1
    assert body["edge_id"] == "edge/boot" and body["aggregates"][0]["requests"] == 1
    spool.close()
