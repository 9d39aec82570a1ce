"""Edge aggregates: one window's sufficient statistics per deployment x arm x drafter version x category.

A fleet that serves a million requests a second cannot send one row per request. An edge (the
router, or any serving fleet that prefers it) sums its requests per window instead and sends one
:class:`EdgeWindow` per (edge id, window): the control plane stores it once (a retry of the same
window is acknowledged and ignored, a different body for a stored window is a conflict) and keeps
raw per-request records only as a sample.

Each :class:`WindowAggregate` holds exactly what the consumers need, as sums:

* the drift detector's per-position conditional counts ``x = (successes[K], trials[K])`` summed
  (``accepted_per_position``, ``reached_per_position``) and their second moments ``sum x x'``
  (upper triangle, row-major), so the baseline's overdispersion is measured on aggregated traffic
  exactly as on per-request records (see :mod:`controlplane.drift.reference`);
* the canary judge's per-request sums: for each primary metric ``[n, sum, sum of squares]``
  (Welford state is derived from them) and the hit rate's request-level spread (six integer sums);
* the workload-mix monitor's prompt-length moments (``log1p(prompt_tokens)``);
* latency quantile sketches (DDSketch, 1% relative accuracy, mergeable), per latency figure.

:class:`WindowAccumulator` builds aggregates from per-request records (the router uses it, the
tests check the detector's equivalence with it); :func:`parse_edge_window` validates a posted
body into an :class:`EdgeWindow`, every problem reported at once.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from ddsketch import DDSketch

from controlplane.ingest.record import AcceptanceRecord
from controlplane.speculation_math import ms_per_token, tokens_per_step

FORMAT = "edge-window/v1"
SKETCH_RELATIVE_ACCURACY = 0.01
LATENCY_FIGURES = ("inter_token_ms", "total_ms", "ttft_ms")
MIN_WINDOW_S = 10
MAX_WINDOW_S = 3600
MAX_POSITIONS = 16
MAX_AGGREGATES_PER_WINDOW = 50_000
MAX_EDGE_ID_CHARS = 200
MAX_SKETCH_BINS = 4_096
MAX_NAME_CHARS = 100
# An edge may send a window late (it was down), never one that has not ended yet.
MAX_WINDOW_AGE = timedelta(days=7)
MAX_REPORTED_PROBLEMS = 20


def moment_length(k: int) -> int:
    """Entries of the upper triangle of a ``2k x 2k`` matrix."""
    d = 2 * k
    return d * (d + 1) // 2


def upper_triangle(matrix: Sequence[Sequence[float]]) -> list[float]:
    d = len(matrix)
    return [float(matrix[i][j]) for i in range(d) for j in range(i, d)]


def full_matrix(upper: Sequence[float], k: int) -> list[list[float]]:
    """The symmetric ``2k x 2k`` matrix from its upper triangle (row-major)."""
    d = 2 * k
    out = [[0.0] * d for _ in range(d)]
    it = iter(upper)
    for i in range(d):
        for j in range(i, d):
            v = float(next(it))
            out[i][j] = v
            out[j][i] = v
    return out


# ----------------------------------------------------------------------------------------- sketch


def sketch_to_dict(sketch: DDSketch) -> dict[str, Any]:
    """A DDSketch's positive store as ``{"alpha", "bins": [[key, count], ...], "zeros"}`` (latencies >= 0)."""
    store = sketch._store  # the library's store has no public iterator; bins are its documented state
    bins = [
        [store.offset + i, float(c)]
        for i, c in enumerate(store.bins)
        if c  # dense array from offset
    ]
    return {"alpha": SKETCH_RELATIVE_ACCURACY, "bins": bins, "zeros": float(sketch._zero_count)}


def sketch_from_dict(data: Mapping[str, Any]) -> DDSketch:
    """Rebuild a sketch (each bin re-added at its key's representative value: same key, same count)."""
    sketch = DDSketch(relative_accuracy=SKETCH_RELATIVE_ACCURACY)
    mapping = sketch._mapping
    for key, count in data.get("bins", []):
        if count > 0:
            sketch.add(mapping.value(int(key)), float(count))
    zeros = float(data.get("zeros", 0.0))
    if zeros > 0:
        sketch.add(0.0, zeros)
    return sketch


