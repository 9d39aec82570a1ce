"""Per-request benchmark records, their statistics, and the table / JSON / CSV reports.

Pure: no network; the only I/O is ``write_reports`` (files) and ``render`` (a Rich console).

Names follow NVIDIA AIPerf, the anchor this report matches:

* one per-request record per line of ``profile_export.jsonl``: ``metadata`` (``session_num``,
  ``x_request_id``, ``request_start_ns``, ``request_ack_ns``, ``request_end_ns``,
  ``benchmark_phase``), ``metrics`` (each ``{"value", "unit"}``: ``time_to_first_token``,
  ``inter_token_latency``, ``request_latency``, ``input_sequence_length``,
  ``output_sequence_length``, ``output_token_throughput_per_user`` and the ``spec_decode_*``
  record metrics), the engine-neutral ``spec_decode_acceptance`` struct and ``error``
  (``code``, ``type``, ``message``);
* per configuration and load, a stats block per record metric (``unit``, ``avg``, ``min``,
  ``max``, ``p50``, ``p90``, ``p95``, ``p99``, ``std``, ``count``) and the derived scalars
  ``request_throughput``, ``output_token_throughput``, ``request_count``,
  ``error_request_count``, ``benchmark_duration``, ``total_spec_decode_steps``,
  ``total_accepted_draft_tokens``, ``total_draft_tokens``,
  ``spec_decode_overall_draft_acceptance_rate``, ``spec_decode_token_weighted_acceptance_length``
  and ``pooled_spec_decode_acceptance_histogram``; plus vLLM's
  ``spec_decode_per_position_acceptance_rates`` (the acceptance by position).

Definitions:

* percentiles interpolate linearly between order statistics (numpy's default, which AIPerf uses);
  ``std`` is the population standard deviation;
* ``inter_token_latency`` = (last token time - first token time) / (output tokens - 1) per
  request (AIPerf / genai-perf), percentiles taken over requests; undefined below two tokens;
* ``time_to_first_token``: streaming, the client's time to the first SSE chunk carrying text;
  non-streaming, the server's reported TTFT from its perf metrics when present (else absent);
* acceptance by position i = Σ accepted_per_position[i] ÷ Σ verify steps over the requests that
  drafted (vLLM's ``num_accepted_tokens_per_pos[i] / num_drafts``): the share of verify steps that
  accepted draft position i, so it is non-increasing in i;
* ``spec_decode_acceptance_length`` = 1 + accepted ÷ steps; ``spec_decode_draft_acceptance_rate``
  = 100 × accepted ÷ drafted; ``spec_decode_accepted_per_verified`` = (accepted + steps) ÷
  (drafted + steps); the pooled histogram counts verify steps that accepted exactly j drafts, exact
  from the per-position counts: steps - app[0], app[j-1] - app[j], ..., app[k-1].
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from controlplane.ingest.record import AcceptanceRecord
from controlplane.speculation_math import hit_rate, mean_accepted_length, ms_per_token

PERCENTILES: Final = (50, 90, 95, 99)
JSONL_NAME: Final = "profile_export.jsonl"
# AIPerf's run summary (``JsonExportData``), one per configuration and load, next to that run's
# own ``profile_export.jsonl``, under AIPERF_DIR/<config>/<load type>-<load>/.
AIPERF_JSON_NAME: Final = "profile_export_aiperf.json"
AIPERF_DIR: Final = "aiperf"
AIPERF_SCHEMA_VERSION: Final = "1.0"
# JsonMetricResult's stat keys (ai-dynamo/aiperf src/aiperf/common/models/export_models.py).
AIPERF_STATS: Final = (
    "unit",
    "avg",
    "p1",
    "p5",
    "p10",
    "p25",
    "p50",
    "p75",
    "p90",
    "p95",
    "p99",
    "min",
    "max",
    "std",
)
JSON_NAME: Final = "benchmark.json"
CSV_NAME: Final = "benchmark.csv"
SCHEMA_VERSION: Final = "1"

# Record metrics summarised per configuration and load: AIPerf tag -> unit.
RECORD_METRICS: Final[dict[str, str]] = {
    "time_to_first_token": "ms",
    "inter_token_latency": "ms",
    "request_latency": "ms",
    "input_sequence_length": "tokens",
    "output_sequence_length": "tokens",
    "output_token_throughput_per_user": "tokens/sec/user",
    "spec_decode_acceptance_length": "ratio",
    "spec_decode_draft_acceptance_rate": "%",
    "spec_decode_accepted_per_verified": "ratio",
    "spec_decode_steps": "count",
    "spec_decode_accepted_draft_tokens": "tokens",
    "spec_decode_draft_tokens": "tokens",
}


# --------------------------------------------------------------------------------------------
# Math
# --------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between order statistics.

    Equal to ``numpy.percentile(values, p)`` (method "linear"): rank h = (n - 1)·p/100, and the
    value lies between the floor(h)-th and ceil(h)-th smallest, in proportion.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    ordered = sorted(values)
    h = (len(ordered) - 1) * p / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


def stats(values: Sequence[float], unit: str) -> dict[str, Any]:
    """AIPerf's stats block of one record metric; ``count`` 0 and no figures for no values."""
    if not values:
        return {"unit": unit, "count": 0}
    n = len(values)
    avg = math.fsum(values) / n
    out: dict[str, Any] = {
        "unit": unit,
        "avg": avg,
        "min": min(values),
        "max": max(values),
    }
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p)
    out["std"] = math.sqrt(math.fsum((v - avg) ** 2 for v in values) / n)
    out["count"] = n
    return out


