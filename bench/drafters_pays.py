"""A drafter that does not pay, found and acted on by the running loop.

The processes of ``controlplane up`` (API, Celery worker and beat, the reference server, the arm
router) on a private embedded database; a deployment serving the generic (prose-trained) drafter
on code traffic at a k too large for it (8), at a steady hit rate (no drift to notice), with the
standing 5 % no-speculation share. Traffic goes through the router, which reports every reply's
acceptance under the serving key. The beat's drift pass runs the speculation check; the bench
only watches the API.

1. calibration: code traffic with speculation off (the speed-up denominator);
2. unprofitable: the generic drafter on code until the check acts (capped);
3. after the action: code traffic again on whatever the check switched to.

Figures: ``unprofitable_detected_requests`` (requests sent until the check's action appeared;
target <= 2,000), ``after_action_speedup_vs_nospec`` (calibrated no-speculation ms per token over
the live arm's after the action; target >= 1.0), plus the speed-up before the action, the action,
its reason and the check's ratio. Run as a script it writes bench/results/drafters_pays.json.

Usage: .venv/bin/python bench/drafters_pays.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from controlplane.accounts.service import first_account, issue_key  # noqa: E402
from controlplane.bootstrap import init_account  # noqa: E402
from controlplane.config import Settings  # noqa: E402
from controlplane.db.models import Role  # noqa: E402
from controlplane.db.session import unit_of_work  # noqa: E402
from controlplane.supervisor import (  # noqa: E402
    Supervisor,
    UpOptions,
    child_env,
    child_specs,
    local_url,
    serving_key,
    write_router_config,
)
from tests.conftest import TEST_SECRET  # noqa: E402
from tests.fleet.processes import free_port  # noqa: E402
from workers.serve.traffic import Callbacks, Phase, PhaseReport, RequestResult, TrafficDriver  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "drafters_pays.json"
NAME = "pays"
DOMAIN = "code"
MAX_TOKENS = 16
# k too large for the generic drafter on code: each verify step pays for 8 drafter steps while
# about a quarter of the drafts are accepted.
DRAFT_K = 8
DETECTION_CAP = 2000
POLL_S = 1.0


class CheckWatcher(threading.Thread):
    """Polls GET speculation-check; notes the first action and how many requests were sent by then."""

    def __init__(self, http: httpx.Client, prefix: str, sent: list[int]) -> None:
        super().__init__(daemon=True, name="check-watcher")
        self.http, self.prefix, self.sent = http, prefix, sent
        self.stop_event = threading.Event()
        self.acted: dict[str, Any] | None = None
        self.requests_at_action: int | None = None
        self.last: dict[str, Any] = {}

    def run(self) -> None:
        while not self.stop_event.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        try:
            response = self.http.get(f"{self.prefix}/speculation-check")
        except httpx.HTTPError:
            return
        if response.status_code != 200:
            return
        self.last = response.json()
        if self.acted is None and self.last.get("action"):
            self.acted = dict(self.last)
            self.requests_at_action = self.sent[0]


def _phase(name: str, requests: int, seed: int) -> Phase:
    return Phase(name=name, mix={DOMAIN: 1.0}, requests=requests, max_tokens=MAX_TOKENS, seed=seed)


def _live_ms_per_token(report: PhaseReport) -> float | None:
    group = report.by_arm.get("live")
    return group.ms_per_token if group is not None else None


def measure(quick: bool = False) -> dict[str, Any]:
    """Run the loop once; returns the figures (see the module docstring)."""
    say = print
    calibration_requests = 20 if quick else 40
    after_requests = 60 if quick else 150
    with tempfile.TemporaryDirectory() as tmp:
        var = Path(tmp) / "var"
        settings = Settings(
            database_url=f"sqlite:///{var / 'controlplane.db'}",
            broker_url=f"sqla+sqlite:///{var / 'broker.db'}",
            result_backend_url=f"db+sqlite:///{var / 'celery-results.db'}",
            var_dir=var,
            artifact_dir=var / "artifacts",
            environment="test",
            secret_key=TEST_SECRET,
            api_port=free_port(),
            worker_concurrency=1,
        )
        os.environ["CONTROLPLANE_SECRET_KEY"] = TEST_SECRET
        os.environ["CONTROLPLANE_ENVIRONMENT"] = "test"
        options = UpOptions(serve_port=free_port(), router_port=free_port(), trace_sample_rate=0.0)
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
        base = f"/v1/accounts/{account}/deployments"
        prefix = f"{base}/{NAME}"
        serve_url = local_url(options.serve_host, options.router_port)
        stamp = int(time.time())
        started = time.monotonic()
        watcher: CheckWatcher | None = None

        def call(method: str, path: str, body: Any) -> None:
            response = http.request(method, path, json=body)
            if response.status_code >= 400:
                raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:300]}")

        try:
            supervisor.wait_ready([supervisor.start(specs["api"])])
            background = [supervisor.start(specs["worker"]), supervisor.start(specs["beat"])]
            supervisor.wait_ready(
                [*background, supervisor.start(specs["serve"]), supervisor.start(specs["router"])]
            )
            say(f"pays: all processes up in {time.monotonic() - started:.0f} s")
            call(
                "POST",
                base,
                {
                    "deployment_id": NAME,
                    "target_model": "reference-target",
                    "disable_speculative_decoding": True,
                    # The ladder without a GPU job: another k, then n-gram lookup, then none.
                    "auto_realign": False,
                },
            )
            call(
                "PUT",
                f"{prefix}/adaptation-policy",
                {"standing_baseline_share": 0.05, "first_drafter": False},
            )
            time.sleep(2.5)  # the reference server caches its serving config for a second or two
            say("pays: 1/3 calibration, speculation off")
            [calibration] = TrafficDriver(serve_url, NAME, run_id=f"pays-{stamp}-0").run(
                [_phase("no speculation", calibration_requests, seed=9)]
            )
            nospec = calibration.ms_per_token
            call("PATCH", prefix, {"draft_model": "reference-drafter", "draft_token_count": DRAFT_K})
            time.sleep(2.5)

            say("pays: 2/3 the generic drafter on code, until the check acts")
            sent = [0]
            watcher = CheckWatcher(http, prefix, sent)
            watcher.start()
            results: list[RequestResult] = []

            def on_result(_n: int, _p: Phase, result: RequestResult) -> None:
                sent[0] += 1
                results.append(result)
                if sent[0] % 100 == 0 and watcher is not None:
                    last = watcher.last
                    say(f"  {sent[0]} requests; check: {last.get('verdict')}, ratio {last.get('ratio')}")

            [unprofitable] = TrafficDriver(serve_url, NAME, run_id=f"pays-{stamp}-1").run(
                [_phase("generic drafter on code", DETECTION_CAP, seed=1)],
                Callbacks(on_result=on_result),
                should_stop=lambda: watcher is not None and watcher.acted is not None,
            )
            # The action may land in the gap between the last request and the next poll.
            deadline = time.monotonic() + 20
            while watcher.acted is None and time.monotonic() < deadline:
                watcher.poll()
                time.sleep(POLL_S)
            acted = watcher.acted
            summary: dict[str, Any] = {
                "nospec_ms_per_token": nospec,
                "unprofitable_ms_per_token": _live_ms_per_token(unprofitable),
                "unprofitable_speedup_vs_nospec": _ratio(nospec, _live_ms_per_token(unprofitable)),
                "unprofitable_hit_rate": unprofitable.hit_rate,
                "unprofitable_detected_requests": watcher.requests_at_action if acted else None,
                "requests_sent_before_action": sent[0],
                "action": acted.get("action") if acted else None,
                "action_reason": acted.get("reason") if acted else watcher.last.get("reason"),
                "check_ratio_at_action": acted.get("ratio") if acted else None,
                "check_ratio_low_at_action": acted.get("ratio_low") if acted else None,
            }
            if acted is None:
                say(f"pays: the check did not act within {DETECTION_CAP} requests")
                summary["after_action_speedup_vs_nospec"] = None
                return summary
            say(f"pays: the check acted after {watcher.requests_at_action} requests: {acted.get('action')}")
            time.sleep(2.5)
            say("pays: 3/3 after the action")
            [after] = TrafficDriver(serve_url, NAME, run_id=f"pays-{stamp}-2").run(
                [_phase("after the action", after_requests, seed=2)]
            )
            watcher.poll()
            summary.update(
                {
                    "after_action_ms_per_token": _live_ms_per_token(after),
                    "after_action_speedup_vs_nospec": _ratio(nospec, _live_ms_per_token(after)),
                    "after_action_hit_rate": after.hit_rate,
                    "after_action_serving": watcher.last.get("serving"),
                    "ladder_at_end": watcher.last.get("ladder"),
                    "wall_s": round(time.monotonic() - started, 1),
                }
            )
            return summary
        finally:
            if watcher is not None:
                watcher.stop_event.set()
            supervisor.stop_all(first=("router", "serve"))


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calibration and after-action requests")
    args = parser.parse_args(argv)
    figures = measure(quick=args.quick)
    print(json.dumps(figures, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