def merge_sketch_dicts(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not a:
        return dict(b) if b else None
    if not b:
        return dict(a)
    bins: dict[int, float] = {}
    for key, count in [*a.get("bins", []), *b.get("bins", [])]:
        bins[int(key)] = bins.get(int(key), 0.0) + float(count)
    return {
        "alpha": SKETCH_RELATIVE_ACCURACY,
        "bins": sorted([k, c] for k, c in bins.items()),
        "zeros": float(a.get("zeros", 0.0)) + float(b.get("zeros", 0.0)),
    }


def sketch_quantile(data: Mapping[str, Any] | None, q: float) -> float | None:
    if not data or (not data.get("bins") and not data.get("zeros")):
        return None
    value = sketch_from_dict(data).get_quantile_value(q)
    return None if value is None else float(value)


# -------------------------------------------------------------------------------------- aggregate


@dataclass
class WindowAggregate:
    """Sums over one window's requests of one deployment, arm, drafter version and category."""

    deployment: str
    arm: str = "live"
    drafter_version: int | None = None
    category: str = ""
    requests: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    # Requests that carried per-position counts (the detector's observations).
    speculated_requests: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    reached_per_position: list[int] = field(default_factory=list)
    position_moments: list[float] = field(default_factory=list)
    prompt_log_length: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    timed_requests: int = 0
    tokens_per_step: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    ms_per_token: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    spread: list[int] = field(default_factory=lambda: [0] * 6)
    latency: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, int, str]:
        return (self.deployment, self.arm, self.drafter_version or 0, self.category)

    @property
    def k(self) -> int:
        return len(self.reached_per_position)

    def to_dict(self) -> dict[str, Any]:
        return {
            "deployment": self.deployment,
            "arm": self.arm,
            "drafter_version": self.drafter_version,
            "category": self.category,
            "requests": self.requests,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_steps": self.verify_steps,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "speculated_requests": self.speculated_requests,
            "accepted_per_position": list(self.accepted_per_position),
            "reached_per_position": list(self.reached_per_position),
            "position_moments": list(self.position_moments),
            "prompt_log_length": list(self.prompt_log_length),
            "timed_requests": self.timed_requests,
            "tokens_per_step": list(self.tokens_per_step),
            "ms_per_token": list(self.ms_per_token),
            "spread": list(self.spread),
            "latency": {name: dict(s) for name, s in self.latency.items()},
        }

    def detector_sums(self) -> tuple[int, list[float], list[list[float]]]:
        """``(count, sum x, sum x x')`` of ``x = (successes[K], trials[K])`` over the speculated requests."""
        k = self.k
        sx = [float(v) for v in self.accepted_per_position] + [float(v) for v in self.reached_per_position]
        return self.speculated_requests, sx, full_matrix(self.position_moments, k)


class WindowAccumulator:
    """Sums per-request records into one window's aggregates (pure; the edge's side of the format)."""

    def __init__(self, *, k: int) -> None:
        if not 1 <= k <= MAX_POSITIONS:
            raise ValueError(f"k must lie in [1, {MAX_POSITIONS}]")
        self.k = k
        self._rows: dict[tuple[str, str, int, str], WindowAggregate] = {}
        self._sketches: dict[tuple[str, str, int, str], dict[str, DDSketch]] = {}

    def add(self, deployment: str, record: AcceptanceRecord) -> None:
        key = (deployment, record.arm, record.drafter_version or 0, record.category or "")
        agg = self._rows.get(key)
        if agg is None:
            agg = WindowAggregate(
                deployment=deployment,
                arm=record.arm,
                drafter_version=record.drafter_version,
                category=record.category or "",
                accepted_per_position=[0] * self.k,
                reached_per_position=[0] * self.k,
                position_moments=[0.0] * moment_length(self.k),
            )
            self._rows[key] = agg
            self._sketches[key] = {}
        agg.requests += 1
        agg.drafted_tokens += record.drafted_tokens
        agg.accepted_tokens += record.accepted_tokens
        agg.verify_steps += record.verify_steps
        agg.generated_tokens += record.generated_tokens
        if record.prompt_tokens is not None:
            agg.prompt_tokens += record.prompt_tokens
            log_len = math.log1p(record.prompt_tokens)
            agg.prompt_log_length[0] += 1.0
            agg.prompt_log_length[1] += log_len
            agg.prompt_log_length[2] += log_len * log_len
        counts = [int(c) for c in record.accepted_per_position][: self.k]
        if counts and record.verify_steps > 0:
            k = self.k
            successes = counts + [0] * (k - len(counts))
            trials = ([record.verify_steps, *counts[:-1]] + [0] * k)[:k]
            x = [float(v) for v in successes + trials]
            agg.speculated_requests += 1
            for i in range(k):
                agg.accepted_per_position[i] += successes[i]
                agg.reached_per_position[i] += trials[i]
            m = agg.position_moments
            idx = 0
            for i in range(2 * k):
                xi = x[i]
                for j in range(i, 2 * k):
                    m[idx] += xi * x[j]
                    idx += 1
        generated = record.generated_tokens
        if generated > 0:
            latency = ms_per_token(record.inter_token_ms, record.total_ms, record.ttft_ms, generated)
            if latency is not None:
                tps = tokens_per_step(generated, record.verify_steps)
                agg.timed_requests += 1
                if tps > 0 and latency > 0:
                    for sums, value in ((agg.tokens_per_step, tps), (agg.ms_per_token, latency)):
                        sums[0] += 1.0
                        sums[1] += value
                        sums[2] += value * value
            d, a = record.drafted_tokens, record.accepted_tokens
            if d > 0:
                s = agg.spread
                s[0] += 1
                s[1] += d
                s[2] += a
                s[3] += d * d
                s[4] += a * d
                s[5] += a * a
        sketches = self._sketches[key]
        for name in LATENCY_FIGURES:
            value = getattr(record, name)
            if value is not None and value >= 0 and math.isfinite(value):
                sketch = sketches.get(name)
                if sketch is None:
                    sketch = sketches[name] = DDSketch(relative_accuracy=SKETCH_RELATIVE_ACCURACY)
                sketch.add(float(value))

    def __len__(self) -> int:
        return len(self._rows)

    def aggregates(self) -> list[WindowAggregate]:
        out = []
        for key, agg in self._rows.items():
            agg.latency = {name: sketch_to_dict(s) for name, s in self._sketches[key].items()}
            out.append(agg)
        return out


