"""A drafter that does not pay, found and acted on by the running loop.

The processes of ``controlplane up`` (API, Celery worker and beat, the reference server, the arm
router) on a private embedded database; a deployment serving the generic (prose-trained) drafter
on code traffic at a k too large for it (8), at a steady hit rate (no drift to notice), with the
standing 5 % no-speculation share. Traffic goes through the router, which reports every reply's
acceptance under the serving key. The beat's drift pass runs the speculation check; the bench
only watches the API. The deployment has no shadow replay, so no measured verify cost for its
target: the check does not change k on the flat-verify assumption (on this CPU a 2-token verify
costs ~1.44 one-token steps, and the k=1 it used to plan ran 0.91-0.96x) and, realigning off,
switches to n-gram lookup; ``action_detail`` says what it weighed.

1. warm-up: a few code requests with speculation off (a fresh server's first requests are slow;
   nothing here is measured);
2. unprofitable: the generic drafter on code until the check acts (capped);
3. after the action: warm-up requests on both arms, then every prompt sent twice, once to the live
   arm (whatever the check switched to) and once to the no-speculation arm, in alternating order,
   one request at a time. Each request is pinned to its arm through the router's own rule (a
   ``user`` key whose hash lands on that arm's slice of the serving config), and the arm the
   reply names is checked. Half of this traffic is the no-speculation arm's, so the check may
   act again during it (n-gram lookup found slower falls back to no speculation): pairs are
   kept per serving config version, pairs a change fell into are dropped, each version is warmed
   up before it is measured, and the headline is the version in force at the end (every
   version's figures are listed).

Figures: ``unprofitable_detected_requests`` (requests sent until the check's action appeared;
target <= 2,000) and ``after_action_speedup_vs_nospec`` (target >= 1.0): client-side ms per
completion token of the no-speculation arm over the live arm's, both summed over the same
interleaved prompts, with a bootstrap 95 % interval over prompts and the quartiles of the
per-prompt ratios; beside it the same pairs timed by the server, decoding after the first
token and the prefill apart (where a client figure below 1.0 comes from). The speed-up before
the action compares the two arms of phase 2 (the hash split, so different prompts, and only the
5 % share on the no-speculation side). When the
check turned speculation off, both measured arms serve without it and the figure says so
(``after_action_live_speculation``). Run as a script it writes bench/results/drafters_pays.json.

Usage: .venv/bin/python bench/drafters_pays.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from controlplane.router.arms import client_key, pick_arm  # noqa: E402
from controlplane.router.follower import ArmSpec, parse_serving_config  # noqa: E402
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
from workers.serve.traffic import (  # noqa: E402
    Callbacks,
    Phase,
    PhaseReport,
    RequestResult,
    TrafficDriver,
    plan_requests,
)

RESULTS = ROOT / "bench" / "results" / "drafters_pays.json"
NAME = "pays"
DOMAIN = "code"
MAX_TOKENS = 16
# k too large for the generic drafter on code: each verify step pays for 8 drafter steps while
# about a quarter of the drafts are accepted.
DRAFT_K = 8
DETECTION_CAP = 2000
POLL_S = 1.0
NOSPEC = "disabled"
BOOTSTRAP_RESAMPLES = 2000


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


@dataclass(frozen=True)
class PairTiming:
    """One prompt served by both arms: client-side latency and completion tokens of each."""

    nospec_s: float
    nospec_tokens: int
    live_s: float
    live_tokens: int

    @property
    def ratio(self) -> float:
        """No-speculation ms per token over the live arm's, for this prompt alone."""
        return (self.nospec_s / self.nospec_tokens) / (self.live_s / self.live_tokens)


def _pooled(pairs: Sequence[PairTiming]) -> float:
    nospec = sum(p.nospec_s for p in pairs) / sum(p.nospec_tokens for p in pairs)
    live = sum(p.live_s for p in pairs) / sum(p.live_tokens for p in pairs)
    return nospec / live


