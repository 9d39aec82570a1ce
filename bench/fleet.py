"""Fleet simulator: how much edge-aggregated traffic the drift pipeline keeps up with on this machine.

What runs is the product's own path on the machine's PostgreSQL: edges post one ``edge-window/v1``
body per window to two API processes side by side (``POST /v1/accounts/{account}/aggregates``),
the drift monitor's set-based pass (controlplane.drift.aggregate_monitor.monitor_aggregates, the
code the ``drift.monitor_aggregates`` Celery task runs) loops in one process per shard, and the
rollup fold of edge windows runs beside them. Simulated minutes are compressed: minute m+1 of a
step is sent ``interval`` real seconds after minute m, so a step's offered load is
``deployments x rps x 60 / interval`` requests per real second.

Capacity: the load is stepped. After ``WARMUP_MINUTES`` unmeasured minutes (the first windows
fill and freeze every detector's reference window), each step sends ``--step-minutes`` minutes at
one interval (fewer, never under two, where that would take over ``STEP_BUDGET_S``), then waits
for the pipeline to drain. Coarse steps halve the interval (double the
load) from ``--interval`` until a step fails (or double it while the first steps fail); then
``--refine`` steps bisect (geometrically) between the highest passing and lowest failing load. A
step passes when its windows' lag p99 is at most ``LAG_LIMIT_S``: a window's lag runs from when it
was due (its end in compressed time, not when the post got through, so a backed-up ingest counts)
to the end of the pass of the last monitor shard that consumed it; a window not consumed by every
shard of its deployments within ``OBSERVE_S`` of the step's last due time counts as infinitely
late. ``fleet_capacity_requests_per_s`` is the highest passing step's offered load. The pipeline's
work is per window aggregate, not per request, so the load is also given in aggregates per second
and as the deployments that many aggregates serve at one window a minute (requests per second
scale with each deployment's rate at the same work).

Traffic: per deployment a prose/code mix (code 20%), mean position-0 acceptance per category,
each request's acceptance rate drawn from Beta(m kappa, (1 - m) kappa) around that mean
(overdispersion, concentration 20), decaying by 0.97 per position, k = 4, 1 + Poisson(20) verify
steps, each position tried in the steps where the previous one was accepted. Every request of
every window is drawn, and its window sums (counts and the position cross-products) are summed
from those requests, so the detector sees what the traffic made, not its own model. Drift (a
10-25% relative drop of every position) is injected into 1% of deployments at random times
early in the run, a mix shift (code 20% -> 60%, no drafter change) into another 1%.

The detector's delay on aggregates vs on per-request data (same ARL0, same drifts) is measured
offline on per-request streams of the drifted deployments' models, both ways.
``production_threshold_arl0_ratio`` and ``production_delay_ratio_vs_oracle`` come from
bench/drift.py's results (it calibrates the running threshold on its stream families); this
script copies them when bench/results/drift.json exists and says so otherwise.

Writes bench/results/fleet.json. Usage:
  .venv/bin/python bench/fleet.py [--deployments 10000] [--interval 60] [--step-minutes 3]
      [--refine 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from sqlalchemy import create_engine, select, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import api_process  # noqa: E402
from controlplane.accounts.service import Principal, create_account, issue_key  # noqa: E402
from controlplane.config import Settings  # noqa: E402
from controlplane.db.migrate import upgrade_to_head  # noqa: E402
from controlplane.db.models import Deployment, DriftEvent, DriftMonitorState, Role  # noqa: E402
from controlplane.db.session import get_sessionmaker  # noqa: E402
from controlplane.deployments.service import create_deployment  # noqa: E402
from controlplane.deployments.spec import SpeculationRequest  # noqa: E402
from controlplane.drift import MixtureSR  # noqa: E402
from controlplane.ingest.aggregates import FORMAT, upper_triangle  # noqa: E402
from controlplane.models.service import register_reference_models  # noqa: E402

PG_SERVER = os.environ.get("BENCH_PG_SERVER", "postgresql+psycopg://postgres@127.0.0.1:5432")
BENCH_DB = "controlplane_fleet"
SECRET = "fleet-bench-secret"
RESULTS = ROOT / "bench" / "results"
K = 4
MEAN_STEPS = 20
CATEGORIES = ("prose", "code")
CODE_SHARE = 0.2
CODE_SHARE_AFTER = 0.6
KAPPA = 20.0
DECAY = 0.97
# A fleet-scale false-alarm budget: 10^8 requests is 11.6 days of a 100 requests/s deployment.
ARL0 = 100_000_000
REFERENCE = 5_000
MIN_DROP = 0.03
WINDOW_S = 60
# Minutes whose windows fill and freeze every deployment's reference window, before any step.
WARMUP_MINUTES = 2
# Drifts and mix shifts start between these simulated minutes (after the reference windows).
CHANGE_MINUTES = (2, 6)
LAG_LIMIT_S = 10.0
# How long after a step's last window was due its windows may still be consumed (a longer wait
# only turns an infinite lag into a finite one above the limit: the verdict is the same).
OBSERVE_S = 30.0
# How long the pipeline gets to work off a step's backlog before the next step starts.
DRAIN_S = 180.0
# A step at a long interval sends fewer minutes (never under two), so that slow steps stay short.
STEP_BUDGET_S = 240.0
# The simulated clock starts this long ago: every window of a run must have ended before now.
SIMULATED_HOURS_BACK = 3
# (t0, s0..s3) per request, summed into the window's x = (s0..s3, t0..t3) with t_{i+1} = s_i.
_X_ORDER = [1, 2, 3, 4, 0, 1, 2, 3]


# ------------------------------------------------------------------------------------ traffic


def request_counts(p_mean: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One request per entry of ``p_mean`` (its mean acceptance of position 0): (t0, s0..s3), shape
    ``p_mean.shape + (K + 1,)``. Per-request rate Beta(m kappa, (1 - m) kappa), decaying by DECAY
    per position; 1 + Poisson(MEAN_STEPS) verify steps; position i is tried in the steps where
    i - 1 was accepted."""
    m = np.clip(p_mean, 0.02, 0.98)
    rate = rng.beta(m * KAPPA, (1.0 - m) * KAPPA)
    x = np.empty((*p_mean.shape, K + 1), dtype=np.int64)
    tried = 1 + rng.poisson(MEAN_STEPS, size=p_mean.shape)
    x[..., 0] = tried
    for i in range(K):
        tried = rng.binomial(tried, np.clip(rate * DECAY**i, 0.0, 1.0))
        x[..., i + 1] = tried
    return x


