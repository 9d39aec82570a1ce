"""Unit tests for vLLM Prometheus spec-decode counters -> acceptance records (no I/O).

Metric names, labels and the per-position semantics follow vLLM's own exporter
(https://github.com/vllm-project/vllm, vllm/v1/spec_decode/metrics.py: counters
vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens / _num_accepted_tokens_per_pos
with labels model_name, engine and position) and https://docs.vllm.ai/en/stable/design/metrics/.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace
from unittest import mock

import prometheus_client.metrics
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.openmetrics.exposition import generate_latest

from controlplane.ingest.formats import MAX_COUNT, BatchTooLargeError, BatchValidationError
from controlplane.ingest.prometheus import (
    MAX_MISSED_SCRAPES,
    CounterSnapshot,
    SeriesCounters,
    counter_deltas,
    is_openmetrics_media_type,
    parse_exposition,
    records_from_scrapes,
    require_openmetrics_eof,
    scrape_request_id,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def exposition(
    drafts: float,
    draft_tokens: float,
    accepted: float,
    per_pos: list[float],
    *,
    engine: str = "0",
    created: float = 1746100000.0,
    extra: str = "",
) -> str:
    """A /metrics page the way prometheus_client renders vLLM's counters (plus unrelated metrics)."""
    labels = f'engine="{engine}",model_name="{MODEL}"'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{engine="{engine}",model_name="{MODEL}"}} 3.0',
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}",
        f"vllm:spec_decode_num_drafts_created{{{labels}}} {created}",
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.",
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens}",
        f"vllm:spec_decode_num_draft_tokens_created{{{labels}}} {created}",
        "# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
        f"vllm:spec_decode_num_accepted_tokens_created{{{labels}}} {created}",
        "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
    ]
    for i, value in enumerate(per_pos):
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {value}')
        lines.append(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_created{{{labels},position="{i}"}} {created}'
        )
    lines += [
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",le="0.001",model_name="{MODEL}"}} 0.0',
        f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",le="+Inf",model_name="{MODEL}"}} 12.0',
        f'vllm:time_to_first_token_seconds_count{{engine="{engine}",model_name="{MODEL}"}} 12.0',
        f'vllm:time_to_first_token_seconds_sum{{engine="{engine}",model_name="{MODEL}"}} 0.84',
    ]
    return "\n".join(lines) + "\n" + extra


KEY0 = (("engine", "0"), ("model_name", MODEL))
KEY1 = (("engine", "1"), ("model_name", MODEL))


def test_parse_keeps_only_spec_decode_counters() -> None:
    snapshot = parse_exposition(exposition(100.0, 300.0, 170.0, [80.0, 55.0, 35.0]))
    assert snapshot.series == {KEY0: SeriesCounters(100, 300, 170, (80, 55, 35), 1746100000.0)}


def test_parse_accepts_exponent_notation_and_several_engines() -> None:
    text = exposition(1.0e3, 3.0e3, 1.5e3, [9.0e2, 6.0e2]) + exposition(
        5.0, 10.0, 4.0, [3.0, 1.0], engine="1"
    )
    snapshot = parse_exposition(text)
    assert snapshot.series[KEY0].drafts == 1000
    assert snapshot.series[KEY1] == SeriesCounters(5, 10, 4, (3, 1), 1746100000.0)


def test_label_order_does_not_matter() -> None:
    text = (
        f'vllm:spec_decode_num_drafts_total{{model_name="{MODEL}",engine="0"}} 1\n'
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="{MODEL}"}} 2\n'
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{MODEL}",engine="0"}} 1\n'
    )
    assert list(parse_exposition(text).series) == [KEY0]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('vllm:spec_decode_num_drafts_total{engine="0"} 1\n', "missing"),
        (exposition(1.5, 3.0, 1.0, [1.0]), "non-negative integer"),
        (exposition(-1.0, 3.0, 1.0, [1.0]), "non-negative integer"),
        (exposition(1.0, 3.0, 1.0, [1.0]).replace('position="0"', 'position="1"'), "0..k-1"),
        (exposition(1.0, 3.0, 1.0, [1.0]).replace('position="0"', 'position="x"'), "position label"),
        ('vllm:num_requests_running{engine="0"} 3\n', "no vllm:spec_decode"),
        ("vllm:spec_decode_num_drafts_total{engine=0} 1\n", "malformed"),
        (exposition(1.0, 3.0, 1.0, [1.0]) + exposition(2.0, 3.0, 1.0, [1.0]), "repeated"),
    ],
)
def test_parse_problems(text: str, fragment: str) -> None:
    with pytest.raises(BatchValidationError) as info:
        parse_exposition(text)
    assert any(fragment in p.message for p in info.value.problems), info.value.problems
    assert isinstance(info.value, ValueError)  # what the service catches


