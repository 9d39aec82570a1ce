"""Private PostgreSQL and Redis servers for fault tests and benchmarks: each on a free port with its
data in a temporary directory, restartable in place (same port, same data), so a test can take a
database or a broker away under running processes without touching the machine's shared ones."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
import redis

from tests.fleet.processes import free_port

PG_BIN = Path(os.environ.get("TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
# initdb and postgres refuse to run as root; when the tests run as root the server runs as this user.
PG_OS_USER = "postgres"


def _drop_root_kwargs() -> dict[str, Any]:
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(PG_OS_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


class PrivatePostgres:
    """A PostgreSQL cluster of its own: trust authentication, one database ``test``.

    ``restart()`` is a fast stop (every connection cut, open transactions rolled back, a shutdown
    checkpoint written) and a start on the same port and data directory; ``crash()`` is the
    other kind of outage: the server killed with nothing written, so the next start replays the
    WAL (crash recovery). ``stop()`` and ``start()`` leave a gap of the caller's choosing between
    them.
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.root = Path(tempfile.mkdtemp(prefix="private-pg-"))
        self.data_dir = self.root / "data"
        self.log = self.root / "server.log"
        self.database = "test"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *args: str) -> None:
        subprocess.run(
            list(args), check=True, capture_output=True, cwd=self.root, timeout=120, **_drop_root_kwargs()
        )

    def create(self) -> PrivatePostgres:
        if os.geteuid() == 0:
            entry = pwd.getpwnam(PG_OS_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        )
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.root}'\nfsync = off\nmax_connections = 200\n"
                "shared_buffers = 32MB\n"
            )
        self.start()
        with psycopg.connect(self.admin_dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')
        return self

    def admin_dsn(self, database: str | None = None) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database or self.database}"

    def start(self) -> None:
        self._run(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log), "-w", "-t", "60", "start"
        )

    def stop(self) -> None:
        # Fast: every session is terminated at once, open transactions roll back.
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "-t", "60", "stop")

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        if down_s:
            time.sleep(down_s)
        self.start()

    def crash(self, down_s: float = 0.0) -> None:
        """SIGKILL the postmaster, then every server process it leaves behind (as the kernel's OOM
        killer or a lost node would take them), and start again: the start runs crash recovery,
        replaying the WAL from the last checkpoint, before it takes connections."""
        lock = self.data_dir / "postmaster.pid"
        postmaster = int(lock.read_text().split()[0])
        children = _children_of(postmaster)
        os.kill(postmaster, signal.SIGKILL)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in (postmaster, *children)):
            if time.monotonic() > deadline:
                raise AssertionError(f"PostgreSQL processes outlived SIGKILL: {children}")
            time.sleep(0.05)
        # A killed postmaster nobody reaped is a zombie its lock files still name, which the next
        # start would take for a running server; a machine that lost it would not have it at all.
        lock.unlink(missing_ok=True)
        (self.root / f".s.PGSQL.{self.port}.lock").unlink(missing_ok=True)
        if down_s:
            time.sleep(down_s)
        self.start()

    def recoveries(self) -> int:
        """How many times the server log says a start replayed the WAL after a crash."""
        if not self.log.exists():
            return 0
        return self.log.read_text(errors="replace").count("automatic recovery in progress")

    def is_running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()

    def destroy(self) -> None:
        if self.is_running():
            try:
                self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")
            except subprocess.CalledProcessError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:
        return self.create()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.destroy()


def _children_of(parent: int) -> list[int]:
    """The ids of the processes whose parent is ``parent`` (Linux /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name (field 2) is in parentheses and may hold spaces: split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (a zombie, dead but unreaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class PrivateRedis:
    """``redis-server`` on a free port, persistence off (a restart empties it, as a failover to a
    fresh replica would), restartable on the same port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.root = Path(tempfile.mkdtemp(prefix="private-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.root),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20

        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise AssertionError(f"redis-server on port {self.port} did not answer")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.kill()
        self.process.wait(timeout=20)
        self.process = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        if down_s:
            time.sleep(down_s)
        self.start()

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
