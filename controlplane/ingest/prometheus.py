"""vLLM's Prometheus spec-decode counters, turned into acceptance records by counter deltas.

This module owns parsing the exposition, in the Prometheus text format or in OpenMetrics (only the
four ``vllm:spec_decode_*`` counters; everything else is ignored), ``CounterSnapshot`` (one set of
counters per label set, JSON-able so the service can keep the last one per deployment), and the
pure delta logic ``records_from_scrapes``. No I/O and no database: the caller stores snapshots and
records.

OpenMetrics (https://prometheus.io/docs/specs/om/open_metrics_spec/) is told apart by its
``# EOF`` terminator, which it requires as the last line; prometheus_client's OpenMetrics parser
reads it, so exemplars, sample timestamps and ``# UNIT`` lines are handled as that spec says and
then ignored. Counter families may be declared without ``_total`` (the OpenMetrics way) or with it
(the Prometheus way). Names are accepted with ``vllm:`` or ``vllm_``: exporters that only allow
``[a-zA-Z0-9_]`` (prometheus_client's own OpenMetrics exposition among them) write the colon as an
underscore.

Counters used (vLLM ``vllm/v1/spec_decode/metrics.py``, labels ``model_name`` and ``engine``):

* ``vllm:spec_decode_num_drafts_total``: verify steps that carried a draft;
* ``vllm:spec_decode_num_draft_tokens_total``: draft tokens proposed;
* ``vllm:spec_decode_num_accepted_tokens_total``: draft tokens accepted;
* ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: drafts in which at least
  ``i + 1`` tokens were accepted (so non-increasing in i); one series per position 0..k-1, created
  at start-up, so the number of positions is the configured k.

A delta between two scrapes becomes one aggregate record per label set: ``verify_steps`` = Δdrafts,
``drafted_tokens`` = Δdraft tokens, ``accepted_tokens`` = Δaccepted, ``accepted_per_position`` =
Δper position, ``k`` = number of positions, and ``generated_tokens`` = accepted + verify steps
(each verify step emits its accepted drafts plus one token sampled by the target; the counters do
not see prefill tokens or steps without a draft, so this is a lower bound on output tokens).

What is and is not counted, so that nothing is lost or counted twice:

* A label set seen for the first time is a baseline: its values are remembered, not counted. A
  long-lived engine's counters hold its whole history (past 2^31 on a busy one), which is not
  the increase of any window; counting starts from that first sight. A delta too large for one
  record (a counter past 2^31 within one window, which only a long gap between scrapes makes) is
  a baseline again.
* A counter that went down, or a new ``_created`` time, is a reset: the new values are the
  increase since the restart, as Prometheus' ``increase()`` takes them.
* A label set missing from one scrape (an engine that did not answer, a torn page) stays in the
  kept snapshot for MAX_MISSED_SCRAPES scrapes (within the label-set cap): when it returns it is
  diffed against its last values, never counted again from zero.
* A record's id derives from the scrape id, the label set and the counter values it was made of,
  so the same scrape applied twice stores once, and a reused scrape id with other counter values
  still stores its data.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Final, TypeGuard

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families

from controlplane.ingest.formats import (
    MAX_COUNT,
    MAX_K,
    BatchTooLargeError,
    BatchValidationError,
    Problem,
    record_problems,
)
from controlplane.ingest.record import ARM_LIVE, AcceptanceRecord

DRAFTS: Final = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS: Final = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS: Final = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS: Final = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
POSITION_LABEL: Final = "position"
SNAPSHOT_VERSION: Final = 1
# Label sets (engines) one exposition may carry; the push route takes its limit from Settings.
MAX_LABEL_SETS: Final = 1000
# Scrapes a vanished label set is remembered for, so that it is diffed, not re-counted, on return.
MAX_MISSED_SCRAPES: Final = 120

_TOTALS: Final = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED_TOKENS: "accepted_tokens"}
# `<name>_created` (the counter's creation time) changes when the server restarts, even when the
# new values have already grown past the old ones, so it catches resets that values alone miss.
_CREATED: Final = "vllm:spec_decode_num_drafts_created"
# Cheap line filter: the exposition of a busy server is mostly histograms we never read.
_LINE_MARKER: Final = "spec_decode_num_"
# A line naming one of our metrics (a sample, or its TYPE/HELP/UNIT metadata), in either spelling;
# groups: the metadata prefix, the name after ``vllm:``/``vllm_``, and the rest of the line.
_SPEC_DECODE_LINE: Final = re.compile(
    r"[ \t]*(# (?:TYPE|HELP|UNIT) )?vllm[:_](spec_decode_num_[a-zA-Z0-9_:]*)(.*)"
)
_CANONICAL_PREFIX: Final = "vllm:"
# prometheus_client ships this parser without annotations; its signature matches the text one.
_openmetrics_string_to_metric_families: Callable[[str], Iterable[Metric]] = (
    openmetrics_parser.text_string_to_metric_families
)
OPENMETRICS_MEDIA_TYPE: Final = "application/openmetrics-text"
OPENMETRICS_EOF: Final = "# EOF"
_EOF_LINE: Final = re.compile(r"^# EOF$", re.MULTILINE)

LabelKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class SeriesCounters:
    """Cumulative counter values of one label set at one scrape."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    per_pos: tuple[int, ...] = ()
    created: float | None = None  # the drafts counter's creation time, when exposed
    missed: int = 0  # scrapes in a row this label set was absent from (kept snapshots only)


