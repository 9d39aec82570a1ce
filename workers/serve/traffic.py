"""The traffic driver: replays a scenario file against an OpenAI-compatible `/v1/completions` or
`/v1/chat/completions`.

    python -m workers.serve.traffic --scenario scenarios/demo.toml [--url URL] [--model NAME]

A scenario (TOML, meant to be edited) names the server and a list of phases; each phase has a
domain mix (shares of prose / code / structured, or of the chat domains chat / chat_structured,
normalised), a size (`requests`, `duration_s`,
or both: whichever ends first), a load (`concurrency` requests in flight, closed loop; or `rate`
requests per second, open loop, with `concurrency` as the cap on requests in flight),
`max_tokens`, `stop` (a string or up to four: where a completion ends, as a tool-calling client
ends one at its next turn), `stop_by_domain` (a table of such stops per domain, for a mixed
phase whose domains end differently, e.g. `{ structured = "\n" }`; it wins over `stop` for its
domains), `temperature`, `seed`, the corpus `split` (default "test": held out of every training
split, so demo traffic is never text the generic drafter was trained on) and `heldout` (default
false; true draws only from the documents reserved for held-out phases, which no other phase draws
from, so the phase's figures are measured on prompts whose text and source document never reached a
drafter trained on the run's other phases), and `api` (default "completions": `/v1/completions` with
a `prompt`; "chat": `/v1/chat/completions` with `messages`, the chat domains' own, or a prompt of
another domain as one user message; the chat domains need it):

    [server]
    url = "http://127.0.0.1:8601"
    model = "demo"

    [defaults]           # any phase key; a phase's own value wins
    max_tokens = 48

    [[phase]]
    name = "prose"
    requests = 200
    mix = { prose = 1.0 }
    seed = 1

    [[phase]]
    name = "chat"
    requests = 200
    mix = { chat = 1.0 }
    api = "chat"
    seed = 2

Prompts come from `workers.corpora.traffic_prompts` in an order fixed by the phase's seed: request
i of a phase always gets the same domain and prompt (the domain by a seeded draw on the mix, the
prompt as the next of that domain's seeded stream, in which every prompt is a new draw: a structured
request from a newly generated document, a prose or code request a new window of the split). Give
each phase its own seed: two phases with one seed, domain and split send the same prompts. Requests
carry `x-request-id` `<run id>-p<phase>-<i>` (a fresh run id per run unless given, as the control
plane keeps one record per request id), the domain as `category`, the source document as the
non-standard field `document` (`<domain>:<doc id>`, what a held-out split by document keys on), and
ask for `perf_metrics_in_response`; sampled requests (temperature > 0) get a per-request seed. A chat
request is counted on its messages' plain "<role>: <content>" rendering.

Per phase it reports requests, errors, hit rate (accepted / drafted tokens summed over the
responses' speculation records; a response without one, e.g. from a Fireworks deployment, gives its
counts through `perf_metrics`' `speculation-acceptance` pairs "position:hits/total": accepted = the
hits, drafted = the totals; `speculation-generated-tokens` means the tokens the verify steps
emitted, the completion tokens less the prefill's one, as everywhere in this project, so it is
never read as drafted tokens), throughput in completion tokens/s, latency p50/p95, and the same
per arm and per domain; and how often its prompts repeat: `repeat_share`, the share of the phase's
requests whose normalised prompt (`controlplane.traces.holdout.prompt_hash`) an earlier request of
the run already sent, in any phase, and for a held-out phase `heldout_prompt_overlap`, how many of
its requests share a normalised prompt or a document with a phase of the run that is not held out
(0 by construction). A driver keeps one `PromptLedger` for all its runs; pass one to several drivers
to count repeats across them. `run_scenario(..., callbacks=...)` calls `on_phase_start`, `on_result`
(every finished request) and `on_phase_end` so a demo orchestrator can draw progress and read the
figures; `should_stop` ends the run early.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
import tomllib
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from controlplane import speculation_math
from controlplane.traces.holdout import prompt_hash
from workers import corpora
from workers.engine.stop_strings import parse_stop

PHASE_KEYS = frozenset(
    {
        "name",
        "mix",
        "requests",
        "duration_s",
        "concurrency",
        "rate",
        "max_tokens",
        "temperature",
        "seed",
        "split",
        "stop",
        "stop_by_domain",
        "heldout",
        "api",
    }
)
# Which OpenAI route a phase's requests go to, by its `api`.
API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _stop_strings(value: object, where: str) -> tuple[str, ...]:
    """A phase's `stop`: absent, one non-empty string, or a list of 1 to 4 of them."""
    try:
        return parse_stop(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


@dataclass(frozen=True)
class Phase:
    name: str
    mix: dict[str, float]
    requests: int | None = None
    duration_s: float | None = None
    concurrency: int = 1
    rate: float | None = None
    max_tokens: int = 48
    temperature: float = 0.0
    seed: int = 0
    split: str = "test"
    stop: tuple[str, ...] = ()
    stop_by_domain: dict[str, tuple[str, ...]] = field(default_factory=dict)
    heldout: bool = False
    api: str = "completions"

    def stop_for(self, domain: str) -> tuple[str, ...]:
        """Where a completion of ``domain`` ends: its own stops, else the phase's."""
        return self.stop_by_domain.get(domain, self.stop)

    @classmethod
    def parse(cls, raw: Mapping[str, Any], where: str) -> Phase:
        unknown = set(raw) - PHASE_KEYS
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {sorted(unknown)}; expected some of {sorted(PHASE_KEYS)}"
            )
        mix_raw = raw.get("mix")
        if not isinstance(mix_raw, Mapping) or not mix_raw:
            raise ValueError(f"{where}: `mix` must be a table of domain shares, e.g. {{ prose = 1.0 }}")
        mix: dict[str, float] = {}
        for domain, share in mix_raw.items():
            name = corpora.ALIASES.get(domain, domain)
            if name not in corpora.TRAFFIC_DOMAINS:
                raise ValueError(
                    f"{where}: unknown domain {domain!r}; expected one of {corpora.TRAFFIC_DOMAINS}"
                )
            if not isinstance(share, int | float) or share < 0:
                raise ValueError(f"{where}: share of {domain!r} must be a number >= 0")
            mix[name] = mix.get(name, 0.0) + float(share)
        total = sum(mix.values())
        if total <= 0:
            raise ValueError(f"{where}: the mix shares sum to zero")
        mix = {d: s / total for d, s in mix.items() if s > 0}
        requests, duration = raw.get("requests"), raw.get("duration_s")
        if requests is None and duration is None:
            raise ValueError(f"{where}: give `requests`, `duration_s` or both")
        if requests is not None and (not isinstance(requests, int) or requests < 1):
            raise ValueError(f"{where}: `requests` must be an integer >= 1")
        if duration is not None and (not isinstance(duration, int | float) or duration <= 0):
            raise ValueError(f"{where}: `duration_s` must be > 0")
        concurrency = int(raw.get("concurrency", 1))
        rate = raw.get("rate")
        if concurrency < 1 or (rate is not None and float(rate) <= 0):
            raise ValueError(f"{where}: `concurrency` must be >= 1 and `rate` > 0")
        split = str(raw.get("split", "test"))
        if split not in corpora.SPLITS:
            raise ValueError(f"{where}: unknown split {split!r}; expected one of {corpora.SPLITS}")
        temperature = float(raw.get("temperature", 0.0))
        if not 0.0 <= temperature <= 2.0:
            raise ValueError(f"{where}: `temperature` must be within [0, 2]")
        stop = _stop_strings(raw.get("stop"), where)
        by_domain_raw = raw.get("stop_by_domain") or {}
        if not isinstance(by_domain_raw, Mapping):
            raise ValueError(f"{where}: `stop_by_domain` must be a table of stops per domain")
        stop_by_domain: dict[str, tuple[str, ...]] = {}
        for domain, value in by_domain_raw.items():
            name = corpora.ALIASES.get(domain, domain)
            if name not in corpora.TRAFFIC_DOMAINS:
                raise ValueError(
                    f"{where}: unknown domain {domain!r}; expected one of {corpora.TRAFFIC_DOMAINS}"
                )
            stop_by_domain[name] = _stop_strings(value, f"{where} stop_by_domain.{domain}")
        heldout = raw.get("heldout", False)
        if not isinstance(heldout, bool):
            raise ValueError(f"{where}: `heldout` must be true or false")
        api = raw.get("api", "completions")
        if api not in API_PATHS:
            raise ValueError(f"{where}: `api` must be one of {sorted(API_PATHS)}, not {api!r}")
        if api != "chat" and (chat := sorted(set(mix) & set(corpora.CHAT_DOMAINS))):
            raise ValueError(f'{where}: the chat domain(s) {chat} send messages: set api = "chat"')
        return cls(
            name=str(raw.get("name") or where),
            mix=mix,
            requests=requests,
            duration_s=float(duration) if duration is not None else None,
            concurrency=concurrency,
            rate=float(rate) if rate is not None else None,
            max_tokens=int(raw.get("max_tokens", 48)),
            temperature=temperature,
            seed=int(raw.get("seed", 0)),
            split=split,
            stop=stop,
            stop_by_domain=stop_by_domain,
            heldout=heldout,
            api=api,
        )