def inter_token_latency_ms(first_token_ns: int, last_token_ns: int, output_tokens: int) -> float | None:
    """AIPerf's per-request ITL: (last token time - first token time) / (tokens - 1), in ms."""
    if last_token_ns < first_token_ns:
        return None
    # The decode time (first token to last) over the tokens after the first: TTFT is left out.
    return ms_per_token(None, (last_token_ns - first_token_ns) / 1e6, None, output_tokens)


def acceptance_histogram(accepted_per_position: Sequence[int], verify_steps: int) -> list[int]:
    """Verify steps that accepted exactly j drafts, j = 0..k, from the per-position counts."""
    app = list(accepted_per_position)
    if not app:
        return [verify_steps]
    hist = [verify_steps - app[0]]
    hist.extend(app[j - 1] - app[j] for j in range(1, len(app)))
    hist.append(app[-1])
    return hist


# --------------------------------------------------------------------------------------------
# Per-request record
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorDetails:
    """Why a request failed: HTTP status (or 0 without one), exception type, message."""

    code: int
    type: str
    message: str


@dataclass(slots=True)
class RequestRecord:
    """What one benchmark request measured. Times are ``time.time_ns()`` epochs, as in AIPerf."""

    config: str
    phase: str  # "concurrency" (closed loop) | "request_rate" (open loop)
    load: float  # the concurrency, or the offered request rate (requests/s)
    session_num: int
    x_request_id: str
    prompt_index: int
    category: str | None
    request_start_ns: int
    request_end_ns: int
    request_ack_ns: int | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    ttft_ms: float | None = None
    ttft_source: str | None = None  # "client_stream" | "server"
    itl_ms: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    output_tokens_source: str | None = None  # "usage" | "perf_metrics" | "chunks"
    finish_reason: str | None = None
    acceptance: AcceptanceRecord | None = None
    acceptance_format: str | None = None  # which ingest adapter read it ("native", "fireworks", ...)
    output_text: str | None = None
    error: ErrorDetails | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def request_latency_ms(self) -> float:
        return (self.request_end_ns - self.request_start_ns) / 1e6

    @property
    def speculated(self) -> bool:
        """Whether the response reported speculation that drafted at least one token."""
        return self.acceptance is not None and self.acceptance.drafted_tokens > 0