@dataclass(frozen=True)
class EdgeWindow:
    """One edge's aggregates for one window: the unit of ingest and of idempotency."""

    edge_id: str
    window_start: datetime
    window_s: int
    aggregates: list[WindowAggregate]

    @property
    def window_end(self) -> datetime:
        return self.window_start + timedelta(seconds=self.window_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "edge_id": self.edge_id,
            "window_start": self.window_start.isoformat().replace("+00:00", "Z"),
            "window_s": self.window_s,
            "aggregates": [a.to_dict() for a in self.aggregates],
        }

    def digest(self) -> str:
        """A content hash that tells a retry (same body) from a conflicting resend."""
        body = self.to_dict()
        rows = sorted(
            body["aggregates"],
            key=lambda a: (a["deployment"], a["arm"], a["drafter_version"] or 0, a["category"]),
        )
        return hashlib.sha256(
            orjson.dumps({**body, "aggregates": rows}, option=orjson.OPT_SORT_KEYS)
        ).hexdigest()


class EdgeWindowError(ValueError):
    """A posted window that does not validate; ``problems`` lists every problem (field, message)."""

    def __init__(self, problems: list[dict[str, str]], more: int = 0) -> None:
        super().__init__("; ".join(f"{p['field']}: {p['message']}" for p in problems))
        self.problems = problems
        self.more = more


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    out = float(value)
    return out if math.isfinite(out) else None


def _counts(value: Any, length: int | None) -> list[int] | None:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        return None
    out = [_int(v) for v in value]
    if any(v is None or v < 0 for v in out):
        return None
    return [int(v) for v in out if v is not None]


def _numbers(value: Any, length: int, *, non_negative: bool = True) -> list[float] | None:
    if not isinstance(value, list) or len(value) != length:
        return None
    out = [_number(v) for v in value]
    if any(v is None or (non_negative and v < 0) for v in out):
        return None
    return [float(v) for v in out if v is not None]


def _sketch(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("bins", []), list):
        return None
    if value.get("alpha", SKETCH_RELATIVE_ACCURACY) != SKETCH_RELATIVE_ACCURACY:
        return None
    bins = value.get("bins", [])
    if len(bins) > MAX_SKETCH_BINS:
        return None
    clean = []
    # Exact types rather than isinstance (bool is an int; JSON decoders give plain int and
    # float): a fleet posts three sketches of ~50 bins per aggregate, the bulk of ingest's work.
    for pair in bins:
        if type(pair) is not list or len(pair) != 2:
            return None
        key, count = pair
        if type(key) is not int or not -100_000 <= key <= 100_000:
            return None
        kind = type(count)
        if (kind is not float and kind is not int) or not 0.0 <= count < math.inf:
            return None
        clean.append([key, float(count)])
    zeros = _number(value.get("zeros", 0.0))
    if zeros is None or zeros < 0:
        return None
    return {"alpha": SKETCH_RELATIVE_ACCURACY, "bins": clean, "zeros": zeros}