@dataclass(frozen=True, slots=True)
class CounterSnapshot:
    """The spec-decode counters of one scrape, per label set (all labels but ``position``)."""

    series: Mapping[LabelKey, SeriesCounters] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, stable across releases (``version`` guards the layout)."""
        return {
            "version": SNAPSHOT_VERSION,
            "series": [
                {
                    "labels": dict(key),
                    "drafts": c.drafts,
                    "draft_tokens": c.draft_tokens,
                    "accepted_tokens": c.accepted_tokens,
                    "per_pos": list(c.per_pos),
                    "created": c.created,
                    "missed": c.missed,
                }
                for key, c in sorted(self.series.items())
            ],
        }

    @classmethod
    def from_dict(cls, data: object) -> CounterSnapshot:
        """Inverse of ``to_dict``; ``ValueError`` on anything it would not have written."""
        if not isinstance(data, dict) or data.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"not a version-{SNAPSHOT_VERSION} counter snapshot")
        items = data.get("series")
        if not isinstance(items, list):
            raise ValueError("snapshot series must be a list")
        series: dict[LabelKey, SeriesCounters] = {}
        for i, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("labels"), dict):
                raise ValueError(f"snapshot series[{i}] must be an object with labels")
            labels = item["labels"]
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
                raise ValueError(f"snapshot series[{i}].labels must map strings to strings")
            counts: list[int] = []
            for name in ("drafts", "draft_tokens", "accepted_tokens"):
                value = item.get(name)
                if not _is_count(value):
                    raise ValueError(f"snapshot series[{i}].{name} must be a non-negative integer")
                counts.append(value)
            per_pos = item.get("per_pos", [])
            created = item.get("created")
            if not isinstance(per_pos, list):
                raise ValueError(f"snapshot series[{i}].per_pos must be a list")
            if not all(_is_count(c) for c in per_pos):
                raise ValueError(f"snapshot series[{i}].per_pos has invalid counters")
            if created is not None and not isinstance(created, int | float):
                raise ValueError(f"snapshot series[{i}].created must be a number or null")
            missed = item.get("missed", 0)
            if not _is_count(missed):
                raise ValueError(f"snapshot series[{i}].missed must be a non-negative integer")
            key = _label_key(labels)
            if key in series:
                raise ValueError(f"snapshot series[{i}] repeats a label set")
            series[key] = SeriesCounters(
                counts[0],
                counts[1],
                counts[2],
                tuple(per_pos),
                float(created) if created is not None else None,
                missed,
            )
        return cls(series)


def _is_count(value: object) -> TypeGuard[int]:
    return type(value) is int and value >= 0


def _label_key(labels: Mapping[str, str]) -> LabelKey:
    return tuple(sorted((k, v) for k, v in labels.items() if k != POSITION_LABEL))


def _describe(key: LabelKey) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in key) + "}"


def is_openmetrics_media_type(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` header names OpenMetrics text (any version or parameters)."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == OPENMETRICS_MEDIA_TYPE


def _eof_problem(text: str, *, required: bool) -> Problem | None:
    """What is wrong with the ``# EOF`` terminator: missing (when required) or not the last line."""
    match = _EOF_LINE.search(text)
    if match is None:
        if required:
            return Problem(
                None, "body", f"an OpenMetrics exposition must end with a {OPENMETRICS_EOF!r} line"
            )
        return None
    if text[match.end() :] not in ("", "\n"):
        return Problem(
            None, "body", f"nothing may follow the {OPENMETRICS_EOF!r} line of an OpenMetrics exposition"
        )
    return None


