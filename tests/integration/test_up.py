"""`controlplane up` on the embedded default, as a user runs it: real API, Celery worker, beat and
reference server processes on SQLite and the SQLAlchemy broker in a temporary directory; one
completion through the reference server reaches the control plane as an acceptance record and a
trace; Ctrl-C (SIGINT) stops every process, leaving none behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

CLI = [sys.executable, "-m", "controlplane"]
START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(predicate: object, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{log.read_text()[-4000:]}")


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_runs_everything_and_ctrl_c_stops_it_all(tmp_path: Path) -> None:
    api_port, serve_port, router_port = _free_port(), _free_port(), _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")},
        "CONTROLPLANE_ENVIRONMENT": "development",
        "CONTROLPLANE_API_PORT": str(api_port),
        "CONTROLPLANE_API_URL": f"http://127.0.0.1:{api_port}",
        "PYTHONUNBUFFERED": "1",
    }
    out = tmp_path / "up.out"
    started = time.monotonic()
    with out.open("w") as sink:
        up = subprocess.Popen(
            [
                *CLI,
                "up",
                "--serve-port",
                str(serve_port),
                "--router-port",
                str(router_port),
                "--worker-concurrency",
                "1",
                "--grace",
                "15",
            ],
            cwd=tmp_path,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # as a terminal would have it: SIGINT goes to `up` alone below
        )
    try:
        _wait_for(
            lambda: "all up in" in out.read_text() or up.poll() is not None, START_TIMEOUT_S, "all up", out
        )
        text = out.read_text()
        assert up.poll() is None and "all up in" in text, text
        startup_s = time.monotonic() - started
        listed = re.findall(r"^\s+(api|worker|beat|serve|router)\s+pid (\d+)", text, re.M)
        pids = {name: int(pid) for name, pid in listed}
        assert set(pids) == {"api", "worker", "beat", "serve", "router"}, text
        assert f"http://127.0.0.1:{api_port}/dashboard" in text

        api = httpx.Client(
            base_url=f"http://127.0.0.1:{api_port}",
            headers={"Authorization": f"Bearer {(tmp_path / 'var' / 'admin.key').read_text().strip()}"},
            timeout=30,
        )
        created = api.post(
            "/v1/accounts/default/deployments",
            json={
                "target_model": "reference-target",
                "deployment_id": "svc",
                "draft_model": "reference-drafter",
                "draft_token_count": 4,
            },
        )
        assert created.status_code == 201, created.text
        sampled = api.patch("/v1/accounts/default/deployments/svc", json={"trace_sample_rate": 1.0})
        assert sampled.status_code == 200, sampled.text

        # Through the router, which files the record and the sampled trace.
        completion = httpx.post(
            f"http://127.0.0.1:{router_port}/v1/completions",
            json={
                "model": "svc",
                "prompt": "The quick brown fox",
                "max_tokens": 12,
                "temperature": 0,
                "perf_metrics_in_response": True,
                "category": "prose",
            },
            headers={"x-request-id": "up-test-1"},
            timeout=120,
        )
        assert completion.status_code == 200, completion.text
        record = completion.json()["speculation_record"]
        assert record["arm"] == "live" and record["drafted_tokens"] > 0

        def arrived() -> bool:
            total = api.get("/v1/accounts/default/deployments/svc/stats").json()["total"]
            traces = api.get("/v1/accounts/default/deployments/svc/traces").json()["traces"]
            return bool(total.get("requests") == 1 and traces)

        _wait_for(arrived, 30, "the acceptance record and trace in the API", out)
        total = api.get("/v1/accounts/default/deployments/svc/stats").json()["total"]
        assert total["drafted_tokens"] == record["drafted_tokens"]
        assert total["accepted_tokens"] == record["accepted_tokens"]
        trace = api.get("/v1/accounts/default/deployments/svc/traces").json()["traces"][0]
        assert trace["prompt"] == "The quick brown fox" and trace["completion"]
        api.close()

        stopping = time.monotonic()
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0, out.read_text()
        stop_s = time.monotonic() - stopping
        text = out.read_text()
        assert "SIGINT: stopping all processes" in text and "stopped: " in text, text
        # Every child led its own process group; no member of any group may be left.
        assert all(_group_gone(pid) for pid in pids.values()), text
        print(f"\nup: all healthy after {startup_s:.1f} s; stopped in {stop_s:.1f} s")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in locals().get("pids", {}).values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------- the supervisor on tiny child processes


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SLEEPER = "import time\nwhile True: time.sleep(0.1)"
# Ignores SIGTERM and forks a grandchild that ignores it too: only SIGKILL to the group ends both.
STUBBORN = (
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "os.fork()\n"
    "print('ready', flush=True)\n"
    "while True: time.sleep(0.1)"
)


def test_a_child_that_dies_is_reported_and_everything_stops(tmp_path: Path) -> None:
    from controlplane.supervisor import ChildSpec, Supervisor, SupervisorError

    said: list[str] = []
    sup = Supervisor(log_dir=tmp_path, env=dict(os.environ), grace_s=2.0, echo=said.append)
    sleeper = sup.start(ChildSpec("sleeper", _py(SLEEPER), "-"))
    sup.start(ChildSpec("crasher", _py("import sys, time; time.sleep(0.5); print('boom'); sys.exit(3)"), "-"))
    try:
        with_error = None
        try:
            sup.watch()
        except SupervisorError as exc:
            with_error = str(exc)
        assert with_error is not None and "crasher" in with_error and "code 3" in with_error
        assert "boom" in with_error  # the tail of its log
    finally:
        sup.stop_all()
    assert sleeper.process.returncode == -signal.SIGTERM and _group_gone(sleeper.pid)


def test_stop_kills_what_ignores_sigterm_and_leaves_no_group_member(tmp_path: Path) -> None:
    from controlplane.supervisor import ChildSpec, Supervisor

    sup = Supervisor(log_dir=tmp_path, env=dict(os.environ), grace_s=1.0, echo=lambda _: None)
    first = sup.start(ChildSpec("first", _py(SLEEPER), "-"))
    stubborn = sup.start(ChildSpec("stubborn", _py(STUBBORN), "-", ready_log="ready"))
    sup.wait_ready([stubborn], timeout_s=30)
    t0 = time.monotonic()
    killed = sup.stop_all(first=("first",))
    stop_s = time.monotonic() - t0
    # Deterministic lower bound: the stubborn child outlives SIGTERM, so it is killed no sooner
    # than its grace. The upper bound only catches a hang (about 1 s is normal; the 60 s margin is
    # for a loaded machine's stalls, not a figure).
    assert 1.0 <= stop_s < 60, stop_s
    assert "stubborn" in killed and "first" not in killed
    assert first.process.returncode == -signal.SIGTERM
    assert _group_gone(stubborn.pid) and _group_gone(first.pid)


def test_start_up_fails_cleanly_when_a_child_never_gets_healthy(tmp_path: Path) -> None:
    from controlplane.supervisor import ChildSpec, Supervisor, SupervisorError

    sup = Supervisor(log_dir=tmp_path, env=dict(os.environ), grace_s=1.0, echo=lambda _: None)
    child = sup.start(
        ChildSpec("mute", _py(SLEEPER), "-", ready_url=f"http://127.0.0.1:{_free_port()}/healthz")
    )
    try:
        try:
            sup.wait_ready([child], timeout_s=1.5)
            raise AssertionError("expected a start-up failure")
        except SupervisorError as exc:
            assert "not healthy after" in str(exc) and "mute" in str(exc)
    finally:
        sup.stop_all()
    assert _group_gone(child.pid)


def test_children_end_even_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    """SIGKILL cannot be caught; the children's parent-death signal still ends them (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    script = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from controlplane.supervisor import ChildSpec, Supervisor\n"
        f"sup = Supervisor(log_dir=Path({str(tmp_path)!r}), env=dict(os.environ))\n"
        f"child = sup.start(ChildSpec('sleeper', {_py(SLEEPER)!r}, '-'))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert not _group_gone(child_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 60  # a wait, not a figure: room for a loaded machine
    while not _group_gone(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group_gone(child_pid)
