"""Benchmark report math against brute force, and the runner's pure pieces (no network)."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from controlplane.ingest.record import AcceptanceRecord
from loadbench.cli import ConfigError, load_configs_file, parse_config_option
from loadbench.prompts import DOMAINS, DatasetError, PromptItem, builtin_prompts, load_dataset
from loadbench.report import (
    ErrorDetails,
    LoadResult,
    RequestRecord,
    acceptance_histogram,
    aiperf_summary,
    csv_rows,
    inter_token_latency_ms,
    percentile,
    pooled_acceptance,
    stats,
    summarize,
    to_aiperf_record,
)
from loadbench.runner import (
    Configuration,
    Sampling,
    arrival_offsets,
    read_acceptance,
    refuses_perf_flag,
    send_request,
)
from tests.aiperf_spec import AIPERF_METRIC_STATS


def _brute_percentile(values: list[float], p: float) -> float:
    """Linear interpolation written out from the definition: rank (n-1)p/100 between neighbours."""
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    below = int(rank)
    if below == len(xs) - 1:
        return xs[below]
    return xs[below] * (1 - (rank - below)) + xs[below + 1] * (rank - below)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 50, 101])
def test_percentile_matches_numpy_and_brute_force(n: int) -> None:
    rng = random.Random(n)
    values = [rng.lognormvariate(3, 1) for _ in range(n)]
    for p in (0, 1, 5, 25, 50, 75, 90, 95, 99, 100, 33.3):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12)
        assert percentile(values, p) == pytest.approx(_brute_percentile(values, p), rel=1e-12)


def test_percentile_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_stats_block_matches_numpy_and_is_ordered() -> None:
    rng = random.Random(7)
    values = [rng.uniform(0, 1000) for _ in range(200)]
    block = stats(values, "ms")
    assert block["unit"] == "ms" and block["count"] == 200
    assert block["avg"] == pytest.approx(float(np.mean(values)))
    assert block["std"] == pytest.approx(float(np.std(values)))  # population, as numpy's default
    assert block["min"] <= block["p50"] <= block["p90"] <= block["p95"] <= block["p99"] <= block["max"]
    assert stats([], "ms") == {"unit": "ms", "count": 0}


def test_inter_token_latency_is_the_mean_gap_between_tokens() -> None:
    rng = random.Random(3)
    for _ in range(100):
        n = rng.randint(2, 60)
        times = sorted(rng.randint(0, 10**10) for _ in range(n))
        gaps = [(b - a) / 1e6 for a, b in zip(times, times[1:], strict=False)]
        assert inter_token_latency_ms(times[0], times[-1], n) == pytest.approx(sum(gaps) / len(gaps))
    assert inter_token_latency_ms(0, 10, 1) is None  # undefined below two tokens
    assert inter_token_latency_ms(10, 0, 5) is None


def _per_step(rng: random.Random, k: int, steps: int) -> list[int]:
    return [rng.randint(0, k) for _ in range(steps)]


def _positions(per_step: list[int], k: int) -> list[int]:
    return [sum(1 for a in per_step if a >= i + 1) for i in range(k)]


def test_acceptance_histogram_equals_counting_steps() -> None:
    rng = random.Random(11)
    for _ in range(200):
        k = rng.randint(1, 6)
        per_step = _per_step(rng, k, rng.randint(0, 40))
        hist = acceptance_histogram(_positions(per_step, k), len(per_step))
        counted = Counter(per_step)
        assert hist == [counted.get(j, 0) for j in range(k + 1)]
        assert sum(hist) == len(per_step)


def _acc(rng: random.Random, k: int, steps: int, request_id: str = "r") -> AcceptanceRecord:
    per_step = _per_step(rng, k, steps)
    accepted = sum(per_step)
    return AcceptanceRecord(
        request_id=request_id,
        drafted_tokens=k * steps,
        accepted_tokens=accepted,
        verify_steps=steps,
        generated_tokens=1 + accepted + steps,
        accepted_per_position=_positions(per_step, k),
        k=k,
    )


def test_pooled_acceptance_by_position_matches_brute_force_and_does_not_increase() -> None:
    rng = random.Random(5)
    accs = [_acc(rng, 4, rng.randint(1, 30), f"r{i}") for i in range(20)]
    pooled = pooled_acceptance(accs)
    steps = sum(a.verify_steps for a in accs)
    rates = pooled["spec_decode_per_position_acceptance_rates"]
    for i, rate in enumerate(rates):
        assert rate == pytest.approx(sum(a.accepted_per_position[i] for a in accs) / steps)
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    accepted = sum(a.accepted_tokens for a in accs)
    assert pooled["spec_decode_token_weighted_acceptance_length"]["avg"] == pytest.approx(
        1 + accepted / steps
    )
    assert pooled["spec_decode_overall_draft_acceptance_rate"]["avg"] == pytest.approx(
        100 * accepted / sum(a.drafted_tokens for a in accs)
    )
    assert sum(pooled["pooled_spec_decode_acceptance_histogram"].values()) == steps
    # acceptance length = 1 + Σ_i rate_i (each accepted position adds one token per step)
    assert 1 + sum(rates) == pytest.approx(pooled["spec_decode_token_weighted_acceptance_length"]["avg"])
    assert pooled_acceptance([]) == {}


def _record(i: int, latency_ms: float, tokens: int, acc: AcceptanceRecord | None = None) -> RequestRecord:
    start = 10**18 + i * 10**9
    return RequestRecord(
        config="c",
        phase="concurrency",
        load=1,
        session_num=i,
        x_request_id=f"id{i}",
        prompt_index=i,
        category=None,
        request_start_ns=start,
        request_end_ns=start + int(latency_ms * 1e6),
        first_token_ns=start + 10**6,
        last_token_ns=start + int(latency_ms * 1e6),
        ttft_ms=1.0,
        itl_ms=inter_token_latency_ms(start + 10**6, start + int(latency_ms * 1e6), tokens),
        output_tokens=tokens,
        input_tokens=5,
        acceptance=acc,
    )


def test_summarize_throughputs_and_percentiles_over_requests() -> None:
    rng = random.Random(2)
    records = [
        _record(i, rng.uniform(50, 500), rng.randint(2, 40), _acc(rng, 3, 5, f"id{i}")) for i in range(30)
    ]
    failed = _record(30, 10, 0)
    failed.error = ErrorDetails(500, "HTTPStatusError", "boom")
    summary = summarize([*records, failed], duration_s=12.5)
    assert summary["request_count"]["avg"] == 30 and summary["error_request_count"]["avg"] == 1
    total = sum(r.output_tokens or 0 for r in records)
    assert summary["output_token_throughput"]["avg"] == pytest.approx(total / 12.5)
    assert summary["request_throughput"]["avg"] == pytest.approx(30 / 12.5)
    itls = [r.itl_ms for r in records if r.itl_ms is not None]
    assert summary["inter_token_latency"]["p95"] == pytest.approx(float(np.percentile(itls, 95)))
    latencies = [r.request_latency_ms for r in records]
    assert summary["request_latency"]["p50"] == pytest.approx(float(np.percentile(latencies, 50)))
    assert summary["spec_decode_steps"]["count"] == 30


def test_aiperf_record_shapes() -> None:
    rng = random.Random(1)
    good = to_aiperf_record(_record(0, 100, 10, _acc(rng, 2, 4, "id0")))
    assert set(good) == {"metadata", "metrics", "spec_decode_acceptance", "error"}
    assert good["error"] is None
    assert good["metrics"]["request_latency"] == {"value": pytest.approx(100.0), "unit": "ms"}
    assert good["metrics"]["output_sequence_length"] == {"value": 10, "unit": "tokens"}
    sd = good["spec_decode_acceptance"]
    assert sd["num_spec_steps"] == 4 and sum(sd["acceptance_histogram"].values()) == 4
    plain = to_aiperf_record(_record(1, 100, 10))
    assert plain["spec_decode_acceptance"] is None and "spec_decode_steps" not in plain["metrics"]
    bad = _record(2, 5, 0)
    bad.error = ErrorDetails(0, "ConnectError", "refused")
    shaped = to_aiperf_record(bad)
    assert shaped["metrics"] == {} and shaped["error"] == {
        "code": 0,
        "type": "ConnectError",
        "message": "refused",
    }
    json.dumps([good, plain, shaped], allow_nan=False)


def test_csv_rows_have_one_column_per_position() -> None:
    rng = random.Random(4)
    a = LoadResult("spec", "concurrency", 1, [_record(0, 100, 10, _acc(rng, 3, 4, "id0"))], 1.0)
    b = LoadResult("off", "concurrency", 1, [_record(0, 100, 10)], 1.0)
    rows = csv_rows([a, b])
    assert rows[0]["acceptance_pos_2"] is not None and rows[1]["acceptance_pos_2"] is None
    assert rows[0]["request_latency_p95_ms"] == pytest.approx(100.0)


def test_read_acceptance_uses_the_ingest_parsers() -> None:
    native = {
        "request_id": "x",
        "drafted_tokens": 8,
        "accepted_tokens": 5,
        "verify_steps": 2,
        "generated_tokens": 8,
        "accepted_per_position": [2, 2, 1, 0],
        "k": 4,
        "ttft_ms": 12.0,
        "arm": "live",
    }
    acc, fmt = read_acceptance({"id": "x", "choices": [], "speculation_record": native, "perf_metrics": {}})
    assert fmt == "native" and acc is not None and acc.accepted_per_position == [2, 2, 1, 0]
    fireworks = {
        "id": "y",
        "usage": {"prompt_tokens": 3, "completion_tokens": 9},
        "perf_metrics": {"speculation-acceptance": "0:3/4,1:2/4", "server-time-to-first-token": 0.02},
    }
    acc, fmt = read_acceptance(fireworks)
    assert fmt == "fireworks" and acc is not None and acc.accepted_per_position == [3, 2]
    assert acc.ttft_ms == pytest.approx(20.0)
    off = {"id": "z", "perf_metrics": {"server-time-to-first-token": 0.03}, "usage": {"completion_tokens": 4}}
    acc, fmt = read_acceptance(off)  # speculation off: timings still read, no drafts
    assert fmt == "fireworks" and acc is not None and acc.drafted_tokens == 0
    vllm = {
        "id": "v",
        "usage": {"completion_tokens": 7},
        "metrics": {
            "speculative_decoding": {
                "num_spec_steps": 3,
                "num_draft_tokens": 9,
                "num_accepted_draft_tokens": 4,
                "acceptance_histogram": [1, 1, 0, 1],
            }
        },
    }
    acc, fmt = read_acceptance(vllm)
    assert fmt == "vllm" and acc is not None and acc.accepted_per_position == [2, 1, 1]
    assert read_acceptance({"id": "n", "choices": [{"text": "hi"}]}) == (None, None)


def test_streaming_request_measures_ttft_itl_and_tokens() -> None:
    chunks = [
        {"id": "a", "choices": [{"text": "Hel", "index": 0, "finish_reason": None}]},
        {"id": "a", "choices": [{"text": "lo", "index": 0, "finish_reason": None}]},
        {
            "id": "a",
            "choices": [{"text": "", "index": 0, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
        },
    ]
    seen: list[dict[str, Any]] = []

    async def stream() -> Any:
        for chunk in chunks:
            await asyncio.sleep(0.01)
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            config = Configuration("c", "http://server/v1", "m", extra={"top_k": 1})
            return await send_request(
                client,
                config,
                PromptItem("hi"),
                Sampling(max_tokens=5, seed=7),
                session_num=0,
                prompt_index=3,
                phase="concurrency",
                load=1,
            )

    rec = asyncio.run(go())
    assert rec.ok and rec.output_tokens == 5 and rec.output_tokens_source == "usage" and rec.input_tokens == 4
    assert rec.output_text == "Hello" and rec.finish_reason == "length"
    assert rec.ttft_ms is not None and rec.ttft_ms >= 10.0 and rec.ttft_source == "client_stream"
    assert rec.first_token_ns is not None and rec.last_token_ns is not None
    assert rec.itl_ms == pytest.approx((rec.last_token_ns - rec.first_token_ns) / 1e6 / 4)
    body = seen[0]
    assert body["seed"] == 10 and body["top_k"] == 1 and body["stream"] is True and body["model"] == "m"


def test_http_errors_become_error_records() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "The model `m` does not exist."}})

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(
                client,
                Configuration("c", "http://server", "m"),
                PromptItem("hi"),
                Sampling(stream=False),
                session_num=0,
                prompt_index=0,
                phase="concurrency",
                load=1,
            )

    rec = asyncio.run(go())
    assert rec.error == ErrorDetails(404, "HTTPStatusError", "The model `m` does not exist.")


def test_config_option_and_urls() -> None:
    c = parse_config_option('cand=http://h:8/v1,model=draft-2,extra={"a": 1, "b": [1, 2]}')
    assert (c.name, c.model, dict(c.extra)) == ("cand", "draft-2", {"a": 1, "b": [1, 2]})
    assert c.completions_url == "http://h:8/v1/completions"
    assert parse_config_option("x=http://h").completions_url == "http://h/v1/completions"
    assert parse_config_option("x=http://h").model == "x"
    for bad in ("x", "x=ftp://h", "x=http://h,mdl=1", "x=http://h,extra=[1]"):
        with pytest.raises(ConfigError):
            parse_config_option(bad)


def test_arrivals_poisson_mean_gap_and_constant() -> None:
    offsets = arrival_offsets(4.0, 4001, "poisson", seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    # Deterministic: seeded (seed=1). Fresh: the mean of 4,000 exponential gaps has a relative sd of
    # 1.6 %, so 8 % is 5 sd (two-sided 6e-7).
    assert offsets[-1] / 4000 == pytest.approx(0.25, rel=0.08)
    assert arrival_offsets(2.0, 3, "constant") == [0.0, 0.5, 1.0]


def test_load_dataset_jsonl_and_trace_pages(tmp_path: Path) -> None:
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(
        '{"prompt": "a", "category": "code"}\n\n{"prompt": "b", "completion": "c", "max_tokens": 3}\n'
    )
    items = load_dataset(jsonl)
    assert items == [PromptItem("a", "code"), PromptItem("b", None, 3)]
    page = tmp_path / "page.json"
    page.write_text(json.dumps({"traces": [{"id": 1, "prompt": "p", "completion": "q"}], "next_after_id": 1}))
    assert load_dataset(page) == [PromptItem("p")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"completion": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_dataset(bad)


def test_configs_toml_both_shapes(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("secret\n")
    listed = tmp_path / "a.toml"
    listed.write_text(
        '[[config]]\nname = "inherited"\nurl = "http://h:1"\n\n'
        f'[[config]]\nname = "cand"\nurl = "https://api.example/inference/v1"\nmodel = "m"\n'
        f'api_key_file = "{key}"\nextra = {{ speculation = {{ k = 3 }} }}\n'
    )
    configs = load_configs_file(listed)
    assert [(c.name, c.model, c.api_key) for c in configs] == [
        ("inherited", "inherited", None),
        ("cand", "m", "secret"),
    ]
    assert configs[1].completions_url == "https://api.example/inference/v1/completions"
    assert dict(configs[1].extra) == {"speculation": {"k": 3}}
    assert "secret" not in json.dumps([c.describe() for c in configs])
    named = tmp_path / "b.toml"
    named.write_text('[config.off]\nurl = "http://h"\nmodel = "x-nospec"\n')
    assert [(c.name, c.model) for c in load_configs_file(named)] == [("off", "x-nospec")]
    typo = tmp_path / "c.toml"
    typo.write_text('[config.off]\nurl = "http://h"\nmodle = "x"\n')
    with pytest.raises(ConfigError, match="modle"):
        load_configs_file(typo)


def test_the_command_never_needs_torch() -> None:
    """With torch unimportable, the CLI (and the benchmark modules) still load, without workers."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import controlplane.cli, loadbench.cli, loadbench.prompts, loadbench.runner, loadbench.report\n"
        "assert not [m for m in sys.modules if m == 'workers' or m.startswith('workers.')]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_loadbench_and_its_help_import_neither_workers_nor_torch() -> None:
    """A client of the control plane: importing it, or asking the command for --help, with torch
    importable, leaves no workers module and no torch in sys.modules."""
    import subprocess
    import sys

    code = """
import sys

def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] in ("workers", "torch"))

import loadbench, loadbench.cli, loadbench.prompts, loadbench.report, loadbench.runner
assert not loaded(), loaded()

import typer
from typer.testing import CliRunner

alone = typer.Typer()
loadbench.cli.register(alone)
alone.command("noop")(lambda: None)  # two commands, so "benchmark" is a subcommand as in the real app
result = CliRunner().invoke(alone, ["benchmark", "--help"])
assert result.exit_code == 0 and "--dataset" in result.output, result.output
assert not loaded(), loaded()

from controlplane.cli import app
result = CliRunner().invoke(app, ["benchmark", "--help"])
assert result.exit_code == 0 and "--dataset" in result.output, result.output
assert not loaded(), loaded()
"""
    # Wide enough that Rich does not cut the option names short.
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr


