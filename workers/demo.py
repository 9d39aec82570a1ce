"""`controlplane demo`: the whole loop on one machine, with no human touching anything.

    python -m workers.demo [--scenario scenarios/demo.toml] [--fast] [--summary var/demo-summary.json]

It starts the service as `controlplane up` does (API, Celery worker, beat, reference server: real,
separate processes), creates a deployment that speculates with the generic drafter, and drives
traffic from the scenario file through the reference server's OpenAI-compatible API:

1. *calibration*: speculation off, a few unmeasured warm-up requests, then a few requests of each
   domain (what no speculation costs);
2. *before the shift*: the generic drafter on prose, its home ground (the drift detector's
   reference window fills here);
3. *the shift*: traffic moves to the specialised domain. The service notices the hit rate fall,
   realigns the drafter on the deployment's own traces, replays held-out prompts through three
   arms, splits live traffic between them and promotes the winner, all on its own. The demo
   only watches, through the REST API, and ends this phase when the canary has decided;
4. *after*: the same domain on the promoted drafter.

At the end it prints a summary table (hit rate and speed-up at each stage, detection delay, time
from the shift to the promotion, the canary's decision) and writes it as JSON. Speed-ups after the
shift come from the canary's own live split (the three arms interleaved on the same traffic, so
the machine's load falls on all alike); before the shift from the calibration requests.

A shift need not be whole: a phase may mix domains (scenarios/partial_shift.toml moves half the
traffic to structured requests). Each stage is then named by its mix, and the summary adds each
domain's hit rate at every stage, read back through the stats API's category filter (the traffic
driver labels every request with its domain), with its speed-up against the same domain's
no-speculation calibration.

On the embedded default (SQLite) the demo keeps its state in ``var/demo`` and starts afresh every
run; with CONTROLPLANE_DATABASE_URL / CONTROLPLANE_BROKER_URL set (PostgreSQL, Redis) it runs on
those instead, with exactly the same code path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time
import tomllib
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from controlplane.accounts.service import first_account, issue_key
from controlplane.config import Settings, get_settings
from controlplane.db.models import Role
from controlplane.db.session import unit_of_work
from controlplane.speculation_math import hit_rate, ms_per_token, speedup
from controlplane.supervisor import (
    Supervisor,
    SupervisorError,
    UpOptions,
    child_env,
    child_specs,
    local_url,
    serving_key,
    write_router_config,
)
from controlplane.timestamps import parse_utc
from workers.serve.traffic import (
    API_PATHS,
    Callbacks,
    Phase,
    PhaseReport,
    PromptLedger,
    RequestResult,
    Scenario,
    TrafficDriver,
    completion_body,
    plan_requests,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIO = ROOT / "scenarios" / "demo.toml"
POLL_S = 1.0
WARMUP_REQUESTS_PER_DOMAIN = 4
# The promoted drafter's speed-up is measured on prompts of the after phase's own (held-out) kind,
# each sent once pinned to the live arm and once to the no-speculation arm, in alternating order,
# after this many unmeasured warm-up pairs.
PAIRED_WARMUP_PAIRS = 2
# A seed offset for the paired prompts: new draws of the after phase's documents, not its requests.
PAIRED_SEED_OFFSET = 7919

# What the demo configures when the scenario's [demo] table does not say. `--fast` (the tests)
# scales the traffic down; the loop and every decision rule stay the same.
DEMO_DEFAULTS: dict[str, Any] = {
    "deployment": "demo",
    "target_model": "reference-target",
    # A folder to register target_model from first (under a model root, e.g. var/models/NAME, as
    # `make smollm2` leaves it); empty: the target is registered already (the bundled pair is).
    "target_path": "",
    "draft_model": "reference-drafter",
    "draft_token_count": 4,
    "trace_sample_rate": 1.0,
    "calibration_requests": 16,
    "paired_requests": 40,
    "max_shift_s": 900.0,
    "drift_policy": {"reference_requests": 150, "arl0_requests": 10_000, "cooldown_s": 60},
    "canary_policy": {
        "candidate_weight": 0.3,
        "baseline_weight": 0.3,
        "min_samples_per_arm": 40,
        "shadow_prompts": 16,
        "shadow_new_tokens": 48,
        "watch_requests": 100,
        "tune_draft_length": True,
    },
    "realign": {"time_budget_s": 150, "min_traces": 400, "max_wait_s": 300},
}
FAST_OVERRIDES: dict[str, Any] = {
    "calibration_requests": 6,
    "paired_requests": 32,
    "max_shift_s": 600.0,
    "drift_policy": {"reference_requests": 60, "arl0_requests": 10_000, "cooldown_s": 60},
    "canary_policy": {
        "candidate_weight": 0.3,
        "baseline_weight": 0.3,
        "min_samples_per_arm": 15,
        "shadow_prompts": 6,
        "shadow_new_tokens": 32,
        "watch_requests": 30,
        "tune_draft_length": True,
    },
    "realign": {"time_budget_s": 45, "min_traces": 120, "max_wait_s": 150},
    # Requests per phase (before, shift cap, after) and tokens per request. A scenario may set its
    # own fast-run knobs in [demo.fast] (a mixed phase splits its requests between domains, and
    # each domain's figures need enough of them; a drafter for two domains needs more training).
    # The shift ends at the decision or at max_shift_s; its count is a cap set far enough out that
    # a loaded machine, whose worker trains and replays slowly while requests keep flowing, does
    # not spend it first.
    "phase_requests": [90, 8000, 30],
    "max_tokens": 32,
}


@dataclass
class Observed:
    """What the watcher thread has seen through the API (all times are UTC epoch seconds)."""

    drift_event: dict[str, Any] | None = None
    realign_job: dict[str, Any] | None = None
    canary: dict[str, Any] | None = None
    decided: bool = False
    log: list[str] = field(default_factory=list)


class Api:
    def __init__(self, base: str, account: str, key: str, deployment: str) -> None:
        self._http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30.0)
        self.prefix = f"/v1/accounts/{account}/deployments"
        self.deployment = deployment

    def __call__(self, method: str, path: str, body: Any = None) -> Any:
        response = self._http.request(method, self.prefix + path, json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path}: HTTP {response.status_code} {response.text[:300]}")
        return response.json() if response.content else None

    def of(self, path: str) -> Any:
        return self("GET", f"/{self.deployment}{path}")

    def register_model(self, model: str, path: str) -> None:
        """Register a model from a folder, unless the account already has one of that name."""
        models = self.prefix.removesuffix("/deployments") + "/models"
        if self._http.get(f"{models}/{model}").status_code == 200:
            return
        response = self._http.post(models, json={"name": model, "path": path}, timeout=600.0)
        if response.status_code >= 400:
            raise RuntimeError(f"registering {model}: HTTP {response.status_code} {response.text[:300]}")

    def stats(self, **params: Any) -> dict[str, Any]:
        """The deployment's stats total over the filters (category, arm, drafter_version, start, end)."""
        query = {name: value for name, value in params.items() if value is not None}
        response = self._http.get(
            f"{self.prefix}/{self.deployment}/stats", params={"bucket_seconds": 3600, **query}
        )
        if response.status_code >= 400:
            raise RuntimeError(f"GET stats {query}: HTTP {response.status_code} {response.text[:300]}")
        total: dict[str, Any] = response.json()["total"]
        return total