def interleaved_speedup(
    pairs: Sequence[PairTiming], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> dict[str, Any]:
    """The live arm's speed-up over no speculation on the same prompts: ms per token pooled over
    the pairs (no speculation over live), a percentile-bootstrap 95 % interval from resampling
    whole pairs (so each resample keeps a prompt's two arms together), the quartiles of the
    per-prompt ratios and the share of prompts the live arm served faster per token."""
    usable = [p for p in pairs if min(p.nospec_s, p.live_s) > 0 and min(p.nospec_tokens, p.live_tokens) > 0]
    if not usable:
        return {"speedup": None, "interval_95": None, "pairs": 0}
    rng = random.Random(seed)
    n = len(usable)
    boot = sorted(_pooled([usable[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    ratios = sorted(p.ratio for p in usable)
    quartiles = statistics.quantiles(ratios, n=4) if n >= 2 else [ratios[0]] * 3
    return {
        "speedup": round(_pooled(usable), 4),
        "interval_95": [round(boot[int(0.025 * resamples)], 4), round(boot[int(0.975 * resamples) - 1], 4)],
        "pairs": n,
        "pair_ratio_quartiles": [round(q, 4) for q in quartiles],
        "share_of_prompts_live_faster": round(sum(r > 1.0 for r in ratios) / n, 4),
        "nospec_ms_per_token": round(
            1000 * sum(p.nospec_s for p in usable) / sum(p.nospec_tokens for p in usable), 3
        ),
        "live_ms_per_token": round(
            1000 * sum(p.live_s for p in usable) / sum(p.live_tokens for p in usable), 3
        ),
    }


def pin_keys(arms: Sequence[ArmSpec], wanted: Sequence[str], *, prefix: str = "pays") -> dict[str, str]:
    """A ``user`` value per wanted arm that the router's hash places on that arm (the router keys
    a request by its ``user`` before anything else), found by counting up from ``prefix``-0."""
    keys: dict[str, str] = {}
    for number in range(100_000):
        user = f"{prefix}-{number}"
        arm = pick_arm(arms, client_key({"user": user}, {}, None, "")).name
        if arm in wanted and arm not in keys:
            keys[arm] = user
        if len(keys) == len(set(wanted)):
            return keys
    raise ValueError(f"no user key lands on {sorted(set(wanted) - set(keys))} (weights {arms})")


def _phase(name: str, requests: int, seed: int) -> Phase:
    return Phase(name=name, mix={DOMAIN: 1.0}, requests=requests, max_tokens=MAX_TOKENS, seed=seed)


def _arm_ms_per_token(report: PhaseReport, arm: str) -> float | None:
    group = report.by_arm.get(arm)
    return group.ms_per_token if group is not None else None


def _arm_requests(report: PhaseReport, arm: str) -> int:
    group = report.by_arm.get(arm)
    return group.requests if group is not None else 0


@dataclass(frozen=True)
class Served:
    """One reply: client latency and completion tokens, the server's own time to the first token
    and in all (the engine's record; None when the reply has none), and its draft counts."""

    latency_s: float
    tokens: int
    ttft_ms: float | None
    total_ms: float | None
    drafted: int = 0
    accepted: int = 0


def split_pairs(pairs: Sequence[tuple[Served, Served]]) -> dict[str, list[PairTiming]]:
    """(no speculation, live) replies as pair timings three ways: the client's whole request;
    the server's decoding after the first token (prefill and transport left out); and the
    server's time to the first token (one "token" per request: the ratio of mean prefill)."""
    client = [PairTiming(b.latency_s, b.tokens, a.latency_s, a.tokens) for b, a in pairs]
    decode: list[PairTiming] = []
    prefill: list[PairTiming] = []
    for b, a in pairs:
        if b.ttft_ms is None or b.total_ms is None or a.ttft_ms is None or a.total_ms is None:
            continue
        if min(b.tokens, a.tokens) > 1:
            decode_b, decode_a = (b.total_ms - b.ttft_ms) / 1000, (a.total_ms - a.ttft_ms) / 1000
            decode.append(PairTiming(decode_b, b.tokens - 1, decode_a, a.tokens - 1))
            prefill.append(PairTiming(b.ttft_ms / 1000, 1, a.ttft_ms / 1000, 1))
    return {"client": client, "server_decode": decode, "server_prefill": prefill}


@dataclass
class ServingState:
    """One serving config version seen during the measurement: its arms, the user keys that pin
    them, and the pairs measured wholly under it."""

    version: str
    live: dict[str, Any]
    nospec: str
    keys: dict[str, str]
    replies: list[tuple[Served, Served]] = field(default_factory=list)
    warm_left: int = 0

    @classmethod
    def of(cls, config: dict[str, Any], warmup: int) -> ServingState:
        """The state of a serving config: the no-speculation arm is the standing share, else the
        live arm itself when it stopped speculating."""
        by_name = {raw["arm"]: raw for raw in config.get("arms") or []}
        live = by_name.get("live", {})
        nospec = next(
            (name for name, raw in by_name.items() if name != "live" and raw.get("speculation") == NOSPEC),
            "live" if live.get("speculation") == NOSPEC else None,
        )
        if nospec is None:
            raise RuntimeError(f"the serving config has no arm without speculation: {sorted(by_name)}")
        keys = pin_keys(parse_serving_config(config, time.time()).arms, ["live", nospec])
        return cls(str(config.get("config_version")), live, nospec, keys, warm_left=warmup)

    def figures(self) -> dict[str, Any]:
        parts = split_pairs(self.replies)
        drafted = sum(live.drafted for _, live in self.replies)
        accepted = sum(live.accepted for _, live in self.replies)
        return {
            **interleaved_speedup(parts["client"]),
            # Why the client figure is what it is: the same pairs, decoding alone and prefill alone.
            "server_decode": interleaved_speedup(parts["server_decode"]),
            "server_prefill": interleaved_speedup(parts["server_prefill"]),
            "live_speculation": self.live.get("speculation"),
            "live_k": self.live.get("k"),
            "nospec_arm": self.nospec,
            "live_hit_rate": round(accepted / drafted, 4) if drafted else None,
            "config_version": self.version,
        }


class ArmClient:
    """Sends one request at a time through the router, pinned to an arm by its ``user`` key."""

    def __init__(self, url: str, run_id: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=120)
        self.run_id = run_id
        self.keys: dict[str, str] = {}
        self.sent = 0
        self.misrouted = 0

    def send(self, arm: str, prompt: str, category: str) -> Served | None:
        """What the client and the server timed, None when it failed or another arm served."""
        self.sent += 1
        body = {
            "model": NAME,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "user": self.keys[arm],
            "category": category,
            "perf_metrics_in_response": True,
        }
        started = time.perf_counter()
        response = self.http.post(
            "/v1/completions", json=body, headers={"x-request-id": f"{self.run_id}-{self.sent}"}
        )
        latency = time.perf_counter() - started
        if response.status_code != 200:
            return None
        if response.headers.get("x-speculation-arm") != arm:
            self.misrouted += 1
            return None
        data = response.json()
        record = data.get("speculation_record") or {}
        return Served(
            latency,
            int((data.get("usage") or {}).get("completion_tokens") or 0),
            record.get("ttft_ms"),
            record.get("total_ms"),
            int(record.get("drafted_tokens") or 0),
            int(record.get("accepted_tokens") or 0),
        )

    def close(self) -> None:
        self.http.close()


def measure_interleaved(
    url: str,
    read_config: Callable[[], dict[str, Any]],
    *,
    warmup: int,
    pairs: int,
    max_pairs: int,
    run_id: str,
    say: Any = print,
) -> dict[str, Any]:
    """The live arm against no speculation on the same prompts, alternating which goes first,
    until the serving config in force has ``pairs`` pairs (or ``max_pairs`` were sent). The
    check may act again on this traffic (half of it is the no-speculation arm's): pairs are
    kept per config version, a pair the version changed under is dropped, and each new version
    gets ``warmup`` unmeasured pairs first. The headline is the version in force at the end."""
    client = ArmClient(url, run_id)
    planned = plan_requests(_phase("after the action", max_pairs, seed=2))
    states: dict[str, ServingState] = {}
    current: ServingState | None = None
    dropped = 0
    try:
        for i in range(max_pairs):
            config = read_config()
            version = str(config.get("config_version"))
            if current is None or version != current.version:
                current = states.get(version) or states.setdefault(version, ServingState.of(config, warmup))
                client.keys = current.keys
                say(f"  serving {version}: live {current.live.get('speculation')} k={current.live.get('k')}")
            if len(current.replies) >= pairs:
                break
            req = next(planned)
            order = ("live", current.nospec) if i % 2 == 0 else (current.nospec, "live")
            served = [client.send(arm, req.prompt, req.category) for arm in order]
            if str(read_config().get("config_version")) != version:
                dropped += 1
                continue
            if current.warm_left > 0:
                current.warm_left -= 1
                continue
            # By position, not by name: with speculation off both requests go to "live".
            live, base = served[order.index("live")], served[1 - order.index("live")]
            if live is not None and base is not None:
                current.replies.append((base, live))
            if len(current.replies) % 20 == 0 and current.replies:
                so_far = _pooled(split_pairs(current.replies)["client"])
                say(f"  {len(current.replies)}/{pairs} interleaved pairs; {so_far:.3f}x so far")
    finally:
        client.close()
    assert current is not None
    return {
        **current.figures(),
        "states": [state.figures() for state in states.values()],
        "pairs_dropped_at_a_change": dropped,
        "warmup_pairs_per_state": warmup,
        "requests_sent": client.sent,
        "requests_misrouted": client.misrouted,
    }


def measure(quick: bool = False) -> dict[str, Any]:
    """Run the loop once; returns the figures (see the module docstring)."""
    say = print
    warmup_requests = 8
    after_pairs = 60 if quick else 150
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

        def call(method: str, path: str, body: Any = None) -> Any:
            response = http.request(method, path, json=body)
            if response.status_code >= 400:
                raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:300]}")
            return response.json() if response.content else None

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
                    # The ladder without a GPU job: another k (only where a measured verify
                    # cost says it pays: none here), then n-gram lookup, then none.
                    "auto_realign": False,
                },
            )
            call(
                "PUT",
                f"{prefix}/adaptation-policy",
                {"standing_baseline_share": 0.05, "first_drafter": False},
            )
            time.sleep(2.5)  # the reference server caches its serving config for a second or two
            say("pays: 1/3 warm-up, speculation off (not measured)")
            TrafficDriver(serve_url, NAME, run_id=f"pays-{stamp}-0").run(
                [_phase("warm-up", warmup_requests, seed=9)]
            )
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
            before_live = _arm_ms_per_token(unprofitable, "live")
            before_nospec = _arm_ms_per_token(unprofitable, "baseline")
            summary: dict[str, Any] = {
                "unprofitable_ms_per_token": before_live,
                "unprofitable_nospec_ms_per_token": before_nospec,
                # Same phase, arms split by hash: different prompts, few on the no-speculation side.
                "unprofitable_speedup_vs_nospec": _ratio(before_nospec, before_live),
                "unprofitable_nospec_requests": _arm_requests(unprofitable, "baseline"),
                "unprofitable_hit_rate": unprofitable.hit_rate,
                "unprofitable_detected_requests": watcher.requests_at_action if acted else None,
                "requests_sent_before_action": sent[0],
                "action": acted.get("action") if acted else None,
                "action_reason": acted.get("reason") if acted else watcher.last.get("reason"),
                # What the check did and weighed (the draft-length plan's cost model included).
                "action_detail": (acted.get("history") or [{}])[-1].get("detail") if acted else None,
                # From the action's history entry: the status seen may already be a fresh test's.
                "check_ratio_at_action": (acted.get("history") or [{}])[-1].get("ratio") if acted else None,
                "check_ratio_low_at_action": acted.get("ratio_low") if acted else None,
            }
            if acted is None:
                say(f"pays: the check did not act within {DETECTION_CAP} requests")
                summary["after_action_speedup_vs_nospec"] = None
                return summary
            say(f"pays: the check acted after {watcher.requests_at_action} requests: {acted.get('action')}")
            # The router follows serving-config every second and the reference server caches it
            # for a second or two: let both see the action before pinning requests to its arms.
            time.sleep(3.0)
            say("pays: 3/3 after the action, interleaved")
            after = measure_interleaved(
                serve_url,
                lambda: call("GET", f"{prefix}/serving-config"),
                warmup=warmup_requests,
                pairs=after_pairs,
                max_pairs=3 * after_pairs,
                run_id=f"pays-{stamp}-2",
                say=say,
            )
            watcher.poll()
            summary.update(
                {
                    "after_action_speedup_vs_nospec": after["speedup"],
                    "after_action_speedup_interval_95": after["interval_95"],
                    "after_action_pair_ratio_quartiles": after.get("pair_ratio_quartiles"),
                    "after_action_share_of_prompts_live_faster": after.get("share_of_prompts_live_faster"),
                    "after_action_pairs": after["pairs"],
                    "after_action_ms_per_token": after.get("live_ms_per_token"),
                    "after_action_nospec_ms_per_token": after.get("nospec_ms_per_token"),
                    "after_action_hit_rate": after["live_hit_rate"],
                    "after_action_live_speculation": after["live_speculation"],
                    "after_action_live_k": after["live_k"],
                    "after_action_nospec_arm": after["nospec_arm"],
                    # The same pairs split by the server's own timings: decoding after the first
                    # token (where speculation acts) and the prefill (the drafter's prompt pass).
                    "after_action_decode_speedup_vs_nospec": after["server_decode"]["speedup"],
                    "after_action_decode_speedup_interval_95": after["server_decode"]["interval_95"],
                    "after_action_prefill_speedup_vs_nospec": after["server_prefill"]["speedup"],
                    "after_action_prefill_speedup_interval_95": after["server_prefill"]["interval_95"],
                    "after_action_requests_misrouted": after["requests_misrouted"],
                    # The check may act again on the measurement's own traffic: every version
                    # measured, the headline being the one in force at the end.
                    "after_action_serving_changed_during_measurement": len(after["states"]) > 1,
                    "after_action_states": after["states"],
                    "after_action_pairs_dropped_at_a_change": after["pairs_dropped_at_a_change"],
                    "after_action_method": "interleaved pairs through the router, same prompt both arms, "
                    "alternating order, one request at a time, greedy, warm (unmeasured requests first); "
                    "client ms per completion token, no speculation over live; bootstrap over prompts",
                    "after_action_serving": watcher.last.get("serving"),
                    "ladder_at_end": watcher.last.get("ladder"),
                    "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                    "quick": quick,
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
    parser.add_argument("--quick", action="store_true", help="fewer interleaved pairs after the action")
    args = parser.parse_args(argv)
    figures = measure(quick=args.quick)
    print(json.dumps(figures, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
