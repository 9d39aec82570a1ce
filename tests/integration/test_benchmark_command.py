"""`controlplane benchmark` against the real reference server (workers.serve) and the committed
reference models: speculation with the generic drafter vs speculation disabled, on the same prompts.

The server runs as `python -m workers.serve` on a free port; the command runs through the real CLI app.
"""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from controlplane.cli import app
from tests.aiperf_spec import AIPERF_METADATA_REQUIRED, AIPERF_METRIC_STATS, AIPERF_SUMMARY_TOP

pytest.importorskip("torch")

REFERENCE = Path(__file__).resolve().parents[2] / "workers" / "models" / "reference"
K = 4
MAX_TOKENS = 12
REQUESTS = 3


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The reference server in its own process (as deployed), so that its generation does not
    share this process's interpreter lock with the load generator being measured."""
    target = str(REFERENCE / "target")
    entries: dict[str, dict[str, Any]] = {
        "ref-generic": {
            "target_path": target,
            "speculation": "draft_model",
            "drafter_path": str(REFERENCE / "generic-drafter"),
            "k": K,
        },
        "ref-nospec": {"target_path": target, "speculation": "disabled"},
    }
    folder = tmp_path_factory.mktemp("serve")
    (folder / "serving.json").write_text(json.dumps(entries))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (folder / "server.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.serve",
            "--config",
            str(folder / "serving.json"),
            "--port",
            str(port),
            "--threads",
            "1",  # one torch thread: on a shared machine more only oversubscribe the cores
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (folder / "server.log").read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "reference server did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stdlib docstrings (prose, the generic drafter's own domain) written as a JSONL dataset."""
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    texts = [textwrap.__doc__, json.__doc__, csv.__doc__]
    lines = [json.dumps({"prompt": (t or "")[:300], "category": "prose"}) for t in texts]
    path.write_text("\n".join(lines) + "\n")
    return path


def _ordered(block: dict[str, Any]) -> None:
    assert block["count"] > 0
    assert block["min"] <= block["p50"] <= block["p90"] <= block["p95"] <= block["p99"] <= block["max"]
    assert block["min"] <= block["avg"] <= block["max"]


def test_benchmark_generic_drafter_vs_no_speculation(server_url: str, dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    started = time.monotonic()
    result = CliRunner().invoke(
        app,
        [
            "benchmark",
            "--config",
            f"generic={server_url},model=ref-generic",
            "--config",
            f"nospec={server_url}/v1,model=ref-nospec",
            "--dataset",
            str(dataset),
            "--requests",
            str(REQUESTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--temperature",
            "0",
            "--concurrency",
            "1,2",
            "--latency-bound-ms",
            "60000",
            "--search-requests",
            "2",
            "--warmup",
            "3",
            "--max-probes",
            "2",
            "--out-dir",
            str(out),
        ],
    )
    elapsed = time.monotonic() - started
    print(f"benchmark command took {elapsed:.1f} s")
    print(result.output)
    assert result.exit_code == 0, result.output
    assert "controlplane benchmark" in result.output and "maximum sustainable throughput" in result.output

    doc = json.loads((out / "benchmark.json").read_text())
    assert [c["name"] for c in doc["configurations"]] == ["generic", "nospec"]
    assert doc["configurations"][1]["url"] == f"{server_url}/v1/completions"
    results = {(r["config"], r["load"]): r["metrics"] for r in doc["results"]}
    assert set(results) == {("generic", 1), ("nospec", 1), ("generic", 2), ("nospec", 2)}
    for (config, _), m in results.items():
        assert m["request_count"]["avg"] == REQUESTS and m["error_request_count"]["avg"] == 0
        for metric in ("time_to_first_token", "inter_token_latency", "request_latency"):
            _ordered(m[metric])
        assert m["time_to_first_token"]["p95"] <= m["request_latency"]["max"]
        assert m["output_token_throughput"]["avg"] > 0 and m["request_throughput"]["avg"] > 0
        if config == "generic":
            rates = m["spec_decode_per_position_acceptance_rates"]
            assert len(rates) == K and all(0.0 <= r <= 1.0 for r in rates)
            assert all(a >= b for a, b in zip(rates, rates[1:], strict=False)), rates
            length = m["spec_decode_token_weighted_acceptance_length"]["avg"]
            assert length == pytest.approx(1 + sum(rates))
            assert 1.0 <= length <= 1 + K
            assert (
                sum(m["pooled_spec_decode_acceptance_histogram"].values())
                == m["total_spec_decode_steps"]["avg"]
            )
        else:  # speculation disabled: nothing drafted, so no acceptance figures
            assert "spec_decode_per_position_acceptance_rates" not in m
            assert m["spec_decode_acceptance_length"]["count"] == 0

    searches = {s["config"]: s for s in doc["max_throughput"]}
    for s in searches.values():
        assert s["max_sustainable_request_rate"] is not None and s["max_sustainable_request_rate"] > 0
        assert s["p95_request_latency_at_max_ms"] <= 60000
        assert 1 <= len(s["probes"]) <= 2

    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    measured = [r for r in records if r["metadata"]["load_type"] == "concurrency"]
    assert len(measured) == 2 * 2 * REQUESTS
    assert all(r["error"] is None for r in records)
    lengths: dict[tuple[str, str], set[int]] = {}
    for r in measured:
        md, metrics = r["metadata"], r["metrics"]
        assert md["request_start_ns"] <= md["request_ack_ns"] <= md["request_end_ns"]
        assert md["ttft_source"] == "client_stream" and md["output_tokens_source"] == "usage"
        n = metrics["output_sequence_length"]["value"]
        assert 1 <= n <= MAX_TOKENS
        lengths.setdefault((md["conversation_id"], md["config"]), set()).add(n)
        sd = r["spec_decode_acceptance"]
        if md["config"] == "generic":
            # The engine's identity: every token is the prefill's, an accepted draft, or a step's own.
            accepted, steps = sd["num_accepted_draft_tokens"], sd["num_spec_steps"]
            assert n in (1 + accepted + steps, accepted + steps)
            assert sum(sd["acceptance_histogram"].values()) == steps
            assert sd["num_draft_tokens"] <= K * steps
        else:
            assert sd is None
    # Greedy speculation is lossless: the same prompt yields as many tokens with and without it.
    for (conversation, _), ns in lengths.items():
        assert len(ns) == 1
        assert ns == lengths[(conversation, "generic")] == lengths[(conversation, "nospec")]

    with (out / "benchmark.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4
    assert {"request_latency_p95_ms", "inter_token_latency_p50_ms", "acceptance_pos_0"} <= set(rows[0])
    assert all(row["max_sustainable_request_rate"] for row in rows)


def test_benchmark_non_streaming_reads_server_ttft(server_url: str, dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "plain"
    result = CliRunner().invoke(
        app,
        [
            "benchmark",
            "-c",
            f"generic={server_url},model=ref-generic",
            "--dataset",
            str(dataset),
            "--requests",
            "2",
            "--max-tokens",
            "8",
            "--no-stream",
            "--warmup",
            "0",
            "--out-dir",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["metadata"]["ttft_source"] == "server"
        assert 0 < r["metrics"]["time_to_first_token"]["value"] <= r["metrics"]["request_latency"]["value"]
        assert r["spec_decode_acceptance"]["engine"] == "native"


def test_benchmark_built_in_prompts_need_no_dataset(server_url: str, tmp_path: Path) -> None:
    """Without --dataset the prompts are loadbench's own built-in set of the domain, labelled with it."""
    out = tmp_path / "builtin"
    result = CliRunner().invoke(
        app,
        [
            "benchmark",
            "-c",
            f"generic={server_url},model=ref-generic",
            "--domain",
            "structured",
            "--prompts",
            "2",
            "--requests",
            "3",
            "--max-tokens",
            "8",
            "--warmup",
            "0",
            "--out-dir",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "benchmark.json").read_text())
    assert doc["parameters"]["domain"] == "structured" and doc["parameters"]["prompts"] == 2
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["error"] is None for r in records)
    assert {r["metadata"]["category"] for r in records} == {"structured"}
    # Three requests over two prompts: the prompts are cycled, in order.
    assert [r["metadata"]["conversation_id"] for r in records] == ["prompt-0", "prompt-1", "prompt-0"]


@pytest.fixture
def strict_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An OpenAI server that refuses unknown request fields the way TensorRT-LLM's does (400 with
    pydantic's "Extra inputs are not permitted" for the field)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    known = {"model", "prompt", "max_tokens", "temperature", "top_p", "stream", "seed"}
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append(body)
            extra = sorted(set(body) - known)
            if extra:
                status, reply = (
                    400,
                    {
                        "object": "error",
                        "message": f"[{{'type': 'extra_forbidden', 'loc': ('body', '{extra[0]}'), "
                        "'msg': 'Extra inputs are not permitted'}]",
                        "type": "BadRequestError",
                        "code": 400,
                    },
                )
            else:
                status, reply = (
                    200,
                    {
                        "id": "cmpl-1",
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": " ok ok", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
                    },
                )
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        thread.join(timeout=5)


def _run(url: str, out: Path, *extra: str) -> None:
    args = ["benchmark", "-c", f"strict={url},model=m", "--domain", "prose", "--prompts", "2"]
    args += ["--requests", "4", "--no-stream", "--warmup", "0", "--concurrency", "1", "--out-dir", str(out)]
    result = CliRunner().invoke(app, [*args, *extra])
    assert result.exit_code == 0, result.output


def test_perf_flag_dropped_after_a_refusal_and_aiperf_files(
    strict_server: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url, seen = strict_server
    out = tmp_path / "auto"
    _run(url, out)
    # Probed once with the flag, refused, retried without it, and never sent again.
    flagged = [b for b in seen if "perf_metrics_in_response" in b]
    assert len(flagged) == 1 and seen[0] is flagged[0] and len(seen) == 5
    doc = json.loads((out / "benchmark.json").read_text())
    assert doc["configurations"][0]["perf_metrics_in_response"] is False

    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["error"] is None for r in records)
    for r in records:
        assert AIPERF_METADATA_REQUIRED <= set(r["metadata"])
        assert r["metadata"]["benchmark_phase"] in ("warmup", "profiling")
        assert all(set(m) == {"value", "unit"} for m in r["metrics"].values())
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert AIPERF_SUMMARY_TOP <= set(summary) and summary["schema_version"] == "1.0"
    for tag in ("request_latency", "request_count", "request_throughput", "output_sequence_length"):
        assert set(summary[tag]) <= AIPERF_METRIC_STATS and "unit" in summary[tag], tag
    assert summary["request_count"]["avg"] == 4 and summary["error_summary"] == []
    (run,) = (out / "aiperf" / "strict").iterdir()
    assert json.loads((run / "profile_export_aiperf.json").read_text()) == summary
    assert len((run / "profile_export.jsonl").read_text().splitlines()) == 4

    # Naming the engine sends nothing to probe.
    seen.clear()
    _run(url, tmp_path / "trt", "--engine", "trtllm")
    assert len(seen) == 4 and not any("perf_metrics_in_response" in b for b in seen)
