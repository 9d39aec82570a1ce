"""A real S3-compatible server for tests: moto's standalone server, started once per test session
as a child process on a free port of 127.0.0.1 and stopped at the end.

A test module that wants it binds the fixtures at its top level (``s3_endpoint =
s3_server.s3_endpoint``, ``s3_bucket = s3_server.s3_bucket``; an assignment rather than an import,
which linters would report as redefined by each test's parameter). ``s3_endpoint`` is the server's
URL; ``s3_bucket`` creates a fresh bucket, returns ``s3://<bucket>/artifacts`` and puts test
credentials in the environment for that test only.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

START_TIMEOUT_S = 30.0
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The server is local: never ask a proxy the environment may name.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _answers(endpoint: str) -> bool:
    try:
        with _direct.open(f"{endpoint}/moto-api/", timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _die_with_parent_hook() -> Callable[[], None] | None:
    """On Linux, a hook for the child that has the kernel stop it when the test process dies, so
    a test run killed outright (a timeout, ^C twice) leaves no server behind."""
    if sys.platform != "linux":
        return None
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def die_with_parent() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)

    return die_with_parent


def start_s3_server(log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start moto's server and wait until it answers; (process, endpoint URL)."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        # The log file, not a pipe: the server writes a line per request, and an unread pipe
        # would block it once full.
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent_hook(),
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(endpoint):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_s3_server(process)
            raise RuntimeError(f"moto server did not start on {endpoint}:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.05)
    return process, endpoint


def stop_s3_server(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@contextlib.contextmanager
def checking_credentials(endpoint: str) -> Iterator[None]:
    """Within the block the server checks every request's credentials against its own IAM, which
    knows none of the test keys: each request is refused as a real S3 would refuse a bad key."""

    def set_unchecked_requests(count: str) -> None:
        request = urllib.request.Request(
            f"{endpoint}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            # Not urllib's default form type, which the server would parse away from the body.
            headers={"Content-Type": "text/plain"},
        )
        with _direct.open(request, timeout=5):
            pass

    set_unchecked_requests("0")
    try:
        yield
    finally:
        set_unchecked_requests("inf")


@functools.cache
def s3_client(endpoint: str) -> Any:
    """A boto3 client for the test server, with the test credentials whatever the environment
    (one per endpoint: building a client costs a few hundred milliseconds)."""
    import boto3

    return boto3.session.Session(
        aws_access_key_id=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=TEST_CREDENTIALS["AWS_DEFAULT_REGION"],
    ).client("s3", endpoint_url=endpoint)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, endpoint = start_s3_server(tmp_path_factory.mktemp("s3-server") / "moto.log")
    try:
        yield endpoint
    finally:
        stop_s3_server(process)


@pytest.fixture
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A new, empty bucket; returns ``s3://<bucket>/artifacts``. The code under test reads the
    test credentials from the environment, and no AWS config or profile of the machine's."""
    for name, value in TEST_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name in ("NO_PROXY", "no_proxy"):  # the server is local whatever proxy the machine uses
        monkeypatch.setenv(name, "127.0.0.1,localhost")
    bucket = f"artifacts-{uuid.uuid4().hex[:12]}"
    s3_client(s3_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/artifacts"
