"""The router's pure parts: arm hashing, client keys, pool order, circuit breakers, reading
replies (whole and streamed), the bounded spool and the configuration file's errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controlplane.ingest.formats import parse_record
from controlplane.router.acceptance import (
    SseScanner,
    UnreadableReply,
    acceptance_record,
    prompt_text,
    trace_messages,
)
from controlplane.router.arms import client_key, pick_arm, unit_hash
from controlplane.router.config import RouterConfigError, load_config, parse_config
from controlplane.router.follower import ArmSpec, parse_serving_config
from controlplane.router.pools import CircuitBreakers, Pools
from controlplane.router.spool import DiskSpool
from tests.unit.test_ingest_formats import FIREWORKS_RESPONSE, SGLANG_RESPONSE

VLLM_METRICS = {
    "speculative_decoding": {
        "num_spec_steps": 3,
        "num_draft_tokens": 12,
        "num_accepted_draft_tokens": 6,
        "draft_acceptance_rate": 0.5,
        "mean_acceptance_length": 3.0,
        "acceptance_histogram": [0, 1, 1, 1, 0],
    }
}
ARMS = (ArmSpec("live", 0.5, 1), ArmSpec("canary:2", 0.3, 2), ArmSpec("baseline", 0.2, None))


def test_arm_shares_converge_to_their_weights_and_a_key_keeps_its_arm() -> None:
    counts = {a.name: 0 for a in ARMS}
    for i in range(20_000):
        counts[pick_arm(ARMS, f"user:{i}").name] += 1
    for arm in ARMS:
        assert abs(counts[arm.name] / 20_000 - arm.weight) < 0.015
    assert {pick_arm(ARMS, "user:alice").name for _ in range(5)} == {pick_arm(ARMS, "user:alice").name}
    # Weight 0 is never picked; weights need not sum to one.
    assert {
        pick_arm((ArmSpec("a", 0.0, None), ArmSpec("b", 3.0, None)), f"k{i}").name for i in range(200)
    } == {"b"}
    with pytest.raises(ValueError, match="positive weight"):
        pick_arm((ArmSpec("a", 0.0, None),), "k")
    assert unit_hash("x") != unit_hash("y")


def test_the_client_key_is_the_user_then_the_header_then_the_request_id() -> None:
    headers = {"x-session-id": "s-1"}
    assert client_key({"user": "u-1"}, headers, "x-session-id", "r-1") == "user:u-1"
    assert client_key({}, headers, "x-session-id", "r-1") == "header:s-1"
    assert client_key({"user": ""}, {}, "x-session-id", "r-1") == "request:r-1"
    assert client_key({}, headers, None, "r-1") == "request:r-1"


def _pools() -> Pools:
    pools = Pools()
    pools.update(
        [
            ("inc-a", "incumbent", "http://a", 1),
            ("inc-b", "incumbent", "http://b", 1),
            ("cand", "candidate", "http://c", 2),
            ("base", "baseline", "http://d", None),
        ]
    )
    return pools


def test_an_arm_tries_its_pool_then_the_baseline_then_the_live_arm() -> None:
    pools = _pools()
    arms = [(a.name, a.drafter_version) for a in ARMS]
    order = [(a.backend.name, a.arm) for a in pools.attempts("canary:2", 2, arms, now=0.0)]
    assert order == [("cand", "canary:2"), ("base", "baseline"), ("inc-a", "live"), ("inc-b", "live")]
    order = [(a.backend.name, a.arm) for a in pools.attempts("baseline", None, arms, now=0.0)]
    assert order[0] == ("base", "baseline") and {n for n, _ in order[1:]} == {"inc-a", "inc-b"}
    # After a promotion the live arm serves version 2: the backend labelled 2 serves it first.
    promoted = [(a.backend.name, a.arm) for a in pools.attempts("live", 2, [("live", 2)], now=0.0)]
    assert promoted[0] == ("cand", "live")


def test_equal_backends_take_turns_and_the_busier_one_waits() -> None:
    pools = _pools()
    breakers = CircuitBreakers(failures=3, cooldown_s=10.0)
    served = []
    for _ in range(4):
        first = pools.attempts("live", 1, [("live", 1)], now=0.0)[0].backend
        breakers.started(first, 0.0)
        breakers.succeeded(first)
        served.append(first.name)
    assert sorted(served) == ["inc-a", "inc-a", "inc-b", "inc-b"]
    busy = pools.attempts("live", 1, [("live", 1)], now=0.0)[0].backend
    breakers.started(busy, 0.0)
    assert pools.attempts("live", 1, [("live", 1)], now=0.0)[0].backend is not busy


def test_a_failing_backend_is_kept_out_then_tried_once_and_readmitted_on_success() -> None:
    pools = _pools()
    breakers = CircuitBreakers(failures=2, cooldown_s=10.0)
    a = next(b for b in pools.backends if b.name == "inc-a")
    for _ in range(2):
        breakers.started(a, 0.0)
        breakers.failed(a, now=1.0)
    assert not a.available(5.0)
    assert [x.backend.name for x in pools.attempts("live", 1, [("live", 1)], now=5.0)][0] == "inc-b"
    # Listed after every available backend (the baseline pool too): with all out, still tried.
    assert [x.backend.name for x in pools.attempts("live", 1, [("live", 1)], now=5.0)][-1] == "inc-a"
    assert a.available(11.5)
    breakers.started(a, 11.5)  # the half-open trial
    assert not a.available(11.5)
    breakers.failed(a, now=12.0)  # a failed trial reopens at once
    assert not a.available(13.0) and a.available(22.5)
    breakers.started(a, 22.5)
    breakers.succeeded(a)
    assert a.available(22.6) and a.consecutive_failures == 0


def test_rebuilding_pools_keeps_the_state_of_backends_that_stay() -> None:
    pools = _pools()
    a = next(b for b in pools.backends if b.name == "inc-a")
    a.served = 7
    pools.update([("inc-a", "incumbent", "http://a", 1), ("new", "incumbent", "http://n", None)])
    assert {b.name for b in pools.backends} == {"inc-a", "new"}
    assert next(b for b in pools.backends if b.name == "inc-a").served == 7
    pools.update([("inc-a", "incumbent", "http://moved", 1)])
    assert pools.backends[0].served == 0  # a changed URL is a new backend


def test_a_vllm_reply_becomes_a_record_filed_under_the_arm_that_served() -> None:
    reply = {
        "id": "cmpl-1",
        "created": 1,
        "choices": [{"index": 0, "text": "hello"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 9},
        "metrics": VLLM_METRICS,
    }
    record = acceptance_record(
        reply,
        request_id="r1",
        arm="canary:2",
        drafter_version=2,
        category="prose",
        ttft_ms=5.0,
        total_ms=45.0,
    )
    assert record["drafted_tokens"] == 12 and record["accepted_tokens"] == 6 and record["verify_steps"] == 3
    assert record["accepted_per_position"] == [3, 2, 1, 0]
    assert record["generated_tokens"] == 9 and record["arm"] == "canary:2" and record["drafter_version"] == 2
    assert record["ttft_ms"] == 5.0 and record["total_ms"] == 45.0 and record["inter_token_ms"] == 5.0
    assert record["category"] == "prose" and record["request_id"] == "r1"


def test_a_reply_without_acceptance_is_a_no_speculation_record_and_bad_metrics_are_refused() -> None:
    plain = {"choices": [{"text": "a b c"}], "usage": {"prompt_tokens": 2, "completion_tokens": 7}}
    record = acceptance_record(
        plain,
        request_id="r2",
        arm="baseline",
        drafter_version=None,
        category=None,
        ttft_ms=None,
        total_ms=30.0,
    )
    assert (record["drafted_tokens"], record["verify_steps"], record["generated_tokens"]) == (0, 0, 7)
    assert "inter_token_ms" not in record
    broken = {
        **plain,
        "metrics": {"speculative_decoding": {**VLLM_METRICS["speculative_decoding"], "num_draft_tokens": 2}},
    }
    with pytest.raises(UnreadableReply, match="accepted"):
        acceptance_record(
            broken,
            request_id="r3",
            arm="live",
            drafter_version=None,
            category=None,
            ttft_ms=None,
            total_ms=1.0,
        )


def test_the_stream_scanner_reads_metrics_from_the_final_event_across_chunk_boundaries() -> None:
    events = [
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {
            "id": "c",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 9},
            "metrics": VLLM_METRICS,
        },
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    scanner = SseScanner(keep_text=True)
    for i in range(0, len(stream), 7):  # chunks that split lines anywhere
        scanner.feed(stream[i : i + 7])
    scanner.close()
    assert "".join(scanner.text) == "Hello" and scanner.content_events == 2
    record = acceptance_record(
        scanner.reply,
        request_id="s",
        arm="live",
        drafter_version=None,
        category=None,
        ttft_ms=1.0,
        total_ms=9.0,
    )
    assert record["accepted_tokens"] == 6 and record["generated_tokens"] == 9
    quiet = SseScanner()
    quiet.feed(stream)
    assert quiet.text == [] and quiet.reply["usage"]["completion_tokens"] == 9
    # Without usage, the adapter's lower bound (accepted + steps = 9) gives way to the content
    # events when they say more: one token each at least.
    no_usage = {k: v for k, v in scanner.reply.items() if k != "usage"}
    counted = acceptance_record(
        no_usage,
        request_id="s",
        arm="live",
        drafter_version=None,
        category=None,
        ttft_ms=1.0,
        total_ms=9.0,
        content_events=11,
    )
    assert counted["generated_tokens"] == 11


def test_chat_prompts_are_kept_as_plain_role_lines() -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    assert prompt_text(body) == "system: Be brief.\nuser: Hi\nassistant: "
    assert prompt_text({"prompt": "p"}) == "p"
    assert prompt_text({"messages": [{"role": "user", "content": [{"type": "text"}]}]}) is None


def test_a_chat_trace_carries_its_messages_for_the_target_template() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief.", "name": "x"},
            {"role": "user", "content": "Hi"},
        ]
    }
    assert trace_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert trace_messages({"prompt": "p"}) is None
    assert trace_messages({"messages": []}) is None
    assert trace_messages({"messages": [{"role": "user", "content": [{"type": "text"}]}]}) is None


def test_the_spool_keeps_whole_batches_oldest_first_and_evicts_the_oldest_when_full(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, max_bytes=600)
    items = [{"request_id": f"r{i}", "drafted_tokens": 1} for i in range(5)]
    spool.put("chat", "acceptance", items)
    spool.put("chat", "traces", [{"prompt": "p", "completion": "c"}])
    batches = spool.batches()
    assert [(b.kind, b.items) for b in batches] == [("acceptance", 5), ("traces", 1)]
    assert spool.read(batches[0]) == items
    (spool.directory / "000000000099-acceptance-1-chat.tmp").write_text("{")  # a write cut short
    spool.close()
    reopened = DiskSpool(tmp_path, max_bytes=600)
    assert reopened.directory == spool.directory and reopened.bytes == spool.bytes
    assert len(reopened.batches()) == 2 and not list(reopened.directory.glob("*.tmp"))
    for _ in range(3):
        reopened.put("chat", "acceptance", items)
    assert reopened.bytes <= 600 and reopened.dropped_items > 0
    assert reopened.batches()[-1].items == 5
    reopened.close()


def test_router_processes_sharing_a_spool_each_hold_a_slot_and_orphans_are_adopted(tmp_path: Path) -> None:
    first, second = DiskSpool(tmp_path, 10_000), DiskSpool(tmp_path, 10_000)
    assert first.directory != second.directory  # two live processes never share a slot
    second.put("chat", "acceptance", [{"request_id": "a"}])
    second.put("chat", "acceptance", [{"request_id": "b"}])
    first.close()
    second.close()  # the second process is gone and its batches wait in its slot
    third = DiskSpool(tmp_path, 10_000)
    assert [third.read(b)[0]["request_id"] for b in third.batches()] == ["a", "b"]
    assert third.bytes == sum(b.size for b in third.batches())
    assert not [p for p in second.directory.iterdir() if p.suffix == ".json"]
    third.close()


def test_configuration_errors_name_the_file_and_the_field(tmp_path: Path) -> None:
    good = {
        "control_plane": {"url": "http://cp:8600"},
        "deployments": [
            {"name": "chat", "backends": [{"name": "a", "pool": "incumbent", "url": "http://a:8000/"}]}
        ],
    }
    config = parse_config(good)
    assert config.deployments[0].backends[0].url == "http://a:8000"
    bad = {
        "control_plane": {"url": "cp:8600"},
        "deployments": [
            {"name": "chat", "backends": [{"name": "A", "pool": "primary", "url": "http://a"}]},
            {"name": "chat"},
        ],
    }
    with pytest.raises(RouterConfigError) as caught:
        parse_config(bad, "router.toml")
    message = str(caught.value)
    assert "router.toml" in message and "control_plane.url" in message and "pool" in message
    path = tmp_path / "router.toml"
    path.write_text("[control_plane\n")
    with pytest.raises(RouterConfigError, match="not valid TOML"):
        load_config(path)
    with pytest.raises(RouterConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml")


def test_a_serving_config_without_a_positive_arm_is_refused() -> None:
    body = {"arms": [{"arm": "live", "weight": 0.0}], "backends": [], "config_version": "v"}
    with pytest.raises(ValueError, match="positive weight"):
        parse_serving_config(body, 0.0)
    parsed = parse_serving_config(
        {
            "arms": [{"arm": "live", "weight": 1.0, "drafter_version": 3}],
            "backends": [{"name": "a", "pool": "incumbent", "url": "http://a/", "drafter_version": 3}],
            "trace_sample_rate": 0.25,
            "config_version": "abc",
        },
        0.0,
    )
    assert parsed.arms == (ArmSpec("live", 1.0, 3),) and parsed.backends == (
        ("a", "incumbent", "http://a", 3),
    )


@pytest.mark.parametrize("reply", [SGLANG_RESPONSE, FIREWORKS_RESPONSE], ids=["sglang", "fireworks"])
def test_sglang_and_fireworks_replies_are_read_by_the_same_adapters_as_the_ingest_api(
    reply: dict[str, Any],
) -> None:
    ingested = parse_record({**reply, "request_id": "x"})
    record = acceptance_record(
        reply, request_id="x", arm="live", drafter_version=None, category=None, ttft_ms=None, total_ms=100.0
    )
    assert record["drafted_tokens"] == ingested.drafted_tokens > 0
    assert record["accepted_tokens"] == ingested.accepted_tokens
    assert record["verify_steps"] == ingested.verify_steps
    assert record["generated_tokens"] == ingested.generated_tokens
    assert record["total_ms"] == 100.0  # the router's own latency, not the engine's


def test_a_follower_reply_is_filed_under_what_the_follower_says_it_served() -> None:
    from controlplane.router.app import served_as
    from controlplane.router.pools import Attempt, BackendState

    follower = Attempt(BackendState("ref", "follower", "http://r", None), "canary:3")
    # The follower's own config lagged the router's: it served the live arm with no trained drafter.
    assert served_as(follower, {"x-speculation-arm": "live"}) == ("live", None)
    assert served_as(follower, {"x-speculation-arm": "canary:3", "x-drafter-version": "3"}) == ("canary:3", 3)
    fixed = Attempt(BackendState("cand", "candidate", "http://c", 3), "canary:3")
    assert served_as(fixed, {"x-speculation-arm": "live"}) == (
        "canary:3",
        3,
    )  # a fixed backend's word is its pool
    labelled = Attempt(BackendState("inc", "incumbent", "http://i", 2), "live")
    assert served_as(labelled, {}) == ("live", 2)
