"""Ingestion and stats benchmark on the machine's PostgreSQL (throughput, latency, stats query).

Measures, in one run so that the ratios are fair on a noisy shared machine:
  1. batch ingestion through the HTTP API (a real uvicorn server process, a client process on
     loopback sending 10,000-record native batches) vs a raw binary COPY of the same rows into a
     table with the same schema and indexes;
  2. single-record ingestion latency at a fixed 500 requests/s from a second process (open loop:
     requests leave on schedule whether or not earlier ones returned), on a database settled
     after phase 1 (VACUUM ANALYZE of what it wrote, then CHECKPOINT: see settle_database);
     then once more against an API started with CONTROLPLANE_INGEST_SYNCHRONOUS_COMMIT=false,
     whose flushes acknowledge before their WAL reaches the disk;
  3. the stats query (24 h, 5-minute buckets) over a deployment holding 10M records, served from
     the per-minute rollups, timed in-process and through HTTP.
After the server stops, every tier of the ingest deployment's rollups must count each stored
record exactly once (single-record flushes defer their sums to a fold; see
controlplane.ingest.batcher), or the bench fails.
Prints a table and writes bench/results/ingest.json.

Usage: .venv/bin/python bench/ingest.py [--records 400000] [--stats-records 10000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import orjson
import psycopg
import uvloop
from sqlalchemy import create_engine, func, select, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.api_process import start_api  # noqa: E402
from controlplane.accounts.service import Principal, create_account, get_account_by_name, issue_key  # noqa: E402
from controlplane.db.migrate import upgrade_to_head  # noqa: E402
from controlplane.db.models import AcceptanceRecordRow, Deployment, Role  # noqa: E402
from controlplane.db.session import get_sessionmaker  # noqa: E402
from controlplane.deployments.service import create_deployment  # noqa: E402
from controlplane.deployments.spec import SpeculationRequest  # noqa: E402
from controlplane.ingest.record import AcceptanceRecord  # noqa: E402
from controlplane.ingest.service import COPY_SQL, COPY_TYPES, store_records  # noqa: E402
from controlplane.stats.service import acceptance_series  # noqa: E402

PG_SERVER = os.environ.get("BENCH_PG_SERVER", "postgresql+psycopg://postgres@127.0.0.1:5432")
BENCH_DB = "controlplane_bench"
SECRET = "bench-secret"
BATCH = 10_000
STATS_DAY = datetime(2026, 11, 1, tzinfo=UTC)
SERVER_LOG = ROOT / "bench" / "results" / "ingest-server.log"


def native(i: int, rng: random.Random, prefix: str) -> dict[str, object]:
    k = 4
    steps = rng.randint(5, 30)
    per_step = [min(k, int(rng.expovariate(0.5))) for _ in range(steps)]
    return {
        "request_id": f"{prefix}-{i}",
        "drafted_tokens": steps * k,
        "accepted_tokens": sum(per_step),
        "verify_steps": steps,
        "generated_tokens": sum(per_step) + steps,
        "accepted_per_position": [sum(1 for a in per_step if a > p) for p in range(k)],
        "k": k,
        "prompt_tokens": rng.randint(20, 800),
        "ttft_ms": round(rng.uniform(10, 80), 3),
        "inter_token_ms": round(rng.uniform(3, 15), 3),
        "total_ms": round(rng.uniform(100, 900), 3),
        "arm": "live",
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prepare_database(fresh: bool) -> str:
    url = f"{PG_SERVER}/{BENCH_DB}"
    admin = create_engine(f"{PG_SERVER}/test", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        exists = conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": BENCH_DB})
        if fresh and exists:
            conn.execute(text(f"DROP DATABASE {BENCH_DB} WITH (FORCE)"))
            exists = None
        if not exists:
            conn.execute(text(f"CREATE DATABASE {BENCH_DB}"))
    admin.dispose()
    upgrade_to_head(url)
    return url


def ensure_tenant(url: str) -> tuple[str, int, int]:
    """The bench account (kept across runs with its 10M-record stats deployment), a new admin key,
    and fresh "ingest" and "raw-copy" deployments."""
    with get_sessionmaker(url)() as session:
        account = get_account_by_name(session=session, name="bench")
        if account is None:
            account, issued = create_account(session=session, name="bench", secret=SECRET)
        else:
            issued = issue_key(session=session, account=account, name="bench", role=Role.admin, secret=SECRET)
        principal = Principal(issued.key.id, "admin", Role.admin, account.id, "bench")
        # Hard delete: the previous run's rows go with them (ON DELETE CASCADE).
        session.execute(
            text("DELETE FROM deployments WHERE account_id = :a AND name IN ('ingest', 'raw-copy')"),
            {"a": account.id},
        )
        ids = [
            create_deployment(
                session=session,
                principal=principal,
                target_model="m",
                speculation=SpeculationRequest(),
                name=name,
            ).id
            for name in ("ingest", "raw-copy")
        ]
        session.commit()
        return issued.secret, ids[0], ids[1]


def start_server(
    url: str, port: int, workers: int = 1, synchronous_commit: bool = True
) -> subprocess.Popen[bytes]:
    SERVER_LOG.parent.mkdir(parents=True, exist_ok=True)
    return start_api(
        url,
        port,
        SERVER_LOG,
        secret=SECRET,
        env={
            # Production wiring: ingestion nudges the drift monitor through Redis.
            "CONTROLPLANE_BROKER_URL": "redis://127.0.0.1:6379/13",
            "CONTROLPLANE_INGEST_SYNCHRONOUS_COMMIT": "true" if synchronous_commit else "false",
        },
        serve_args=("--workers", str(workers)),
    )


def batch_client(base: str, key: str, bodies: list[bytes], connections: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """Send every batch body, ``connections`` at a time; report wall time and statuses."""

    async def run() -> tuple[float, list[int]]:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as client:
            queue = list(bodies)
            statuses: list[int] = []

            async def worker() -> None:
                while queue:
                    body = queue.pop()
                    response = await client.post("/acceptance", content=body)
                    statuses.append(response.status_code)

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(connections)))
            return time.perf_counter() - start, statuses

    out.put(asyncio.run(run()))


def single_client(base: str, key: str, rate: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """Open-loop single-record POSTs at ``rate``/s over keep-alive connections.

    A lean HTTP/1.1 client on asyncio streams (a general-purpose client costs ~1 ms of CPU per
    request, which on 2 shared cores would be measuring the client). Requests leave on schedule:
    one goes out on an idle connection when its time comes; when none is idle, a new connection
    is opened (up to 64). Latency runs from the scheduled send time, so a slow server cannot hide
    queueing (no coordinated omission).
    """
    from urllib.parse import urlsplit

    parts = urlsplit(base)
    host, port, path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path + "/acceptance"

    async def run() -> tuple[list[float], list[int], float]:
        rng = random.Random(99)
        idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        opened = 0
        latencies: list[float] = []
        statuses: list[int] = []

        def request_bytes(body: bytes) -> bytes:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            return head.encode() + body

        async def exchange(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], body: bytes) -> int:
            reader, writer = conn
            writer.write(request_bytes(body))
            status_line = await reader.readline()
            if not status_line:
                raise ConnectionResetError("server closed the keep-alive connection")
            length = 0
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            await reader.readexactly(length)
            return int(status_line.split()[1])

        async def one(i: int, scheduled: float) -> None:
            nonlocal opened
            body = orjson.dumps({"records": [native(i, rng, f"single-{time.time_ns()}")]})
            if idle:
                conn = idle.pop()
            else:
                opened += 1
                conn = await asyncio.open_connection(host, port)
            try:
                status = await exchange(conn, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                # An idle keep-alive connection the server closed: count the reconnect in the latency.
                conn[1].close()
                conn = await asyncio.open_connection(host, port)
                status = await exchange(conn, body)
            statuses.append(status)
            latencies.append((time.perf_counter() - scheduled) * 1000)
            idle.append(conn)

        for i in range(50):  # warm-up, sequential
            await one(-1 - i, time.perf_counter())
        latencies.clear()
        statuses.clear()
        # Only the requests in flight are kept: gathering every task of the run at its end
        # stalled this loop for ~100 ms over 10,000 tasks, which the last few requests then
        # counted as server latency.
        in_flight: set[asyncio.Task[None]] = set()
        start = time.perf_counter()
        total = int(rate * seconds)
        for i in range(total):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(i, scheduled))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        await asyncio.gather(*in_flight)
        elapsed = time.perf_counter() - start
        for _, writer in idle:
            writer.close()
        return latencies, statuses, total / elapsed

    # uvloop (installed with uvicorn[standard]): the client's own loop overhead counts in every
    # latency it measures; on 2 shared cores the stock loop added ~0.5 ms at the median.
    out.put(uvloop.run(run()))


def in_child(target, *args):  # type: ignore[no-untyped-def]
    """Run a client in a second process (as a real client would be) and return its result."""
    queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    process = mp.Process(target=target, args=(*args, queue))
    process.start()
    while True:
        try:
            result = queue.get(timeout=1)
            break
        except Exception:
            if not process.is_alive():
                raise RuntimeError(f"client process died with exit code {process.exitcode}") from None
    process.join()
    return result


def raw_copy_rate(url: str, rows: list[dict[str, object]], deployment_id: int, tag: str) -> float:
    """Rows/s of a plain binary COPY of the same rows into the same table (same indexes, same
    size), under a deployment of its own; no parsing, validation, idempotency or rollups."""
    dsn = url.replace("postgresql+psycopg", "postgresql")
    now = datetime.now(UTC)
    with psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        for offset in range(0, len(rows), BATCH):
            with (
                conn.cursor() as cursor,
                cursor.copy(COPY_SQL) as copy,
            ):
                copy.set_types(COPY_TYPES)
                for r in rows[offset : offset + BATCH]:
                    copy.write_row(
                        (
                            deployment_id,
                            f"{tag}-{r['request_id']}",
                            now,
                            r["arm"],
                            None,
                            r["k"],
                            r["drafted_tokens"],
                            r["accepted_tokens"],
                            r["verify_steps"],
                            r["generated_tokens"],
                            r["prompt_tokens"],
                            r["accepted_per_position"],
                            r["ttft_ms"],
                            r["inter_token_ms"],
                            r["total_ms"],
                            None,
                        )
                    )
            conn.commit()
        elapsed = time.perf_counter() - start
    return len(rows) / elapsed


def settle_database(url: str) -> float:
    """Let the batch phase's write-back finish before the latency phase starts; returns seconds.

    The batch rounds leave ~1.2M fresh rows: their dirty pages, a pending autovacuum/analyze
    of the grown table and the next checkpoint's flush would otherwise land inside the
    single-record phase and time the previous phase's I/O instead of this one's requests.
    """
    start = time.perf_counter()
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE acceptance_records")
        conn.execute("VACUUM ANALYZE acceptance_rollups")
        conn.execute("VACUUM ANALYZE acceptance_rollup_pending")
        conn.execute("CHECKPOINT")
    return time.perf_counter() - start


def single_phase(base: str, key: str, rate: int, seconds: float) -> tuple[float, float, float]:
    """p50 and p99 latency (ms) of single-record ingestion at ``rate``, and the rate achieved."""
    latencies, statuses, achieved_rate = in_child(single_client, base, key, rate, seconds)
    assert set(statuses) == {200}, f"single statuses {set(statuses)}"
    latencies.sort()
    return latencies[len(latencies) // 2], latencies[int(0.99 * len(latencies)) - 1], achieved_rate


def assert_rollups_exact(url: str, deployment_id: int) -> None:
    stored, pending, tier_sums = rollup_check(url, deployment_id)
    assert pending == 0 and set(tier_sums.values()) == {stored}, (stored, pending, tier_sums)
    print(f"  rollups after shutdown: {stored:,} records stored, every tier counts {stored:,}, none pending")


def rollup_check(url: str, deployment_id: int) -> tuple[int, int, dict[int, int]]:
    """Records stored for the deployment, records still pending a rollup fold, and the requests
    each rollup tier counts."""
    with get_sessionmaker(url)() as session:
        stored = session.scalar(
            text("SELECT count(*) FROM acceptance_records WHERE deployment_id = :d"), {"d": deployment_id}
        )
        pending = session.scalar(
            text("SELECT count(*) FROM acceptance_rollup_pending WHERE deployment_id = :d"),
            {"d": deployment_id},
        )
        tiers = session.execute(
            text(
                "SELECT resolution_s, sum(requests) FROM acceptance_rollups WHERE deployment_id = :d"
                " GROUP BY resolution_s"
            ),
            {"d": deployment_id},
        ).all()
    return int(stored or 0), int(pending or 0), {int(r): int(n) for r, n in tiers}


def ensure_stats_deployment(url: str, target: int) -> int:
    """A deployment with ``target`` records spread over one day, built through the real write path."""
    sessions = get_sessionmaker(url)
    with sessions() as session:
        deployment_id = session.scalar(select(Deployment.id).where(Deployment.name == "stats-10m"))
        if deployment_id is not None:
            have = session.scalar(
                select(func.count())
                .select_from(AcceptanceRecordRow)
                .where(AcceptanceRecordRow.deployment_id == deployment_id)
            )
            if have == target:
                return deployment_id
            session.execute(text("DELETE FROM deployments WHERE id = :d"), {"d": deployment_id})
            session.commit()
        account_id = session.scalar(text("SELECT id FROM accounts WHERE name = 'bench'"))
        deployment = Deployment(
            account_id=account_id,
            name="stats-10m",
            target_model="m",
            speculation_mode="default",
            drift_policy={},
            canary_policy={},
        )
        session.add(deployment)
        session.commit()
        deployment_id = deployment.id
    rng = random.Random(5)
    step = 86_400 / target
    start = time.perf_counter()
    chunk = 50_000
    for offset in range(0, target, chunk):
        records = []
        for i in range(offset, min(target, offset + chunk)):
            raw = native(i, rng, "s")
            records.append(
                AcceptanceRecord(
                    request_id=str(raw["request_id"]),
                    drafted_tokens=raw["drafted_tokens"],  # type: ignore[arg-type]
                    accepted_tokens=raw["accepted_tokens"],
                    verify_steps=raw["verify_steps"],  # type: ignore[arg-type]
                    generated_tokens=raw["generated_tokens"],
                    accepted_per_position=raw["accepted_per_position"],  # type: ignore[arg-type]
                    k=4,
                    prompt_tokens=raw["prompt_tokens"],
                    ttft_ms=raw["ttft_ms"],  # type: ignore[arg-type]
                    inter_token_ms=raw["inter_token_ms"],
                    total_ms=raw["total_ms"],  # type: ignore[arg-type]
                    created_at=STATS_DAY + timedelta(seconds=i * step),
                )
            )
        with sessions() as session:
            store_records(session=session, deployment_id=deployment_id, records=records)
            session.commit()
        done = offset + len(records)
        if done % 1_000_000 == 0:
            print(
                f"  built {done:,} / {target:,} records ({done / (time.perf_counter() - start):,.0f}/s)",
                flush=True,
            )
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE acceptance_rollups")
        conn.execute("VACUUM ANALYZE acceptance_rollup_pending")
    return deployment_id


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=400_000, help="records sent through the batch API")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-workers", type=int, default=1, help="API processes (uvicorn workers)")
    parser.add_argument("--stats-records", type=int, default=10_000_000)
    parser.add_argument("--single-rate", type=int, default=500)
    parser.add_argument("--single-seconds", type=float, default=20.0)
    parser.add_argument("--fresh", action="store_true", help="drop and rebuild the bench database")
    args = parser.parse_args()

    url = prepare_database(args.fresh)
    key, ingest_id, raw_copy_id = ensure_tenant(url)
    print(f"stats deployment: {args.stats_records:,} records through the write path (reused if present)")
    stats_id = ensure_stats_deployment(url, args.stats_records)

    rng = random.Random(1)
    rows = [native(i, rng, f"batch-{time.time_ns()}") for i in range(args.records)]
    bodies = [
        orjson.dumps({"format": "native", "records": rows[o : o + BATCH]}) for o in range(0, len(rows), BATCH)
    ]
    port = free_port()
    server = start_server(url, port, args.server_workers)
    base = f"http://127.0.0.1:{port}/v1/accounts/bench/deployments/ingest"
    try:
        # Warm-up batch (connection pool, JIT-free but caches), then the measured run.
        warm_rng = random.Random(2)
        in_child(
            batch_client,
            base,
            key,
            [
                orjson.dumps(
                    {"records": [native(i, warm_rng, f"warm-{time.time_ns()}") for i in range(BATCH)]}
                )
            ],
            1,
        )
        # Interleave the two arms over several rounds and take medians: this machine is shared
        # and its speed drifts, so only ratios measured side by side are trustworthy.
        batch_rates, copy_rates = [], []
        for round_no in range(args.rounds):
            round_bodies = (
                bodies
                if round_no == 0
                else [
                    body.replace(b'"request_id":"batch-', f'"request_id":"r{round_no}-batch-'.encode())
                    for body in bodies
                ]
            )
            elapsed, statuses = in_child(batch_client, base, key, round_bodies, args.connections)
            assert set(statuses) == {200}, f"batch statuses {set(statuses)}"
            batch_rates.append(args.records / elapsed)
            copy_rates.append(raw_copy_rate(url, rows, raw_copy_id, f"r{round_no}"))
            api_rate, raw_rate = batch_rates[-1], copy_rates[-1]
            print(f"  round {round_no + 1}: API {api_rate:,.0f} records/s, raw COPY {raw_rate:,.0f} rows/s")
        batch_rate = statistics.median(batch_rates)
        copy_rate = statistics.median(copy_rates)
        settle_s = settle_database(url)
        print(f"  database settled after the batch phase in {settle_s:.1f} s (VACUUM ANALYZE, CHECKPOINT)")
        p50, p99, achieved_rate = single_phase(base, key, args.single_rate, args.single_seconds)
        stats_kwargs = {"start": STATS_DAY, "end": STATS_DAY + timedelta(days=1), "bucket_seconds": 300}
        with get_sessionmaker(url)() as session:
            acceptance_series(session=session, deployment_id=stats_id, **stats_kwargs)  # type: ignore[arg-type]
            in_process = []
            for _ in range(20):
                t0 = time.perf_counter()
                result = acceptance_series(session=session, deployment_id=stats_id, **stats_kwargs)  # type: ignore[arg-type]
                in_process.append((time.perf_counter() - t0) * 1000)
        assert result["total"]["requests"] == args.stats_records
        stats_url = f"http://127.0.0.1:{port}/v1/accounts/bench/deployments/stats-10m/stats"
        params = {
            "start": STATS_DAY.isoformat(),
            "end": (STATS_DAY + timedelta(days=1)).isoformat(),
            "bucket_seconds": 300,
        }
        http_times = []
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}) as client:
            for _ in range(21):
                t0 = time.perf_counter()
                response = client.get(stats_url, params=params)
                http_times.append((time.perf_counter() - t0) * 1000)
                assert response.status_code == 200, response.text
        http_times = http_times[1:]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert_rollups_exact(url, ingest_id)
    # The same phase against an API whose flushes do not wait for the disk (the opt-in
    # CONTROLPLANE_INGEST_SYNCHRONOUS_COMMIT=false): what is left of the tail is the service's.
    relaxed = start_server(url, port, args.server_workers, synchronous_commit=False)
    try:
        relaxed_p50, relaxed_p99, relaxed_rate = single_phase(
            base, key, args.single_rate, args.single_seconds
        )
    finally:
        relaxed.terminate()
        relaxed.wait(timeout=30)
    assert_rollups_exact(url, ingest_id)

    results = {
        "batch_records_per_s": round(batch_rate),
        "copy_records_per_s": round(copy_rate),
        "ratio_vs_copy": round(batch_rate / copy_rate, 3),
        "single_rate_target_per_s": args.single_rate,
        "single_rate_achieved_per_s": round(achieved_rate, 1),
        "settle_before_single_s": round(settle_s, 1),
        "single_p50_ms": round(p50, 2),
        "single_p99_ms": round(p99, 2),
        "single_relaxed_commit_p50_ms": round(relaxed_p50, 2),
        "single_relaxed_commit_p99_ms": round(relaxed_p99, 2),
        "stats_records": args.stats_records,
        "stats_query_ms": round(statistics.median(in_process), 2),
        "stats_query_http_ms": round(statistics.median(http_times), 2),
        "batch_records": args.records,
        "batch_rounds": args.rounds,
        "batch_records_per_s_rounds": [round(r) for r in batch_rates],
        "copy_records_per_s_rounds": [round(r) for r in copy_rates],
        "batch_connections": args.connections,
        "cpu_count": os.cpu_count(),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    table = [
        (
            f"batch ingest via HTTP API (records/s; {args.records:,} records, {args.connections} connections,"
            f" median of {args.rounds} rounds)",
            f"{batch_rate:,.0f}",
            ">= 50,000",
        ),
        ("raw binary COPY of the same rows into the same table (rows/s, median)", f"{copy_rate:,.0f}", "-"),
        ("API / raw COPY", f"{batch_rate / copy_rate:.2f}", ">= 0.50"),
        (
            f"single-record ingest p50 / p99 at {achieved_rate:.0f} req/s, second process (ms)",
            f"{p50:.2f} / {p99:.2f}",
            "p99 <= 10",
        ),
        (
            f"the same at {relaxed_rate:.0f} req/s, flushes not waiting for the disk"
            " (opt-in synchronous_commit off; ms)",
            f"{relaxed_p50:.2f} / {relaxed_p99:.2f}",
            "-",
        ),
        (
            f"stats query, {args.stats_records:,} records, 24 h in 5-min buckets (ms, in-process, median)",
            f"{statistics.median(in_process):.2f}",
            "<= 20",
        ),
        ("same query through HTTP (ms, median of 20)", f"{statistics.median(http_times):.2f}", "-"),
    ]
    print("\n| figure | measured | target |\n|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ingest.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out / 'ingest.json'}")


if __name__ == "__main__":
    main()
