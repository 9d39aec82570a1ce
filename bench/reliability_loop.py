"""The whole loop under faults, for bench/reliability.py: the processes of `controlplane up` on a
private PostgreSQL and a private Redis, the demo's fast scenario driven through the arm router,
and three faults timed by what the API shows: the worker SIGKILLed (its whole process group, pool
children included) while the realign job runs and again while the canary's shadow replay runs,
each time started again at once, and Redis restarted (emptied) once, after the drift event.

Counted at the end: promotions of the deployment (the canary's promote decision; exactly one is
right) and drift events still open (stalled: nothing will ever resolve them).
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from controlplane.accounts.service import first_account, issue_key
from controlplane.bootstrap import init_account
from controlplane.config import Settings
from controlplane.db.models import Role
from controlplane.db.session import get_engine, unit_of_work
from controlplane.supervisor import (
    Child,
    Supervisor,
    UpOptions,
    child_env,
    child_specs,
    local_url,
    serving_key,
    write_router_config,
)
from tests.conftest import TEST_SECRET
from tests.fleet.processes import free_port
from tests.fleet.services import PrivatePostgres, PrivateRedis
from workers.demo import DEFAULT_SCENARIO, DEMO_DEFAULTS, FAST_OVERRIDES
from workers.serve.traffic import Callbacks, Scenario, TrafficDriver

POLL_S = 1.0
# Recovery sped up to fit a bench run: a dead worker's lease lapses in seconds, not a minute.
RECOVERY_ENV = {
    "CONTROLPLANE_REALIGN_LEASE_S": "12",
    "CONTROLPLANE_REALIGN_RETRY_BACKOFF_S": "5",
    "CONTROLPLANE_REALIGN_RESEND_AFTER_S": "20",
    "CONTROLPLANE_SHADOW_RESEND_AFTER_S": "30",
    "CONTROLPLANE_CELERY_VISIBILITY_TIMEOUT_S": "900",
}


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if nested else value
    return out


class LoopFaults(threading.Thread):
    """Watches jobs and canaries through the API and injects each fault once, at its moment."""

    def __init__(
        self,
        api: httpx.Client,
        prefix: str,
        kill_worker: Callable[[str], None],
        restart_redis: Callable[[], None],
        say: Callable[[str], None],
    ) -> None:
        super().__init__(daemon=True, name="loop-faults")
        self.api, self.prefix = api, prefix
        self.kill_worker, self.restart_redis, self.say = kill_worker, restart_redis, say
        self.stop_event = threading.Event()
        self.done: dict[str, float] = {}
        self.decision: dict[str, Any] | None = None
        self.errors: list[str] = []

    def run(self) -> None:
        started = time.monotonic()
        while not self.stop_event.wait(POLL_S):
            try:
                self.poll(time.monotonic() - started)
            except Exception as exc:  # the API away for a moment (Redis restart) must not end the watch
                self.errors.append(repr(exc)[:200])

    def poll(self, at: float) -> None:
        events = self.api.get(f"{self.prefix}/drift-events").json()["drift_events"]
        if events and "redis_restart" not in self.done:
            self.say("loop: drift event seen; restarting Redis")
            self.restart_redis()
            self.done["redis_restart"] = at
        jobs = self.api.get(f"{self.prefix}/jobs").json()["jobs"]
        realign = [j for j in jobs if j["kind"] == "realign"]
        if (
            realign
            and realign[0]["state"] == "running"
            and realign[0]["progress"] > 0.05
            and "kill_training" not in self.done
        ):
            self.say(
                f"loop: realign job {realign[0]['id']} running ({realign[0]['progress']:.0%});"
                " SIGKILL the worker"
            )
            self.kill_worker("training")
            self.done["kill_training"] = at
        canaries = self.api.get(f"{self.prefix}/canaries").json()["canaries"]
        if canaries:
            canary = canaries[0]
            replaying = [j for j in jobs if j["kind"] != "realign" and j["state"] == "running"]
            if canary["phase"] == "shadow" and replaying and "kill_replay" not in self.done:
                self.say(
                    f"loop: canary {canary['canary_id']} replaying (job {replaying[0]['id']});"
                    " SIGKILL the worker"
                )
                self.kill_worker("replay")
                self.done["kill_replay"] = at
            if canary["decision"] is not None:
                self.decision = canary


def run_loop_under_faults(
    *, quick: bool, say: Callable[[str], None], max_shift_s: float = 900.0
) -> dict[str, Any]:
    raw = tomllib.loads(DEFAULT_SCENARIO.read_text())
    scenario = Scenario.from_dict(raw)
    knobs = _merged(_merged(DEMO_DEFAULTS, raw.get("demo", {})), FAST_OVERRIDES)
    sizes = FAST_OVERRIDES["phase_requests"]
    phases = [
        replace(p, requests=n, max_tokens=knobs.get("max_tokens") or p.max_tokens)
        for p, n in zip(scenario.phases, sizes, strict=True)
    ]
    name = str(knobs["deployment"])
    with tempfile.TemporaryDirectory() as tmp, PrivatePostgres() as pg, PrivateRedis() as broker:
        var = Path(tmp) / "var"
        settings = Settings(
            database_url=pg.url,
            broker_url=broker.url,
            result_backend_url=broker.url,
            var_dir=var,
            artifact_dir=var / "artifacts",
            environment="test",
            secret_key=TEST_SECRET,
            api_port=free_port(),
            worker_concurrency=2,
        )
        for key, value in {
            **RECOVERY_ENV,
            "CONTROLPLANE_SECRET_KEY": TEST_SECRET,
            "CONTROLPLANE_ENVIRONMENT": "test",
            "CONTROLPLANE_REALIGN_TIME_BUDGET_S": str(knobs["realign"]["time_budget_s"]),
            "CONTROLPLANE_REALIGN_MIN_TRACES": str(knobs["realign"]["min_traces"]),
            "CONTROLPLANE_REALIGN_MAX_WAIT_S": str(knobs["realign"]["max_wait_s"]),
        }.items():
            os.environ[key] = value
        options = UpOptions(
            serve_port=free_port(),
            router_port=free_port(),
            trace_sample_rate=float(knobs["trace_sample_rate"]),
        )
        settings.ensure_local_dirs()
        init_account(settings, account_name="default")
        key_file, account = serving_key(settings, None)
        write_router_config(settings, options, account=account, key_file=key_file)
        specs = {s.name: s for s in child_specs(settings, options, account=account, key_file=key_file)}
        supervisor = Supervisor(log_dir=var / "logs", env=child_env(settings), grace_s=10.0, echo=say)
        with unit_of_work(settings.database_url) as session:
            owner = first_account(session=session)
            assert owner is not None
            admin = issue_key(
                session=session, account=owner, name="bench", role=Role.admin, secret=TEST_SECRET
            ).secret
        api_url = local_url(settings.api_host, settings.api_port)
        http = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {admin}"}, timeout=30)
        prefix = f"/v1/accounts/{account}/deployments/{name}"
        workers: list[Child] = []
        kills: list[dict[str, Any]] = []
        started = time.monotonic()

        def kill_worker(why: str) -> None:
            victim = workers[-1]
            os.killpg(victim.pid, signal.SIGKILL)
            victim.process.wait(timeout=30)
            kills.append({"why": why, "at_s": round(time.monotonic() - started, 1)})
            workers.append(supervisor.start(specs["worker"]))

        def restart_redis() -> None:
            broker.restart(down_s=1.0)

        summary: dict[str, Any] = {}
        try:
            supervisor.wait_ready([supervisor.start(specs["api"])])
            workers.append(supervisor.start(specs["worker"]))
            background = [workers[0], supervisor.start(specs["beat"])]
            supervisor.wait_ready(
                [*background, supervisor.start(specs["serve"]), supervisor.start(specs["router"])]
            )
            say(f"loop: all processes up in {time.monotonic() - started:.0f} s")
            base = f"/v1/accounts/{account}/deployments"
            for method, path, body in (
                (
                    "POST",
                    base,
                    {
                        "deployment_id": name,
                        "target_model": knobs["target_model"],
                        "draft_model": knobs["draft_model"],
                        "draft_token_count": int(knobs["draft_token_count"]),
                    },
                ),
                ("PATCH", prefix, {"trace_sample_rate": float(knobs["trace_sample_rate"])}),
                ("PATCH", f"{prefix}/drift-policy", knobs["drift_policy"]),
                ("PATCH", f"{prefix}/canary-policy", knobs["canary_policy"]),
            ):
                response = http.request(method, path, json=body)
                if response.status_code >= 400:
                    raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:300]}")
            time.sleep(2.5)
            serve_url = local_url(options.serve_host, options.router_port)
            stamp = int(time.time())
            say("loop: before the shift")
            TrafficDriver(serve_url, name, run_id=f"rel-{stamp}-1").run([phases[0]], Callbacks())
            faults = LoopFaults(http, prefix, kill_worker, restart_redis, say)
            faults.start()
            deadline = time.monotonic() + max_shift_s
            say("loop: the shift (faults armed)")
            shift = phases[1]
            # The shift phase is capped by requests; drive it again while the loop has not decided.
            round_ = 0
            while faults.decision is None and time.monotonic() < deadline:
                round_ += 1
                TrafficDriver(serve_url, name, run_id=f"rel-{stamp}-2-{round_}").run(
                    [shift],
                    Callbacks(),
                    should_stop=lambda: faults.decision is not None or time.monotonic() > deadline,
                )
            # A promotion is followed by the post-promotion watch: settle before counting.
            time.sleep(10)
            faults.stop_event.set()
            faults.join(10)
            canaries = http.get(f"{prefix}/canaries").json()["canaries"]
            events = http.get(f"{prefix}/drift-events").json()["drift_events"]
            jobs = http.get(f"{prefix}/jobs").json()["jobs"]
            promotions = sum(1 for c in canaries if c.get("decision") == "promote")
            stalled = [e for e in events if e.get("state") not in ("resolved", "dismissed")]
            summary = {
                "promotions_per_loop": promotions,
                "stalled_events": len(stalled),
                "faults": {**{k: round(v, 1) for k, v in faults.done.items()}, "kills": kills},
                "faults_missed": [
                    f for f in ("redis_restart", "kill_training", "kill_replay") if f not in faults.done
                ],
                "canaries": [
                    {k: c.get(k) for k in ("canary_id", "phase", "decision", "reason")} for c in canaries
                ],
                "drift_events": [
                    {k: e.get(k) for k in ("state", "resolution", "resolution_reason")} for e in events
                ],
                "jobs": [{k: j.get(k) for k in ("id", "kind", "state", "attempts", "error")} for j in jobs],
                "watch_errors": faults.errors[:10],
                "seconds": round(time.monotonic() - started, 1),
                "max_shift_s": max_shift_s,
            }
        except Exception as exc:
            logs = {c.spec.name: c.log_tail(30) for c in supervisor.children}
            summary = {"error": f"{type(exc).__name__}: {exc}", "logs": logs}
            raise RuntimeError(f"{exc}\n{logs}") from exc
        finally:
            supervisor.stop_all(first=("router", "serve"))
            http.close()
            get_engine(settings.database_url).dispose()
    return summary
