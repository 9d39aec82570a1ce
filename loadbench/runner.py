"""The load generator behind ``controlplane benchmark``: OpenAI-compatible ``/v1/completions``.

Sends the same prompts, output lengths and sampling parameters to every configuration (a named
endpoint + model + extra request fields) with ``httpx`` (async), closed loop (a fixed number of
requests in flight) or open loop (requests released at an offered rate, Poisson or evenly spaced,
whatever the replies do), and measures each request as ``report.RequestRecord``. The acceptance a
response reports is read with the control plane's own ingest parsers: our reference server's
``speculation_record`` (native, exact counts), else whatever ``controlplane.ingest.formats``
detects (Fireworks ``perf_metrics``, vLLM ``metrics.speculative_decoding``, SGLang ``meta_info``,
TensorRT-LLM).

The maximum sustainable throughput is searched open loop: offered rates are probed upwards
(doubling) until the p95 request latency breaks the bound (or a request fails), then bisected
between the last rate that held and the first that broke; the answer is the highest rate that held.
A probe is short (``search_requests`` requests), so the answer is an estimate whose resolution is
the last bisection step.

No torch and nothing of the workers: the prompts come from ``loadbench.prompts``.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import httpx

from controlplane.ingest.formats import (
    FORMAT_ADAPTERS,
    PERF_METRICS_IN_RESPONSE,
    BatchValidationError,
    detect_format,
    parse_record,
)
from controlplane.ingest.record import AcceptanceRecord
from loadbench.prompts import PromptItem
from loadbench.report import (
    ErrorDetails,
    LoadResult,
    Probe,
    RequestRecord,
    SearchResult,
    inter_token_latency_ms,
    percentile,
)

ARRIVALS: Final = ("poisson", "constant")
# Keys of a response (or of any streaming chunk) that the acceptance parsers read.
_METRIC_KEYS: Final = ("usage", "perf_metrics", "speculation_record", "metrics", "meta_info")


PERF_FLAG: Final = PERF_METRICS_IN_RESPONSE
# The engines of the ingest formats' registry (controlplane.ingest.formats.FORMAT_ADAPTERS):
# those whose servers take Fireworks' `perf_metrics_in_response` (our reference server answers it
# like Fireworks), and those whose OpenAI servers have no such field (TensorRT-LLM's refuses
# unknown fields).
PERF_FLAG_ENGINES: Final = tuple(a.engine for a in FORMAT_ADAPTERS if a.request_flag == PERF_FLAG)
NO_PERF_FLAG_ENGINES: Final = tuple(a.engine for a in FORMAT_ADAPTERS if a.request_flag != PERF_FLAG)
ENGINES: Final = ("auto", *PERF_FLAG_ENGINES, *NO_PERF_FLAG_ENGINES)
_EXTRA_REFUSED = re.compile(r"extra[ _](fields|inputs)[^.]*not permitted|extra_forbidden", re.IGNORECASE)


def refuses_perf_flag(status: int, message: str) -> bool:
    """Whether a 4xx reply refused the request for carrying `perf_metrics_in_response`: it names
    the field, or says extra fields are not permitted (pydantic's wording, as TensorRT-LLM's
    OpenAI server answers unknown fields with 400/422)."""
    return 400 <= status < 500 and (PERF_FLAG in message or _EXTRA_REFUSED.search(message) is not None)


@dataclass
class PerfFlagSupport:
    """Whether a configuration's server takes `perf_metrics_in_response`; None: not known yet."""

    accepted: bool | None = None


