"""`controlplane up`: the whole service as real, separate processes on one machine.

Starts, in order, and waits for each to be healthy:

1. the API (`python -m controlplane serve`), healthy when `GET /readyz` answers 200;
2. a Celery worker on both queues (`default` for monitoring, `gpu` for realignment and canary
   replay) and beat, healthy when their logs say `ready.` / `beat: Starting...`;
3. the reference server (`python -m workers.serve --control-plane ...`), healthy on `GET /healthz`;
   it reads each deployment's serving config from the API and posts acceptance records and
   sampled traces back, with its own serving-role key (kept in `var/serving.key`, mode 0600).

The database is migrated and the first account created before anything starts (the same bootstrap
as `controlplane serve`). Every child runs in its own process group and session, so a terminal's
Ctrl-C reaches only this supervisor, which then stops them in order: the reference server first
(its last records still reach the API), then beat, the worker and the API together; SIGTERM to
each group, SIGKILL to what is left after the grace period, and a final sweep of every group so
nothing is orphaned. A child that exits on its own is never restarted: it is reported with the
tail of its log and everything else is stopped (exit code 1).

The embedded default needs no server: SQLite under ./var and kombu's SQLAlchemy transport on a
SQLite file as the broker (a real Celery transport, polled, messages survive restarts). With it
the worker uses the prefork pool with two processes: the broker connection stays in the parent,
and a minutes-long realignment on one child leaves the other free for the drift monitor (the solo
pool would hold monitoring back until training ends). Production settings (PostgreSQL, Redis) run
exactly the same commands; only the URLs in the environment differ. Nothing here imports torch:
the worker and the reference server are subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import httpx

from controlplane.accounts.service import authenticate, first_account, get_account_by_name, issue_key
from controlplane.bootstrap import prepare_embedded_database
from controlplane.config import Settings, environment_for_child
from controlplane.db.models import Role
from controlplane.db.session import unit_of_work

SERVING_KEY_NAME = "reference-server"
READY_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 25

Echo = Callable[[str], None]


class SupervisorError(RuntimeError):
    """Startup failed or a child died; the message says which and why."""


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    where: str  # what to print: where it listens or what it consumes
    ready_url: str | None = None  # healthy when this answers 200
    ready_log: str | None = None  # ... or when its log matches this regex


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def is_ready(self) -> bool:
        if self.spec.ready_url is not None:
            try:
                return httpx.get(self.spec.ready_url, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False
        if self.spec.ready_log is not None:
            try:
                return re.search(self.spec.ready_log, self.log_path.read_text(errors="replace")) is not None
            except OSError:
                return False
        return True


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM if the supervisor itself is killed (no orphans even then)."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Starts children in their own process groups, health-waits them, watches, stops them all."""

    def __init__(
        self, *, log_dir: Path, env: dict[str, str], grace_s: float = 10.0, echo: Echo = print
    ) -> None:
        self.log_dir = log_dir
        self.env = env
        self.grace_s = grace_s
        self.echo = echo
        self.children: list[Child] = []
        self.stop_requested = threading.Event()
        self.stop_reason = ""

    # ------------------------------------------------------------------------------------- start
    def start(self, spec: ChildSpec) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        log_file = log_path.open("wb")
        process = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # own session and process group: no terminal SIGINT, killpg-able
            preexec_fn=_die_with_parent,
        )
        child = Child(spec, process, log_path, log_file)
        self.children.append(child)
        return child

    def wait_ready(self, children: Sequence[Child], timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll until every child is healthy; raise if one exits, a stop is asked, or time runs out."""
        pending = list(children)
        deadline = time.monotonic() + timeout_s
        while pending:
            self.check_alive()
            if self.stop_requested.is_set():
                raise SupervisorError(f"stopped during start-up ({self.stop_reason})")
            for child in [c for c in pending if c.is_ready()]:
                pending.remove(child)
                self.echo(f"  {child.spec.name:<8} ready in {time.monotonic() - child.started_at:5.1f} s")
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(c.spec.name for c in pending)
                tails = "\n".join(f"--- {c.log_path} ---\n{c.log_tail()}" for c in pending)
                raise SupervisorError(f"not healthy after {timeout_s:.0f} s: {names}\n{tails}")
            self.stop_requested.wait(0.25)

    def check_alive(self) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise SupervisorError(
                    f"{child.spec.name} (pid {child.pid}) exited with code {code}; it is not restarted.\n"
                    f"--- last lines of {child.log_path} ---\n{child.log_tail()}"
                )

    # ------------------------------------------------------------------------------------- watch
    def watch(self) -> None:
        """Block until a stop is asked (returns) or a child exits (raises)."""
        while not self.stop_requested.is_set():
            self.check_alive()
            self.stop_requested.wait(0.5)

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.stop_requested.set()

    def install_signal_handlers(self) -> Callable[[], None]:
        """SIGINT and SIGTERM ask for a clean stop; returns a function restoring the old handlers."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            self.request_stop(signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for sig, old in previous.items():
                signal.signal(sig, old)

        return restore

    # -------------------------------------------------------------------------------------- stop
    def stop_all(self, first: Sequence[str] = ()) -> list[str]:
        """Stop every child: the ones named in `first` before the others. Returns what had to be killed."""
        killed: list[str] = []
        early = [c for c in self.children if c.spec.name in first]
        rest = [c for c in self.children if c.spec.name not in first]
        for batch in (early, rest):
            killed += self._stop(batch)
        for child in self.children:  # a last sweep: members left in a group after its leader exited
            if _group_alive(child.pid):
                _signal_group(child.pid, signal.SIGKILL)
                killed.append(f"{child.spec.name} (left-over group members)")
            child.log_file.close()
        # Killed orphans linger as zombies until init reaps them: wait (briefly) until they are gone.
        deadline = time.monotonic() + 5.0
        while any(_group_alive(c.pid) for c in self.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        return killed

    def _stop(self, children: Sequence[Child]) -> list[str]:
        # The leader first: Celery's parent then stops its own pool, uvicorn drains its requests.
        for child in children:
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + self.grace_s
        killed = []
        for child in children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child.pid, signal.SIGKILL)
                child.process.wait()
                killed.append(child.spec.name)
        # Whatever is left in a group once its leader is gone gets SIGTERM, then SIGKILL at the deadline.
        left = [c for c in children if _group_alive(c.pid)]
        for child in left:
            _signal_group(child.pid, signal.SIGTERM)
        deadline = max(deadline, time.monotonic() + 1.0)
        while any(_group_alive(c.pid) for c in left) and time.monotonic() < deadline:
            time.sleep(0.05)
        return killed


# ------------------------------------------------------------------------------------ composition


@dataclass(frozen=True)
class UpOptions:
    serve_host: str = "127.0.0.1"
    serve_port: int = 8601
    # The arm router in front of the reference server: clients send their traffic here.
    router_port: int = 8700
    account: str | None = None  # default: the first account
    worker_concurrency: int = 2
    trace_sample_rate: float = 0.1  # when the serving config does not say
    serve_threads: int | None = None  # torch threads of the reference server; None: half the cores
    # Torch threads its verify passes may try (timed as it serves); None: its own share only.
    serve_multi_row_threads: int | None = None
    grace_s: float = 10.0
    ready_timeout_s: float = READY_TIMEOUT_S


def local_url(host: str, port: int) -> str:
    """A URL local clients can use for a server bound to `host` (0.0.0.0 means this machine)."""
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{client_host}:{port}"


def redact(url: str) -> str:
    return re.sub(r"//([^:/@]+):[^@/]+@", r"//\1:***@", url)


def serving_key(settings: Settings, account_name: str | None) -> tuple[Path, str]:
    """The file holding the reference server's ingest key, and the account name. The key in
    `var/serving.key` is reused while it still authenticates as a serving key, else a new one is
    issued (role serving: it reads serving config and writes the records a canary judges, nothing
    else)."""
    path = settings.var_dir / "serving.key"
    with unit_of_work(settings.database_url) as session:
        account = (
            get_account_by_name(session=session, name=account_name)
            if account_name
            else first_account(session=session)
        )
        if account is None:
            raise SupervisorError(
                f"no account {account_name!r}" if account_name else "no account in the database"
            )
        if path.exists():
            secret = path.read_text().strip()
            principal = authenticate(session=session, presented=secret, secret=settings.secret_key)
            if (
                principal is not None
                and principal.account_id == account.id
                and principal.role == Role.serving
            ):
                return path, account.name
        issued = issue_key(
            session=session,
            account=account,
            name=SERVING_KEY_NAME,
            role=Role.serving,
            secret=settings.secret_key,
        )
        name = account.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(issued.secret + "\n")
    return path, name


def child_env(settings: Settings) -> dict[str, str]:
    """The environment every child reads its settings from: ours, with the resolved values pinned."""
    return environment_for_child(
        **{
            "CONTROLPLANE_DATABASE_URL": settings.database_url,
            "CONTROLPLANE_BROKER_URL": settings.broker_url,
            "CONTROLPLANE_RESULT_BACKEND_URL": settings.result_backend_url,
            "CONTROLPLANE_VAR_DIR": str(settings.var_dir),
            "CONTROLPLANE_ARTIFACT_DIR": str(settings.artifact_dir),
            "CONTROLPLANE_API_HOST": settings.api_host,
            "CONTROLPLANE_API_PORT": str(settings.api_port),
            "CONTROLPLANE_API_URL": local_url(settings.api_host, settings.api_port),
            "CONTROLPLANE_WORKER_CONCURRENCY": str(settings.worker_concurrency),
            "PYTHONUNBUFFERED": "1",
        }
    )


def child_specs(settings: Settings, options: UpOptions, *, account: str, key_file: Path) -> list[ChildSpec]:
    py = sys.executable
    api = local_url(settings.api_host, settings.api_port)
    serve = local_url(options.serve_host, options.serve_port)
    celery = [py, "-m", "celery", "-A", "workers.celery_app"]
    serve_argv = [
        py,
        "-m",
        "workers.serve",
        "--control-plane",
        api,
        "--account",
        account,
        "--api-key-file",
        str(key_file),
        "--trace-sample-rate",
        str(options.trace_sample_rate),
        "--host",
        options.serve_host,
        "--port",
        str(options.serve_port),
    ]
    # Half the cores by default: the worker trains on the rest, and torch threads that outnumber
    # free cores spin-wait each other into order-of-magnitude slowdowns.
    threads = options.serve_threads or max(1, (os.cpu_count() or 2) // 2)
    serve_argv += ["--threads", str(threads)]
    # Verify passes stay on the server's own share unless asked: here the server always shares the
    # machine (API, workers, beat, router, database), and the passes it times on more threads wait
    # at barriers for a descheduled one. With one busy neighbour on 2 cores, trying 2 threads
    # raised the mean latency/token of speculating requests by 20% and tripled its spread, while
    # requests without speculation (no verify passes) were untouched: a canary judging means
    # then saw a drafter at 3 tokens/step no faster than no speculation.
    if options.serve_multi_row_threads and options.serve_multi_row_threads != threads:
        serve_argv += ["--multi-row-threads", str(options.serve_multi_row_threads)]
    # Behind the router, which reports every reply's record and sampled trace: the server reporting
    # too would store each trace twice.
    serve_argv += ["--no-report"]
    router = local_url(options.serve_host, options.router_port)
    return [
        ChildSpec(
            "api",
            [
                py,
                "-m",
                "controlplane",
                "serve",
                "--host",
                settings.api_host,
                "--port",
                str(settings.api_port),
            ],
            f"{api}  (OpenAPI {api}/docs, metrics {api}/metrics)",
            ready_url=f"{api}/readyz",
        ),
        ChildSpec(
            "worker",
            [
                *celery,
                "worker",
                "-Q",
                "default,gpu",
                "-P",
                "prefork",
                "-c",
                str(options.worker_concurrency),
                "-n",
                f"up-{os.getpid()}@%h",
                "--loglevel=INFO",
            ],
            f"queues default,gpu (prefork x{options.worker_concurrency}) on {redact(settings.broker_url)}",
            ready_log=r"@\S+ ready\.",
        ),
        ChildSpec(
            "beat",
            [*celery, "beat", "--schedule", str(settings.var_dir / "celerybeat-schedule"), "--loglevel=INFO"],
            "drift monitor every few seconds, retention hourly",
            ready_log=r"beat: Starting",
        ),
        ChildSpec(
            "serve",
            serve_argv,
            f"{serve}/v1  (the reference engine, behind the router)",
            ready_url=f"{serve}/healthz",
        ),
        ChildSpec(
            "router",
            [
                py,
                "-m",
                "controlplane",
                "router",
                "--config",
                str(router_config_path(settings)),
                "--host",
                options.serve_host,
                "--port",
                str(options.router_port),
            ],
            f"{router}/v1  (OpenAI-compatible completions and chat; model = deployment name)",
            ready_url=f"{router}/healthz",
        ),
    ]


def router_config_path(settings: Settings) -> Path:
    return settings.var_dir / "router.toml"


def write_router_config(settings: Settings, options: UpOptions, *, account: str, key_file: Path) -> Path:
    """The router of `up` and the demo: every deployment of the account (``"*"``), served by the
    reference server, which follows serving-config itself and serves the arm the router names."""
    path = router_config_path(settings)
    api = local_url(settings.api_host, settings.api_port)
    serve = local_url(options.serve_host, options.serve_port)
    path.write_text(
        "# Written by `controlplane up` / `controlplane demo` at every start.\n"
        f"[control_plane]\nurl = {json.dumps(api)}\naccount = {json.dumps(account)}\n"
        f"api_key_file = {json.dumps(str(key_file))}\n\n"
        f"[router]\nspool_dir = {json.dumps(str(settings.var_dir / 'router-spool'))}\n\n"
        '[[deployments]]\nname = "*"\n\n'
        f'[[deployments.backends]]\nname = "reference"\npool = "follower"\nurl = {json.dumps(serve)}\n'
    )
    return path


def run_up(settings: Settings, options: UpOptions, echo: Echo = print) -> int:
    """Run everything until Ctrl-C (returns 0) or until a child fails (returns 1)."""
    started = time.monotonic()
    settings = settings.model_copy(update={"worker_concurrency": options.worker_concurrency})
    settings.ensure_local_dirs()
    prepare_embedded_database(settings)
    key_file, account = serving_key(settings, options.account)
    write_router_config(settings, options, account=account, key_file=key_file)
    specs = {s.name: s for s in child_specs(settings, options, account=account, key_file=key_file)}
    supervisor = Supervisor(
        log_dir=settings.var_dir / "logs", env=child_env(settings), grace_s=options.grace_s, echo=echo
    )
    restore = supervisor.install_signal_handlers()
    echo(f"database {redact(settings.database_url)}\nbroker   {redact(settings.broker_url)}")
    echo(f"logs     {supervisor.log_dir}/<name>.log\nstarting (Ctrl-C stops everything)...")
    code = 0
    try:
        supervisor.wait_ready([supervisor.start(specs["api"])], options.ready_timeout_s)
        background = [supervisor.start(specs["worker"]), supervisor.start(specs["beat"])]
        serving = supervisor.start(specs["serve"])
        routing = supervisor.start(specs["router"])
        supervisor.wait_ready([*background, serving, routing], options.ready_timeout_s)
        api = local_url(settings.api_host, settings.api_port)
        echo(f"\nall up in {time.monotonic() - started:.1f} s (account {account!r})")
        for child in supervisor.children:
            echo(f"  {child.spec.name:<8} pid {child.pid:<7} {child.spec.where}")
        echo(f"  dashboard         {api}/dashboard")
        echo(
            f"  try: create a deployment (controlplane deployment create target --deployment-id demo "
            f"--draft-model generic-drafter --draft-token-count 4), then\n"
            f"       python -m workers.serve.traffic --scenario scenarios/demo.toml "
            f"--url {local_url(options.serve_host, options.router_port)}"
        )
        supervisor.watch()
        echo(f"\n{supervisor.stop_reason}: stopping all processes...")
    except SupervisorError as exc:
        echo(f"\nerror: {exc}\nstopping all processes...")
        code = 1
    finally:
        killed = supervisor.stop_all(first=("router", "serve"))
        restore()
        if killed:
            echo(f"killed after the {options.grace_s:.0f} s grace period: {', '.join(killed)}")
        echo("stopped: " + ", ".join(f"{c.spec.name} ({_outcome(c)})" for c in supervisor.children))
    return code


def _outcome(child: Child) -> str:
    code = child.process.returncode
    if code is None:
        return "running?"
    if code == -signal.SIGTERM:
        return "terminated"
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