def _epoch(iso: str | None) -> float | None:
    if not iso:
        return None
    return parse_utc(iso).timestamp()


def merge_knobs(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge_knobs(out[key], value) if nested else value
    return out


def demo_settings(base: Settings, fresh: bool) -> Settings:
    """The embedded default gets its own var/demo (wiped when fresh); a server database is used as is."""
    if not base.is_sqlite:
        return base
    var = base.var_dir / "demo"
    if fresh and var.exists():
        shutil.rmtree(var)
    var.mkdir(parents=True, exist_ok=True)
    return base.model_copy(
        update={
            "var_dir": var,
            "database_url": f"sqlite:///{var / 'controlplane.db'}",
            "broker_url": f"sqla+sqlite:///{var / 'broker.db'}",
            "result_backend_url": f"db+sqlite:///{var / 'celery-results.db'}",
            "artifact_dir": var / "artifacts",
        }
    )


def admin_key(settings: Settings) -> tuple[str, str]:
    """An admin key of the first account for the demo's own API calls (hashed like any other)."""
    with unit_of_work(settings.database_url) as session:
        account = first_account(session=session)
        if account is None:
            raise SystemExit("no account: the API did not initialise the database")
        issued = issue_key(
            session=session, account=account, name="demo-driver", role=Role.admin, secret=settings.secret_key
        )
        return account.name, issued.secret


class Watcher(threading.Thread):
    """Polls the API for the loop's progress: drift event, realignment job, canary, decision."""

    def __init__(self, api: Api, observed: Observed, say: Any) -> None:
        super().__init__(daemon=True, name="demo-watcher")
        self.api, self.observed, self.say = api, observed, say
        self.stop_event = threading.Event()
        self._seen: set[str] = set()

    def _once(self, key: str, message: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.observed.log.append(message)
            self.say(message)

    def run(self) -> None:
        while not self.stop_event.wait(POLL_S):
            try:
                self.poll()
            except Exception as exc:  # the API being slow for a moment must not end the demo
                self.say(f"  (watcher: {exc})")

    def poll(self) -> None:
        events = self.api.of("/drift-events")["drift_events"]
        if events:
            event = events[-1]
            self.observed.drift_event = event
            self._once(
                "drift",
                # The detector's rates: accepted over tried draft positions (a position is tried
                # only after the one before it was accepted), higher than the hit rate the tables
                # show (accepted over drafted).
                f"drift detected: per-position acceptance {_pct(event.get('baseline_rate'))} -> "
                f"{_pct(event.get('current_rate'))} (the detector's conditional rate, not the hit rate; "
                f"event {event.get('event_id', event.get('id'))})",
            )
        jobs = [j for j in self.api.of("/jobs")["jobs"] if j["kind"] == "realign"]
        if jobs:
            job = jobs[0]
            self.observed.realign_job = job
            self._once(f"job-{job['id']}-{job['state']}", f"realign job {job['id']}: {job['state']}")
            if job["state"] == "running":
                bucket = int(job["progress"] * 10)
                self._once(
                    f"job-{job['id']}-{bucket}",
                    f"  realign {job['progress']:.0%}: {job['progress_message']}",
                )
        canaries = self.api.of("/canaries")["canaries"]
        if canaries:
            canary = canaries[0]
            self.observed.canary = canary
            self._once(
                f"canary-{canary['canary_id']}-{canary['phase']}",
                f"canary {canary['canary_id']} (v{canary['candidate_version']} vs the incumbent): "
                f"{canary['phase']}" + (f", {canary['decision']}" if canary["decision"] else ""),
            )
            if canary["decision"] is not None:
                self.observed.decided = True


def planned_phases(scenario: Scenario, fast: bool, max_tokens: int | None, sizes: list[int]) -> list[Phase]:
    phases = list(scenario.phases)
    if len(phases) != 3:
        raise SystemExit("the demo scenario needs three [[phase]]s: before the shift, the shift, after it")
    if fast:
        phases = [
            replace(p, requests=n, max_tokens=max_tokens or p.max_tokens)
            for p, n in zip(phases, sizes, strict=True)
        ]
    return phases


def _stage(report: PhaseReport | None) -> dict[str, Any]:
    if report is None:
        return {}
    return {
        "requests": report.requests,
        "errors": report.errors,
        "hit_rate": report.hit_rate,
        "ms_per_token": report.ms_per_token,
        "tokens_per_s": report.tokens_per_s,
        "repeat_share": report.repeat_share,
        "heldout_prompt_overlap": report.heldout_prompt_overlap,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with open(args.scenario, "rb") as f:
        raw = tomllib.load(f)
    scenario = Scenario.from_dict(raw)
    knobs = merge_knobs(DEMO_DEFAULTS, raw.get("demo", {}))
    if args.fast:
        knobs = merge_knobs(knobs, FAST_OVERRIDES)
        # A scenario's own fast-run knobs ([demo.fast]) win over the defaults above.
        knobs = merge_knobs(knobs, raw.get("demo", {}).get("fast", {}))
    phases = planned_phases(scenario, args.fast, knobs.get("max_tokens"), knobs.get("phase_requests", []))
    name = str(knobs["deployment"])

    from rich.console import Console

    console = Console()
    say = console.print
    settings = demo_settings(get_settings(), fresh=not args.keep_state)
    # The worker reads its realignment knobs from the environment, like every other setting.
    os.environ["CONTROLPLANE_REALIGN_TIME_BUDGET_S"] = str(knobs["realign"]["time_budget_s"])
    os.environ["CONTROLPLANE_REALIGN_MIN_TRACES"] = str(knobs["realign"]["min_traces"])
    os.environ["CONTROLPLANE_REALIGN_MAX_WAIT_S"] = str(knobs["realign"]["max_wait_s"])
    options = UpOptions(
        serve_port=args.serve_port,
        router_port=args.router_port,
        trace_sample_rate=float(knobs["trace_sample_rate"]),
        serve_multi_row_threads=args.serve_multi_row_threads,
    )

    settings.ensure_local_dirs()
    from controlplane.bootstrap import init_account

    init_account(settings, account_name="default")
    key_file, account = serving_key(settings, None)
    write_router_config(settings, options, account=account, key_file=key_file)
    specs = {s.name: s for s in child_specs(settings, options, account=account, key_file=key_file)}
    supervisor = Supervisor(
        log_dir=settings.var_dir / "logs", env=child_env(settings), grace_s=10.0, echo=say
    )
    restore = supervisor.install_signal_handlers()
    api_url = local_url(settings.api_host, settings.api_port)
    # Traffic goes through the arm router, as a team's would: it splits the canary's arms and
    # reports every reply's acceptance; the reference server behind it serves the arm it names.
    serve_url = local_url(options.serve_host, options.router_port)
    started = time.monotonic()
    summary: dict[str, Any] = {}
    watcher: Watcher | None = None
    try:
        where = settings.database_url.split("@")[-1]
        say(f"[bold]demo[/bold]: database {where}, logs in {supervisor.log_dir}")
        supervisor.wait_ready([supervisor.start(specs["api"])])
        background = [supervisor.start(specs["worker"]), supervisor.start(specs["beat"])]
        serving = supervisor.start(specs["serve"])
        routing = supervisor.start(specs["router"])
        supervisor.wait_ready([*background, serving, routing])
        up_s = time.monotonic() - started
        say(f"all processes up in {up_s:.0f} s; dashboard: [bold]{api_url}/dashboard[/bold]")
        account, key = admin_key(settings)
        say(f"  (dashboard login key for this run: {key})")
        api = Api(api_url, account, key, name)
        if knobs.get("target_path"):
            api.register_model(knobs["target_model"], str(Path(knobs["target_path"]).resolve()))
        api(
            "POST",
            "",
            {
                "deployment_id": name,
                "target_model": knobs["target_model"],
                "disable_speculative_decoding": True,
            },
        )
        api("PATCH", f"/{name}", {"trace_sample_rate": float(knobs["trace_sample_rate"])})
        api("PATCH", f"/{name}/drift-policy", knobs["drift_policy"])
        api("PATCH", f"/{name}/canary-policy", knobs["canary_policy"])
        run_stamp = int(time.time())
        phase_count = [0]

        results: list[RequestResult] = []
        # Every prompt the run sends, by normalised hash and source document, across the phases (each
        # phase has its own driver): the repeats of earlier requests and a held-out phase's overlap
        # with everything the drafter could have trained on are counted against all of them.
        ledger = PromptLedger()

        def drive(phase: Phase, label: str, stop: Any = None) -> PhaseReport:
            count = [0, 0, 0]
            results.clear()

            def on_result(_n: int, _p: Phase, r: RequestResult) -> None:
                results.append(r)
                count[0] += 1
                count[1] += r.accepted_tokens
                count[2] += r.drafted_tokens
                if count[0] % 25 == 0:
                    hit = f"{count[1] / count[2]:.1%}" if count[2] else "-"
                    say(f"  {label}: {count[0]} requests, hit rate {hit}")

            supervisor.check_alive()
            # Request ids must be unique per deployment (ingestion is idempotent by id): a run id per phase.
            phase_count[0] += 1
            driver = TrafficDriver(
                serve_url, name, run_id=f"demo-{run_stamp}-{phase_count[0]}", ledger=ledger
            )
            reports = driver.run([phase], Callbacks(on_result=on_result), should_stop=stop)
            if not reports:
                raise SupervisorError(f"{label}: no requests were sent")
            [report] = reports
            return report

        # 1. Calibration: what no speculation costs on each domain (the speed-up denominators).
        say("[bold]1/4[/bold] calibration: speculation off")
        calibration: dict[str, PhaseReport] = {}
        domains = sorted({d for p in phases for d in p.mix})
        # A fresh server's first requests pay one-off costs (weight packing, allocator growth)
        # and the other processes are still settling: unmeasured, they made the first domain's
        # no-speculation figure up to three times its steady cost, and its speed-ups as inflated.
        drive(
            replace(
                phases[0],
                name="warm-up, speculation off",
                mix={domain: 1.0 / len(domains) for domain in domains},
                requests=WARMUP_REQUESTS_PER_DOMAIN * len(domains),
                seed=98,
            ),
            "warm-up (not measured)",
        )
        for domain in domains:
            # Requests shaped like the first phase that sends this domain (max_tokens, stop, ...).
            shaped_like = next(p for p in phases if domain in p.mix)
            calibration[domain] = drive(
                replace(
                    shaped_like,
                    name=f"no speculation, {domain}",
                    mix={domain: 1.0},
                    requests=int(knobs["calibration_requests"]),
                    seed=99,
                ),
                f"no speculation ({domain})",
            )
        # `draft_model = ""`: day 0, no drafter; the service trains the first one on its own.
        if knobs["draft_model"]:
            api(
                "PATCH",
                f"/{name}",
                {"draft_model": knobs["draft_model"], "draft_token_count": int(knobs["draft_token_count"])},
            )
            time.sleep(2.5)  # the reference server caches its serving config for a second or two

        # The held-out probe's prompts: new draws of the after phase's reserved documents. Probed
        # now (the generic drafter) and again after the promotion: the same prompts both times.
        probe_phase = replace(phases[2], seed=phases[2].seed + PAIRED_SEED_OFFSET)
        probe_before: dict[str, Any] = {}
        if knobs["draft_model"]:
            probe_before = probe_heldout(
                local_url(options.serve_host, options.serve_port),
                name,
                probe_phase,
                int(knobs["paired_requests"]),
                run_id=f"demo-{run_stamp}-probe-before",
                ledger=ledger,
            )

        # 2. Before the shift: the generic drafter on its home ground.
        say(f"[bold]2/4[/bold] {phases[0].name}: {_drafter_label(knobs)}")
        before_started = time.time()
        before = drive(phases[0], "before the shift")

        # 3. The shift: the service must notice, realign, canary and promote by itself.
        say(f"[bold]3/4[/bold] {phases[1].name}: watching the service react")
        observed = Observed()
        watcher = Watcher(api, observed, say)
        watcher.start()
        shift_started = time.time()
        deadline = time.monotonic() + float(knobs["max_shift_s"])
        shift = drive(
            phases[1],
            "after the shift",
            stop=lambda: observed.decided or time.monotonic() > deadline or bool(supervisor.stop_reason),
        )
        shift_results = list(results)
        watcher.poll()
        canary = observed.canary or {}
        promoted = canary.get("decision") == "promote"

        # 4. After: the promoted drafter on the shifted traffic.
        after = None
        heldout: dict[str, Any] = {}
        if promoted:
            time.sleep(2.5)
            say(f"[bold]4/4[/bold] {phases[2].name}: the promoted drafter")
            after = drive(phases[2], "after the promotion")
            # The same prompts as before the shift (already in the ledger: not recorded twice).
            paired = probe_heldout(
                local_url(options.serve_host, options.serve_port),
                name,
                probe_phase,
                int(knobs["paired_requests"]),
                run_id=f"demo-{run_stamp}-probe-after",
                ledger=None if probe_before else ledger,
            )
            heldout = {
                "demo_promoted_hit_rate_heldout": after.hit_rate,
                "demo_promoted_speedup_vs_nospec_heldout": paired.get("speedup_vs_nospec"),
                "heldout_prompt_overlap": (after.heldout_prompt_overlap or 0)
                + int((probe_before or paired).get("heldout_prompt_overlap") or 0),
                "paired": paired,
                "probe_before_shift": probe_before,
                # Generic minus promoted hit rate on identical held-out prompts, in points.
                "heldout_drop_points_by_domain": heldout_drops(probe_before, paired) if probe_before else {},
            }
            say(
                f"  held out (no prompt or document of these reached training; overlap "
                f"{heldout['heldout_prompt_overlap']}): hit rate {_pct(after.hit_rate)}, "
                f"{paired.get('speedup_vs_nospec') or '-'}x vs no speculation (interleaved, warm)"
            )
        else:
            say(f"[red]the canary did not promote[/red]: {canary.get('reason') or 'no decision in time'}")
        watcher.stop_event.set()
        summary = _summary(
            knobs, calibration, before, shift, after, observed, shift_started, shift_results, phases
        )
        summary.update(heldout)
        if _mixed(phases):
            try:
                summary["per_category"] = per_category_figures(
                    api, phases, calibration, before, after, observed, before_started, shift_results
                )
            except (RuntimeError, httpx.HTTPError) as exc:  # the loop's figures above still stand
                say(f"[red]per-category figures unavailable[/red]: {exc}")
                summary["per_category_error"] = str(exc)
            for stage_name, figures in summary.get("per_category", {}).items():
                summary["stages"][stage_name]["per_category"] = figures
        summary["wall_s"] = round(time.monotonic() - started, 1)
        summary["deployment"] = name
        summary["api_url"] = api_url
    except SupervisorError as exc:
        say(f"[red]error[/red]: {exc}")
        summary = {"error": str(exc)}
    finally:
        if watcher is not None:
            watcher.stop_event.set()
        supervisor.stop_all(first=("router", "serve"))
        restore()
    return summary


def _pct(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"


def probe_heldout(
    url: str, model: str, phase: Phase, pairs: int, *, run_id: str, ledger: PromptLedger | None
) -> dict[str, Any]:
    """The live arm against no speculation on ``pairs`` prompts of ``phase`` (a held-out phase):
    each prompt sent straight to the reference server twice, pinned once to the live arm and once
    to the standing no-speculation arm (``x-speculation-arm``), the order alternating from pair to
    pair, after a few unmeasured warm-up pairs. Behind the router the server neither records nor
    traces what it serves (``--no-report``), so no probe can reach a drafter's training; the same
    ``phase`` probed before the shift and after the promotion sends the very same prompts, which
    compares the generic and the promoted drafter on identical held-out requests.

    Returns the live arm's hit rate (overall and per domain: exact counts), ms per token per arm
    (summed latency / summed completion tokens) and the speed-up, with the per-pair spread. A reply
    that names another arm than the one pinned voids the figures. The prompts are recorded in
    ``ledger`` (when given) as a phase of their own, which gives their overlap with the run."""
    planned = plan_requests(phase)
    greedy = replace(phase, temperature=0.0)
    tally = ledger.open_phase(heldout=phase.heldout) if ledger is not None else None
    arms = ("live", "baseline")
    latency = dict.fromkeys(arms, 0.0)
    tokens = dict.fromkeys(arms, 0)
    counts: dict[str, list[int]] = {}  # domain -> [accepted, drafted] of the live arm
    per_prompt: list[tuple[str, int, int]] = []  # (domain, accepted, drafted) of the live arm
    ratios: list[float] = []
    with httpx.Client(timeout=120.0) as client:
        for index in range(PAIRED_WARMUP_PAIRS + pairs):
            request = next(planned)
            if ledger is not None and tally is not None:
                ledger.record(tally, request)
            order = arms if index % 2 == 0 else arms[::-1]
            measured: dict[str, tuple[float, int, int, int]] = {}
            for arm in order:
                body = completion_body(model, greedy, request)
                started = time.perf_counter()
                resp = client.post(
                    f"{url}{API_PATHS[greedy.api]}",  # chat domains go as messages
                    json=body,
                    headers={"x-speculation-arm": arm, "x-request-id": f"{run_id}-{index}-{arm}"},
                )
                elapsed = time.perf_counter() - started
                resp.raise_for_status()
                data = resp.json()
                record = data.get("speculation_record") or {}
                served = record.get("arm") or resp.headers.get("x-speculation-arm")
                if served != arm:
                    return {"error": f"pinned the {arm} arm, the server served {served!r}", "planned": index}
                measured[arm] = (
                    elapsed,
                    int((data.get("usage") or {}).get("completion_tokens") or 0),
                    int(record.get("accepted_tokens") or 0),
                    int(record.get("drafted_tokens") or 0),
                )
            if index < PAIRED_WARMUP_PAIRS:
                continue
            for arm, (elapsed, count, _, _) in measured.items():
                latency[arm] += elapsed
                tokens[arm] += count
            per_prompt.append((request.domain, measured["live"][2], measured["live"][3]))
            domain = counts.setdefault(request.domain, [0, 0])
            domain[0] += measured["live"][2]
            domain[1] += measured["live"][3]
            (baseline_s, baseline_tokens, _, _), (live_s, live_tokens, _, _) = (
                measured["baseline"],
                measured["live"],
            )
            pair = speedup(
                _wall_ms_per_token(baseline_s, baseline_tokens), _wall_ms_per_token(live_s, live_tokens)
            )
            if pair is not None:
                ratios.append(pair)
    ms = {arm: _wall_ms_per_token(latency[arm], tokens[arm]) for arm in arms}
    accepted = sum(a for a, _ in counts.values())
    drafted = sum(d for _, d in counts.values())
    ratios.sort()
    return {
        "pairs": pairs,
        "planned": PAIRED_WARMUP_PAIRS + pairs,
        "hit_rate": hit_rate(accepted, drafted),
        "by_domain": {
            d: {"hit_rate": hit_rate(a, n), "accepted_tokens": a, "drafted_tokens": n}
            for d, (a, n) in sorted(counts.items())
        },
        "per_prompt": per_prompt,
        "ms_per_token": ms,
        "speedup_vs_nospec": _speedup(ms["baseline"], ms["live"]),
        "per_pair_speedup_median": round(ratios[len(ratios) // 2], 3) if ratios else None,
        "per_pair_speedup_range": [round(ratios[0], 3), round(ratios[-1], 3)] if ratios else None,
        "heldout_prompt_overlap": ledger.figures(tally).heldout_prompt_overlap
        if ledger is not None and tally is not None
        else None,
    }


def heldout_drops(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float | None]:
    """Per domain, the generic drafter's held-out hit rate minus the promoted one's, in points, on
    the identical prompts the two probes sent (None where either drafted nothing)."""
    out: dict[str, float | None] = {}
    for domain in sorted(set(before.get("by_domain") or {}) | set(after.get("by_domain") or {})):
        was = ((before.get("by_domain") or {}).get(domain) or {}).get("hit_rate")
        now = ((after.get("by_domain") or {}).get(domain) or {}).get("hit_rate")
        out[domain] = round((was - now) * 100, 2) if was is not None and now is not None else None
    return out


def _drafter_label(knobs: dict[str, Any]) -> str:
    return "generic drafter" if knobs["draft_model"] else "no drafter yet"


def _speedup(baseline_ms_per_token: float | None, ms: float | None) -> float | None:
    value = speedup(baseline_ms_per_token, ms)
    return round(value, 3) if value is not None else None


def _wall_ms_per_token(seconds: float, tokens: int) -> float | None:
    """Wall milliseconds per token of requests timed end to end by the client (TTFT included)."""
    return ms_per_token(None, 1000.0 * seconds, None, tokens, include_ttft=True)


def mix_label(phase: Phase) -> str:
    """A phase's traffic in words: "prose", or "50% prose + 50% structured" (largest share first)."""
    if len(phase.mix) == 1:
        return next(iter(phase.mix))
    shares = sorted(phase.mix.items(), key=lambda item: (-item[1], item[0]))
    return " + ".join(f"{share:.0%} {domain}" for domain, share in shares)


def nospec_ms_per_token(report: PhaseReport, calibration: dict[str, PhaseReport]) -> float | None:
    """What the phase's tokens would have cost without speculation: each domain's calibrated ms
    per token, weighted by the tokens the phase generated in that domain (one domain: its own)."""
    weighted, tokens = 0.0, 0
    for domain, group in report.by_domain.items():
        if not group.completion_tokens:
            continue
        cost = calibration[domain].ms_per_token if domain in calibration else None
        if cost is None:
            return None  # a domain never calibrated: no fair denominator
        weighted += cost * group.completion_tokens
        tokens += group.completion_tokens
    # The calibration's figures are wall time per token: weighted by tokens, they sum to wall time.
    return ms_per_token(None, weighted, None, tokens, include_ttft=True)


def _mixed(phases: list[Phase]) -> bool:
    return any(len(phase.mix) > 1 for phase in phases)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).isoformat()


def _ms_per_token(results: list[RequestResult]) -> float | None:
    ok = [r for r in results if r.ok]
    return _wall_ms_per_token(sum(r.latency_s for r in ok), sum(r.completion_tokens for r in ok))


def per_category_figures(
    api: Api,
    phases: list[Phase],
    calibration: dict[str, PhaseReport],
    before: PhaseReport,
    after: PhaseReport | None,
    observed: Observed,
    before_started: float,
    shift_results: list[RequestResult],
) -> dict[str, dict[str, dict[str, Any]]]:
    """Each domain's hit rate at every stage, read back through the stats API's category filter,
    and its speed-up against the same domain's no-speculation calibration (client-side ms per
    token, as every other speed-up here).

    The generic drafter before the shift: the live arm from the before phase to the alarm (the
    calibration's requests draft nothing, so they do not move a hit rate). The stale drafter:
    the live arm from the alarm to the decision. The realigned drafter: the canary's candidate
    arm. The promoted drafter: the live arm at the promoted version.
    """
    canary = observed.canary or {}
    version = canary.get("candidate_version")
    detected = _epoch((observed.drift_event or {}).get("detected_at"))
    decided = _epoch(canary.get("decided_at"))
    nospec = {domain: report.ms_per_token for domain, report in calibration.items()}

    def figures(domain: str, ms_per_token: float | None, **filters: Any) -> dict[str, Any]:
        total = api.stats(category=domain, **filters)
        return {
            "hit_rate": total["hit_rate"],
            # The records the hit rate counts (those of the range's edge minutes included).
            "records": total["requests"],
            "drafted_tokens": total["drafted_tokens"],
            "speedup_vs_nospec": _speedup(nospec.get(domain), ms_per_token),
        }

    def shifted(domain: str, arm: str) -> list[RequestResult]:
        return [r for r in shift_results if r.domain == domain and r.arm == arm]

    stages: dict[str, dict[str, dict[str, Any]]] = {}
    before_end = detected or time.time()
    stages["before_shift"] = {
        domain: figures(
            domain,
            before.by_domain[domain].ms_per_token if domain in before.by_domain else None,
            arm="live",
            start=_iso(before_started),
            end=_iso(before_end),
        )
        for domain in sorted(phases[0].mix)
    }
    if detected is not None and decided is not None:
        stages["after_shift_stale"] = {
            domain: figures(
                domain,
                _ms_per_token(shifted(domain, "live")),
                arm="live",
                start=_iso(detected),
                end=_iso(decided),
            )
            for domain in sorted(phases[1].mix)
        }
    if version is not None:
        candidate_arm = f"canary:{version}"
        stages["after_realignment"] = {
            domain: figures(domain, _ms_per_token(shifted(domain, candidate_arm)), arm=candidate_arm)
            for domain in sorted(phases[1].mix)
        }
    if version is not None and after is not None:
        stages["after_promotion_live"] = {
            domain: figures(
                domain,
                after.by_domain[domain].ms_per_token if domain in after.by_domain else None,
                arm="live",
                drafter_version=version,
            )
            for domain in sorted(phases[2].mix)
        }
    return stages


def _summary(
    knobs: dict[str, Any],
    calibration: dict[str, PhaseReport],
    before: PhaseReport,
    shift: PhaseReport,
    after: PhaseReport | None,
    observed: Observed,
    shift_started: float,
    shift_results: list[RequestResult],
    phases: list[Phase],
) -> dict[str, Any]:
    home_traffic, shifted_traffic, after_traffic = (mix_label(p) for p in phases)
    canary = observed.canary or {}
    figures = (canary.get("arms") or {}).get("decision_figures") or {}
    arms = figures.get("arm_counts") or {}
    incumbent, candidate, baseline = (arms.get(a) or {} for a in ("incumbent", "candidate", "baseline"))
    event = observed.drift_event or {}
    detected = _epoch(event.get("detected_at"))
    delay = None
    if detected is not None:
        # Requests of the shifted traffic answered before the alarm was raised.
        delay = sum(1 for r in shift_results if r.ok and r.finished_at <= detected)
    decided = _epoch(canary.get("decided_at"))
    stale_live = shift.by_arm.get("live")
    stages = {
        "before_shift": {
            "what": f"{_drafter_label(knobs)} on {home_traffic}",
            **_stage(before),
            "speedup_vs_nospec": _speedup(nospec_ms_per_token(before, calibration), before.ms_per_token),
        },
        "after_shift_stale": {
            "what": f"generic (stale) drafter on {shifted_traffic}",
            "hit_rate": stale_live.hit_rate if stale_live else None,
            "requests": stale_live.requests if stale_live else 0,
            "ms_per_token": incumbent.get("ms_per_token"),
            "speedup_vs_nospec": _speedup(baseline.get("ms_per_token"), incumbent.get("ms_per_token")),
            "source": "canary live split (interleaved arms)",
        },
        "after_realignment": {
            "what": f"realigned drafter on {shifted_traffic}",
            "hit_rate": candidate.get("hit_rate"),
            "requests": candidate.get("requests"),
            "ms_per_token": candidate.get("ms_per_token"),
            "speedup_vs_nospec": _speedup(baseline.get("ms_per_token"), candidate.get("ms_per_token")),
            "speedup_vs_stale": _speedup(incumbent.get("ms_per_token"), candidate.get("ms_per_token")),
            "source": "canary live split (interleaved arms)",
        },
        "after_promotion_live": {
            "what": f"promoted drafter serving all traffic ({after_traffic})",
            **_stage(after),
            "speedup_vs_nospec": _speedup(
                nospec_ms_per_token(after, calibration) if after else None,
                after.ms_per_token if after else None,
            ),
            "source": "after phase vs the calibration's no-speculation requests",
        },
    }
    return {
        "stale_hit_rate": stages["after_shift_stale"]["hit_rate"],
        # The canary's candidate arm ran at the stale drafter's k: the two hit rates compare. After
        # the promotion the tuner's k serves, and hit rate (accepted / drafted) depends on k.
        "realigned_hit_rate": candidate.get("hit_rate"),
        "promoted_live_hit_rate": after.hit_rate if after else None,
        "speedup_vs_nospec": stages["after_realignment"]["speedup_vs_nospec"],
        "speedup_vs_stale": stages["after_realignment"]["speedup_vs_stale"],
        "stale_speedup_vs_nospec": stages["after_shift_stale"]["speedup_vs_nospec"],
        "detection_delay_requests": delay,
        "shift_to_promotion_s": round(decided - shift_started, 1)
        if decided and canary.get("decision") == "promote"
        else None,
        "decision": canary.get("decision"),
        "decision_reason": canary.get("reason"),
        "chosen_k": (figures.get("draft_length") or {}).get("best_k"),
        "stages": stages,
        "events": observed.log,
        "calibration": {d: _stage(r) for d, r in calibration.items()},
        "knobs": knobs,
    }


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if "error" in summary:
        console.print(f"[red]demo failed[/red]: {summary['error']}")
        return

    def pct(v: Any) -> str:
        return f"{v:.1%}" if isinstance(v, int | float) else "-"

    def x(v: Any) -> str:
        return f"{v:.2f}x" if isinstance(v, int | float) else "-"

    table = Table(title="demo summary (measured on this machine)")
    for column in ("stage", "hit rate", "ms / token", "vs no speculation", "vs stale drafter"):
        table.add_column(column)
    for stage in summary["stages"].values():
        ms = stage.get("ms_per_token")
        table.add_row(
            stage["what"],
            pct(stage.get("hit_rate")),
            f"{ms:.2f}" if isinstance(ms, int | float) else "-",
            x(stage.get("speedup_vs_nospec")),
            x(stage.get("speedup_vs_stale")),
        )
    console.print(table)
    if summary.get("per_category"):
        by_category = Table(title="per request category (hit rate from the stats API's category filter)")
        for column in ("stage", "category", "hit rate", "records", "vs no speculation"):
            by_category.add_column(column)
        for stage_name, domains in summary["per_category"].items():
            for domain, figures in domains.items():
                by_category.add_row(
                    summary["stages"][stage_name]["what"],
                    domain,
                    pct(figures.get("hit_rate")),
                    str(figures.get("records")),
                    x(figures.get("speedup_vs_nospec")),
                )
        console.print(by_category)
    console.print(
        f"detection delay: {summary['detection_delay_requests']} requests after the shift; "
        f"shift to promotion: {summary['shift_to_promotion_s']} s; canary decision: {summary['decision']}"
        f" (k chosen: {summary['chosen_k']})\n  why: {summary['decision_reason']}"
    )
    if "demo_promoted_hit_rate_heldout" in summary:
        paired = summary.get("paired") or {}
        console.print(
            f"promoted drafter on held-out documents (overlap with everything sent before: "
            f"{summary['heldout_prompt_overlap']}): "
            f"hit rate {pct(summary['demo_promoted_hit_rate_heldout'])}, "
            f"{x(summary['demo_promoted_speedup_vs_nospec_heldout'])} vs no speculation "
            f"({paired.get('pairs')} prompts, live and no-speculation arms interleaved and warm"
            + (f"; {paired['error']}" if paired.get("error") else "")
            + ")"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="controlplane demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", type=Path, default=DEFAULT_SCENARIO, help="the traffic scenario (TOML)")
    ap.add_argument("--fast", action="store_true", help="a smaller run for tests (same loop, less traffic)")
    ap.add_argument("--summary", type=Path, default=None, help="where to write the summary JSON")
    ap.add_argument("--serve-port", type=int, default=8601, help="the reference server's port")
    ap.add_argument("--router-port", type=int, default=8700, help="the arm router's port (traffic goes here)")
    ap.add_argument("--keep-state", action="store_true", help="reuse var/demo instead of starting afresh")
    ap.add_argument(
        "--serve-multi-row-threads",
        type=int,
        default=None,
        help="torch threads the reference server's verify passes may try, timed as it serves "
        "(default: its own share; more pays only on a machine nothing else keeps busy)",
    )
    args = ap.parse_args(argv)
    if args.serve_multi_row_threads is not None and args.serve_multi_row_threads < 1:
        ap.error("--serve-multi-row-threads must be at least 1")
    summary = run(args)
    settings = get_settings()
    path = args.summary or (settings.var_dir / "demo-summary.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print_summary(summary)
    print(f"summary written to {path}")
    raise SystemExit(1 if "error" in summary or summary.get("decision") != "promote" else 0)


if __name__ == "__main__":
    main()