@dataclass(frozen=True)
class Configuration:
    """A named endpoint + model + extra request fields (merged last into every request body).

    ``engine``: "auto" sends Fireworks' ``perf_metrics_in_response`` until a server refuses it
    (``refuses_perf_flag``), then retries that request without it and leaves it out for the rest
    of the run; "fireworks" / "reference" always send it; "vllm" / "sglang" / "trtllm" never do.
    """

    name: str
    url: str
    model: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    engine: str = "auto"
    perf_flag: PerfFlagSupport = field(default_factory=PerfFlagSupport, compare=False, repr=False)

    @property
    def sends_perf_flag(self) -> bool:
        if self.engine in NO_PERF_FLAG_ENGINES:
            return False
        return self.engine in PERF_FLAG_ENGINES or self.perf_flag.accepted is not False

    @property
    def completions_url(self) -> str:
        """``.../completions`` as given, else ``.../v1`` + ``/completions``, else + ``/v1/completions``."""
        url = self.url.rstrip("/")
        if url.endswith("/completions"):
            return url
        if url.endswith("/v1"):
            return url + "/completions"
        return url + "/v1/completions"

    def describe(self) -> dict[str, Any]:
        """For the report (never the API key)."""
        return {
            "name": self.name,
            "url": self.completions_url,
            "model": self.model,
            "extra": dict(self.extra),
            "authenticated": self.api_key is not None,
            "engine": self.engine,
            "perf_metrics_in_response": self.sends_perf_flag,
        }


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stream: bool = True
    seed: int | None = None  # request i gets seed + i, the same in every configuration
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    timeout_s: float = 300.0

    def body(self, config: Configuration, item: PromptItem, index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": config.model,
            "prompt": item.text,
            "max_tokens": item.max_tokens or self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
        }
        if config.sends_perf_flag:  # Fireworks' switch (our reference server honours it too)
            body[PERF_FLAG] = True
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # vLLM sends usage in a last chunk
        if self.seed is not None:
            body["seed"] = self.seed + index
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(config.extra)
        return body


# --------------------------------------------------------------------------------------------
# One request
# --------------------------------------------------------------------------------------------


def read_acceptance(body: Mapping[str, Any]) -> tuple[AcceptanceRecord | None, str | None]:
    """The acceptance a response reports, via the ingest parsers, and the format that read it."""
    native = body.get("speculation_record")
    if isinstance(native, dict):
        try:
            return parse_record(native, "native"), "native"
        except BatchValidationError:
            pass
    rest = {key: value for key, value in body.items() if key != "speculation_record"}
    try:
        fmt = detect_format(rest)
    except ValueError:
        return None, None
    try:
        return parse_record(rest, fmt), fmt
    except BatchValidationError:
        if fmt != "fireworks":
            return None, None
    try:  # perf_metrics without speculation-acceptance: speculation off, timings still useful
        return parse_record({**rest, "arm": "baseline"}, "fireworks"), "fireworks"
    except BatchValidationError:
        return None, None


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:500]
    return json.dumps(obj)[:500]


def _usage_tokens(usage: object, key: str) -> int | None:
    if isinstance(usage, dict) and type(usage.get(key)) is int:
        value: int = usage[key]
        return value
    return None


class _Clock:
    """Epoch nanoseconds read off the monotonic clock (no jumps within a request)."""

    def __init__(self) -> None:
        self.epoch_ns = time.time_ns()
        self.mono_ns = time.perf_counter_ns()

    def now(self) -> int:
        return self.epoch_ns + (time.perf_counter_ns() - self.mono_ns)


async def send_request(
    client: httpx.AsyncClient,
    config: Configuration,
    item: PromptItem,
    sampling: Sampling,
    *,
    session_num: int,
    prompt_index: int,
    phase: str,
    load: float,
) -> RequestRecord:
    """Send one completion request and measure it; failures become a record with ``error``."""
    request_id = f"bench-{uuid.uuid4().hex}"
    headers = {"x-request-id": request_id}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    body = sampling.body(config, item, prompt_index)
    clock = _Clock()
    rec = RequestRecord(
        config=config.name,
        phase=phase,
        load=load,
        session_num=session_num,
        x_request_id=request_id,
        prompt_index=prompt_index,
        category=item.category,
        request_start_ns=clock.epoch_ns,
        request_end_ns=clock.epoch_ns,
    )
    try:
        if body.get("stream"):
            merged = await _stream(client, config, body, headers, clock, rec)
        else:
            merged = await _plain(client, config, body, headers, clock, rec)
    except httpx.HTTPError as exc:
        rec.request_end_ns = clock.now()
        rec.error = ErrorDetails(0, type(exc).__name__, str(exc) or repr(exc))
        return rec
    if rec.error is not None and body.get(PERF_FLAG) and config.engine == "auto":
        if refuses_perf_flag(rec.error.code, rec.error.message):
            config.perf_flag.accepted = False  # remembered for the rest of the run
            return await send_request(
                client,
                config,
                item,
                sampling,
                session_num=session_num,
                prompt_index=prompt_index,
                phase=phase,
                load=load,
            )
    if rec.error is not None or merged is None:
        return rec
    if body.get(PERF_FLAG):
        config.perf_flag.accepted = True
    _finish(rec, merged, sampling.stream)
    return rec