def test_load_dataset_text_file_one_prompt_a_line(tmp_path: Path) -> None:
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\n  \nsecond {not json}\n")
    assert load_dataset(text) == [PromptItem("first prompt"), PromptItem("second {not json}")]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(DatasetError, match="no prompts"):
        load_dataset(empty)
    not_jsonl = tmp_path / "prompts.jsonl"
    not_jsonl.write_text("first prompt\n")  # only .txt is read as plain text: a bad JSONL line is an error
    with pytest.raises(DatasetError, match="not valid JSON"):
        load_dataset(not_jsonl)


@pytest.mark.parametrize("domain", DOMAINS)
def test_builtin_prompts_are_distinct_labelled_and_of_the_domains_shape(domain: str) -> None:
    items = builtin_prompts(domain)
    assert len(items) >= 8
    assert len({p.text for p in items}) == len(items)
    assert all(p.category == domain and p.max_tokens is None for p in items)
    # Long enough to exercise a drafter, short enough for a small model's context.
    assert all(100 <= len(p.text) <= 800 for p in items), [len(p.text) for p in items]
    if domain == "structured":  # cut right after the answer marker, as the reference traffic is
        assert all(p.text.endswith(("\nSQL:", "\nCall:")) for p in items)
    else:  # cut at a line boundary
        assert all(p.text.endswith("\n") for p in items)
    assert builtin_prompts(domain, 3) == items[:3]