def _aggregate(raw: Any, where: str, problems: list[dict[str, str]]) -> WindowAggregate | None:
    def bad(name: str, message: str) -> None:
        problems.append({"field": f"{where}.{name}", "message": message})

    if not isinstance(raw, dict):
        bad("", "must be an object")
        return None
    start = len(problems)
    deployment = raw.get("deployment")
    if not isinstance(deployment, str) or not deployment or len(deployment) > MAX_NAME_CHARS:
        bad("deployment", f"must be a deployment name of 1-{MAX_NAME_CHARS} characters")
    arm = raw.get("arm", "live")
    if not isinstance(arm, str) or not arm or len(arm) > 40:
        bad("arm", "must be an arm name of 1-40 characters")
    version = raw.get("drafter_version")
    if version is not None and (_int(version) is None or not 0 < version < 2**31):
        bad("drafter_version", "must be a positive integer or null")
    category = raw.get("category") or ""
    if not isinstance(category, str) or len(category) > MAX_NAME_CHARS:
        bad("category", f"must be a string of at most {MAX_NAME_CHARS} characters")
    totals = {}
    for name in ("requests", "drafted_tokens", "accepted_tokens", "verify_steps", "generated_tokens"):
        v = _int(raw.get(name))
        if v is None or v < 0 or v >= 2**62:
            bad(name, "must be a non-negative integer")
        totals[name] = v or 0
    for name in ("prompt_tokens", "speculated_requests", "timed_requests"):
        v = _int(raw.get(name, 0))
        if v is None or v < 0 or v >= 2**62:
            bad(name, "must be a non-negative integer")
        totals[name] = v or 0
    if totals["accepted_tokens"] > totals["drafted_tokens"]:
        bad("accepted_tokens", "exceeds drafted_tokens")
    if totals["speculated_requests"] > totals["requests"] or totals["timed_requests"] > totals["requests"]:
        bad("speculated_requests", "speculated and timed requests cannot exceed requests")
    accepted = _counts(raw.get("accepted_per_position", []), None)
    k = len(accepted) if accepted is not None else 0
    reached = _counts(raw.get("reached_per_position", []), k)
    if accepted is None or reached is None or k > MAX_POSITIONS:
        bad(
            "accepted_per_position",
            f"accepted and reached per position: equal-length lists (<= {MAX_POSITIONS}) of counts",
        )
        accepted, reached = [], []
    elif any(a > r for a, r in zip(accepted, reached, strict=True)):
        bad("accepted_per_position", "a position's accepted count exceeds its reached count")
    elif k and reached[0] > totals["verify_steps"]:
        bad("reached_per_position", "position 0 is reached at most once per verify step")
    moments = _numbers(raw.get("position_moments", [] if not k else None), moment_length(k))
    if moments is None:
        bad(
            "position_moments",
            f"must hold the {moment_length(k)} upper-triangle sums of x x' (x = successes, trials)",
        )
        moments = []
    elif k and totals["speculated_requests"] == 0 and any(moments):
        bad("position_moments", "moments given for zero speculated requests")
    prompt = _numbers(raw.get("prompt_log_length", [0, 0, 0]), 3)
    tps = _numbers(raw.get("tokens_per_step", [0, 0, 0]), 3)
    mpt = _numbers(raw.get("ms_per_token", [0, 0, 0]), 3)
    for name, sums in (("prompt_log_length", prompt), ("tokens_per_step", tps), ("ms_per_token", mpt)):
        if sums is None:
            bad(name, "must be [count, sum, sum of squares] of non-negative numbers")
    spread = _counts(raw.get("spread", [0] * 6), 6)
    if spread is None:
        bad("spread", "must be six non-negative integer sums")
    latency_raw = raw.get("latency", {})
    latency: dict[str, dict[str, Any]] = {}
    if not isinstance(latency_raw, dict) or set(latency_raw) - set(LATENCY_FIGURES):
        bad("latency", f"must map some of {list(LATENCY_FIGURES)} to DDSketch bins")
    else:
        for name, value in latency_raw.items():
            sketch = _sketch(value)
            if sketch is None:
                bad(
                    f"latency.{name}",
                    f"must be {{alpha: {SKETCH_RELATIVE_ACCURACY}, bins: [[key, count], ...], zeros}}",
                )
            else:
                latency[name] = sketch
    unknown = set(raw) - set(WindowAggregate.__dataclass_fields__)
    if unknown:
        bad(sorted(unknown)[0], f"unknown field(s): {sorted(unknown)[:5]}")
    if len(problems) > start:
        return None
    return WindowAggregate(
        deployment=str(deployment),
        arm=str(arm),
        drafter_version=version,
        category=category,
        requests=totals["requests"],
        drafted_tokens=totals["drafted_tokens"],
        accepted_tokens=totals["accepted_tokens"],
        verify_steps=totals["verify_steps"],
        generated_tokens=totals["generated_tokens"],
        prompt_tokens=totals["prompt_tokens"],
        speculated_requests=totals["speculated_requests"],
        accepted_per_position=accepted,
        reached_per_position=reached,
        position_moments=moments,
        prompt_log_length=prompt or [0.0, 0.0, 0.0],
        timed_requests=totals["timed_requests"],
        tokens_per_step=tps or [0.0, 0.0, 0.0],
        ms_per_token=mpt or [0.0, 0.0, 0.0],
        spread=spread or [0] * 6,
        latency=latency,
    )