async def _plain(
    client: httpx.AsyncClient,
    config: Configuration,
    body: dict[str, Any],
    headers: dict[str, str],
    clock: _Clock,
    rec: RequestRecord,
) -> dict[str, Any] | None:
    resp = await client.post(config.completions_url, json=body, headers=headers)
    rec.request_end_ns = rec.request_ack_ns = clock.now()
    if resp.status_code >= 400:
        rec.error = ErrorDetails(resp.status_code, "HTTPStatusError", _error_message(resp.content))
        return None
    try:
        obj = resp.json()
    except ValueError:
        rec.error = ErrorDetails(resp.status_code, "InvalidResponse", "response is not JSON")
        return None
    if not isinstance(obj, dict):
        rec.error = ErrorDetails(resp.status_code, "InvalidResponse", "response is not a JSON object")
        return None
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        rec.output_text = str(choices[0].get("text") or "")
        rec.finish_reason = choices[0].get("finish_reason")
    return obj


async def _stream(
    client: httpx.AsyncClient,
    config: Configuration,
    body: dict[str, Any],
    headers: dict[str, str],
    clock: _Clock,
    rec: RequestRecord,
) -> dict[str, Any] | None:
    merged: dict[str, Any] = {}
    texts: list[str] = []
    text_chunks = 0
    async with client.stream("POST", config.completions_url, json=body, headers=headers) as resp:
        rec.request_ack_ns = clock.now()
        if resp.status_code >= 400:
            raw = await resp.aread()
            rec.request_end_ns = clock.now()
            rec.error = ErrorDetails(resp.status_code, "HTTPStatusError", _error_message(raw))
            return None
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = clock.now()
            try:
                chunk = json.loads(data)
            except ValueError:
                continue
            if not isinstance(chunk, dict):
                continue
            if isinstance(chunk.get("error"), dict):
                rec.request_end_ns = now
                rec.error = ErrorDetails(
                    int(chunk["error"].get("code") or 0)
                    if str(chunk["error"].get("code", "")).isdigit()
                    else 0,
                    "StreamError",
                    str(chunk["error"].get("message", ""))[:500],
                )
                return None
            choices = chunk.get("choices")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                text = choices[0].get("text") or ""
                if text:
                    texts.append(str(text))
                    text_chunks += 1
                    if rec.first_token_ns is None:
                        rec.first_token_ns = now
                    rec.last_token_ns = now
                if choices[0].get("finish_reason") is not None:
                    rec.finish_reason = choices[0]["finish_reason"]
            for key in (*_METRIC_KEYS, "id"):
                if chunk.get(key) is not None:
                    merged[key] = chunk[key]
            rec.request_end_ns = now
    if rec.request_end_ns == rec.request_start_ns:
        rec.request_end_ns = clock.now()
    rec.output_text = "".join(texts)
    merged["_text_chunks"] = text_chunks
    return merged


def _finish(rec: RequestRecord, body: dict[str, Any], streamed: bool) -> None:
    text_chunks = body.pop("_text_chunks", None)
    acc, fmt = read_acceptance(body)
    rec.acceptance, rec.acceptance_format = acc, fmt
    usage = body.get("usage")
    rec.input_tokens = _usage_tokens(usage, "prompt_tokens")
    if rec.input_tokens is None and acc is not None:
        rec.input_tokens = acc.prompt_tokens
    out = _usage_tokens(usage, "completion_tokens")
    if out is not None:
        rec.output_tokens, rec.output_tokens_source = out, "usage"
    elif acc is not None and acc.generated_tokens:
        rec.output_tokens, rec.output_tokens_source = acc.generated_tokens, "perf_metrics"
    elif streamed and text_chunks is not None:
        rec.output_tokens, rec.output_tokens_source = text_chunks, "chunks"  # a lower bound
    if streamed:
        if rec.first_token_ns is not None:
            rec.ttft_ms = (rec.first_token_ns - rec.request_start_ns) / 1e6
            rec.ttft_source = "client_stream"
            if rec.last_token_ns is not None and rec.output_tokens is not None:
                rec.itl_ms = inter_token_latency_ms(rec.first_token_ns, rec.last_token_ns, rec.output_tokens)
    elif acc is not None:
        rec.ttft_ms = acc.ttft_ms
        rec.ttft_source = "server" if acc.ttft_ms is not None else None
        rec.itl_ms = acc.inter_token_ms


# --------------------------------------------------------------------------------------------
# Loads
# --------------------------------------------------------------------------------------------


def new_client(timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
    )