@dataclass(frozen=True)
class Scenario:
    url: str
    model: str
    phases: tuple[Phase, ...]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Scenario:
        server = raw.get("server", {})
        defaults = raw.get("defaults", {})
        listed = raw.get("phase", raw.get("phases"))
        if not isinstance(listed, list) or not listed:
            raise ValueError("a scenario needs at least one [[phase]]")
        phases = tuple(Phase.parse({**defaults, **p}, f"phase {i + 1}") for i, p in enumerate(listed))
        return cls(
            url=str(server.get("url", "http://127.0.0.1:8601")).rstrip("/"),
            model=str(server.get("model", "demo")),
            phases=phases,
        )

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        with open(path, "rb") as f:
            return cls.from_dict(tomllib.load(f))


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    domain: str
    category: str
    prompt: str  # a chat request's messages as plain "<role>: <content>" lines
    document: str  # "<domain>:<doc id>" of the document the prompt was cut from
    messages: tuple[dict[str, str], ...] = ()  # a chat domain's request (empty for the others)


def plan_requests(phase: Phase) -> Iterator[PlannedRequest]:
    """The phase's requests in their fixed order (endless: the phase's size decides where to stop)."""
    rng = random.Random(f"traffic:{phase.seed}")
    domains = sorted(phase.mix)
    cumulative = list(_cumulative([phase.mix[d] for d in domains]))
    streams = {d: corpora.traffic_prompts(d, phase.split, phase.seed, heldout=phase.heldout) for d in domains}
    index = 0
    while True:
        u = rng.random()
        domain = next((d for d, c in zip(domains, cumulative, strict=True) if u < c), domains[-1])
        prompt = next(streams[domain])
        document = corpora.document_key(domain, prompt.doc_id)
        yield PlannedRequest(index, domain, prompt.category, prompt.text, document, prompt.messages)
        index += 1