def parse_edge_window(payload: Any, *, now: datetime | None = None) -> EdgeWindow:
    """Validate a posted window; raise :class:`EdgeWindowError` listing every problem."""
    problems: list[dict[str, str]] = []
    if not isinstance(payload, dict):
        raise EdgeWindowError([{"field": "", "message": "the body must be a JSON object"}])
    if payload.get("format", FORMAT) != FORMAT:
        problems.append({"field": "format", "message": f"must be {FORMAT!r}"})
    edge_id = payload.get("edge_id")
    if not isinstance(edge_id, str) or not edge_id.strip() or len(edge_id) > MAX_EDGE_ID_CHARS:
        problems.append(
            {
                "field": "edge_id",
                "message": f"must be a non-empty string of at most {MAX_EDGE_ID_CHARS} characters",
            }
        )
    window_s = _int(payload.get("window_s"))
    if window_s is None or not MIN_WINDOW_S <= window_s <= MAX_WINDOW_S or 86400 % window_s:
        problems.append(
            {
                "field": "window_s",
                "message": f"must be an integer in [{MIN_WINDOW_S}, {MAX_WINDOW_S}] dividing a day",
            }
        )
        window_s = None
    start: datetime | None = None
    raw_start = payload.get("window_start")
    try:
        start = (
            datetime.fromisoformat(str(raw_start).replace("Z", "+00:00"))
            if isinstance(raw_start, str)
            else None
        )
    except ValueError:
        start = None
    if start is None or start.tzinfo is None:
        problems.append({"field": "window_start", "message": "must be an ISO 8601 time with a zone"})
        start = None
    else:
        start = start.astimezone(UTC)
        current = now or datetime.now(UTC)
        if window_s is not None:
            if start.timestamp() % window_s or start.microsecond:
                problems.append(
                    {
                        "field": "window_start",
                        "message": "must be a multiple of window_s since the Unix epoch",
                    }
                )
            elif start + timedelta(seconds=window_s) > current + timedelta(seconds=5):
                problems.append({"field": "window_start", "message": "the window has not ended yet"})
        if start < current - MAX_WINDOW_AGE:
            problems.append({"field": "window_start", "message": f"older than {MAX_WINDOW_AGE.days} days"})
    rows = payload.get("aggregates")
    aggregates: list[WindowAggregate] = []
    if not isinstance(rows, list) or len(rows) > MAX_AGGREGATES_PER_WINDOW:
        problems.append(
            {
                "field": "aggregates",
                "message": f"must be a list of at most {MAX_AGGREGATES_PER_WINDOW} aggregates",
            }
        )
        rows = []
    seen: set[tuple[str, str, int, str]] = set()
    for i, raw in enumerate(rows):
        agg = _aggregate(raw, f"aggregates[{i}]", problems)
        if agg is None:
            continue
        if agg.key in seen:
            problems.append(
                {
                    "field": f"aggregates[{i}]",
                    "message": "repeats a (deployment, arm, drafter_version, category) of this window",
                }
            )
        seen.add(agg.key)
        aggregates.append(agg)
    unknown = set(payload) - {"format", "edge_id", "window_start", "window_s", "aggregates"}
    if unknown:
        problems.append({"field": sorted(unknown)[0], "message": f"unknown field(s): {sorted(unknown)[:5]}"})
    if problems:
        raise EdgeWindowError(problems[:MAX_REPORTED_PROBLEMS], max(0, len(problems) - MAX_REPORTED_PROBLEMS))
    assert start is not None and window_s is not None and isinstance(edge_id, str)
    return EdgeWindow(edge_id=edge_id, window_start=start, window_s=window_s, aggregates=aggregates)


def window_start_of(moment: datetime, window_s: int) -> datetime:
    """The start of the ``window_s`` window holding ``moment`` (multiples of it since the epoch)."""
    ts = int(moment.timestamp())
    return datetime.fromtimestamp(ts - ts % window_s, UTC)