def _percent(rate: float | None) -> float | None:
    """A rate in AIPerf's "%" unit (the one place a rate is multiplied by 100)."""
    return 100.0 * rate if rate is not None else None


def _metric(value: float | int | None, unit: str) -> dict[str, Any] | None:
    return None if value is None else {"value": value, "unit": unit}


def spec_decode_record_metrics(acc: AcceptanceRecord) -> dict[str, float | int | None]:
    """AIPerf's spec-decode record metrics of one request that drafted (None where undefined)."""
    steps, accepted, drafted = acc.verify_steps, acc.accepted_tokens, acc.drafted_tokens
    return {
        "spec_decode_acceptance_length": mean_accepted_length(accepted, steps),
        "spec_decode_draft_acceptance_rate": _percent(hit_rate(accepted, drafted)),
        "spec_decode_accepted_per_verified": (accepted + steps) / (drafted + steps)
        if drafted + steps
        else None,
        "spec_decode_steps": steps,
        "spec_decode_accepted_draft_tokens": accepted,
        "spec_decode_draft_tokens": drafted,
    }


def record_metric_values(rec: RequestRecord) -> dict[str, float | int | None]:
    """The record metrics of one successful request, by AIPerf tag (None where undefined)."""
    out: dict[str, float | int | None] = {
        "time_to_first_token": rec.ttft_ms,
        "inter_token_latency": rec.itl_ms,
        "request_latency": rec.request_latency_ms,
        "input_sequence_length": rec.input_tokens,
        "output_sequence_length": rec.output_tokens,
        "output_token_throughput_per_user": 1000.0 / rec.itl_ms if rec.itl_ms else None,
    }
    if rec.speculated:
        assert rec.acceptance is not None
        out.update(spec_decode_record_metrics(rec.acceptance))
    return out


def spec_decode_acceptance(acc: AcceptanceRecord, engine: str | None) -> dict[str, Any]:
    """AIPerf's engine-neutral per-request acceptance struct, plus our exact per-position counts."""
    steps = acc.verify_steps
    hist = acceptance_histogram(acc.accepted_per_position, steps)
    return {
        "engine": engine,
        "mean_acceptance_length": mean_accepted_length(acc.accepted_tokens, steps),
        "draft_acceptance_rate": hit_rate(acc.accepted_tokens, acc.drafted_tokens),
        "acceptance_histogram": {str(j): c for j, c in enumerate(hist)},
        "num_accepted_draft_tokens": acc.accepted_tokens,
        "num_draft_tokens": acc.drafted_tokens,
        "num_spec_steps": steps,
        "num_spec_tokens": acc.k,
        "accepted_per_position": list(acc.accepted_per_position),
    }


def to_aiperf_record(rec: RequestRecord) -> dict[str, Any]:
    """One line of ``profile_export.jsonl``, shaped like AIPerf's ``MetricRecordInfo``."""
    metadata = {
        "session_num": rec.session_num,
        "x_request_id": rec.x_request_id,
        "conversation_id": f"prompt-{rec.prompt_index}",
        "turn_index": 0,
        "request_start_ns": rec.request_start_ns,
        "request_ack_ns": rec.request_ack_ns,
        "request_end_ns": rec.request_end_ns,
        # Required by AIPerf's MetricRecordMetadata: which worker / record processor handled it.
        "worker_id": f"loadbench-{rec.config}",
        "record_processor_id": "loadbench",
        "benchmark_phase": "profiling",
        "was_cancelled": False,
        "cancellation_time_ns": None,
        # Not AIPerf: which configuration and load this request belongs to.
        "config": rec.config,
        "load_type": rec.phase,
        "load": rec.load,
        "category": rec.category,
        "ttft_source": rec.ttft_source,
        "output_tokens_source": rec.output_tokens_source,
        "finish_reason": rec.finish_reason,
    }
    if rec.error is not None:
        return {
            "metadata": metadata,
            "metrics": {},
            "spec_decode_acceptance": None,
            "error": {"code": rec.error.code, "type": rec.error.type, "message": rec.error.message},
        }
    metrics = {
        tag: m
        for tag, value in record_metric_values(rec).items()
        if (m := _metric(value, RECORD_METRICS[tag])) is not None
    }
    acceptance = (
        spec_decode_acceptance(rec.acceptance, rec.acceptance_format)
        if rec.speculated and rec.acceptance is not None
        else None
    )
    return {"metadata": metadata, "metrics": metrics, "spec_decode_acceptance": acceptance, "error": None}


