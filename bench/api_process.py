"""The control plane's API as a child process of a benchmark: ``python -m controlplane serve`` on a
port, with the database, environment and secret key the benchmark chose, returned once it answers
``/healthz`` (killed, and its log's tail raised, if it never does within about 30 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def start_api(
    url: str,
    port: int,
    log: Path,
    *,
    secret: str,
    env: Mapping[str, str],
    serve_args: Sequence[str] = (),
    what: str = "server",
) -> subprocess.Popen[bytes]:
    """The API over ``url`` on ``port``, its stderr in ``log``; ``env`` adds settings, and
    ``serve_args`` options of ``controlplane serve``."""
    process = subprocess.Popen(
        [sys.executable, "-m", "controlplane", "serve", "--port", str(port), *serve_args],
        cwd=ROOT,
        env={
            **os.environ,
            "CONTROLPLANE_DATABASE_URL": url,
            "CONTROLPLANE_ENVIRONMENT": "test",
            "CONTROLPLANE_SECRET_KEY": secret,
            **env,
        },
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{what} did not start: {log.read_text()[-2000:]}")
