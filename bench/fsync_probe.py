"""How long the disk takes to make a small write durable: the wait every durable commit pays.

Writes 8 KiB and fdatasync()s it every 2 ms for --seconds (default 20, the length of
bench/ingest.py's single-record phase) in --directory (default var/, which on this machine sits
on the same disk as PostgreSQL's data directory), then prints the latency percentiles and how
many syncs stalled past 20 and 50 ms. A PostgreSQL commit waits for one such sync of its WAL
(unless the ingest flushes are set not to: CONTROLPLANE_INGEST_SYNCHRONOUS_COMMIT=false), so a
stall here holds every single-record request in flight. Writes bench/results/fsync_probe.json.

Usage: .venv/bin/python bench/fsync_probe.py [--seconds 20] [--directory var]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = b"\0" * 8192


def probe(directory: Path, seconds: float) -> list[float]:
    """fdatasync latencies (ms) of one 8-KiB overwrite every 2 ms."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fsync_probe.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    latencies = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            os.pwrite(fd, BLOCK, 0)
            start = time.perf_counter()
            os.fdatasync(fd)
            latencies.append((time.perf_counter() - start) * 1000)
            time.sleep(0.002)
    finally:
        os.close(fd)
        path.unlink()
    return sorted(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--directory", type=Path, default=ROOT / "var")
    args = parser.parse_args()
    latencies = probe(args.directory, args.seconds)
    n = len(latencies)
    results = {
        "syncs": n,
        "p50_ms": round(latencies[n // 2], 3),
        "p99_ms": round(latencies[int(0.99 * n)], 3),
        "p999_ms": round(latencies[int(0.999 * n)], 3),
        "max_ms": round(latencies[-1], 1),
        "over_20ms": sum(1 for x in latencies if x > 20),
        "over_50ms": sum(1 for x in latencies if x > 50),
        "seconds": args.seconds,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    print(
        f"{n} fdatasync calls of 8 KiB over {args.seconds:.0f} s: p50 {results['p50_ms']} ms, "
        f"p99 {results['p99_ms']} ms, p99.9 {results['p999_ms']} ms, max {results['max_ms']} ms; "
        f"{results['over_20ms']} over 20 ms, {results['over_50ms']} over 50 ms"
    )
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsync_probe.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