# --------------------------------------------------------------------------------------------
# Summary per configuration and load
# --------------------------------------------------------------------------------------------


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None) -> dict[str, Any]:
    """Stats of every record metric, AIPerf's derived scalars, and the acceptance by position.

    ``duration_s`` defaults to first request start → last response end (AIPerf's benchmark
    duration); throughputs are per second of it.
    """
    ok = [r for r in records if r.ok]
    if duration_s is None:
        duration_s = (
            (max(r.request_end_ns for r in records) - min(r.request_start_ns for r in records)) / 1e9
            if records
            else 0.0
        )
    out: dict[str, Any] = {}
    values: dict[str, list[float]] = {tag: [] for tag in RECORD_METRICS}
    for r in ok:
        for tag, value in record_metric_values(r).items():
            if value is not None:
                values[tag].append(float(value))
    for tag, unit in RECORD_METRICS.items():
        out[tag] = stats(values[tag], unit)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    out["request_count"] = {"unit": "requests", "avg": len(ok)}
    out["error_request_count"] = {"unit": "requests", "avg": len(records) - len(ok)}
    out["benchmark_duration"] = {"unit": "sec", "avg": duration_s}
    out["total_output_tokens"] = {"unit": "tokens", "avg": output_tokens}
    out["request_throughput"] = {"unit": "requests/sec", "avg": len(ok) / duration_s if duration_s else None}
    out["output_token_throughput"] = {
        "unit": "tokens/sec",
        "avg": output_tokens / duration_s if duration_s else None,
    }
    out.update(pooled_acceptance([r.acceptance for r in ok if r.speculated and r.acceptance is not None]))
    return out


def pooled_acceptance(accs: Sequence[AcceptanceRecord]) -> dict[str, Any]:
    """Run-level acceptance figures of the requests that drafted; empty when none did."""
    if not accs:
        return {}
    steps = sum(a.verify_steps for a in accs)
    accepted = sum(a.accepted_tokens for a in accs)
    drafted = sum(a.drafted_tokens for a in accs)
    width = max(len(a.accepted_per_position) for a in accs)
    positions = [0] * width
    pooled = [0] * (width + 1)
    for a in accs:
        for i, count in enumerate(a.accepted_per_position):
            positions[i] += count
        for j, count in enumerate(acceptance_histogram(a.accepted_per_position, a.verify_steps)):
            pooled[j] += count
    return {
        "total_spec_decode_steps": {"unit": "count", "avg": steps},
        "total_accepted_draft_tokens": {"unit": "tokens", "avg": accepted},
        "total_draft_tokens": {"unit": "tokens", "avg": drafted},
        "spec_decode_overall_draft_acceptance_rate": {
            "unit": "%",
            "avg": _percent(hit_rate(accepted, drafted)),
        },
        "spec_decode_token_weighted_acceptance_length": {
            "unit": "ratio",
            "avg": mean_accepted_length(accepted, steps),
        },
        "spec_decode_per_position_acceptance_rates": [c / steps if steps else 0.0 for c in positions],
        "spec_decode_accepted_per_position": positions,
        "pooled_spec_decode_acceptance_histogram": {str(j): c for j, c in enumerate(pooled)},
    }


@dataclass(slots=True)
class LoadResult:
    """One configuration at one load: its requests and their summary."""

    config: str
    phase: str
    load: float
    records: list[RequestRecord]
    duration_s: float
    summary: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.summary:
            self.summary = summarize(self.records, self.duration_s)