def simulate_requests(p_mean: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` requests per row of ``p_mean``: successes and trials, shape (rows, n, K)."""
    x = request_counts(np.repeat(p_mean[:, None], n, axis=1), rng)
    s = x[..., 1:].astype(float)
    t = np.concatenate([x[..., :1], x[..., 1:K]], axis=2).astype(float)
    return s, t


@dataclass(frozen=True)
class FleetModel:
    """Per-deployment acceptance means, and which deployments drift or shift their mix, and when."""

    p_prose: np.ndarray
    p_code: np.ndarray
    drifted: np.ndarray
    mixed: np.ndarray
    change_at_s: np.ndarray  # simulated seconds; inf where nothing changes
    drop: np.ndarray
    seed: int

    @classmethod
    def draw(cls, deployments: int, seed: int) -> FleetModel:
        rng = np.random.default_rng(seed)
        p_prose = rng.uniform(0.65, 0.88, deployments)
        p_code = p_prose * rng.uniform(0.6, 0.8, deployments)
        n_changed = max(1, deployments // 100)
        order = rng.permutation(deployments)
        drifted, mixed = np.sort(order[:n_changed]), np.sort(order[n_changed : 2 * n_changed])
        change_at_s = np.full(deployments, np.inf)
        low, high = (m * WINDOW_S for m in CHANGE_MINUTES)
        change_at_s[drifted] = rng.uniform(low, high, n_changed)
        change_at_s[mixed] = rng.uniform(low, high, n_changed)
        drop = np.zeros(deployments)
        drop[drifted] = rng.uniform(0.10, 0.25, n_changed)
        return cls(p_prose, p_code, drifted, mixed, change_at_s, drop, seed)

    @property
    def n(self) -> int:
        return len(self.p_prose)


@dataclass
class WindowSums:
    """One simulated minute of every deployment: requests, sum x and sum x x' per category."""

    requests: np.ndarray  # (deployments, 2)
    sx: np.ndarray  # (deployments, 2, 2K)
    sxx: np.ndarray  # (deployments, 2, 2K, 2K)


def draw_window_sums(
    model: FleetModel, minute: int, rps: int, rows: Sequence[int] | None = None, chunk: int = 64
) -> WindowSums:
    """Every request of ``minute`` for the deployments ``rows`` (default all), summed per
    category. Each chunk of deployments draws from its own stream, seeded by the run's seed, the
    minute and the chunk's first deployment, so a minute is the same whichever process draws it."""
    rows = list(range(model.n)) if rows is None else list(rows)
    n = rps * WINDOW_S
    start = minute * WINDOW_S
    mixed = np.isin(np.arange(model.n), model.mixed)
    out = WindowSums(
        np.zeros((len(rows), 2), np.int64),
        np.zeros((len(rows), 2, 2 * K), np.int64),
        np.zeros((len(rows), 2, 2 * K, 2 * K), np.int64),
    )
    for at in range(0, len(rows), chunk):
        ids = np.asarray(rows[at : at + chunk])
        rng = np.random.default_rng([model.seed, minute, int(ids[0])])
        after = start + rng.random((len(ids), n)) * WINDOW_S >= model.change_at_s[ids, None]
        share = np.where(mixed[ids, None] & after, CODE_SHARE_AFTER, CODE_SHARE)
        code = rng.random((len(ids), n)) < share
        p_mean = np.where(code, model.p_code[ids, None], model.p_prose[ids, None])
        p_mean = p_mean * np.where(after, 1.0 - model.drop[ids, None], 1.0)
        x = request_counts(p_mean, rng).astype(np.float64)  # float: BLAS sums, exact below 2^53
        whole_sx, whole_sxx = x.sum(axis=1), np.matmul(x.transpose(0, 2, 1), x)
        xc = x * code[:, :, None]
        code_sx, code_sxx = xc.sum(axis=1), np.matmul(xc.transpose(0, 2, 1), x)
        part = slice(at, at + len(ids))
        for c, (sx, sxx, count) in enumerate(
            (
                (whole_sx - code_sx, whole_sxx - code_sxx, n - code.sum(axis=1)),
                (code_sx, code_sxx, code.sum(axis=1)),
            )
        ):
            out.requests[part, c] = count
            out.sx[part, c] = np.rint(sx[:, _X_ORDER])
            out.sxx[part, c] = np.rint(sxx[:, _X_ORDER][:, :, _X_ORDER])
    return out


def latency_sketch(seed: int) -> dict[str, Any]:
    from ddsketch import DDSketch

    from controlplane.ingest.aggregates import SKETCH_RELATIVE_ACCURACY, sketch_to_dict

    sketch = DDSketch(relative_accuracy=SKETCH_RELATIVE_ACCURACY)
    for v in np.random.default_rng(seed).lognormal(math.log(12.0), 0.3, 2_000):
        sketch.add(float(v))
    return {"inter_token_ms": sketch_to_dict(sketch)}


def aggregate_body(
    name: str, c: int, n: int, sx: np.ndarray, sxx: np.ndarray, latency: dict[str, Any]
) -> dict[str, Any]:
    s, t = sx[:K], sx[K:]
    steps = int(t[0])
    accepted = int(s.sum())
    return {
        "deployment": name,
        "arm": "live",
        "category": CATEGORIES[c],
        "requests": n,
        "drafted_tokens": K * steps,
        "accepted_tokens": accepted,
        "verify_steps": steps,
        "generated_tokens": accepted + steps,
        "prompt_tokens": 0,
        "speculated_requests": n,
        "accepted_per_position": [int(v) for v in s],
        "reached_per_position": [int(v) for v in t],
        "position_moments": upper_triangle(sxx.tolist()),
        "latency": latency,
    }


@dataclass
class MinuteBodies:
    """One simulated minute as the edges send it: a body per edge, and the aggregates in them."""

    bodies: list[bytes]
    aggregates: int


def edge_bodies(
    model: FleetModel, minute: int, rps: int, edges: int, sim_start: datetime, latency: dict[str, Any]
) -> MinuteBodies:
    """One ``edge-window/v1`` body per edge for ``minute`` (edge e holds deployments d % edges == e)."""
    sums = draw_window_sums(model, minute, rps)
    bodies = []
    count = 0
    for e in range(edges):
        aggregates = [
            aggregate_body(f"fleet-{d}", c, int(sums.requests[d, c]), sums.sx[d, c], sums.sxx[d, c], latency)
            for d in range(e, model.n, edges)
            for c in range(2)
            if sums.requests[d, c] > 0
        ]
        body = {
            "format": FORMAT,
            "edge_id": f"edge-{e}",
            "window_start": (sim_start + timedelta(minutes=minute)).isoformat(),
            "window_s": WINDOW_S,
            "aggregates": aggregates,
        }
        bodies.append(orjson.dumps(body))
        count += len(aggregates)
    return MinuteBodies(bodies, count)


def _bodies_job(args: tuple[FleetModel, int, int, int, datetime, dict[str, Any]]) -> MinuteBodies:
    return edge_bodies(*args)


# --------------------------------------------------------------------------------- load steps


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (infinite values sort last); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)]


def window_lags(
    due: dict[int, float],
    consumed: dict[int, dict[int, float]],
    needed: dict[int, frozenset[int]],
    until: float,
) -> dict[int, float]:
    """Each window's lag: from when it was due to the end of the last pass of a shard it needed,
    infinite when some shard it needed had not consumed it by ``until``."""
    lags = {}
    for window, due_at in due.items():
        passes = consumed.get(window, {})
        ends = [passes.get(shard) for shard in needed[window]]
        done = [end for end in ends if end is not None and end <= until]
        lags[window] = max(done) - due_at if len(done) == len(ends) and done else math.inf
    return lags


def _bracket(history: Sequence[tuple[float, bool]]) -> tuple[float, float] | None:
    passed = [i for i, ok in history if ok]
    if not passed:
        return None
    best = min(passed)
    failed = [i for i, ok in history if not ok and i < best]
    return (best, max(failed)) if failed else None


@dataclass
class LoadSearch:
    """Steps the interval (real seconds per simulated minute): coarse steps by ``factor`` from
    ``start`` (down while steps pass, up while they fail), then ``refine`` geometric bisections
    between the highest passing and the lowest failing load, within [min_interval, max_interval]."""

    start: float
    refine: int
    factor: float = 2.0
    min_interval: float = 0.25
    max_interval: float = 480.0
    history: list[tuple[float, bool]] = field(default_factory=list)

    def record(self, interval: float, passed: bool) -> None:
        self.history.append((interval, passed))

    def bracket(self) -> tuple[float, float] | None:
        """(shortest passing interval, longest failing interval shorter than it), when both exist."""
        return _bracket(self.history)

    def next_interval(self) -> float | None:
        """The next interval to try, None when the search is done."""
        if not self.history:
            return self.start
        bracket = self.bracket()
        if bracket is None:
            passed = [i for i, ok in self.history if ok]
            if passed:  # every step so far passed (or failed only at lower loads): go faster
                following = min(passed) / self.factor
                return following if following >= self.min_interval else None
            following = max(i for i, _ in self.history) * self.factor
            return following if following <= self.max_interval else None
        formed_at = next(n for n in range(len(self.history)) if _bracket(self.history[: n + 1]))
        if len(self.history) - 1 - formed_at >= self.refine:
            return None
        return math.sqrt(bracket[0] * bracket[1])

    def capacity_interval(self) -> float | None:
        passed = [i for i, ok in self.history if ok]
        return min(passed) if passed else None

    def capacity_is_lower_bound(self) -> bool:
        """True when no load above the highest passing one failed (the search hit its floor)."""
        return self.capacity_interval() is not None and self.bracket() is None


# ----------------------------------------------------------------------------------- database


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prepare_database() -> str:
    url = f"{PG_SERVER}/{BENCH_DB}"
    admin = create_engine(f"{PG_SERVER}/test", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": BENCH_DB}):
            conn.execute(text(f"DROP DATABASE {BENCH_DB} WITH (FORCE)"))
        conn.execute(text(f"CREATE DATABASE {BENCH_DB}"))
    admin.dispose()
    upgrade_to_head(url)
    return url


def create_fleet(url: str, deployments: int) -> tuple[str, dict[str, int]]:
    """The bench account, its serving key and ``deployments`` deployments (one made by the service,
    the rest copied from it in one statement)."""
    with get_sessionmaker(url)() as session:
        register_reference_models(session=session, settings=Settings(database_url=url, secret_key=SECRET))
        account, issued = create_account(session=session, name="fleet", secret=SECRET)
        serving = issue_key(session=session, account=account, name="edges", role=Role.serving, secret=SECRET)
        principal = Principal(issued.key.id, "admin", Role.admin, account.id, "fleet")
        template = create_deployment(
            session=session,
            principal=principal,
            target_model="reference-target",
            speculation=SpeculationRequest(draft_model="reference-drafter", draft_token_count=K),
            name="fleet-0",
        )
        template.drift_policy = {"arl0_requests": ARL0, "reference_requests": REFERENCE, "min_drop": MIN_DROP}
        session.flush()
        columns = [c.name for c in Deployment.__table__.columns if c.name not in ("id", "name")]
        listed = ", ".join(columns)
        session.execute(
            text(
                f"INSERT INTO deployments (name, {listed}) "
                f"SELECT 'fleet-' || g, {listed} FROM deployments, generate_series(1, :n) AS g WHERE id = :t"
            ),
            {"n": deployments - 1, "t": template.id},
        )
        session.commit()
        ids = {name: int(i) for i, name in session.execute(select(Deployment.id, Deployment.name))}
        return serving.secret, ids


def start_api(url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    return api_process.start_api(
        url,
        port,
        log,
        secret=SECRET,
        env={
            "CONTROLPLANE_DRIFT_ENQUEUE_ON_INGEST": "false",
            "CONTROLPLANE_RATE_LIMIT_PER_MINUTE": "1000000",
        },
        what="API",
    )


# ------------------------------------------------------------------------------------ monitor


def monitor_loop(url: str, shard: int, shards: int, stop: Any, out: Any) -> None:
    """One shard's monitor, as the Celery task runs it, in a loop; reports each pass."""
    from controlplane.drift.aggregate_monitor import DetectorCache
    from controlplane.errors import ConflictError
    from controlplane.loop.drift import monitor_aggregates

    settings = Settings(database_url=url, environment="test", secret_key=SECRET)
    factory = get_sessionmaker(url)
    cache = DetectorCache()
    while not stop.is_set():
        started = time.time()
        session = factory()
        try:
            outcome = monitor_aggregates(
                session=session, settings=settings, shard=shard, shards=shards, cache=cache
            )
            session.commit()
            outcome.commit(cache)
        except ConflictError:
            session.rollback()
            out.put(("conflict", shard, started, time.time()))
            continue
        finally:
            session.close()
        done = time.time()
        if outcome.windows:
            out.put(
                (
                    "pass",
                    shard,
                    started,
                    done,
                    outcome.deployments,
                    outcome.windows,
                    outcome.requests,
                    sorted(outcome.edge_window_ids),
                )
            )
        if done - started < 0.5:
            time.sleep(0.5 - (done - started))


def rollup_loop(url: str, stop: Any, out: Any) -> None:
    """The rollup fold of edge windows (what the ``acceptance.rollup_aggregates`` task runs)."""
    from controlplane.ingest.aggregate_rollups import fold_aggregate_rollups

    factory = get_sessionmaker(url)
    while not stop.is_set():
        started = time.time()
        with factory() as session:
            fold = fold_aggregate_rollups(session=session)
            session.commit()
        if fold.windows:
            out.put(("rollup", started, time.time(), fold.windows, fold.as_dict().get("aggregates", 0)))
        else:
            time.sleep(1.0)


# -------------------------------------------------------------------------------- per request


def delay_comparison(traffic: FleetModel, rps: int, rng: np.random.Generator) -> dict[str, Any]:
    """Delay in requests of the same detector fed per request vs per window, on exact per-request
    streams of the drifted deployments' models (same change points as in the fleet run)."""
    window = rps * WINDOW_S
    per_request: list[float] = []
    per_window: list[float] = []
    same_cadence: list[float] = []
    missed = 0
    for d in traffic.drifted:
        change = int(traffic.change_at_s[d] * rps)
        horizon = change + 8 * window
        p_before = np.array([traffic.p_prose[d], traffic.p_code[d]])
        p_after = p_before * (1.0 - traffic.drop[d])
        s_b, t_b = simulate_requests(p_before, horizon, rng)
        s_a, t_a = simulate_requests(p_after, horizon, rng)
        code = rng.random(horizon) < CODE_SHARE
        after = np.arange(horizon) >= change
        cat = code.astype(int)
        s = np.where(after[:, None], s_a[cat, np.arange(horizon)], s_b[cat, np.arange(horizon)])
        t = np.where(after[:, None], t_a[cat, np.arange(horizon)], t_b[cat, np.arange(horizon)])
        names = [CATEGORIES[c] for c in cat]
        config = {"arl0": float(ARL0), "reference_size": REFERENCE, "min_drop": MIN_DROP, "n_positions": K}
        one = MixtureSR(**config)
        alarm_request = None
        from controlplane.drift import RequestObservation

        for i in range(horizon):
            one.update(
                RequestObservation.from_counts(
                    k=K,
                    verify_steps=int(t[i, 0]),
                    accepted_per_position=[int(v) for v in s[i]],
                    drafted_tokens=K * int(t[i, 0]),
                    accepted_tokens=int(s[i].sum()),
                    category=names[i],
                )
            )
            if one.drift_detected:
                alarm_request = i
                break
        windowed = MixtureSR(**config)
        alarm_window_end = None
        x = np.concatenate([s, t], axis=1)
        for w0 in range(0, horizon, window):
            groups = []
            for c, name in enumerate(CATEGORIES):
                rows = x[w0 : w0 + window][cat[w0 : w0 + window] == c]
                if len(rows):
                    groups.append((name, len(rows), rows.sum(axis=0), rows.T @ rows))
            windowed.update_window(groups)
            if windowed.drift_detected:
                alarm_window_end = min(horizon, w0 + window) - 1
                break
        if alarm_request is None or alarm_window_end is None or alarm_request < change:
            missed += 1
            continue
        per_request.append(alarm_request - change + 1)
        per_window.append(alarm_window_end - change + 1)
        # The per-request detector fed at the same cadence acts at the end of its alarm's window.
        same_cadence.append((alarm_request // window + 1) * window - change)
    mean = statistics.fmean
    return {
        "drifts": int(len(traffic.drifted)),
        "missed_or_early": missed,
        "delay_per_request_mean": mean(per_request) if per_request else None,
        "delay_per_window_mean": mean(per_window) if per_window else None,
        "delay_same_cadence_mean": mean(same_cadence) if same_cadence else None,
        "ratio": (mean(per_window) / mean(per_request)) if per_request else None,
        "ratio_same_cadence": (mean(per_window) / mean(same_cadence)) if same_cadence else None,
    }


# --------------------------------------------------------------------------------------- main


class PassCollector(threading.Thread):
    """Reads the monitors' reports: every pass, and when each shard consumed each edge window."""

    def __init__(self, passes: Any) -> None:
        super().__init__(daemon=True, name="pass-collector")
        self.passes = passes
        self.lock = threading.Lock()
        self.log: list[tuple[Any, ...]] = []
        self.consumed: dict[int, dict[int, float]] = {}
        self.conflicts = 0
        self.last_report = time.time()
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                item = self.passes.get(timeout=0.5)
            except queue.Empty:
                continue
            with self.lock:
                self.last_report = time.time()
                if item[0] == "conflict":
                    self.conflicts += 1
                    continue
                self.log.append(item)
                shard, done = item[1], item[3]
                for window in item[7]:
                    by_shard = self.consumed.setdefault(window, {})
                    by_shard[shard] = max(by_shard.get(shard, 0.0), done)

    def snapshot(self) -> dict[int, dict[int, float]]:
        with self.lock:
            return {w: dict(s) for w, s in self.consumed.items()}


@dataclass
class Posted:
    step: int
    minute: int
    edge: int
    due: float
    window_id: int | None = None
    error: str | None = None
    finished: bool = False
    posted_at: float | None = None  # when the API answered 200


@dataclass
class StepResult:
    number: int
    interval_s: float
    minutes: list[int]
    offered_requests_per_s: float
    offered_aggregates_per_s: float
    windows: int
    lag_p50_s: float | None
    lag_p99_s: float | None
    # Where the lag goes: due to accepted by the API, and accepted to consumed by every shard.
    ingest_p99_s: float | None
    consume_p99_s: float | None
    unconsumed_windows: int
    post_errors: int
    monitor_cycle_p50_s: float | None
    monitor_cycle_p99_s: float | None
    drained_s: float | None
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for key in ("lag_p50_s", "lag_p99_s", "consume_p99_s"):  # JSON has no infinity: None
            value = out[key]
            out[key] = None if value is None or math.isinf(value) else round(value, 3)
        out["lag_infinite"] = self.lag_p99_s is not None and math.isinf(self.lag_p99_s)
        return out


class Fleet:
    """The running pipeline and the edges posting to it."""

    def __init__(self, args: argparse.Namespace, model: FleetModel, key: str, ids: dict[str, int]) -> None:
        self.args, self.model = args, model
        self.ports = [free_port(), free_port()]
        self.client = httpx.Client(
            timeout=300.0,
            headers={"Authorization": f"Bearer {key}"},
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
        )
        self.posted: list[Posted] = []
        self.threads: list[threading.Thread] = []
        self.sim_start = datetime.fromtimestamp((int(time.time()) // 3600 - SIMULATED_HOURS_BACK) * 3600, UTC)
        self.latency = latency_sketch(args.seed)
        # The monitor shards each edge's window must be consumed by (deployment id % shards).
        self.needed_by_edge = [
            frozenset(ids[f"fleet-{d}"] % args.shards for d in range(e, model.n, args.edges))
            for e in range(args.edges)
        ]
        self.next_minute = 0
        self.pool = mp.get_context("spawn").Pool(args.build_processes) if args.build_processes > 1 else None

    def build(self, minutes: int) -> list[MinuteBodies]:
        """The next ``minutes`` simulated minutes' edge bodies (built before the step: not timed)."""
        jobs = [
            (self.model, m, self.args.rps, self.args.edges, self.sim_start, self.latency)
            for m in range(self.next_minute, self.next_minute + minutes)
        ]
        self.next_minute += minutes
        if self.pool is not None:
            return list(self.pool.map(_bodies_job, jobs))
        return [_bodies_job(job) for job in jobs]

    def _post(self, record: Posted, body: bytes) -> None:
        port = self.ports[record.edge % len(self.ports)]
        try:
            response = self.client.post(
                f"http://127.0.0.1:{port}/v1/accounts/fleet/aggregates",
                content=body,
                headers={"Content-Type": "application/json"},
            )
            if response.status_code == 200:
                record.window_id = int(response.json()["edge_window_id"])
                record.posted_at = time.time()
            else:
                record.error = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            record.error = repr(exc)
        record.finished = True

    def send(self, step: int, first_minute: int, bodies: list[MinuteBodies], interval: float) -> list[Posted]:
        """Post each minute's bodies when due (``interval`` apart), each in its own thread, so a
        slow ingest delays nothing but its own windows (whose lag counts from when they were due)."""
        start = time.time() + 0.2
        records = []
        for j, minute_bodies in enumerate(bodies):
            due = start + j * interval
            time.sleep(max(0.0, due - time.time()))
            for e, body in enumerate(minute_bodies.bodies):
                record = Posted(step, first_minute + j, e, due)
                thread = threading.Thread(target=self._post, args=(record, body), daemon=True)
                thread.start()
                self.threads.append(thread)
                records.append(record)
        self.posted.extend(records)
        return records

    def close(self) -> None:
        for thread in self.threads:
            thread.join(timeout=60)
        self.client.close()
        if self.pool is not None:
            self.pool.terminate()


def settle(
    records: list[Posted], collector: PassCollector, needed: list[frozenset[int]], until: float
) -> bool:
    """Wait until every record is posted and consumed by every shard it needs, or ``until``."""
    while time.time() < until:
        consumed = collector.snapshot()
        if all(
            r.finished
            and (
                r.error is not None
                or (r.window_id is not None and needed[r.edge] <= set(consumed.get(r.window_id, {})))
            )
            for r in records
        ):
            return True
        time.sleep(0.25)
    return False


def run_step(
    fleet: Fleet, collector: PassCollector, number: int, interval: float, minutes: int
) -> StepResult:
    """One load step: build, send at ``interval``, observe, drain (see the module docstring)."""
    args = fleet.args
    first = fleet.next_minute
    t0 = time.perf_counter()
    bodies = fleet.build(minutes)
    built_s = time.perf_counter() - t0
    records = fleet.send(number, first, bodies, interval)
    last_due = max(r.due for r in records)
    observe_until = last_due + OBSERVE_S
    settle(records, collector, fleet.needed_by_edge, observe_until)
    consumed = collector.snapshot()
    due = {}
    needed = {}
    lags: list[float] = []
    for r in records:
        if r.window_id is None:
            lags.append(math.inf)  # not posted (error or still in flight): never consumed in time
            continue
        due[r.window_id] = r.due
        needed[r.window_id] = fleet.needed_by_edge[r.edge]
    by_window = window_lags(due, consumed, needed, observe_until)
    lags.extend(by_window.values())
    ingest = [r.posted_at - r.due for r in records if r.posted_at is not None]
    consume = [
        by_window[r.window_id] - (r.posted_at - r.due)
        for r in records
        if r.window_id is not None and r.posted_at is not None
    ]
    drain_started = time.time()
    drained = settle(fleet.posted, collector, fleet.needed_by_edge, drain_started + DRAIN_S)
    # Quiet monitors: the last pass before the next step has reported.
    time.sleep(2.0)
    with collector.lock:
        cycles = [p[3] - p[2] for p in collector.log if records[0].due <= p[2] <= observe_until]
    requests_per_minute = fleet.model.n * args.rps * WINDOW_S
    aggregates_per_minute = statistics.fmean(m.aggregates for m in bodies)
    p99 = percentile(lags, 0.99)
    result = StepResult(
        number=number,
        interval_s=round(interval, 4),
        minutes=list(range(first, first + minutes)),
        offered_requests_per_s=requests_per_minute / interval,
        offered_aggregates_per_s=aggregates_per_minute / interval,
        windows=len(records),
        lag_p50_s=percentile(lags, 0.50),
        lag_p99_s=p99,
        ingest_p99_s=round(percentile(ingest, 0.99) or 0.0, 3) if ingest else None,
        consume_p99_s=percentile(consume, 0.99),
        unconsumed_windows=sum(math.isinf(v) for v in lags),
        post_errors=sum(r.error is not None for r in records),
        monitor_cycle_p50_s=percentile(cycles, 0.50),
        monitor_cycle_p99_s=percentile(cycles, 0.99),
        drained_s=round(time.time() - drain_started, 1) if drained else None,
        passed=p99 is not None and p99 <= LAG_LIMIT_S,
    )
    shown = "inf" if p99 is None or math.isinf(p99) else f"{p99:.1f} s"
    cycle_shown = "-" if result.monitor_cycle_p99_s is None else f"{result.monitor_cycle_p99_s:.1f}"
    print(
        f"  step {number}: interval {interval:.2f} s, "
        f"offered {result.offered_requests_per_s:,.0f} requests/s "
        f"({result.offered_aggregates_per_s:,.0f} aggregates/s; built in {built_s:.0f} s): lag p99 {shown} "
        f"(ingest p99 {result.ingest_p99_s} s, pass cycle p99 {cycle_shown} s), "
        f"{result.unconsumed_windows} of {len(records)} windows late past {OBSERVE_S:.0f} s -> "
        f"{'pass' if result.passed else 'FAIL'}"
        + ("" if drained else f"; backlog not drained in {DRAIN_S:.0f} s"),
        flush=True,
    )
    return result


def step_minutes(interval: float, most: int) -> int:
    """Simulated minutes of a step at ``interval``: ``most``, fewer where that would outlast
    STEP_BUDGET_S of sending, never under two (a lag needs a window sent behind another)."""
    return max(2, min(most, int(STEP_BUDGET_S // interval)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--deployments", type=int, default=10_000)
    parser.add_argument("--rps", type=int, default=100, help="requests per second per deployment")
    parser.add_argument("--edges", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument(
        "--interval",
        type=float,
        default=None,
        help="first step's real seconds per simulated minute (default 60, real time; 15 with --quick)",
    )
    parser.add_argument("--step-minutes", type=int, default=3, help="simulated minutes per load step")
    parser.add_argument("--refine", type=int, default=3, help="bisection steps after the coarse ones")
    parser.add_argument(
        "--build-processes",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="processes drawing a step's traffic before it starts (not while it runs)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="1,000 deployments, 2-minute steps from 15 s, 2 refinements"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.deployments, args.step_minutes, args.refine = 1_000, 2, 2
    if args.interval is None:
        args.interval = 15.0 if args.quick else 60.0
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(
        f"fleet bench: {args.deployments} deployments x {args.rps} requests/s, steps of {args.step_minutes} "
        f"simulated minutes from {args.interval:.0f} s each, {args.edges} edges, "
        f"{args.shards} monitor shards; "
        f"ARL0 {ARL0:.0e}, reference {REFERENCE} requests, min_drop {MIN_DROP}; a step passes at lag p99 "
        f"<= {LAG_LIMIT_S:.0f} s",
        flush=True,
    )
    model = FleetModel.draw(args.deployments, args.seed)
    url = prepare_database()
    key, ids = create_fleet(url, args.deployments)
    fleet = Fleet(args, model, key, ids)
    logs = RESULTS / "fleet_api"
    logs.mkdir(exist_ok=True)
    apis = [start_api(url, port, logs / f"api{i}.log") for i, port in enumerate(fleet.ports)]
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    passes: Any = ctx.Queue()
    monitors = [
        ctx.Process(target=monitor_loop, args=(url, s, args.shards, stop, passes)) for s in range(args.shards)
    ]
    rollups: Any = ctx.Queue()
    monitors.append(ctx.Process(target=rollup_loop, args=(url, stop, rollups)))
    for p in monitors:
        p.start()
    collector = PassCollector(passes)
    collector.start()
    # Backing off stops at four times the first interval: a lag that does not shrink as the load
    # halves is the pipeline's floor on this machine, not its capacity.
    search = LoadSearch(start=args.interval, refine=args.refine, max_interval=4 * args.interval)
    steps: list[StepResult] = []
    max_minutes = SIMULATED_HOURS_BACK * 60 - 5
    run_started = time.time()
    try:
        print(
            f"  warm-up: {WARMUP_MINUTES} minutes at {args.interval:.0f} s (reference windows; not measured)"
        )
        warmup = run_step(fleet, collector, 0, args.interval, WARMUP_MINUTES)
        while (interval := search.next_interval()) is not None:
            if fleet.next_minute + step_minutes(interval, args.step_minutes) > max_minutes:
                print("  simulated clock would pass the present: search stopped", flush=True)
                break
            minutes = step_minutes(interval, args.step_minutes)
            result = run_step(fleet, collector, len(steps) + 1, interval, minutes)
            steps.append(result)
            search.record(interval, result.passed)
    finally:
        stop.set()
        for p in monitors:
            p.join(timeout=30)
        collector.stop_event.set()
        for api in apis:
            api.terminate()
            api.wait(timeout=30)
        fleet.close()
    run_seconds = time.time() - run_started
    rollup_log: list[tuple[Any, ...]] = []
    while True:
        try:
            rollup_log.append(rollups.get_nowait())
        except queue.Empty:
            break
    rolled_windows = sum(r[3] for r in rollup_log)
    rolled_aggregates = sum(r[4] for r in rollup_log)
    rollup_busy_s = sum(r[2] - r[1] for r in rollup_log)
    with get_sessionmaker(url)() as session:
        events = session.execute(select(DriftEvent.deployment_id, DriftEvent.records_examined)).all()
        states = session.execute(
            select(DriftMonitorState.deployment_id, DriftMonitorState.records_examined)
        ).all()
        storage = {
            table: int(session.scalar(text(f"SELECT pg_total_relation_size('{table}')")) or 0)
            for table in ("acceptance_aggregates", "edge_windows", "drift_monitor_states")
        }
        partitions = session.execute(
            text(
                "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_inherits i "
                "JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent "
                "WHERE p.relname = 'acceptance_aggregates'"
            )
        ).all()
        storage["acceptance_aggregates"] += sum(int(size) for _, size in partitions)
    id_to_index = {ids[f"fleet-{d}"]: d for d in range(args.deployments)}
    drifted = {int(d) for d in model.drifted}
    mixed = {int(d) for d in model.mixed}
    alarmed = {id_to_index[int(deployment_id)] for deployment_id, _ in events}
    unchanged_alarms = sorted(alarmed - drifted - mixed)
    mix_alarms = sorted(alarmed & mixed)
    detected = sorted(alarmed & drifted)
    monitored_requests = sum(int(r) for _, r in states)
    allowed_mean = monitored_requests / ARL0  # requests after each detector's reference window
    allowed_p95 = allowed_mean + 1.645 * math.sqrt(max(allowed_mean, 1e-9)) + 1
    delay = delay_comparison(model, args.rps, np.random.default_rng(args.seed + 7))
    simulated_days = fleet.next_minute / 1440.0
    stored_bytes = storage["acceptance_aggregates"] + storage["edge_windows"]
    per_deployment_day = stored_bytes / args.deployments / simulated_days
    retention_days = 100e9 / (per_deployment_day * 10_000)
    drift_json = RESULTS / "drift.json"
    production: dict[str, Any] = {}
    if drift_json.exists():
        summary = json.loads(drift_json.read_text()).get("summary", {})
        for key_name in ("production_threshold_arl0_ratio", "production_delay_ratio_vs_oracle"):
            production[key_name] = summary.get(key_name)
        production["source"] = "bench/results/drift.json (bench/drift.py)"
    else:
        production["source"] = "missing: run bench/drift.py first (make bench runs it before this script)"
    best = max((s for s in steps if s.passed), key=lambda s: s.offered_requests_per_s, default=None)
    first = steps[0] if steps else None
    finite = [s for s in steps if s.lag_p99_s is not None and math.isfinite(s.lag_p99_s)]
    lowest = min(finite, key=lambda s: s.lag_p99_s or 0.0, default=None)
    figures = {
        "deployments": args.deployments,
        "fleet_capacity_requests_per_s": best.offered_requests_per_s if best else None,
        "fleet_capacity_aggregates_per_s": best.offered_aggregates_per_s if best else None,
        # The deployments those aggregates serve at one window a minute (two categories each).
        "fleet_capacity_deployments_at_one_window_a_minute": (
            best.offered_aggregates_per_s * WINDOW_S / len(CATEGORIES) if best else None
        ),
        "fleet_capacity_interval_s": best.interval_s if best else None,
        "fleet_capacity_lag_p99_s": best.as_dict()["lag_p99_s"] if best else None,
        # True when every load tried passed: the capacity is at least this, the search's floor.
        "fleet_capacity_is_lower_bound": search.capacity_is_lower_bound(),
        # The lowest lag p99 any step reached, and at what load: when it does not fall as the
        # load halves, it is the pipeline's floor on this machine.
        "fleet_lag_p99_lowest_s": round(lowest.lag_p99_s, 3) if lowest and lowest.lag_p99_s else None,
        "fleet_lag_p99_lowest_at_requests_per_s": lowest.offered_requests_per_s if lowest else None,
        # None above: no step passed, down to a quarter of the first step's load.
        "fleet_capacity_none_reason": None
        if best
        else f"no step kept lag p99 <= {LAG_LIMIT_S:.0f} s, the lowest offered "
        f"{min((s.offered_requests_per_s for s in steps), default=0):,.0f} requests/s",
        "fleet_capacity_rule": f"highest offered load whose step's window lag p99 <= {LAG_LIMIT_S:.0f} s; "
        f"windows unconsumed {OBSERVE_S:.0f} s after the step's last one was due count as infinite lag",
        "load_steps": [s.as_dict() for s in steps],
        "warmup_step": warmup.as_dict(),
        # The first step (at --interval; 60 s is real time) in the old figures' terms.
        "lag_p99_s": first.as_dict()["lag_p99_s"] if first else None,
        "lag_p50_s": first.as_dict()["lag_p50_s"] if first else None,
        "lag_measured_at_offered_requests_per_s": first.offered_requests_per_s if first else None,
        "monitor_cycle_p99_s": first.monitor_cycle_p99_s if first else None,
        "monitor_cycle_p50_s": first.monitor_cycle_p50_s if first else None,
        "monitor_passes": len(collector.log),
        "monitor_conflicts": collector.conflicts,
        **{k: v for k, v in production.items() if k != "source"},
        "production_threshold_source": production["source"],
        "detection_delay_ratio_vs_per_request": delay["ratio"],
        "detection_delay_ratio_vs_per_request_same_cadence": delay["ratio_same_cadence"],
        "delay_comparison": delay,
        "drifts_injected": len(drifted),
        "drifts_detected": len(detected),
        "mix_shifts_injected": len(mixed),
        "false_alarms": len(unchanged_alarms) + len(mix_alarms),
        "false_alarms_unchanged": len(unchanged_alarms),
        "false_alarms_mix_shifted": len(mix_alarms),
        "false_alarms_allowed_mean": allowed_mean,
        "false_alarms_allowed_p95": allowed_p95,
        "monitored_requests": monitored_requests,
        "storage_bytes": storage,
        "storage_bytes_per_deployment_day": per_deployment_day,
        "retention_days_for_100GB_at_10k_deployments": retention_days,
        "rollup_fold": {
            "windows": rolled_windows,
            "of_windows_posted": len(fleet.posted),
            "aggregates": rolled_aggregates,
            "busy_s": rollup_busy_s,
            "aggregates_per_busy_s": rolled_aggregates / rollup_busy_s if rollup_busy_s else None,
        },
        "windows_posted": len(fleet.posted),
        "post_errors": [r.error for r in fleet.posted if r.error][:5],
        "simulated_minutes": fleet.next_minute,
        "run_seconds": run_seconds,
        "wall_seconds": time.perf_counter() - started,
        "config": {
            "rps": args.rps,
            "first_interval_s": args.interval,
            "step_minutes": args.step_minutes,
            "refine": args.refine,
            "edges": args.edges,
            "shards": args.shards,
            "arl0": ARL0,
            "reference_requests": REFERENCE,
            "min_drop": MIN_DROP,
            "kappa": KAPPA,
            "quick": args.quick,
            "cpus": os.cpu_count(),
            "load_1min": os.getloadavg()[0],
        },
    }
    (RESULTS / "fleet.json").write_text(json.dumps(figures, indent=2, default=float))
    capacity = figures["fleet_capacity_requests_per_s"]
    rows = [
        ("deployments", figures["deployments"], ""),
        (
            "fleet_capacity_requests_per_s"
            + (" (at least: every step passed)" if search.capacity_is_lower_bound() else ""),
            f"{capacity:,.0f}" if capacity else "none passed",
            "printed",
        ),
        (
            "  as aggregates/s (deployments at one window a minute)",
            f"{figures['fleet_capacity_aggregates_per_s'] or 0:,.0f} "
            f"({figures['fleet_capacity_deployments_at_one_window_a_minute'] or 0:,.0f})",
            "",
        ),
        (
            f"lag_p99_s at {figures['lag_measured_at_offered_requests_per_s'] or 0:,.0f} requests/s",
            figures["lag_p99_s"],
            "<= 10",
        ),
        ("monitor_cycle_p99_s (same step)", figures["monitor_cycle_p99_s"], "<= 5"),
        ("production_threshold_arl0_ratio", production.get("production_threshold_arl0_ratio"), "1.0-1.3"),
        ("production_delay_ratio_vs_oracle", production.get("production_delay_ratio_vs_oracle"), "<= 1.2"),
        ("detection_delay_ratio_vs_per_request", delay["ratio"], "<= 1.2"),
        ("  same cadence (per-request acts at its window's end)", delay["ratio_same_cadence"], ""),
        (
            "false_alarms (unchanged + mix-shifted)",
            f"{figures['false_alarms']} (allowed mean {allowed_mean:.1f}, 95% {allowed_p95:.1f})",
            "within ARL0",
        ),
        ("drifts detected", f"{len(detected)} / {len(drifted)}", ""),
        ("storage_bytes_per_deployment_day", f"{per_deployment_day:,.0f}", "printed"),
        ("retention for 100 GB at 10k deployments (days)", f"{retention_days:.1f}", ""),
        (
            "rollup fold: windows folded / posted (aggregates/s busy)",
            f"{rolled_windows} / {len(fleet.posted)} "
            f"({figures['rollup_fold']['aggregates_per_busy_s'] or 0:,.0f})",
            "",
        ),
    ]
    print(f"\n{'figure':60s} {'measured':>36s}  target")
    for name, value, target in rows:
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        print(f"{name:60s} {shown:>36s}  {target}")
    print(f"\nwrote {RESULTS / 'fleet.json'} in {figures['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