def test_snapshot_round_trips_through_json() -> None:
    text = exposition(100.0, 300.0, 170.0, [80.0, 55.0, 35.0]) + exposition(
        5.0, 10.0, 4.0, [3.0, 1.0], engine="1"
    )
    snapshot = parse_exposition(text)
    stored = json.loads(json.dumps(snapshot.to_dict()))
    assert CounterSnapshot.from_dict(stored) == snapshot
    assert CounterSnapshot.from_dict(CounterSnapshot().to_dict()) == CounterSnapshot()


@pytest.mark.parametrize(
    "data",
    [
        None,
        {"version": 2, "series": []},
        {"version": 1, "series": {}},
        {
            "version": 1,
            "series": [{"labels": {"engine": 0}, "drafts": 1, "draft_tokens": 1, "accepted_tokens": 0}],
        },
        {"version": 1, "series": [{"labels": {}, "drafts": -1, "draft_tokens": 1, "accepted_tokens": 0}]},
        {
            "version": 1,
            "series": [
                {"labels": {}, "drafts": 1, "draft_tokens": 1, "accepted_tokens": 0, "per_pos": [1.5]}
            ],
        },
        {
            "version": 1,
            "series": [{"labels": {}, "drafts": 1, "draft_tokens": 1, "accepted_tokens": 0, "created": "x"}],
        },
        {"version": 1, "series": [{"labels": {}, "drafts": 1, "draft_tokens": 1, "accepted_tokens": 0}] * 2},
    ],
)
def test_snapshot_from_dict_refuses_what_to_dict_never_writes(data: object) -> None:
    with pytest.raises(ValueError):
        CounterSnapshot.from_dict(data)


def test_delta_becomes_one_aggregate_record() -> None:
    before = parse_exposition(exposition(100.0, 300.0, 170.0, [80.0, 55.0, 35.0]))
    after = parse_exposition(exposition(150.0, 450.0, 250.0, [118.0, 80.0, 52.0]))
    when = datetime(2025, 5, 1, 12, 0, tzinfo=UTC)
    (record,) = records_from_scrapes(
        before, after, "scrape-2", arm="canary:4", drafter_version=4, category="code", scraped_at=when
    )
    assert (record.verify_steps, record.drafted_tokens, record.accepted_tokens) == (50, 150, 80)
    assert record.accepted_per_position == [38, 25, 17]
    assert record.generated_tokens == 80 + 50  # accepted plus one target token per verify step
    assert record.k == 3
    assert (record.arm, record.drafter_version, record.category, record.created_at) == (
        "canary:4",
        4,
        "code",
        when,
    )
    assert record.request_id == scrape_request_id(KEY0, "scrape-2", before.series[KEY0], after.series[KEY0])


def test_request_ids_are_deterministic_and_distinct() -> None:
    a = scrape_request_id(KEY0, "s1")
    assert a == scrape_request_id(KEY0, "s1")
    assert len({a, scrape_request_id(KEY0, "s2"), scrape_request_id(KEY1, "s1")}) == 3
    assert len(a) <= 200
    before = parse_exposition(exposition(1.0, 3.0, 1.0, [1.0, 0.0, 0.0]))
    after = parse_exposition(exposition(11.0, 33.0, 6.0, [4.0, 2.0, 0.0]))
    first = records_from_scrapes(before, after, "s9")
    assert records_from_scrapes(before, after, "s9") == first  # re-push: same ids, the store dedupes


def test_re_pushing_the_stored_scrape_yields_nothing() -> None:
    snapshot = parse_exposition(exposition(100.0, 300.0, 170.0, [80.0, 55.0, 35.0]))
    assert records_from_scrapes(snapshot, snapshot, "same") == []