@dataclass(frozen=True, slots=True)
class Probe:
    """One open-loop step of the throughput search."""

    rate: float
    p95_latency_ms: float | None
    achieved_request_throughput: float | None
    errors: int
    passed: bool


@dataclass(slots=True)
class SearchResult:
    """The maximum sustainable request rate of one configuration under a p95 latency bound."""

    config: str
    latency_bound_ms: float
    probes: list[Probe]
    max_sustainable_rate: float | None  # None: even the lowest probed rate broke the bound

    def as_dict(self) -> dict[str, Any]:
        best = next((p for p in self.probes if p.rate == self.max_sustainable_rate and p.passed), None)
        return {
            "config": self.config,
            "latency_bound_ms": self.latency_bound_ms,
            "max_sustainable_request_rate": self.max_sustainable_rate,
            "p95_request_latency_at_max_ms": best.p95_latency_ms if best else None,
            "achieved_request_throughput_at_max": best.achieved_request_throughput if best else None,
            "probes": [
                {
                    "request_rate": p.rate,
                    "p95_request_latency_ms": p.p95_latency_ms,
                    "achieved_request_throughput": p.achieved_request_throughput,
                    "error_request_count": p.errors,
                    "passed": p.passed,
                }
                for p in self.probes
            ],
        }


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------

# (CSV column, summary metric, stat) in the order the CSV lists them.
_CSV_STATS: Final = (
    ("request_count", "request_count", "avg"),
    ("error_request_count", "error_request_count", "avg"),
    ("benchmark_duration_s", "benchmark_duration", "avg"),
    ("time_to_first_token_p50_ms", "time_to_first_token", "p50"),
    ("time_to_first_token_p95_ms", "time_to_first_token", "p95"),
    ("inter_token_latency_p50_ms", "inter_token_latency", "p50"),
    ("inter_token_latency_p95_ms", "inter_token_latency", "p95"),
    ("request_latency_p50_ms", "request_latency", "p50"),
    ("request_latency_p95_ms", "request_latency", "p95"),
    ("output_sequence_length_avg", "output_sequence_length", "avg"),
    ("output_token_throughput_tokens_per_s", "output_token_throughput", "avg"),
    ("request_throughput_per_s", "request_throughput", "avg"),
    ("spec_decode_token_weighted_acceptance_length", "spec_decode_token_weighted_acceptance_length", "avg"),
    ("spec_decode_overall_draft_acceptance_rate_pct", "spec_decode_overall_draft_acceptance_rate", "avg"),
)


def _stat(summary: Mapping[str, Any], metric: str, stat: str) -> Any:
    block = summary.get(metric)
    return block.get(stat) if isinstance(block, dict) else None


def csv_rows(results: Sequence[LoadResult], searches: Sequence[SearchResult] = ()) -> list[dict[str, Any]]:
    """One flat row per configuration and load; the search's answer repeated on its config's rows."""
    max_k = max(
        (len(r.summary.get("spec_decode_per_position_acceptance_rates", [])) for r in results), default=0
    )
    by_config = {s.config: s for s in searches}
    rows: list[dict[str, Any]] = []
    for r in results:
        row: dict[str, Any] = {"config": r.config, "load_type": r.phase, "load": r.load}
        for column, metric, stat in _CSV_STATS:
            row[column] = _stat(r.summary, metric, stat)
        rates = r.summary.get("spec_decode_per_position_acceptance_rates", [])
        for i in range(max_k):
            row[f"acceptance_pos_{i}"] = rates[i] if i < len(rates) else None
        if searches:
            search = by_config.get(r.config)
            row["latency_bound_ms"] = search.latency_bound_ms if search else None
            row["max_sustainable_request_rate"] = search.max_sustainable_rate if search else None
        rows.append(row)
    return rows