def test_builtin_prompts_alias_and_unknown_domain() -> None:
    assert builtin_prompts("tool") == builtin_prompts("structured")
    with pytest.raises(DatasetError, match="unknown domain"):
        builtin_prompts("poetry")


def test_perf_flag_refusals_are_recognised() -> None:
    trt = "[{'type': 'extra_forbidden', 'loc': ('body', 'x'), 'msg': 'Extra inputs are not permitted'}]"
    assert refuses_perf_flag(400, trt) and refuses_perf_flag(422, "unknown field perf_metrics_in_response")
    assert refuses_perf_flag(400, "extra fields not permitted")
    assert not refuses_perf_flag(400, "max_tokens must be positive")
    assert not refuses_perf_flag(500, "perf_metrics_in_response")


def test_engine_decides_the_perf_flag() -> None:
    item = PromptItem("p")
    assert "perf_metrics_in_response" in Sampling().body(Configuration("a", "http://x", "m"), item, 0)
    for engine in ("vllm", "sglang", "trtllm"):
        body = Sampling().body(Configuration("a", "http://x", "m", engine=engine), item, 0)
        assert "perf_metrics_in_response" not in body
    refused = Configuration("a", "http://x", "m")
    refused.perf_flag.accepted = False
    assert "perf_metrics_in_response" not in Sampling().body(refused, item, 0)
    fixed = Configuration("a", "http://x", "m", engine="fireworks")
    fixed.perf_flag.accepted = False
    assert "perf_metrics_in_response" in Sampling().body(fixed, item, 0)


def test_aiperf_summary_fields() -> None:
    """JsonExportData / JsonMetricResult (ai-dynamo/aiperf src/aiperf/common/models/export_models.py)."""
    records = [_record(i, 100.0 + i, 8) for i in range(3)]
    records[2].error = ErrorDetails(400, "HTTPStatusError", "bad")
    summary = aiperf_summary(LoadResult("c", "concurrency", 1, records, 1.0))
    assert summary["schema_version"] == "1.0" and summary["was_cancelled"] is False
    assert summary["error_summary"] == [
        {"error_details": {"code": 400, "type": "HTTPStatusError", "message": "bad"}, "count": 1}
    ]
    assert summary["start_time"] < summary["end_time"]
    blocks = {k: v for k, v in summary.items() if isinstance(v, dict)}
    assert {"request_latency", "request_count", "error_request_count"} <= set(blocks)
    assert all(set(b) <= AIPERF_METRIC_STATS and "unit" in b for b in blocks.values())
    assert summary["request_count"] == {"unit": "requests", "avg": 2}