def require_openmetrics_eof(text: str) -> None:
    """Refuse an OpenMetrics exposition without its ``# EOF`` line, or with text after it.

    For callers that know the body is OpenMetrics (from its content type): ``parse_exposition``
    alone cannot tell a truncated OpenMetrics body from Prometheus text, which has no terminator.
    """
    problem = _eof_problem(text, required=True)
    if problem is not None:
        raise BatchValidationError([problem])


def _canonical_lines(text: str, *, openmetrics: bool) -> list[str]:
    """Our metrics' lines, named ``vllm:...``; in OpenMetrics, metadata names lose a ``_total``.

    OpenMetrics names a counter family without ``_total`` and its samples with it; a family
    declared with the suffix would make the parser see the samples as a second family of that
    name, so the Prometheus-style declaration is rewritten rather than refused.
    """
    lines: list[str] = []
    for line in text.splitlines():
        if _LINE_MARKER not in line:
            continue
        match = _SPEC_DECODE_LINE.match(line)
        if match is None:
            continue  # the marker inside another metric's labels or help text
        metadata, name, rest = match.group(1) or "", match.group(2), match.group(3)
        if openmetrics and metadata and name.endswith("_total"):
            name = name.removesuffix("_total")
        lines.append(f"{metadata}{_CANONICAL_PREFIX}{name}{rest}")
    return lines


