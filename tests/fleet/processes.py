"""Real processes for router tests and benchmarks: the control plane's API on SQLite (stoppable and
restartable on the same port and database), vLLM-style stub backends, and the router itself."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, process: subprocess.Popen[Any] | None = None, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{url}: process exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


class ControlPlaneProcess:
    """``controlplane serve`` on the embedded default, in ``workdir`` (its var/ holds the SQLite
    database and the admin key), on one port across restarts."""

    def __init__(self, workdir: Path, port: int | None = None, **env: str) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = clean_env(CONTROLPLANE_API_PORT=str(self.port), CONTROLPLANE_API_URL=self.url, **env)
        self.process: subprocess.Popen[bytes] | None = None
        # Appended to across restarts: a fault test shows what the server said around each one.
        self.log = workdir / "api.log"

    def start(self) -> ControlPlaneProcess:
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "controlplane", "serve"],
                cwd=self.workdir,
                env=self.env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        try:
            # Generous: on a 2-core machine shared with other test runs an import-heavy start takes 30 s+.
            wait_http(f"{self.url}/readyz", self.process, timeout_s=120.0)
        except AssertionError:
            self.stop(kill=True)  # never left behind by a start that failed
            raise AssertionError(f"{self.url} did not become ready:\n{self.log_tail()}") from None
        return self

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    @property
    def admin_key(self) -> str:
        return (self.workdir / "var" / "admin.key").read_text().strip()

    def stop(self, *, kill: bool = False) -> None:
        if self.process is None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def api(self, method: str, path: str, json: Any = None, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key or self.admin_key}"}
        return httpx.request(method, f"{self.url}{path}", json=json, headers=headers, timeout=30.0)


def start_process(
    args: Sequence[str], health_url: str, cwd: Path | None = None, **env: str
) -> subprocess.Popen[bytes]:
    return started(spawn_process(args, cwd, **env), health_url)


def spawn_process(args: Sequence[str], cwd: Path | None = None, **env: str) -> subprocess.Popen[bytes]:
    """Start a process without waiting for it (several start side by side; `started` waits)."""
    return subprocess.Popen(
        list(args), cwd=cwd or ROOT, env=clean_env(**env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def started(process: subprocess.Popen[bytes], health_url: str) -> subprocess.Popen[bytes]:
    """The process once its health URL answers; killed, with its stderr in the error, if it never does."""
    try:
        # A wait, not a figure: a reference server loading torch and its model beside other test
        # runs on 2 cores has taken over 60 s to answer.
        wait_http(health_url, process, timeout_s=180.0)
    except AssertionError:
        process.kill()
        _, err = process.communicate()
        args = process.args if isinstance(process.args, list) else [str(process.args)]
        raise AssertionError(f"{' '.join(map(str, args))} did not start: {err.decode()[-2000:]}") from None
    return process


def start_stub_backend(port: int, *flags: str) -> subprocess.Popen[bytes]:
    return start_process(
        [sys.executable, "-m", "tests.fleet.vllm_style_backend", "--port", str(port), *flags],
        f"http://127.0.0.1:{port}/health",
    )


def start_router(config: Path, port: int, cwd: Path, *flags: str, **env: str) -> subprocess.Popen[bytes]:
    return start_process(
        [
            sys.executable,
            "-m",
            "controlplane",
            "router",
            "--config",
            str(config),
            "--port",
            str(port),
            *flags,
        ],
        f"http://127.0.0.1:{port}/healthz",
        cwd=cwd,
        **env,
    )


def stop(process: subprocess.Popen[Any] | None, *, kill: bool = False) -> None:
    if process is None or process.poll() is not None:
        return
    if kill:
        process.kill()
    else:
        process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