def _cumulative(weights: list[float]) -> Iterator[float]:
    total = 0.0
    for w in weights:
        total += w
        yield total


@dataclass
class PromptTally:
    """One phase's requests as the ledger counts them."""

    heldout: bool
    requests: int = 0
    repeats: int = 0
    sent: list[tuple[str, str]] = field(default_factory=list)  # (prompt hash, document) per request


@dataclass(frozen=True)
class PromptFigures:
    requests: int
    repeats: int
    repeat_share: float | None
    heldout_prompt_overlap: int | None  # None for a phase that is not held out


class PromptLedger:
    """Every prompt a run has sent, by normalised prompt hash and by document: the one place that
    counts a phase's repeats (of any earlier request of the run) and a held-out phase's overlap with
    the run's other phases."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._open_prompts: set[str] = set()
        self._open_documents: set[str] = set()

    def open_phase(self, *, heldout: bool) -> PromptTally:
        return PromptTally(heldout=heldout)

    def record(self, tally: PromptTally, request: PlannedRequest) -> None:
        """Count one sent request (in the order they are sent)."""
        digest = prompt_hash(request.prompt)
        tally.requests += 1
        tally.repeats += digest in self._seen
        self._seen.add(digest)
        tally.sent.append((digest, request.document))
        if not tally.heldout:
            self._open_prompts.add(digest)
            self._open_documents.add(request.document)

    def figures(self, tally: PromptTally) -> PromptFigures:
        """The phase's figures; a held-out phase's overlap is with every phase that is not held out
        recorded so far (the phases before it, or all of them once the run is over)."""
        overlap = (
            sum(d in self._open_prompts or doc in self._open_documents for d, doc in tally.sent)
            if tally.heldout
            else None
        )
        share = tally.repeats / tally.requests if tally.requests else None
        return PromptFigures(tally.requests, tally.repeats, share, overlap)


def plan_figures(phases: list[Phase] | tuple[Phase, ...]) -> list[PromptFigures]:
    """Each phase's prompt figures for a run that sends every phase's `requests` in order, planned
    without a server (a phase with only `duration_s` has no planned size and is refused)."""
    ledger = PromptLedger()
    tallies = []
    for phase in phases:
        if phase.requests is None:
            raise ValueError(f"phase {phase.name!r} has no `requests`: its size depends on the server")
        tally = ledger.open_phase(heldout=phase.heldout)
        for request in itertools.islice(plan_requests(phase), phase.requests):
            ledger.record(tally, request)
        tallies.append(tally)
    return [ledger.figures(t) for t in tallies]


@dataclass
class RequestResult:
    phase: str
    index: int
    request_id: str
    domain: str
    ok: bool
    latency_s: float
    completion_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    arm: str | None = None
    drafter_version: int | None = None
    ttft_s: float | None = None
    error: str | None = None
    finished_at: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        return speculation_math.hit_rate(self.accepted_tokens, self.drafted_tokens)


@dataclass
class Group:
    requests: int = 0
    errors: int = 0
    hit_rate: float | None = None
    ms_per_token: float | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class PhaseReport:
    name: str
    requests: int
    errors: int
    hit_rate: float | None
    tokens_per_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    ms_per_token: float | None
    wall_s: float
    completion_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    by_arm: dict[str, Group] = field(default_factory=dict)
    by_domain: dict[str, Group] = field(default_factory=dict)
    heldout: bool = False
    repeats: int = 0
    repeat_share: float | None = None
    heldout_prompt_overlap: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _group(results: list[RequestResult]) -> Group:
    ok = [r for r in results if r.ok]
    drafted = sum(r.drafted_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    tokens = sum(r.completion_tokens for r in ok)
    latency = sum(r.latency_s for r in ok)
    return Group(
        requests=len(results),
        errors=len(results) - len(ok),
        hit_rate=speculation_math.hit_rate(accepted, drafted),
        # The client times each request end to end: wall time per token, TTFT included.
        ms_per_token=speculation_math.ms_per_token(None, 1000.0 * latency, None, tokens, include_ttft=True),
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        completion_tokens=tokens,
    )


def summarise(name: str, results: list[RequestResult], wall_s: float) -> PhaseReport:
    whole = _group(results)
    latencies = [r.latency_s for r in results if r.ok]
    by_arm: dict[str, list[RequestResult]] = defaultdict(list)
    by_domain: dict[str, list[RequestResult]] = defaultdict(list)
    for r in results:
        by_arm[r.arm or "?"].append(r)
        by_domain[r.domain].append(r)
    return PhaseReport(
        name=name,
        requests=whole.requests,
        errors=whole.errors,
        hit_rate=whole.hit_rate,
        tokens_per_s=whole.completion_tokens / wall_s if wall_s > 0 else 0.0,
        latency_p50_s=_percentile(latencies, 0.5),
        latency_p95_s=_percentile(latencies, 0.95),
        ms_per_token=whole.ms_per_token,
        wall_s=wall_s,
        completion_tokens=whole.completion_tokens,
        drafted_tokens=whole.drafted_tokens,
        accepted_tokens=whole.accepted_tokens,
        by_arm={k: _group(v) for k, v in sorted(by_arm.items())},
        by_domain={k: _group(v) for k, v in sorted(by_domain.items())},
    )


@dataclass
class Callbacks:
    """Hooks called on the driver's thread; any may be None."""

    on_phase_start: Callable[[int, Phase], None] | None = None
    on_result: Callable[[int, Phase, RequestResult], None] | None = None
    on_phase_end: Callable[[int, Phase, PhaseReport], None] | None = None