def parse_exposition(
    text: str, *, openmetrics: bool | None = None, max_label_sets: int = MAX_LABEL_SETS
) -> CounterSnapshot:
    """The spec-decode counters in a Prometheus text or OpenMetrics exposition (other metrics are
    ignored). ``openmetrics=None`` tells the format by the ``# EOF`` line; ``True`` requires it.

    Raises ``BatchValidationError`` (a ``ValueError``) listing every problem: malformed lines, a
    missing or misplaced ``# EOF`` in OpenMetrics, counter values that are negative, fractional or
    not finite, a label set missing one of the three total counters, positions that are not
    0..k-1 (k at most MAX_K), or no spec-decode counters at all; ``BatchTooLargeError`` for more
    than ``max_label_sets`` label sets.
    """
    if openmetrics is None:
        openmetrics = _EOF_LINE.search(text) is not None
    if openmetrics:
        require_openmetrics_eof(text)
    lines = _canonical_lines(text, openmetrics=openmetrics)
    problems: list[Problem] = []
    totals: dict[LabelKey, dict[str, int]] = {}
    positions: dict[LabelKey, dict[int, int]] = {}
    created: dict[LabelKey, float] = {}
    try:
        if openmetrics:
            # The other metrics were filtered out with the terminator; the parser requires it back.
            kept = "\n".join([*lines, OPENMETRICS_EOF]) + "\n"
            families = list(_openmetrics_string_to_metric_families(kept))
        else:
            families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
        samples = [s for family in families for s in family.samples]
    except ValueError as exc:
        kind = "OpenMetrics" if openmetrics else "Prometheus text"
        raise BatchValidationError([Problem(None, "body", f"malformed {kind} exposition: {exc}")]) from exc
    for sample in samples:
        name, labels, value = sample.name, sample.labels, sample.value
        if name not in _TOTALS and name != ACCEPTED_PER_POS:
            if name == _CREATED and math.isfinite(value):
                created[_label_key(labels)] = value
            continue  # other `_created` samples and non-spec metrics
        key = _label_key(labels)
        where = f"{name}{_describe(key)}"
        if not (math.isfinite(value) and value >= 0 and value == int(value)):
            problems.append(Problem(None, where, f"a counter must be a non-negative integer, got {value!r}"))
            continue
        count = int(value)
        if name == ACCEPTED_PER_POS:
            raw_pos = labels.get(POSITION_LABEL, "")
            if not (raw_pos.isascii() and raw_pos.isdigit()):
                problems.append(
                    Problem(None, where, f"position label must be 0, 1, ..., got {raw_pos[:20]!r}")
                )
                continue
            if len(raw_pos) > 3 or int(raw_pos) >= MAX_K:
                problems.append(
                    Problem(
                        None, where, f"position label must be below {MAX_K} (at most {MAX_K} draft positions)"
                    )
                )
                continue
            slot = positions.setdefault(key, {})
            if int(raw_pos) in slot:
                problems.append(Problem(None, f"{where}[{raw_pos}]", "sample repeated"))
            slot[int(raw_pos)] = count
        else:
            slot_totals = totals.setdefault(key, {})
            if _TOTALS[name] in slot_totals:
                problems.append(Problem(None, where, "sample repeated"))
            slot_totals[_TOTALS[name]] = count

    keys = set(totals) | set(positions)
    if len(keys) > max_label_sets:
        raise BatchTooLargeError(
            [
                Problem(
                    None,
                    "body",
                    f"{len(keys)} label sets exceed the limit of {max_label_sets} per exposition "
                    "(CONTROLPLANE_PROMETHEUS_MAX_LABEL_SETS)",
                )
            ]
        )
    series: dict[LabelKey, SeriesCounters] = {}
    for key in sorted(keys):
        found = totals.get(key, {})
        missing = [n for n, short in _TOTALS.items() if short not in found]
        if missing:
            problems.append(Problem(None, _describe(key), f"missing {', '.join(missing)}"))
            continue
        by_pos = positions.get(key, {})
        if sorted(by_pos) != list(range(len(by_pos))):
            problems.append(Problem(None, f"{ACCEPTED_PER_POS}{_describe(key)}", "positions must be 0..k-1"))
            continue
        series[key] = SeriesCounters(
            found["drafts"],
            found["draft_tokens"],
            found["accepted_tokens"],
            tuple(by_pos[i] for i in range(len(by_pos))),
            created.get(key),
        )
    if not series and not problems:
        problems.append(
            Problem(None, "body", "no vllm:spec_decode_* counters found; is speculative decoding on?")
        )
    if problems:
        raise BatchValidationError(problems)
    return CounterSnapshot(series)


def scrape_request_id(
    key: LabelKey,
    scrape_id: str,
    previous: SeriesCounters | None = None,
    current: SeriesCounters | None = None,
) -> str:
    """Deterministic: the same scrape pushed twice yields the same ids, so the store dedupes it;
    the counter values are part of the id, so a scrape id reused for other counters never makes
    a new window's record look like a repeat (and be dropped)."""
    values = [_values(previous), _values(current)]
    body = json.dumps([scrape_id, list(key), *values], separators=(",", ":"))
    return f"prom:{hashlib.sha256(body.encode()).hexdigest()[:40]}"


def _values(counters: SeriesCounters | None) -> list[Any] | None:
    if counters is None:
        return None
    c = counters
    return [c.drafts, c.draft_tokens, c.accepted_tokens, list(c.per_pos), c.created]


def _delta(previous: SeriesCounters, current: SeriesCounters) -> SeriesCounters:
    """``increase`` semantics: after a reset (any counter went down, or a new creation time) the
    current values are the increase since the reset."""
    reset = (
        current.drafts < previous.drafts
        or current.draft_tokens < previous.draft_tokens
        or current.accepted_tokens < previous.accepted_tokens
        or any(c < p for c, p in zip(current.per_pos, previous.per_pos, strict=False))
        or (
            current.created is not None
            and previous.created is not None
            and current.created != previous.created
        )
    )
    if reset:
        return current
    if len(current.per_pos) == len(previous.per_pos):
        per_pos = tuple(c - p for c, p in zip(current.per_pos, previous.per_pos, strict=True))
    else:
        # Positions appeared or vanished without a reset (k only changes on restart): a scrape
        # missed some series, so the per-position split of this window is unknown, not zero.
        per_pos = ()
    return SeriesCounters(
        current.drafts - previous.drafts,
        current.draft_tokens - previous.draft_tokens,
        current.accepted_tokens - previous.accepted_tokens,
        per_pos,
        current.created,
    )


