"""The arm router under load, with real processes: what it adds to latency, whether it loses
records while the control plane restarts, whether a backend's death reaches clients, and how
closely it keeps the configured arm split. Writes bench/results/router.json.

    python bench/router.py [--quick]

Processes (all on this machine): the control plane's API on SQLite, vLLM-style stub backends
(tests/fleet/vllm_style_backend.py: real HTTP, vLLM's per-request metrics shape, a fixed service
time), and `controlplane router`. The load generator is an open-loop asyncio client (requests sent
on a fixed schedule, whatever the replies do), so queueing shows in the percentiles.

1. added_latency_p99_ms: non-streamed requests at 200/s, alternating one-second blocks (20 of each)
   sent straight to one backend and through the router to the same backend (one deployment, one backend), so
   both see the same machine; p99 through the router minus p99 direct. added_ttft_p99_ms: the same
   for streamed requests, time to the first byte of the stream.
2. arm_split_max_deviation: 10,000 requests with distinct `user` keys to a deployment in a live
   canary (the control plane's real split); the largest gap between an arm's configured weight
   and its observed share (the arm the router says served, `x-speculation-arm`).
3. records_lost: 2 minutes at 40 requests/s through the router while the control plane is
   stopped and started twice (once killed, once stopped gracefully, each down for 8 s); the
   records the backends produced minus the records stored, counted after the spool drained.
4. client_errors_during_backend_kill: 100 requests/s for 20 s to a deployment with two
   incumbent backends; one is killed (SIGKILL) 5 s in; errors any client saw.

``--aggregation-cost`` measures instead, in this process, what the router does per served reply
once the reply has left (the record built from a vLLM-style reply and handed to the reporter),
with aggregate windows off and on, at raw-record sample rates 1 and 0.05: µs per request, and
what counting one record in its window adds at k = 4, 8 and 16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fleet.canary_setup import open_live_canary  # noqa: E402
from tests.fleet.processes import ControlPlaneProcess, free_port, start_router, start_stub_backend, stop  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BACKEND_DELAY_MS = 10.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def open_loop(
    session: aiohttp.ClientSession,
    url: str,
    bodies: Any,
    rate: float,
    duration_s: float,
    *,
    stream: bool = False,
    on_reply: Any = None,
) -> tuple[list[float], int]:
    """Send on a fixed schedule; returns latencies (ms: whole reply, or first byte when streamed)
    and the number of client-visible errors."""
    latencies: list[float] = []
    errors = 0
    tasks = []

    async def one(body: dict[str, Any]) -> None:
        nonlocal errors
        started = time.perf_counter()
        try:
            async with session.post(url, json=body) as resp:
                if stream:
                    await resp.content.readany()
                    first = time.perf_counter()
                    await resp.read()
                else:
                    await resp.read()
                    first = time.perf_counter()
                if resp.status != 200:
                    errors += 1
                    return
                latencies.append((first - started) * 1000.0)
                if on_reply is not None:
                    on_reply(resp)
        except (aiohttp.ClientError, TimeoutError):
            errors += 1

    interval = 1.0 / rate
    start = time.perf_counter()
    n = 0
    while True:
        due = start + n * interval
        if due - start >= duration_s:
            break
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(next(bodies))))
        n += 1
    await asyncio.gather(*tasks)
    return latencies, errors


def bodies(model: str, *, stream: bool = False, users: bool = False) -> Any:
    i = 0
    while True:
        body: dict[str, Any] = {"model": model, "prompt": "Summarise the ticket.", "max_tokens": 16}
        if stream:
            body["stream"] = True
        if users:
            body["user"] = f"user-{i}"
        i += 1
        yield body


def write_config(
    path: Path, cp_url: str, spool: Path, backends: dict[str, list[tuple[str, str, int, int | None]]]
) -> None:
    lines = [
        "[control_plane]",
        f'url = "{cp_url}"',
        "poll_interval_s = 1.0",
        "[router]",
        f'spool_dir = "{spool}"',
        "breaker_cooldown_s = 5.0",
    ]
    for deployment, pool in backends.items():
        lines += ["[[deployments]]", f'name = "{deployment}"']
        for name, kind, port, version in pool:
            lines += [
                "[[deployments.backends]]",
                f'name = "{name}"',
                f'pool = "{kind}"',
                f'url = "http://127.0.0.1:{port}"',
            ]
            if version is not None:
                lines.append(f"drafter_version = {version}")
    path.write_text("\n".join(lines) + "\n")


def stored_records(db: Path, deployment: str) -> int:
    with sqlite3.connect(db) as conn:
        row = conn.execute(
            "SELECT count(*) FROM acceptance_records r JOIN deployments d ON d.id = r.deployment_id "
            "WHERE d.name = ? AND d.deleted_at IS NULL",
            (deployment,),
        ).fetchone()
    return int(row[0])


def backend_replies(port: int) -> int:
    return int(httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()["replies"])


async def latency_phase(router_url: str, backend_url: str, quick: bool) -> dict[str, Any]:
    """Alternating one-second blocks, direct then through the router, so that both paths see the
    same machine; p99 over all blocks of each path."""
    blocks = 6 if quick else 20
    out: dict[str, Any] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for stream in (False, True):
            direct: list[float] = []
            routed: list[float] = []
            errors = 0
            paths = {"direct": f"{backend_url}/v1/completions", "router": f"{router_url}/v1/completions"}
            # Warm both paths (connections, caches) before measuring.
            for url in paths.values():
                await open_loop(session, url, bodies("latency", stream=stream), 100, 1.0, stream=stream)
            for _ in range(blocks):
                for name, url in paths.items():
                    lat, err = await open_loop(
                        session, url, bodies("latency", stream=stream), 200, 1.0, stream=stream
                    )
                    (direct if name == "direct" else routed).extend(lat)
                    errors += err
            key = "ttft" if stream else "latency"
            out[key] = {
                "requests_each": len(direct),
                "errors": errors,
                "direct_p50_ms": statistics.median(direct),
                "direct_p99_ms": percentile(direct, 0.99),
                "router_p50_ms": statistics.median(routed),
                "router_p99_ms": percentile(routed, 0.99),
                "added_p50_ms": statistics.median(routed) - statistics.median(direct),
                "added_p99_ms": percentile(routed, 0.99) - percentile(direct, 0.99),
            }
    return out


async def split_phase(router_url: str, weights: dict[str, float], total: int) -> dict[str, Any]:
    counts: dict[str, int] = {}
    errors = 0
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        sem = asyncio.Semaphore(48)

        async def one(i: int) -> None:
            nonlocal errors
            async with sem:
                body = {"model": "split", "prompt": "p", "max_tokens": 4, "user": f"user-{i}"}
                try:
                    async with session.post(f"{router_url}/v1/completions", json=body) as resp:
                        await resp.read()
                        if resp.status != 200:
                            errors += 1
                            return
                        arm = resp.headers.get("x-speculation-arm", "?")
                        counts[arm] = counts.get(arm, 0) + 1
                except aiohttp.ClientError:
                    errors += 1

        await asyncio.gather(*(one(i) for i in range(total)))
    served = sum(counts.values())
    observed = {arm: n / served for arm, n in counts.items()}
    deviation = max(abs(observed.get(arm, 0.0) - w) for arm, w in weights.items())
    return {
        "requests": total,
        "errors": errors,
        "configured": weights,
        "observed": observed,
        "max_deviation": deviation,
    }


async def durability_phase(
    router_url: str, cp: ControlPlaneProcess, duration_s: float, outages: list[tuple[float, bool]]
) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    events: list[str] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        traffic = asyncio.create_task(
            open_loop(session, f"{router_url}/v1/completions", bodies("durable", users=True), 40, duration_s)
        )
        started = time.monotonic()
        for at, kill in outages:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            await asyncio.to_thread(cp.stop, kill=kill)
            events.append(
                f"{time.monotonic() - started:.1f}s control plane {'killed' if kill else 'stopped'}"
            )
            await asyncio.sleep(8.0)
            await asyncio.to_thread(cp.start)
            events.append(f"{time.monotonic() - started:.1f}s control plane back")
        latencies, errors = await traffic
    return {"client_errors": errors, "replies": len(latencies), "events": events}


async def kill_phase(router_url: str, victim: Any, duration_s: float) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        traffic = asyncio.create_task(
            open_loop(
                session, f"{router_url}/v1/completions", bodies("failover", users=True), 100, duration_s
            )
        )
        await asyncio.sleep(5.0)
        victim.kill()
        latencies, errors = await traffic
    return {"client_errors": errors, "replies": len(latencies), "p99_ms": percentile(latencies, 0.99)}


def wait_drained(router_url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        reporter = httpx.get(f"{router_url}/healthz", timeout=5).json()["reporter"]
        if (reporter["buffered"] == 0 and reporter["spool_bytes"] == 0) or time.monotonic() > deadline:
            return dict(reporter)
        time.sleep(0.5)


def aggregation_cost(requests: int = 20_000) -> dict[str, float]:
    """µs per reply of the router's reporting work (``Router._report``) with windows off and on,
    and of counting one record in a window (``OpenWindows.add``) by draft positions."""
    import random

    from controlplane.ingest.record import AcceptanceRecord
    from controlplane.router.app import Router, ServedCall
    from controlplane.router.arms import unit_hash
    from controlplane.router.config import parse_config
    from controlplane.router.windows import OpenWindows

    rng = random.Random(0)
    replies = []
    for _ in range(1_000):
        steps = rng.randint(4, 12)
        hist = [0] * 5
        for _ in range(steps):
            hist[min(4, int(rng.expovariate(0.6)))] += 1
        accepted = sum(i * n for i, n in enumerate(hist))
        replies.append(
            {
                "choices": [{"index": 0, "text": "w0 w1 w2", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": accepted + steps},
                "metrics": {
                    "speculative_decoding": {
                        "num_spec_steps": steps,
                        "num_draft_tokens": steps * 4,
                        "num_accepted_draft_tokens": accepted,
                        "acceptance_histogram": hist,
                    }
                },
            }
        )
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as spool:
        routers = {}
        for label, window_s, rate in (("off", 0, 1.0), ("on_rate_1", 60, 1.0), ("on_rate_0.05", 60, 0.05)):
            config = parse_config(
                {
                    "control_plane": {"url": "http://127.0.0.1:9"},
                    "router": {"spool_dir": f"{spool}/{label}", "aggregate_window_s": window_s},
                    "deployments": [{"name": "chat", "raw_record_sample_rate": rate}],
                }
            )
            routers[label] = (Router(config), window_s, rate)  # never started: nothing is sent
        # Interleaved rounds, the best of each: this machine's other load only ever adds time.
        rounds, each = 10, requests // 10
        for round_ in range(rounds):
            for label, (router, window_s, rate) in routers.items():
                started = time.perf_counter()
                for i in range(round_ * each, (round_ + 1) * each):
                    request_id = f"rq-{i}"
                    raw = window_s == 0 or rate >= 1.0 or unit_hash(f"raw:{request_id}") < rate
                    call = ServedCall("chat", request_id, None, None, started, raw, 4)
                    router._report(call, replies[i % len(replies)], "live", None, None, 120.0, 0, "")
                cost = (time.perf_counter() - started) / each * 1e6
                out[f"report_{label}_us"] = min(out.get(f"report_{label}_us", cost), cost)
                router.reporter._take()  # an empty buffer for the next round, as the flush keeps it
        for router, _, _ in routers.values():
            router.reporter.spool.close()
    for k in (4, 8, 16):
        windows = OpenWindows(window_s=60)
        records = [
            AcceptanceRecord(
                request_id="r",
                drafted_tokens=8 * k,
                accepted_tokens=k,
                verify_steps=8,
                generated_tokens=8 + k,
                accepted_per_position=sorted((rng.randint(0, 8) for _ in range(k)), reverse=True),
                k=k,
                prompt_tokens=100,
                ttft_ms=rng.uniform(10, 30),
                total_ms=rng.uniform(100, 300),
                inter_token_ms=rng.uniform(5, 15),
                category=rng.choice([None, "a", "b"]),
            )
            for _ in range(1_000)
        ]
        now = time.time()
        for _ in range(5):
            started = time.perf_counter()
            for i in range(requests // 5):
                windows.add("chat", records[i % len(records)], k, now)
            cost = (time.perf_counter() - started) / (requests // 5) * 1e6
            out[f"window_add_k{k}_us"] = min(out.get(f"window_add_k{k}_us", cost), cost)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter phases (a smoke run, not the figures)")
    ap.add_argument(
        "--aggregation-cost",
        action="store_true",
        help="only the per-request cost of aggregate windows (a micro-benchmark in this process)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="the router on a core of its own (CPU 1), everything else on CPU 0, as a router runs "
        "on its own machine or pod in production",
    )
    args = ap.parse_args()
    if args.aggregation_cost:
        for name, value in aggregation_cost().items():
            print(f"{name:32} {value:8.1f} µs per request")
        return
    pinned = args.pin and len(os.sched_getaffinity(0)) >= 2
    if pinned:
        os.sched_setaffinity(0, {0})  # the control plane, the backends and the load generator inherit it
    work = Path(tempfile.mkdtemp(prefix="router-bench-"))
    cp = ControlPlaneProcess(work).start()
    processes = []
    try:
        for name in ("latency", "split", "durable", "failover"):
            r = cp.api(
                "POST",
                "/v1/accounts/default/deployments",
                {"target_model": "reference-target", "deployment_id": name},
            )
            assert r.status_code == 201, r.text
        weights = {"candidate_weight": 0.3, "baseline_weight": 0.2}
        r = cp.api("PATCH", "/v1/accounts/default/deployments/split/canary-policy", weights)
        assert r.status_code == 200, r.text
        open_live_canary(f"sqlite:///{work / 'var' / 'controlplane.db'}", "split")
        config = cp.api("GET", "/v1/accounts/default/deployments/split/serving-config").json()
        configured = {arm["arm"]: arm["weight"] for arm in config["arms"]}

        ports = {name: free_port() for name in ("lat", "inc-a", "inc-b", "cand", "base")}
        delay = ["--delay-ms", str(BACKEND_DELAY_MS)]
        processes.append(start_stub_backend(ports["lat"], *delay, "--chunk-delay-ms", "1"))
        processes.append(start_stub_backend(ports["inc-a"], *delay, "--seed", "1"))
        victim = start_stub_backend(ports["inc-b"], *delay, "--seed", "2")
        processes.append(victim)
        processes.append(
            start_stub_backend(ports["cand"], *delay, "--drafter-version", "1", "--accept", "0.8")
        )
        processes.append(start_stub_backend(ports["base"], *delay, "--no-speculation"))
        split_pool = [
            ("inc-a", "incumbent", ports["inc-a"], None),
            ("cand", "candidate", ports["cand"], 1),
            ("base", "baseline", ports["base"], None),
        ]
        config_path = work / "router.toml"
        write_config(
            config_path,
            cp.url,
            work / "spool",
            {
                "latency": [("lat", "incumbent", ports["lat"], None)],
                "split": split_pool,
                "durable": [("inc-a", "incumbent", ports["inc-a"], None)],
                "failover": [
                    ("inc-a", "incumbent", ports["inc-a"], None),
                    ("inc-b", "incumbent", ports["inc-b"], None),
                ],
            },
        )
        router_port = free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        router = start_router(config_path, router_port, work, CONTROLPLANE_ROUTER_API_KEY=cp.admin_key)
        processes.append(router)
        if pinned:
            os.sched_setaffinity(router.pid, {1})
        time.sleep(2.0)  # the first serving-config polls

        latency = asyncio.run(latency_phase(router_url, f"http://127.0.0.1:{ports['lat']}", args.quick))
        split = asyncio.run(split_phase(router_url, configured, 2_000 if args.quick else 10_000))

        before_replies = backend_replies(ports["inc-a"])
        before_stored = stored_records(work / "var" / "controlplane.db", "durable")
        wait_drained(router_url)
        duration = 40.0 if args.quick else 120.0
        outages = [(10.0, True), (25.0, False)] if args.quick else [(30.0, True), (75.0, False)]
        durability = asyncio.run(durability_phase(router_url, cp, duration, outages))
        reporter = wait_drained(router_url, 120.0)
        produced = backend_replies(ports["inc-a"]) - before_replies
        stored = stored_records(work / "var" / "controlplane.db", "durable") - before_stored

        kill = asyncio.run(kill_phase(router_url, victim, 10.0 if args.quick else 20.0))
    finally:
        for process in processes:
            stop(process)
        cp.stop()

    out = {
        "added_latency_p99_ms": round(latency["latency"]["added_p99_ms"], 3),
        "added_ttft_p99_ms": round(latency["ttft"]["added_p99_ms"], 3),
        "records_lost": produced - stored,
        "client_errors_during_backend_kill": kill["client_errors"],
        "arm_split_max_deviation": round(split["max_deviation"], 4),
        "details": {
            "latency": latency,
            "split": split,
            "durability": {
                **durability,
                "records_produced": produced,
                "records_stored": stored,
                "reporter": reporter,
            },
            "backend_kill": kill,
            "backend_service_time_ms": BACKEND_DELAY_MS,
            "quick": args.quick,
            "router_pinned_to_its_own_core": pinned,
        },
    }
    print(f"{'figure':36} {'value':>10}  target")
    print(f"{'added_latency_p99_ms (200/s)':36} {out['added_latency_p99_ms']:>10.3f}  <= 2")
    print(f"{'added_ttft_p99_ms (200/s, streamed)':36} {out['added_ttft_p99_ms']:>10.3f}  <= 2")
    print(f"{'records_lost (CP restarted twice)':36} {out['records_lost']:>10}  0")
    print(f"{'client_errors_during_backend_kill':36} {out['client_errors_during_backend_kill']:>10}  0")
    print(f"{'arm_split_max_deviation':36} {out['arm_split_max_deviation']:>10.4f}  <= 0.02")
    for key in ("latency", "ttft"):
        d = latency[key]
        print(
            f"  {key}: direct p50 {d['direct_p50_ms']:.2f} p99 {d['direct_p99_ms']:.2f} ms; "
            f"router p50 {d['router_p50_ms']:.2f} p99 {d['router_p99_ms']:.2f} ms ({d['requests_each']} each)"
        )
    print(f"  split observed {split['observed']}")
    print(f"  durability: produced {produced}, stored {stored}; {'; '.join(durability['events'])}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "router.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