async def run_concurrency(
    client: httpx.AsyncClient,
    config: Configuration,
    prompts: Sequence[PromptItem],
    sampling: Sampling,
    concurrency: int,
    requests: int,
) -> LoadResult:
    """Closed loop: ``concurrency`` workers each send the next request as soon as theirs returns.
    Request i uses prompt i mod len(prompts), so every configuration gets the same prompts."""
    if concurrency < 1 or requests < 1:
        raise ValueError("concurrency and requests must be at least 1")
    indices = iter(range(requests))
    records: list[RequestRecord] = []

    async def worker() -> None:
        for i in indices:
            records.append(
                await send_request(
                    client,
                    config,
                    prompts[i % len(prompts)],
                    sampling,
                    session_num=i,
                    prompt_index=i % len(prompts),
                    phase="concurrency",
                    load=concurrency,
                )
            )

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    duration = time.perf_counter() - start
    records.sort(key=lambda r: r.session_num)
    return LoadResult(config.name, "concurrency", concurrency, records, duration)


def arrival_offsets(rate: float, n: int, arrival: str = "poisson", seed: int = 0) -> list[float]:
    """Send times (s after the start) of n requests at ``rate`` per second; the first at 0."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}")
    rng = random.Random(f"arrivals:{seed}:{rate}")
    offsets = [0.0]
    for _ in range(n - 1):
        gap = rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
        offsets.append(offsets[-1] + gap)
    return offsets[:n]


async def run_rate(
    client: httpx.AsyncClient,
    config: Configuration,
    prompts: Sequence[PromptItem],
    sampling: Sampling,
    rate: float,
    requests: int,
    arrival: str = "poisson",
    seed: int = 0,
) -> LoadResult:
    """Open loop: release request i at its arrival time whether or not earlier ones returned."""
    loop = asyncio.get_running_loop()
    offsets = arrival_offsets(rate, requests, arrival, seed)
    tasks: list[asyncio.Task[RequestRecord]] = []
    start = loop.time()
    for i, offset in enumerate(offsets):
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(
            asyncio.create_task(
                send_request(
                    client,
                    config,
                    prompts[i % len(prompts)],
                    sampling,
                    session_num=i,
                    prompt_index=i % len(prompts),
                    phase="request_rate",
                    load=rate,
                )
            )
        )
    records = list(await asyncio.gather(*tasks))
    return LoadResult(config.name, "request_rate", rate, records, loop.time() - start)


def _probe(result: LoadResult, bound_ms: float) -> Probe:
    ok = [r.request_latency_ms for r in result.records if r.ok]
    errors = len(result.records) - len(ok)
    p95 = percentile(ok, 95) if ok else None
    achieved = result.summary["request_throughput"]["avg"]
    return Probe(
        result.load, p95, achieved, errors, bool(ok) and not errors and p95 is not None and p95 <= bound_ms
    )


def _round_rate(rate: float) -> float:
    return float(f"{rate:.3g}")


async def search_max_rate(
    client: httpx.AsyncClient,
    config: Configuration,
    prompts: Sequence[PromptItem],
    sampling: Sampling,
    latency_bound_ms: float,
    *,
    rates: Sequence[float] | None = None,
    start_rate: float = 1.0,
    requests: int = 16,
    max_probes: int = 8,
    refine_steps: int = 2,
    arrival: str = "poisson",
    seed: int = 0,
    on_probe: Callable[[Probe], None] | None = None,
) -> tuple[SearchResult, list[LoadResult]]:
    """The highest offered rate whose p95 request latency stays within the bound, and the probes.

    With ``rates``: probe them in ascending order until one breaks the bound. Without: start at
    ``start_rate``, double while the bound holds (halve while it breaks), then bisect
    ``refine_steps`` times between the highest rate that held and the lowest that broke, within
    ``max_probes`` probes in all.
    """
    probes: list[Probe] = []
    runs: list[LoadResult] = []

    async def probe(rate: float) -> Probe:
        run = await run_rate(client, config, prompts, sampling, rate, requests, arrival, seed)
        result = _probe(run, latency_bound_ms)
        runs.append(run)
        probes.append(result)
        if on_probe is not None:
            on_probe(result)
        return result

    if rates:
        for rate in sorted(set(rates)):
            if not (await probe(rate)).passed:
                break
    else:
        lo: float | None = None
        hi: float | None = None
        rate = _round_rate(start_rate)
        while len(probes) < max_probes and (lo is None or hi is None):
            if (await probe(rate)).passed:
                lo = rate
                rate = _round_rate(rate * 2)
            else:
                hi = rate
                if lo is not None:
                    break
                rate = _round_rate(rate / 2)
                if rate < 1e-3:
                    break
        steps = 0
        while lo is not None and hi is not None and steps < refine_steps and len(probes) < max_probes:
            mid = _round_rate((lo + hi) / 2)
            if mid in (lo, hi):
                break
            if (await probe(mid)).passed:
                lo = mid
            else:
                hi = mid
            steps += 1
    passed = [p.rate for p in probes if p.passed]
    return SearchResult(config.name, latency_bound_ms, probes, max(passed) if passed else None), runs


# --------------------------------------------------------------------------------------------
# A whole benchmark
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchmarkPlan:
    configs: Sequence[Configuration]
    prompts: Sequence[PromptItem]
    sampling: Sampling
    concurrencies: Sequence[int] = (1,)
    requests: int = 16
    warmup: int = 1
    latency_bound_ms: float | None = None
    rates: Sequence[float] | None = None
    search_requests: int = 16
    max_probes: int = 8
    arrival: str = "poisson"
    seed: int = 0

    def describe(self) -> dict[str, Any]:
        s = self.sampling
        return {
            "prompts": len(self.prompts),
            "requests": self.requests,
            "warmup": self.warmup,
            "concurrency": list(self.concurrencies),
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stream": s.stream,
            "seed": s.seed,
            "ignore_eos": s.ignore_eos,
            "latency_bound_ms": self.latency_bound_ms,
            "request_rates": list(self.rates) if self.rates else None,
            "search_requests": self.search_requests,
            "arrival": self.arrival,
        }


@dataclass
class BenchmarkOutcome:
    results: list[LoadResult]
    searches: list[SearchResult]
    search_runs: list[LoadResult]
    warmup_errors: dict[str, str]


def _probe_reporter(name: str, say: Callable[[str], None]) -> Callable[[Probe], None]:
    def report(p: Probe) -> None:
        p95 = "-" if p.p95_latency_ms is None else f"{p.p95_latency_ms:.0f}"
        say(f"{name}: {p.rate:g} req/s -> p95 {p95} ms{'' if p.passed else ' (over the bound)'}")

    return report


async def run_benchmark_async(
    plan: BenchmarkPlan, progress: Callable[[str], None] | None = None
) -> BenchmarkOutcome:
    """Warm every configuration up, then each concurrency level across the configurations in
    turn (so a change in machine load hits them alike), then the throughput search per config."""
    say = progress or (lambda _: None)
    results: list[LoadResult] = []
    searches: list[SearchResult] = []
    search_runs: list[LoadResult] = []
    warmup_errors: dict[str, str] = {}
    async with new_client(plan.sampling.timeout_s) as client:
        for config in plan.configs:
            for i in range(plan.warmup):
                rec = await send_request(
                    client,
                    config,
                    plan.prompts[i % len(plan.prompts)],
                    plan.sampling,
                    session_num=i,
                    prompt_index=i % len(plan.prompts),
                    phase="warmup",
                    load=1,
                )
                if rec.error is not None:
                    warmup_errors[config.name] = f"{rec.error.type}: {rec.error.message}"
                    say(f"{config.name}: warm-up request failed: {rec.error.message}")
                    break
        for concurrency in plan.concurrencies:
            for config in plan.configs:
                say(f"{config.name}: concurrency {concurrency}, {plan.requests} requests")
                results.append(
                    await run_concurrency(
                        client, config, plan.prompts, plan.sampling, concurrency, plan.requests
                    )
                )
        if plan.latency_bound_ms is not None:
            for config in plan.configs:
                # Start at the best closed-loop throughput seen: roughly the capacity.
                seen = [
                    r.summary["request_throughput"]["avg"] or 0.0 for r in results if r.config == config.name
                ]
                start = max(seen, default=0.0) or 1.0
                bound = plan.latency_bound_ms
                say(f"{config.name}: searching the highest rate with p95 latency <= {bound:g} ms")
                search, runs = await search_max_rate(
                    client,
                    config,
                    plan.prompts,
                    plan.sampling,
                    plan.latency_bound_ms,
                    rates=plan.rates,
                    start_rate=start,
                    requests=plan.search_requests,
                    max_probes=plan.max_probes,
                    arrival=plan.arrival,
                    seed=plan.seed,
                    on_probe=_probe_reporter(config.name, say),
                )
                searches.append(search)
                search_runs.extend(runs)
    return BenchmarkOutcome(results, searches, search_runs, warmup_errors)


def run_benchmark(plan: BenchmarkPlan, progress: Callable[[str], None] | None = None) -> BenchmarkOutcome:
    return asyncio.run(run_benchmark_async(plan, progress))