def _fits_one_record(delta: SeriesCounters) -> bool:
    generated = delta.accepted_tokens + delta.drafts
    return (
        max(delta.drafts, delta.draft_tokens, delta.accepted_tokens, generated, *delta.per_pos) <= MAX_COUNT
    )


@dataclass(frozen=True, slots=True)
class CounterDeltas:
    """What one scrape adds: its records, the label sets taken as baselines (remembered, not
    counted), and the snapshot to keep for the next scrape (this one's counters plus label sets
    that vanished recently)."""

    records: list[AcceptanceRecord]
    baselines: list[LabelKey]
    snapshot: CounterSnapshot


def counter_deltas(
    previous: CounterSnapshot | None,
    current: CounterSnapshot,
    scrape_id: str,
    *,
    arm: str = ARM_LIVE,
    drafter_version: int | None = None,
    category: str | None = None,
    scraped_at: datetime | None = None,
    max_label_sets: int = MAX_LABEL_SETS,
) -> CounterDeltas:
    """One aggregate record per label set whose counters moved since ``previous``.

    Windows with no drafts and no tokens yield no record. Raises ``BatchValidationError`` when a
    delta breaks a count identity (e.g. more accepted than drafted, which only a scrape torn
    between counter updates produces), so no inconsistent row is stored.
    """
    records: list[AcceptanceRecord] = []
    baselines: list[LabelKey] = []
    problems: list[Problem] = []
    for key in sorted(current.series):
        now = current.series[key]
        before = previous.series.get(key) if previous is not None else None
        if before is None:
            baselines.append(key)
            continue
        delta = _delta(before, now)
        if not (delta.drafts or delta.draft_tokens or delta.accepted_tokens or any(delta.per_pos)):
            continue
        if not _fits_one_record(delta):
            baselines.append(key)
            continue
        record = AcceptanceRecord(
            request_id=scrape_request_id(key, scrape_id, before, now),
            drafted_tokens=delta.draft_tokens,
            accepted_tokens=delta.accepted_tokens,
            verify_steps=delta.drafts,
            generated_tokens=delta.accepted_tokens + delta.drafts,
            accepted_per_position=list(delta.per_pos),
            k=len(now.per_pos) or None,
            arm=arm,
            drafter_version=drafter_version,
            category=category,
            created_at=scraped_at,
        )
        errs = record_problems(record)
        if errs:
            problems.extend(Problem(None, f"{_describe(key)}.{f}", m) for f, m in errs)
            continue
        records.append(record)
    if problems:
        raise BatchValidationError(problems)
    return CounterDeltas(records, baselines, _kept_snapshot(previous, current, max_label_sets))


def _kept_snapshot(previous: CounterSnapshot | None, current: CounterSnapshot, limit: int) -> CounterSnapshot:
    """``current`` plus the label sets of ``previous`` it lacks, each remembered for at most
    MAX_MISSED_SCRAPES scrapes and, most recently seen first, within ``limit`` label sets in all."""
    series = dict(current.series)
    if previous is None:
        return current
    vanished = sorted(
        (c.missed, key, c)
        for key, c in previous.series.items()
        if key not in series and c.missed + 1 < MAX_MISSED_SCRAPES
    )
    for _, key, counters in vanished[: max(limit - len(series), 0)]:
        series[key] = replace(counters, missed=counters.missed + 1)
    return CounterSnapshot(series)


def records_from_scrapes(
    previous: CounterSnapshot | None,
    current: CounterSnapshot,
    scrape_id: str,
    *,
    arm: str = ARM_LIVE,
    drafter_version: int | None = None,
    category: str | None = None,
    scraped_at: datetime | None = None,
) -> list[AcceptanceRecord]:
    """The records of ``counter_deltas`` alone."""
    return counter_deltas(
        previous,
        current,
        scrape_id,
        arm=arm,
        drafter_version=drafter_version,
        category=category,
        scraped_at=scraped_at,
    ).records