def report_document(
    params: Mapping[str, Any],
    configs: Sequence[Mapping[str, Any]],
    results: Sequence[LoadResult],
    searches: Sequence[SearchResult],
) -> dict[str, Any]:
    """The JSON report: parameters, configurations, a summary per config and load, the searches."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "controlplane benchmark",
        "parameters": dict(params),
        "configurations": [dict(c) for c in configs],
        "results": [
            {"config": r.config, "load_type": r.phase, "load": r.load, "metrics": r.summary} for r in results
        ],
        "max_throughput": [s.as_dict() for s in searches],
    }


def aiperf_summary(
    result: LoadResult, started_ns: int | None = None, ended_ns: int | None = None
) -> dict[str, Any]:
    """One configuration and load as AIPerf's ``profile_export_aiperf.json`` (``JsonExportData``,
    ai-dynamo/aiperf ``src/aiperf/common/models/export_models.py``): ``schema_version``,
    ``benchmark_id``, one ``{"unit", "avg", "p50", ...}`` object per metric tag (AIPerf's own tags,
    and our ``spec_decode_*`` ones, which its model keeps as extra fields), ``was_cancelled``,
    ``error_summary`` (``[{"error_details": {code, type, message}, "count"}]``), ``start_time`` and
    ``end_time`` (ISO 8601). Metrics without a value are left out, as AIPerf's exporter drops Nones."""
    from datetime import UTC, datetime

    out: dict[str, Any] = {
        "schema_version": AIPERF_SCHEMA_VERSION,
        "benchmark_id": f"{result.config}/{result.phase}-{result.load:g}",
    }
    for tag, block in result.summary.items():
        if not isinstance(block, dict) or "unit" not in block:
            continue
        stats_ = {k: block[k] for k in AIPERF_STATS if block.get(k) is not None}
        if len(stats_) > 1:  # more than the unit
            out[tag] = stats_
    errors: dict[tuple[int | None, str, str], int] = {}
    for rec in result.records:
        if rec.error is not None:
            key = (rec.error.code, rec.error.type, rec.error.message)
            errors[key] = errors.get(key, 0) + 1
    out["was_cancelled"] = False
    out["error_summary"] = [
        {"error_details": {"code": c, "type": t, "message": m}, "count": n} for (c, t, m), n in errors.items()
    ]
    starts = [r.request_start_ns for r in result.records]
    ends = [r.request_end_ns for r in result.records]
    first = started_ns if started_ns is not None else min(starts, default=None)
    last = ended_ns if ended_ns is not None else max(ends, default=None)
    if first is not None and last is not None:
        out["start_time"] = datetime.fromtimestamp(first / 1e9, tz=UTC).isoformat()
        out["end_time"] = datetime.fromtimestamp(last / 1e9, tz=UTC).isoformat()
    return out


def _run_dir_name(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text) or "_"


def write_aiperf_runs(out_dir: Path, results: Sequence[LoadResult]) -> list[Path]:
    """Per configuration and load, AIPerf's artifact layout: a folder holding that run's
    ``profile_export.jsonl`` and ``profile_export_aiperf.json``; returns the folders."""
    folders: list[Path] = []
    for result in results:
        folder = (
            out_dir
            / AIPERF_DIR
            / _run_dir_name(result.config)
            / _run_dir_name(f"{result.phase}-{result.load:g}")
        )
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / JSONL_NAME).open("w") as fh:
            for rec in result.records:
                fh.write(json.dumps(to_aiperf_record(rec), allow_nan=False) + "\n")
        summary = aiperf_summary(result)
        (folder / AIPERF_JSON_NAME).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
        folders.append(folder)
    return folders