class TrafficDriver:
    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        run_id: str | None = None,
        timeout_s: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
        ledger: PromptLedger | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.run_id = run_id or f"traffic-{uuid.uuid4().hex[:10]}"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout_s
        self._transport = transport
        self.ledger = ledger or PromptLedger()

    def run(
        self,
        phases: list[Phase] | tuple[Phase, ...],
        callbacks: Callbacks | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[PhaseReport]:
        return asyncio.run(self._run(list(phases), callbacks or Callbacks(), should_stop))

    async def _run(
        self, phases: list[Phase], cb: Callbacks, should_stop: Callable[[], bool] | None
    ) -> list[PhaseReport]:
        limits = httpx.Limits(max_connections=max(p.concurrency for p in phases) + 2)
        # Building a corpus takes seconds (prose reads every pydoc topic, structured traffic builds
        # Faker's pools): do it before any clock starts.
        for domain, split in sorted({(d, p.split) for p in phases for d in p.mix}):
            await asyncio.to_thread(corpora.prepare_traffic, domain, split)
        reports: list[PhaseReport] = []
        async with httpx.AsyncClient(
            timeout=self._timeout, limits=limits, headers=self._headers, transport=self._transport
        ) as client:
            for number, phase in enumerate(phases):
                if should_stop is not None and should_stop():
                    break
                if cb.on_phase_start is not None:
                    cb.on_phase_start(number, phase)
                report = await self._phase(client, number, phase, cb, should_stop)
                reports.append(report)
                if cb.on_phase_end is not None:
                    cb.on_phase_end(number, phase, report)
        return reports

    async def _phase(
        self,
        client: httpx.AsyncClient,
        number: int,
        phase: Phase,
        cb: Callbacks,
        should_stop: Callable[[], bool] | None,
    ) -> PhaseReport:
        planned = plan_requests(phase)
        tally = self.ledger.open_phase(heldout=phase.heldout)
        results: list[RequestResult] = []
        slots = asyncio.Semaphore(phase.concurrency)
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        end = start + phase.duration_s if phase.duration_s is not None else math.inf

        async def one(req: PlannedRequest) -> None:
            try:
                result = await self._send(client, number, phase, req)
                results.append(result)
                if cb.on_result is not None:
                    cb.on_result(number, phase, result)
            finally:
                slots.release()

        sent = 0
        while phase.requests is None or sent < phase.requests:
            if phase.rate is not None:  # open loop: request i leaves at start + i / rate
                delay = start + sent / phase.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            await slots.acquire()
            if time.monotonic() >= end or (should_stop is not None and should_stop()):
                slots.release()
                break
            request = next(planned)
            self.ledger.record(tally, request)
            task = asyncio.create_task(one(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
        if tasks:
            await asyncio.gather(*tasks)
        results.sort(key=lambda r: r.index)
        report = summarise(phase.name, results, time.monotonic() - start)
        figures = self.ledger.figures(tally)
        report.heldout = phase.heldout
        report.repeats, report.repeat_share = figures.repeats, figures.repeat_share
        report.heldout_prompt_overlap = figures.heldout_prompt_overlap
        return report

    async def _send(
        self, client: httpx.AsyncClient, number: int, phase: Phase, req: PlannedRequest
    ) -> RequestResult:
        request_id = f"{self.run_id}-p{number}-{req.index}"
        body = completion_body(self.model, phase, req)
        t0 = time.monotonic()
        base = RequestResult(phase.name, req.index, request_id, req.domain, False, 0.0)
        try:
            resp = await client.post(
                f"{self.url}{API_PATHS[phase.api]}", json=body, headers={"x-request-id": request_id}
            )
            latency = time.monotonic() - t0
            if resp.status_code >= 400:
                base.latency_s, base.error = latency, f"HTTP {resp.status_code}: {resp.text[:200]}"
                base.finished_at = time.time()
                return base
            data = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            base.latency_s, base.error = time.monotonic() - t0, repr(exc)
            base.finished_at = time.time()
            return base
        record = data.get("speculation_record") or {}
        perf = data.get("perf_metrics") or {}
        usage = data.get("usage") or {}
        ttft = perf.get("server-time-to-first-token")
        fw_accepted, fw_drafted = fireworks_counts(perf.get("speculation-acceptance"))
        return RequestResult(
            phase=phase.name,
            index=req.index,
            request_id=request_id,
            domain=req.domain,
            ok=True,
            latency_s=latency,
            completion_tokens=int(usage.get("completion_tokens") or record.get("generated_tokens") or 0),
            drafted_tokens=int(record.get("drafted_tokens") or fw_drafted),
            accepted_tokens=int(record.get("accepted_tokens") or fw_accepted),
            arm=record.get("arm"),
            drafter_version=record.get("drafter_version"),
            ttft_s=float(ttft) if ttft is not None else None,
            finished_at=time.time(),
        )


def completion_body(model: str, phase: Phase, req: PlannedRequest) -> dict[str, Any]:
    """The body of a planned request for the phase's route (`API_PATHS[phase.api]`): its `prompt`,
    or for chat its `messages` (a prompt of a completion domain as one user message); the phase's
    length, temperature (with a per-request seed when sampling) and stops, the request's category
    and source document."""
    if phase.api == "chat":
        messages = list(req.messages) or [{"role": "user", "content": req.prompt}]
        content: dict[str, Any] = {"messages": [dict(m) for m in messages]}
    else:
        content = {"prompt": req.prompt}
    body: dict[str, Any] = {
        "model": model,
        **content,
        "max_tokens": phase.max_tokens,
        "temperature": phase.temperature,
        "perf_metrics_in_response": True,
        "category": req.category,
        "document": req.document,
    }
    if phase.temperature > 0:
        body["seed"] = (phase.seed * 1_000_003 + req.index) % 2**31
    stop = phase.stop_for(req.domain)
    if stop:
        body["stop"] = list(stop)
    return body


def fireworks_counts(acceptance: object) -> tuple[int, int]:
    """(accepted, drafted) from Fireworks' `speculation-acceptance` "0:hits/total,1:..." string
    (position i's hits and totals, summed); (0, 0) when absent or not in that spelling."""
    if not isinstance(acceptance, str):
        return 0, 0
    accepted = drafted = 0
    for part in acceptance.split(","):
        hits, slash, total = part.rpartition(":")[2].strip().partition("/")
        if not (slash and hits.isdigit() and total.isdigit()):
            return 0, 0
        accepted, drafted = accepted + int(hits), drafted + int(total)
    return accepted, drafted


def run_scenario(
    scenario: Scenario,
    callbacks: Callbacks | None = None,
    *,
    api_key: str | None = None,
    run_id: str | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[PhaseReport]:
    driver = TrafficDriver(scenario.url, scenario.model, api_key=api_key, run_id=run_id)
    return driver.run(scenario.phases, callbacks, should_stop)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    ap = argparse.ArgumentParser(prog="python -m workers.serve.traffic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", type=Path, default=Path("scenarios/demo.toml"))
    ap.add_argument("--url", default=None, help="server base URL (overrides the scenario's)")
    ap.add_argument("--model", default=None, help="model / deployment name (overrides the scenario's)")
    ap.add_argument(
        "--api-key-file", type=Path, default=None, help="bearer key for the server, if it wants one"
    )
    ap.add_argument("--run-id", default=None, help="request-id prefix (default: a fresh one)")
    ap.add_argument("--json", type=Path, default=None, help="write the phase reports here")
    args = ap.parse_args(argv)

    scenario = Scenario.load(args.scenario)
    url, model = args.url or scenario.url, args.model or scenario.model
    api_key = args.api_key_file.read_text().strip() if args.api_key_file else None
    console = Console()
    routes = ", ".join(sorted({API_PATHS[p.api] for p in scenario.phases}))
    console.print(f"traffic to {url} ({routes}), model {model!r}, {len(scenario.phases)} phase(s)")
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("hit {task.fields[hit]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        tasks: dict[int, Any] = {}
        tallies: dict[int, list[int]] = {}

        def start(n: int, phase: Phase) -> None:
            tasks[n] = progress.add_task(phase.name, total=phase.requests, hit="-")
            tallies[n] = [0, 0]

        def result(n: int, phase: Phase, r: RequestResult) -> None:
            tallies[n][0] += r.accepted_tokens
            tallies[n][1] += r.drafted_tokens
            hit = f"{tallies[n][0] / tallies[n][1]:.1%}" if tallies[n][1] else "-"
            progress.update(tasks[n], advance=1, hit=hit)

        driver = TrafficDriver(url, model, api_key=api_key, run_id=args.run_id)
        reports = driver.run(scenario.phases, Callbacks(on_phase_start=start, on_result=result))

    table = Table(title="traffic by phase")
    columns = ("phase", "requests", "errors", "hit rate", "tokens/s", "ms/token", "p50 s", "p95 s")
    for col in (*columns, "repeats", "held-out overlap", "arms"):
        table.add_column(col)
    for rep in reports:
        arms = ", ".join(f"{a}: {g.requests} ({_fmt(g.hit_rate, '.0%')})" for a, g in rep.by_arm.items())
        table.add_row(
            rep.name,
            str(rep.requests),
            str(rep.errors),
            _fmt(rep.hit_rate, ".1%"),
            f"{rep.tokens_per_s:.1f}",
            _fmt(rep.ms_per_token, ".1f"),
            _fmt(rep.latency_p50_s, ".2f"),
            _fmt(rep.latency_p95_s, ".2f"),
            f"{rep.repeats} ({_fmt(rep.repeat_share, '.1%')})",
            "-" if rep.heldout_prompt_overlap is None else str(rep.heldout_prompt_overlap),
            arms,
        )
    console.print(table)
    if args.json is not None:
        args.json.write_text(json.dumps([r.as_dict() for r in reports], indent=2))


if __name__ == "__main__":
    main()