def test_first_push_is_a_baseline_even_past_two_to_the_31() -> None:
    # A vLLM up for weeks: its counters hold its whole history, far beyond an INTEGER column.
    big = 3 * 2**31
    snapshot = parse_exposition(exposition(big, 3 * big, 2 * big, [big, big // 2, big // 2]))
    deltas = counter_deltas(None, snapshot, "first")
    assert deltas.records == [] and deltas.baselines == [KEY0]
    assert deltas.snapshot == snapshot
    # The next push counts only what happened since.
    later = parse_exposition(
        exposition(big + 10, 3 * big + 30, 2 * big + 17, [big + 8, big // 2 + 5, big // 2 + 4])
    )
    nxt = counter_deltas(deltas.snapshot, later, "second")
    (record,) = nxt.records
    assert (record.verify_steps, record.drafted_tokens, record.accepted_tokens) == (10, 30, 17)
    assert record.accepted_per_position == [8, 5, 4] and nxt.baselines == []


def test_a_delta_too_large_for_one_record_is_a_new_baseline() -> None:
    before = CounterSnapshot({KEY0: SeriesCounters(10, 30, 10, (6, 4))})
    after = CounterSnapshot({KEY0: SeriesCounters(10 + 2**31, 30 + 2**32, 10 + 2**31, (6 + 2**31, 4))})
    deltas = counter_deltas(before, after, "gap")
    assert deltas.records == [] and deltas.baselines == [KEY0]
    assert deltas.snapshot.series[KEY0] == after.series[KEY0]
    assert MAX_COUNT == 2**31 - 1


def test_a_reused_scrape_id_with_other_counters_still_stores_its_window() -> None:
    first = CounterSnapshot({KEY0: SeriesCounters(10, 20, 10, (6, 4))})
    second = CounterSnapshot({KEY0: SeriesCounters(20, 40, 20, (12, 8))})
    third = CounterSnapshot({KEY0: SeriesCounters(30, 60, 30, (18, 12))})
    (a,) = records_from_scrapes(first, second, "fixed")
    (b,) = records_from_scrapes(second, third, "fixed")
    assert a.request_id != b.request_id  # two windows, two records, whatever the scrape id
    (again,) = records_from_scrapes(first, second, "fixed")
    assert again.request_id == a.request_id  # the same window applied twice stores once


def test_a_vanished_label_set_is_diffed_against_its_last_values_when_it_returns() -> None:
    both = CounterSnapshot(
        {KEY0: SeriesCounters(100, 200, 150, (90, 60)), KEY1: SeriesCounters(50, 100, 70, (40, 30))}
    )
    only0 = CounterSnapshot({KEY0: SeriesCounters(110, 220, 165, (99, 66))})
    gap = counter_deltas(both, only0, "s2")
    assert [r.verify_steps for r in gap.records] == [10]
    assert gap.snapshot.series[KEY1] == SeriesCounters(50, 100, 70, (40, 30), missed=1)
    back = CounterSnapshot(
        {KEY0: SeriesCounters(120, 240, 180, (108, 72)), KEY1: SeriesCounters(60, 120, 84, (48, 36))}
    )
    returned = counter_deltas(gap.snapshot, back, "s3")
    assert sorted((r.verify_steps, r.accepted_tokens) for r in returned.records) == [(10, 14), (10, 15)]
    assert returned.baselines == [] and returned.snapshot.series[KEY1].missed == 0
    # Remembered through JSON too (the snapshot is stored between pushes).
    assert CounterSnapshot.from_dict(json.loads(json.dumps(gap.snapshot.to_dict()))) == gap.snapshot


def test_vanished_label_sets_are_remembered_for_a_bounded_time_and_number() -> None:
    previous = CounterSnapshot({KEY1: SeriesCounters(5, 15, 5, (3, 2), missed=MAX_MISSED_SCRAPES - 1)})
    current = CounterSnapshot({KEY0: SeriesCounters(1, 3, 1, (1, 0))})
    assert list(counter_deltas(previous, current, "x").snapshot.series) == [KEY0]  # forgotten
    previous = CounterSnapshot({KEY1: SeriesCounters(5, 15, 5, (3, 2))})
    assert list(counter_deltas(previous, current, "x", max_label_sets=1).snapshot.series) == [KEY0]
    assert set(counter_deltas(previous, current, "x", max_label_sets=2).snapshot.series) == {KEY0, KEY1}


def test_label_sets_per_exposition_are_capped() -> None:
    text = "".join(exposition(1.0, 3.0, 1.0, [1.0], engine=str(i)) for i in range(5))
    assert len(parse_exposition(text, max_label_sets=5).series) == 5
    with pytest.raises(BatchTooLargeError) as info:
        parse_exposition(text, max_label_sets=4)
    assert "limit of 4" in info.value.problems[0].message


def test_positions_beyond_the_draft_limit_are_refused() -> None:
    text = exposition(1.0, 3.0, 1.0, [1.0]).replace('position="0"', 'position="64"')
    with pytest.raises(BatchValidationError) as info:
        parse_exposition(text)
    assert any("below 64" in p.message for p in info.value.problems)
    huge = exposition(1.0, 3.0, 1.0, [1.0]).replace('position="0"', 'position="' + "9" * 5000 + '"')
    with pytest.raises(BatchValidationError):
        parse_exposition(huge)


def test_counter_reset_takes_current_values_as_the_increase() -> None:
    before = parse_exposition(exposition(100.0, 300.0, 170.0, [80.0, 55.0, 35.0]))
    restarted = parse_exposition(exposition(20.0, 60.0, 30.0, [15.0, 10.0, 5.0], created=1746200000.0))
    (record,) = records_from_scrapes(before, restarted, "after-restart")
    assert (record.verify_steps, record.drafted_tokens, record.accepted_tokens) == (20, 60, 30)
    assert record.accepted_per_position == [15, 10, 5]


def test_reset_seen_only_in_created_time() -> None:
    # The server restarted and already counted past the old values: only _created tells.
    before = parse_exposition(exposition(100.0, 300.0, 170.0, [80.0, 55.0, 35.0]))
    after = parse_exposition(exposition(120.0, 360.0, 200.0, [90.0, 65.0, 45.0], created=1746200000.0))
    (record,) = records_from_scrapes(before, after, "x")
    assert (record.verify_steps, record.accepted_tokens) == (120, 200)


def test_reset_of_one_position_counter_resets_the_series() -> None:
    before = SeriesCounters(100, 300, 170, (80, 55, 35))
    after = SeriesCounters(110, 330, 171, (82, 55, 34))
    (record,) = records_from_scrapes(CounterSnapshot({KEY0: before}), CounterSnapshot({KEY0: after}), "x")
    assert record.verify_steps == 110  # never a negative delta


def test_a_new_label_set_is_a_baseline_and_a_vanished_one_counts_nothing() -> None:
    before = parse_exposition(exposition(100.0, 300.0, 170.0, [80.0, 55.0, 35.0]))
    after = parse_exposition(
        exposition(100.0, 300.0, 170.0, [80.0, 55.0, 35.0])
        + exposition(5.0, 15.0, 4.0, [3.0, 1.0, 0.0], engine="1")
    )
    deltas = counter_deltas(before, after, "y")
    assert deltas.records == [] and deltas.baselines == [KEY1]
    assert records_from_scrapes(after, before, "z") == []


def test_positions_appearing_or_vanishing_without_reset() -> None:
    no_positions = CounterSnapshot({KEY0: SeriesCounters(10, 30, 6, ())})
    with_positions = CounterSnapshot({KEY0: SeriesCounters(20, 60, 12, (6, 4, 2))})
    (grew,) = records_from_scrapes(no_positions, with_positions, "a")
    assert grew.accepted_tokens == 6 and grew.accepted_per_position == []  # previous positions unknown
    (shrank,) = records_from_scrapes(
        with_positions, CounterSnapshot({KEY0: SeriesCounters(30, 90, 18, ())}), "b"
    )
    assert shrank.accepted_per_position == [] and shrank.k is None


def test_torn_scrape_is_refused() -> None:
    before = CounterSnapshot({KEY0: SeriesCounters(100, 300, 170, (80, 55, 35))})
    torn = CounterSnapshot({KEY0: SeriesCounters(101, 303, 180, (82, 57, 41))})  # +10 accepted, +3 drafted
    with pytest.raises(BatchValidationError) as info:
        records_from_scrapes(before, torn, "t")
    fields = {p.field for p in info.value.problems}
    assert any(f.endswith(".accepted_tokens") for f in fields), fields


# --- OpenMetrics -------------------------------------------------------------------------------

STARTED_AT = 1746100000.0
RESTARTED_AT = 1746200000.0


class FakeVllmServer:
    """vLLM's spec-decode counters in a real prometheus_client registry, exposed as OpenMetrics.

    The counters are created (and their ``_created`` time fixed) at start-up, as vLLM does for
    every position 0..k-1; a restart is a new instance with a later ``started_at``.
    """

    def __init__(self, k: int = 3, *, started_at: float = STARTED_AT, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        clock = SimpleNamespace(time=lambda: started_at)
        with mock.patch.object(prometheus_client.metrics, "time", clock):
            self.drafts = Counter(
                "vllm:spec_decode_num_drafts",
                "Number of spec decoding drafts.",
                labels,
                registry=self.registry,
            ).labels(MODEL, engine)
            self.draft_tokens = Counter(
                "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels, registry=self.registry
            ).labels(MODEL, engine)
            self.accepted = Counter(
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                labels,
                registry=self.registry,
            ).labels(MODEL, engine)
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [*labels, "position"],
                registry=self.registry,
            )
            self.per_pos = [per_pos.labels(MODEL, engine, str(i)) for i in range(k)]
        # Metrics the parser must skip: a gauge and a histogram with a unit.
        Gauge("vllm:num_requests_running", "Requests running.", labels, registry=self.registry).labels(
            MODEL, engine
        ).set(3)
        Histogram(
            "vllm:time_to_first_token_seconds", "TTFT.", labels, unit="seconds", registry=self.registry
        ).labels(MODEL, engine).observe(0.2)

    def serve(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> None:
        """Count one window of verify steps; the drafts counter carries a trace exemplar."""
        self.drafts.inc(drafts, exemplar={"trace_id": "0af7651916cd43dd8448eb211c80319c"})
        self.draft_tokens.inc(draft_tokens)
        self.accepted.inc(accepted)
        for child, value in zip(self.per_pos, per_pos, strict=True):
            child.inc(value)

    def scrape(self) -> str:
        return generate_latest(self.registry).decode()


def openmetrics(
    drafts: int,
    draft_tokens: int,
    accepted: int,
    per_pos: list[int],
    *,
    created: float = STARTED_AT,
    prefix: str = "vllm:",
    typed_with_total: bool = False,
    timestamp: str = "",
) -> str:
    """An OpenMetrics page written by hand, for the cases prometheus_client never renders."""
    labels = f'engine="0",model_name="{MODEL}"'
    stamp = f" {timestamp}" if timestamp else ""
    lines = [
        "# TYPE vllm:time_to_first_token_seconds histogram",
        "# UNIT vllm:time_to_first_token_seconds seconds",
        f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",{labels}}} 12.0',
        f"vllm:time_to_first_token_seconds_count{{{labels}}} 12.0",
        f"vllm:time_to_first_token_seconds_sum{{{labels}}} 0.84",
    ]
    families = [
        ("num_drafts", [("", drafts)]),
        ("num_draft_tokens", [("", draft_tokens)]),
        ("num_accepted_tokens", [("", accepted)]),
        ("num_accepted_tokens_per_pos", [(f',position="{i}"', v) for i, v in enumerate(per_pos)]),
    ]
    for short, samples in families:
        family = f"{prefix}spec_decode_{short}"
        declared = f"{family}_total" if typed_with_total else family
        lines += [
            f"# TYPE {declared} counter",
            f"# UNIT {declared} ",
            f"# HELP {declared} Spec decode {short}.",
        ]
        for extra, value in samples:
            exemplar = ' # {trace_id="abc"} 1.0 1746100001.5' if short == "num_drafts" else ""
            lines.append(f"{family}_total{{{labels}{extra}}} {value}{stamp}{exemplar}")
            lines.append(f"{family}_created{{{labels}{extra}}} {created}{stamp}")
    return "\n".join([*lines, "# EOF"]) + "\n"


def test_prometheus_client_openmetrics_scrape_parses() -> None:
    server = FakeVllmServer()
    server.serve(100, 300, 170, [80, 55, 35])
    text = server.scrape()
    assert text.endswith("# EOF\n") and "vllm_spec_decode_num_drafts_total" in text  # the real format
    expected = {KEY0: SeriesCounters(100, 300, 170, (80, 55, 35), STARTED_AT)}
    assert parse_exposition(text).series == expected  # told by the # EOF line
    assert parse_exposition(text, openmetrics=True).series == expected


def test_prometheus_client_openmetrics_scrapes_become_deltas() -> None:
    server = FakeVllmServer()
    server.serve(100, 300, 170, [80, 55, 35])
    before = parse_exposition(server.scrape())
    server.serve(50, 150, 80, [38, 25, 17])
    (record,) = records_from_scrapes(before, parse_exposition(server.scrape()), "om-2")
    assert (record.verify_steps, record.drafted_tokens, record.accepted_tokens) == (50, 150, 80)
    assert record.accepted_per_position == [38, 25, 17] and record.k == 3


def test_prometheus_client_restart_with_larger_values_is_a_reset() -> None:
    server = FakeVllmServer()
    server.serve(100, 300, 170, [80, 55, 35])
    before = parse_exposition(server.scrape())
    restarted = FakeVllmServer(started_at=RESTARTED_AT)
    restarted.serve(120, 360, 200, [90, 65, 45])  # already past the old values
    (record,) = records_from_scrapes(before, parse_exposition(restarted.scrape()), "om-restart")
    assert (record.verify_steps, record.accepted_tokens, record.accepted_per_position) == (
        120,
        200,
        [90, 65, 45],
    )


def test_openmetrics_created_samples_are_not_counters_but_mark_restarts() -> None:
    before = parse_exposition(openmetrics(100, 300, 170, [80, 55, 35]))
    assert before.series == {KEY0: SeriesCounters(100, 300, 170, (80, 55, 35), STARTED_AT)}
    same_start = parse_exposition(openmetrics(120, 360, 200, [90, 65, 45]))
    (record,) = records_from_scrapes(before, same_start, "a")
    assert (record.verify_steps, record.accepted_tokens) == (20, 30)
    restarted = parse_exposition(openmetrics(120, 360, 200, [90, 65, 45], created=RESTARTED_AT))
    (record,) = records_from_scrapes(before, restarted, "b")
    assert (record.verify_steps, record.accepted_tokens) == (120, 200)  # neither 20 nor 100 + 120


@pytest.mark.parametrize("prefix", ["vllm:", "vllm_"])
@pytest.mark.parametrize("typed_with_total", [False, True])
def test_openmetrics_spellings_and_family_declarations(prefix: str, typed_with_total: bool) -> None:
    text = openmetrics(10, 30, 6, [4, 2], prefix=prefix, typed_with_total=typed_with_total)
    assert parse_exposition(text).series == {KEY0: SeriesCounters(10, 30, 6, (4, 2), STARTED_AT)}


def test_prometheus_text_accepts_the_underscore_spelling() -> None:
    text = exposition(100.0, 300.0, 170.0, [80.0, 55.0, 35.0]).replace("vllm:", "vllm_")
    assert parse_exposition(text).series == {KEY0: SeriesCounters(100, 300, 170, (80, 55, 35), STARTED_AT)}
    both = exposition(1.0, 3.0, 1.0, [1.0]) + exposition(1.0, 3.0, 1.0, [1.0]).replace("vllm:", "vllm_")
    with pytest.raises(BatchValidationError, match="repeated"):
        parse_exposition(both)  # one series written in both spellings is still one series


def test_openmetrics_timestamps_and_exemplars_are_ignored() -> None:
    text = openmetrics(10, 30, 6, [4, 2], timestamp="1746100100.25")
    assert '# {trace_id="abc"}' in text
    assert parse_exposition(text).series == {KEY0: SeriesCounters(10, 30, 6, (4, 2), STARTED_AT)}


@pytest.mark.parametrize(
    ("text", "openmetrics_flag", "fragment"),
    [
        (openmetrics(1, 3, 1, [1]).removesuffix("# EOF\n"), True, "must end with"),
        (openmetrics(1, 3, 1, [1]) + "vllm:spec_decode_num_drafts_total 1\n", None, "nothing may follow"),
        (openmetrics(1, 3, 1, [1]) + "\n", None, "nothing may follow"),
        (openmetrics(1, 3, 1, [1]) + "# EOF\n", None, "nothing may follow"),
        (openmetrics(1, 3, 1, [1]).replace("} 3", "} -3"), None, "malformed OpenMetrics"),
    ],
)
def test_openmetrics_problems(text: str, openmetrics_flag: bool | None, fragment: str) -> None:
    with pytest.raises(BatchValidationError) as info:
        parse_exposition(text, openmetrics=openmetrics_flag)
    assert any(fragment in p.message for p in info.value.problems), info.value.problems


def test_eof_terminator_check() -> None:
    require_openmetrics_eof(openmetrics(1, 3, 1, [1]))
    require_openmetrics_eof(openmetrics(1, 3, 1, [1]).removesuffix("\n"))  # the final newline is optional
    with pytest.raises(BatchValidationError, match="must end with"):
        require_openmetrics_eof(exposition(1.0, 3.0, 1.0, [1.0]))
    # Without a terminator and without a content type saying otherwise, it is Prometheus text.
    assert KEY0 in parse_exposition(exposition(1.0, 3.0, 1.0, [1.0])).series


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("application/openmetrics-text; version=1.0.0; charset=utf-8", True),
        ("Application/OpenMetrics-Text", True),
        ("text/plain; version=0.0.4; charset=utf-8", False),
        ("", False),
        (None, False),
    ],
)
def test_openmetrics_media_type(content_type: str | None, expected: bool) -> None:
    assert is_openmetrics_media_type(content_type) is expected