def write_reports(
    out_dir: Path,
    document: Mapping[str, Any],
    results: Sequence[LoadResult],
    searches: Sequence[SearchResult] = (),
    extra_records: Iterable[RequestRecord] = (),
) -> dict[str, Path]:
    """Write ``benchmark.json``, ``benchmark.csv`` and ``profile_export.jsonl`` under ``out_dir``,
    and AIPerf's own layout per configuration and load (``write_aiperf_runs``); with one
    configuration at one load, ``profile_export_aiperf.json`` sits next to the top-level JSONL too.

    ``extra_records`` (e.g. the throughput search's requests) join the per-request JSONL only.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / JSON_NAME, "csv": out_dir / CSV_NAME, "jsonl": out_dir / JSONL_NAME}
    paths["json"].write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    rows = csv_rows(results, searches)
    buf = io.StringIO()
    if rows:
        fieldnames = list(rows[0])
        for row in rows[1:]:
            fieldnames.extend(k for k in row if k not in fieldnames)
        writer = csv.DictWriter(buf, fieldnames=fieldnames, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    paths["csv"].write_text(buf.getvalue())
    with paths["jsonl"].open("w") as fh:
        for result in results:
            for rec in result.records:
                fh.write(json.dumps(to_aiperf_record(rec), allow_nan=False) + "\n")
        for rec in extra_records:
            fh.write(json.dumps(to_aiperf_record(rec), allow_nan=False) + "\n")
    runs = write_aiperf_runs(out_dir, results)
    paths["aiperf"] = out_dir / AIPERF_DIR
    if len(results) == 1:  # a single run: AIPerf's files also at the top, as `aiperf profile` writes
        paths["aiperf_json"] = out_dir / AIPERF_JSON_NAME
        paths["aiperf_json"].write_text((runs[0] / AIPERF_JSON_NAME).read_text())
    return paths


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _ms(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _pair(summary: Mapping[str, Any], metric: str) -> str:
    return f"{_ms(_stat(summary, metric, 'p50'))}/{_ms(_stat(summary, metric, 'p95'))}"


def render(console: Any, results: Sequence[LoadResult], searches: Sequence[SearchResult] = ()) -> None:
    """Print the results table (and the throughput search's) on a Rich console."""
    from rich.table import Table

    table = Table(title="controlplane benchmark (latencies in ms: p50/p95)", title_justify="left")
    for name, justify in (
        ("config", "left"),
        ("load", "right"),
        ("ok/err", "right"),
        ("TTFT", "right"),
        ("ITL", "right"),
        ("latency", "right"),
        ("out tok/s", "right"),
        ("req/s", "right"),
        ("accept len", "right"),
        ("accept by position", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in results:
        s = r.summary
        load = f"c={int(r.load)}" if r.phase == "concurrency" else f"{r.load:g}/s"
        rates = s.get("spec_decode_per_position_acceptance_rates")
        table.add_row(
            r.config,
            load,
            f"{_fmt(_stat(s, 'request_count', 'avg'))}/{_fmt(_stat(s, 'error_request_count', 'avg'))}",
            _pair(s, "time_to_first_token"),
            _pair(s, "inter_token_latency"),
            _pair(s, "request_latency"),
            _fmt(_stat(s, "output_token_throughput", "avg")),
            _fmt(_stat(s, "request_throughput", "avg"), 2),
            _fmt(_stat(s, "spec_decode_token_weighted_acceptance_length", "avg"), 2),
            " ".join(f"{x:.2f}" for x in rates) if rates else "-",
        )
    console.print(table)
    if searches:
        search_table = Table(title="maximum sustainable throughput (open loop)", title_justify="left")
        for name in ("config", "p95 bound ms", "max req/s", "p95 at max ms", "probes (req/s: p95 ms)"):
            search_table.add_column(name)
        for search in searches:
            d = search.as_dict()
            probes = ", ".join(
                f"{p.rate:g}: {_ms(p.p95_latency_ms)}{'' if p.passed else ' ✗'}" for p in search.probes
            )
            search_table.add_row(
                search.config,
                _ms(search.latency_bound_ms),
                _fmt(search.max_sustainable_rate, 3),
                _ms(d["p95_request_latency_at_max_ms"]),
                probes,
            )
        console.print(search_table)
