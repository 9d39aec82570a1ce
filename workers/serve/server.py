"""The reference OpenAI-compatible completions server on top of the engine.

Owns `create_app(config)`: POST /v1/completions (prompt, max_tokens, temperature, top_p, seed,
stop, stream, Fireworks' `prediction` and `perf_metrics_in_response`, and a non-standard `category`, the
traffic label copied into the acceptance record and trace, and `document`, the source document the
prompt was cut from, copied into the trace), POST /v1/chat/completions (the same
parameters around `messages`, plus `max_completion_tokens` and `stream_options.include_usage`; the
messages are rendered into one prompt by workers.serve.chat with the target folder's chat template,
and from there both routes share one generation path), GET /v1/models and GET /healthz, with
OpenAI-shaped 4xx errors. Which target, drafters and k serve a model name is read per request from a
pluggable serving-config source (a static dict, or any callable such as `http_serving_config`,
which reads the control plane's `GET .../serving-config` and caches it for a second), so a
promotion or a new canary split takes effect within seconds, without a restart. Loaded models are
cached by folder path; decoders by their full setup.

Serving config of one model name, the control plane's shape (a live canary has three arms):
    {"model": "<deployment name>", "config_version": "<opaque>", "target_path": str,
     "target_sha256": str | None, "trace_sample_rate": float (optional), "max_len": int (optional),
     "arms": [{"arm": "live", "weight": 0.8, "speculation": "draft_model" | "ngram" | "disabled",
               "drafter_path": str | None, "drafter_sha256": str | None,
               "drafter_version": int | None, "k": int, "ngram_length": int,
               "draft_confidence_threshold": float | None (optional)},
              {"arm": "canary:<version>", "weight": 0.1, ...},
              {"arm": "baseline", "weight": 0.1, "speculation": "disabled", ...}]}
Without a canary there is one arm, "live", with weight 1.0. An arm's `draft_confidence_threshold`
stops its draft rounds at the first draft the drafter gives less than that probability (null: never
early; a key left out: the server's own `--draft-confidence-threshold`). An arm's keys override the top-level
ones (so an arm may name its own target_path). The older flat entry is still accepted and is one
implicit arm (named by its "arm" key, default "live"):
    {"target_path": str, "speculation": ..., "drafter_path": str | None, "k": int,
     "ngram_length": int, optional: "target_sha256", "drafter_sha256", "drafter_version", "arm",
     "max_len", "trace_sample_rate"}

Arm assignment is deterministic per request id (the `x-request-id` header, else a fresh id): the
first 8 bytes of sha256(request id) as a number in [0, 1), scaled by the total weight, picked off
the cumulative weights in the listed order. The same id gets the same arm in every process, and the
share of ids per arm converges to its weight. A request header `x-speculation-arm: <arm name>` pins
the arm when the current config lists an arm of that name (else the hash decides as usual), so a
router in front can send a request to a chosen arm. Every completion reply (plain and streamed)
carries the response headers `x-speculation-arm` (the arm that served it) and, when that arm has
one, `x-drafter-version`. With a static config of one arm the server is a fixed backend: an
incumbent drafter, a candidate drafter, or `"speculation": "disabled"`.

Metrics style (`ServerConfig.metrics_style`, `--metrics-style`): "fireworks" (the default) answers
`perf_metrics_in_response: true` with Fireworks' `perf_metrics` (workers.engine.metrics
`to_fireworks`: `speculation-acceptance` as "position:hits/total" pairs, and
`speculation-generated-tokens` = the tokens the verify steps emitted) plus our native
`speculation_record`, in the body or the final streamed chunk. "vllm" makes the server look like
vLLM started with `--per-request-spec-decode-metrics summary`: every reply carries a top-level
`metrics` object whose `speculative_decoding` is vLLM's summary (`to_vllm`; null when the arm
does not speculate), in the final streamed chunk (the one with `finish_reason`) when streaming, and
never `perf_metrics` or `speculation_record`, so a router in front of it can rely only on what
vLLM itself sends. The emitted acceptance record carries the arm and the
arm's drafter version. Traces (prompt + completion text) are sampled by the same kind of hash of
"trace:" + request id, at the config's `trace_sample_rate` (else `ServerConfig.trace_sample_rate`).
Records and traces go to `on_record` / `on_trace` sinks, in production a `ControlPlaneReporter`
(workers.serve.reporter) that batches them to the control plane from a background thread.

Generation holds one lock: on a CPU box requests would only contend for the same cores, and a
decoder's KV caches belong to one request at a time.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from workers.engine.decoder import GenerationResult, SpeculativeDecoder
from workers.engine.eagle import EagleHead, HeadProposer
from workers.engine.head_io import is_head_folder, load_head_folder
from workers.engine.hf_io import load_hf_folder
from workers.engine.model import Transformer
from workers.engine.proposers import (
    DraftModelProposer,
    NgramProposer,
    Proposer,
    check_confidence_threshold,
)
from workers.engine.stop_strings import parse_stop
from workers.engine.tokenizer import Tokenizer, ensure_same_tokenizer
from workers.serve.chat import InvalidMessages, TemplateError, chat_messages, render_chat

ServingConfigSource = Callable[[str], Mapping[str, Any] | None]
RecordSink = Callable[[str, dict[str, Any]], None]
# (model name, prompt, completion, category, document)
TraceSink = Callable[[str, str, str, str | None, str | None], None]
SPECULATION_MODES = ("draft_model", "ngram", "disabled")
METRICS_STYLES = ("fireworks", "vllm")
ARM_HEADER = "x-speculation-arm"
DRAFTER_VERSION_HEADER = "x-drafter-version"


@dataclass
class ServerConfig:
    # Static entries, or a callable model name -> entry (None: unknown model).
    serving_config: Mapping[str, Mapping[str, Any]] | ServingConfigSource
    # Names for GET /v1/models when `serving_config` is a callable that cannot enumerate.
    model_names: list[str] = field(default_factory=list)
    # Called with (model name, native acceptance record) after every request, e.g. to post it to
    # the control plane's ingest API. Exceptions are swallowed: metrics must not fail a completion.
    on_record: RecordSink | None = None
    # Called with (model name, prompt, completion, category, document) for the sampled requests.
    on_trace: TraceSink | None = None
    # Trace sample rate when the serving config does not carry `trace_sample_rate`.
    trace_sample_rate: float = 0.0
    max_decoders: int = 8
    # Torch threads verify passes may use (decoder.MultiRowThreads picks between these and the
    # process's own count by timing them); None: the process's count for every pass.
    multi_row_threads: int | None = None
    # Draft-model rounds stop at the first drafted token the drafter gives less than this
    # probability (0: always draft k). See DraftModelProposer.
    draft_confidence_threshold: float = 0.0
    # Called once when the app shuts down (e.g. to flush a reporter): uvicorn re-raises SIGTERM
    # after its graceful shutdown, so code after `uvicorn.run` would never run.
    on_shutdown: Callable[[], None] | None = None
    # Turns the control plane's model refs ({"name", "uri", "files" | "manifest_sha256", ...}) into
    # a verified local folder (workers.loading.VerifiedModels.path_of). Without it, only static
    # entries with target_path/drafter_path are served.
    model_locator: Callable[[Mapping[str, Any]], str] | None = None
    # Which engine's per-request metrics the replies carry: "fireworks" or "vllm" (module doc).
    metrics_style: str = "fireworks"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Prediction(BaseModel):
    type: Literal["content"] = "content"
    content: str


def _document_label(value: str | None) -> str | None:
    # The control plane refuses a whole trace batch for one blank label: refuse the request instead.
    if value is not None and (not value.strip() or "\x00" in value):
        raise ValueError("must be a non-empty string without NUL characters")
    return value


# Not OpenAI: the source document the prompt was cut from (at most the traces.document column's
# 200 characters); held-out evaluation keeps every prompt of one document apart from training.
DocumentLabel = Annotated[str | None, Field(max_length=200), AfterValidator(_document_label)]


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | list[str]
    # None: as many as the context leaves after the prompt (the chat route's default).
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stream: bool = False
    prediction: Prediction | None = None
    # OpenAI: one string or up to four; the completion ends before the first one it would contain.
    stop: str | list[str] | None = None
    perf_metrics_in_response: bool = False
    # Not OpenAI: the traffic label (e.g. a workload domain) the acceptance record and trace carry.
    category: str | None = Field(default=None, max_length=100)
    document: DocumentLabel = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    # Checked by workers.serve.chat, so that a bad message gets a 400 naming it rather than a schema dump.
    messages: list[Any]
    max_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's newer name for max_tokens; it wins when both are given.
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    prediction: Prediction | None = None
    perf_metrics_in_response: bool = False
    category: str | None = Field(default=None, max_length=100)
    document: DocumentLabel = None

    def as_completion(self) -> CompletionRequest:
        """The completion request the shared generation path serves (its prompt is rendered later,
        with the template of the target the request's arm picks)."""
        return CompletionRequest(
            model=self.model,
            prompt="",
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            n=self.n,
            seed=self.seed,
            stream=self.stream,
            prediction=self.prediction,
            stop=self.stop,
            perf_metrics_in_response=self.perf_metrics_in_response,
            category=self.category,
            document=self.document,
        )


@dataclass(frozen=True)
class Deployment:
    target_path: str
    speculation: str
    drafter_path: str | None
    k: int
    ngram_length: int
    target_sha256: str | None
    drafter_sha256: str | None
    drafter_version: int | None
    arm: str
    max_len: int | None
    # None: the server's own threshold (ServerConfig.draft_confidence_threshold); 0: never early.
    draft_confidence_threshold: float | None = None

    @classmethod
    def parse(cls, name: str, raw: Mapping[str, Any]) -> Deployment:
        speculation = str(raw.get("speculation", "disabled"))
        if speculation == "default":  # the control plane's "use the deployment's drafter if any"
            speculation = "draft_model" if raw.get("drafter_path") else "disabled"
        if speculation not in SPECULATION_MODES:
            raise ValueError(f"model {name!r}: unknown speculation mode {speculation!r}")
        if not raw.get("target_path"):
            raise ValueError(f"model {name!r}: serving config has no target_path")
        if speculation == "draft_model" and not raw.get("drafter_path"):
            raise ValueError(f"model {name!r}: draft_model speculation without a drafter_path")
        version = raw.get("drafter_version")
        threshold: float | None = None
        if "draft_confidence_threshold" in raw:  # present and null: never stop early
            threshold = float(raw["draft_confidence_threshold"] or 0.0)
            check_confidence_threshold(threshold)
        return cls(
            target_path=str(raw["target_path"]),
            speculation=speculation,
            drafter_path=str(raw["drafter_path"]) if raw.get("drafter_path") else None,
            k=int(raw.get("k", raw.get("draft_token_count", 4)) or 4),
            ngram_length=int(raw.get("ngram_length", raw.get("ngram_speculation_length", 3)) or 3),
            target_sha256=raw.get("target_sha256"),
            drafter_sha256=raw.get("drafter_sha256"),
            drafter_version=int(version) if version is not None else None,
            arm=str(raw.get("arm", "live")),
            max_len=int(raw["max_len"]) if raw.get("max_len") else None,
            draft_confidence_threshold=threshold,
        )


def with_local_paths(
    raw: Mapping[str, Any], locator: Callable[[Mapping[str, Any]], str] | None
) -> Mapping[str, Any]:
    """The serving config with its model refs (``target``, each arm's ``drafter``) replaced by the
    verified local folders the locator gives; a ref that fails verification fails the request."""
    refs = isinstance(raw.get("target"), Mapping) or any(
        isinstance(arm.get("drafter"), Mapping) for arm in raw.get("arms") or []
    )
    if not refs:
        return raw
    if locator is None:
        raise ValueError("the serving config names models by reference, but this server has no locator")
    out = dict(raw)
    if isinstance(raw.get("target"), Mapping):
        out["target_path"] = locator(raw["target"])
    arms = []
    for arm in raw.get("arms") or []:
        arm = dict(arm)
        if isinstance(arm.get("drafter"), Mapping):
            arm["drafter_path"] = locator(arm["drafter"])
        arms.append(arm)
    if arms:
        out["arms"] = arms
    return out


def unit_interval(key: str) -> float:
    """A number in [0, 1) from sha256 of `key`: the same in every process and on every machine."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


@dataclass(frozen=True)
class Arm:
    name: str
    weight: float
    deployment: Deployment


@dataclass(frozen=True)
class ServingPlan:
    """A model name's arms with their routing weights, parsed from one serving-config object."""

    model: str
    arms: tuple[Arm, ...]
    config_version: str | None = None
    trace_sample_rate: float | None = None

    @classmethod
    def parse(cls, name: str, raw: Mapping[str, Any]) -> ServingPlan:
        rate = raw.get("trace_sample_rate")
        if rate is not None and not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"model {name!r}: trace_sample_rate {rate!r} is not within [0, 1]")
        version = raw.get("config_version")
        common = {key: value for key, value in raw.items() if key != "arms"}
        if "arms" not in raw:  # the flat entry: one implicit arm
            dep = Deployment.parse(name, common)
            arms: tuple[Arm, ...] = (Arm(dep.arm, 1.0, dep),)
        else:
            listed = raw["arms"]
            if not isinstance(listed, list) or not listed:
                raise ValueError(f"model {name!r}: serving config has no arms")
            parsed = []
            for entry in listed:
                arm_name = str(entry.get("arm") or "live")
                weight = float(entry.get("weight", 1.0))
                if not weight >= 0.0:
                    raise ValueError(f"model {name!r}: arm {arm_name!r} has a negative weight")
                parsed.append(
                    Arm(arm_name, weight, Deployment.parse(name, {**common, **entry, "arm": arm_name}))
                )
            arms = tuple(parsed)
            if len({a.name for a in arms}) != len(arms):
                raise ValueError(f"model {name!r}: arm names repeat")
            if sum(a.weight for a in arms) <= 0.0:
                raise ValueError(f"model {name!r}: arm weights sum to zero")
        return cls(
            model=str(raw.get("model") or name),
            arms=arms,
            config_version=str(version) if version is not None else None,
            trace_sample_rate=float(rate) if rate is not None else None,
        )

    def pick(self, request_id: str, pinned: str | None = None) -> Arm:
        """The arm a request header names, when this plan lists it; else `assign`."""
        if pinned:
            for arm in self.arms:
                if arm.name == pinned:
                    return arm
        return self.assign(request_id)

    def assign(self, request_id: str) -> Arm:
        """The arm of a request: its hash's place on the cumulative weights (see the module doc)."""
        total = sum(a.weight for a in self.arms)
        point = unit_interval(request_id) * total
        cumulative = 0.0
        for arm in self.arms:
            cumulative += arm.weight
            if point < cumulative and arm.weight > 0.0:
                return arm
        return next(a for a in reversed(self.arms) if a.weight > 0.0)  # rounding at the top end


class ModelStore:
    """Loaded models by folder path (a drafter shared by deployments is loaded once)."""

    def __init__(self) -> None:
        self._models: dict[str, tuple[Transformer, Tokenizer]] = {}
        self._heads: dict[tuple[str, str], tuple[EagleHead, Tokenizer]] = {}
        self._lock = threading.Lock()

    def get(self, path: str, sha256: str | None = None) -> tuple[Transformer, Tokenizer]:
        with self._lock:
            if path not in self._models:
                self._models[path] = load_hf_folder(path, expected_sha256=sha256)
            return self._models[path]

    def head(
        self, path: str, sha256: str | None, target: Transformer, target_path: str
    ) -> tuple[EagleHead, Tokenizer]:
        """A draft head over ``target`` (its embeddings shared: one copy per target it serves)."""
        with self._lock:
            key = (path, target_path)
            if key not in self._heads:
                self._heads[key] = load_head_folder(path, target, expected_sha256=sha256)
            return self._heads[key]


class Engine:
    """Resolves a model name to a ready `SpeculativeDecoder` and runs requests one at a time."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.models = ModelStore()
        self._decoders: OrderedDict[Deployment, SpeculativeDecoder] = OrderedDict()
        self.lock = threading.Lock()

    def resolve(self, name: str) -> ServingPlan:
        source = self.config.serving_config
        try:
            raw = source(name) if callable(source) else source.get(name)
        except Exception as exc:  # the control plane being down must not look like a 404
            raise APIError(503, f"serving config unavailable: {exc}", "server_error") from exc
        if raw is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        try:
            return ServingPlan.parse(name, with_local_paths(raw, self.config.model_locator))
        except (ValueError, TypeError, AttributeError) as exc:
            raise APIError(500, f"bad serving config: {exc}", "server_error") from exc

    def model_names(self) -> list[str]:
        source = self.config.serving_config
        return list(self.config.model_names) or ([] if callable(source) else list(source))

    def decoder(self, dep: Deployment) -> SpeculativeDecoder:
        if dep in self._decoders:
            self._decoders.move_to_end(dep)
            return self._decoders[dep]
        target, tok = self.models.get(dep.target_path, dep.target_sha256)
        proposer: Proposer | None = None
        if dep.speculation == "draft_model":
            assert dep.drafter_path is not None
            threshold = dep.draft_confidence_threshold
            if threshold is None:
                threshold = self.config.draft_confidence_threshold
            if is_head_folder(dep.drafter_path):  # an EAGLE-3 head: it drafts from the target's states
                head, dtok = self.models.head(dep.drafter_path, dep.drafter_sha256, target, dep.target_path)
                ensure_same_tokenizer(tok, dtok, dep.target_path, dep.drafter_path)
                proposer = HeadProposer(head, name=dep.drafter_path, confidence_threshold=threshold)
            else:
                drafter, dtok = self.models.get(dep.drafter_path, dep.drafter_sha256)
                ensure_same_tokenizer(tok, dtok, dep.target_path, dep.drafter_path)
                proposer = DraftModelProposer(drafter, name=dep.drafter_path, confidence_threshold=threshold)
        elif dep.speculation == "ngram":
            proposer = NgramProposer(dep.ngram_length)
        dec = SpeculativeDecoder(
            target,
            tok,
            proposer,
            k=dep.k,
            max_len=dep.max_len,
            multi_row_threads=self.config.multi_row_threads,
        )
        self._decoders[dep] = dec
        while len(self._decoders) > self.config.max_decoders:
            self._decoders.popitem(last=False)
        return dec

    def run(
        self,
        dep: Deployment,
        req: CompletionRequest,
        prompt: str,
        on_tokens: Callable[[list[int]], None] | None,
    ) -> GenerationResult:
        with self.lock:
            try:
                dec = self.decoder(dep)
            except (OSError, ValueError) as exc:
                raise APIError(500, f"cannot load deployment models: {exc}", "server_error") from exc
            prompt_ids = dec.tokenizer.encode(prompt)
            if not prompt_ids:
                raise APIError(400, "prompt must not be empty", param="prompt")
            max_tokens = (
                req.max_tokens if req.max_tokens is not None else max(1, dec.max_len - len(prompt_ids))
            )
            if len(prompt_ids) + max_tokens > dec.max_len:
                raise APIError(
                    400,
                    f"This model's maximum context length is {dec.max_len} tokens. However, you requested "
                    f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                    f"{max_tokens} for the completion).",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            gen = torch.Generator().manual_seed(req.seed) if req.seed is not None else None
            if gen is None and req.temperature > 0:
                gen = torch.Generator().manual_seed(int.from_bytes(uuid.uuid4().bytes[:8], "little") >> 1)
            return dec.generate(
                prompt_ids,
                max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                generator=gen,
                prediction=req.prediction.content if req.prediction is not None else None,
                on_tokens=on_tokens,
                stop=stop_strings(req),
            )


def stop_strings(req: CompletionRequest) -> tuple[str, ...]:
    return parse_stop(None if req.stop == [] else req.stop)  # an empty list, like null, asks for none


def _validate_sampling(req: CompletionRequest) -> None:
    if req.n != 1:
        raise APIError(400, "only n = 1 is supported", param="n")
    try:
        stop_strings(req)
    except ValueError as exc:
        raise APIError(400, str(exc), param="stop") from exc


def _validate(req: CompletionRequest) -> str:
    _validate_sampling(req)
    if isinstance(req.prompt, list):
        if len(req.prompt) != 1:
            raise APIError(400, "exactly one prompt per request is supported", param="prompt")
        return req.prompt[0]
    return req.prompt


class _TextStream:
    """Turns token chunks into text deltas, holding back bytes of a split UTF-8 character and, with
    stop strings, any tail that may be the start of one (the final chunk sends what the decoder's
    cut text still holds)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        end = len(text) - self.hold
        for s in self.stops:
            if (i := text.find(s, max(0, self.sent))) >= 0:
                end = min(end, i)
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta


def _response_extras(
    req: CompletionRequest, res: GenerationResult, dep: Deployment, request_id: str, style: str
) -> dict[str, Any]:
    m = res.metrics
    out: dict[str, Any] = {
        "usage": {
            "prompt_tokens": m.prompt_tokens,
            "completion_tokens": m.generated_tokens,
            "total_tokens": m.prompt_tokens + m.generated_tokens,
        }
    }
    if style == "vllm":  # what vLLM's --per-request-spec-decode-metrics summary adds, always
        out["metrics"] = {"speculative_decoding": m.to_vllm() if m.k >= 1 else None}
    elif req.perf_metrics_in_response:
        out["perf_metrics"] = m.to_fireworks()
        out["speculation_record"] = m.to_native(request_id, dep.arm, dep.drafter_version)
    return out


@dataclass(frozen=True)
class _ReplyShape:
    """How a route words the replies of the shared generation path: text completions, or chat
    completions (a message, and streamed deltas that open with the assistant role)."""

    chat: bool
    # Chat streams send usage only when asked, in a chunk of its own after the last choice.
    include_stream_usage: bool = False

    @property
    def id_prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self.choice(text, finish_reason)

    def opening_choices(self) -> list[dict[str, Any]]:
        if self.chat:
            return [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        return []


def _served_headers(dep: Deployment) -> dict[str, str]:
    headers = {ARM_HEADER: dep.arm}
    if dep.drafter_version is not None:
        headers[DRAFTER_VERSION_HEADER] = str(dep.drafter_version)
    return headers


def create_app(config: ServerConfig) -> FastAPI:
    if config.metrics_style not in METRICS_STYLES:
        raise ValueError(f"metrics_style must be one of {METRICS_STYLES}, got {config.metrics_style!r}")
    engine = Engine(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if config.on_shutdown is not None:
            await run_in_threadpool(config.on_shutdown)

    app = FastAPI(title="speculative-decoding reference server", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed parameters with 400 invalid_request_error, never FastAPI's 422.
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(first.get("msg"))
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    def emit(
        req: CompletionRequest,
        prompt: str,
        res: GenerationResult,
        dep: Deployment,
        request_id: str,
        rate: float,
    ) -> None:
        # Sinks must never fail a completion (the production sink only enqueues).
        if config.on_record is not None:
            record = res.metrics.to_native(request_id, dep.arm, dep.drafter_version)
            if req.category is not None:
                record["category"] = req.category
            try:
                config.on_record(req.model, record)
            except Exception:
                pass
        if config.on_trace is not None and rate > 0.0 and unit_interval("trace:" + request_id) < rate:
            try:
                # The stop string the reply omits is part of what the target wrote: keep it.
                completion = res.text + (res.stop_string or "")
                config.on_trace(req.model, prompt, completion, req.category, req.document)
            except Exception:
                pass

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": n, "object": "model", "created": now, "owned_by": "local"}
                for n in engine.model_names()
            ],
        }

    async def serve(
        req: CompletionRequest,
        request: Request,
        shape: _ReplyShape,
        prompt_for: Callable[[Deployment], str],
    ) -> JSONResponse | StreamingResponse:
        """Both routes' generation: pick the arm, build its prompt, run it (streamed or not), emit
        the acceptance record and sampled trace, and word the reply as `shape` says."""
        # Off the event loop: an HTTP source may have to ask the control plane, a template a disk.
        plan = await run_in_threadpool(engine.resolve, req.model)
        request_id = request.headers.get("x-request-id") or f"{shape.id_prefix}{uuid.uuid4().hex}"
        dep = plan.pick(request_id, request.headers.get(ARM_HEADER)).deployment
        served = _served_headers(dep)
        prompt = await run_in_threadpool(prompt_for, dep)
        rate = plan.trace_sample_rate if plan.trace_sample_rate is not None else config.trace_sample_rate
        created = int(time.time())
        base = {"id": request_id, "object": shape.object, "created": created, "model": req.model}

        if not req.stream:
            res = await run_in_threadpool(engine.run, dep, req, prompt, None)
            emit(req, prompt, res, dep, request_id, rate)
            choice = shape.choice(res.text, res.finish_reason)
            extras = _response_extras(req, res, dep, request_id, config.metrics_style)
            return JSONResponse({**base, "choices": [choice], **extras}, headers=served)

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[int] | None] = asyncio.Queue()

        def on_tokens(ids: list[int]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, list(ids))

        # Start now, so that validation errors (too long, unknown drafter) still become 4xx replies.
        task = asyncio.ensure_future(run_in_threadpool(engine.run, dep, req, prompt, on_tokens))
        task.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        first = await queue.get()
        if first is None:
            task.result()  # raises the APIError, turned into an error reply by the handler

        chunk_base = {**base, "object": shape.chunk_object}

        def event(body: dict[str, Any]) -> str:
            return f"data: {json.dumps(body)}\n\n"

        async def events() -> AsyncIterator[str]:
            for opening in shape.opening_choices():
                yield event({**chunk_base, "choices": [opening]})
            stream = _TextStream(engine.models.get(dep.target_path, dep.target_sha256)[1], stop_strings(req))
            chunk: list[int] | None = first
            while chunk is not None:
                delta = stream.push(chunk)
                if delta:
                    yield event({**chunk_base, "choices": [shape.delta(delta)]})
                chunk = await queue.get()
            res = await task
            emit(req, prompt, res, dep, request_id, rate)
            tail = res.text[stream.sent :]  # whatever was held back as an incomplete character
            extras = _response_extras(req, res, dep, request_id, config.metrics_style)
            if shape.chat:
                usage = extras.pop("usage")
                yield event({**chunk_base, "choices": [shape.delta(tail, res.finish_reason)], **extras})
                if shape.include_stream_usage:
                    yield event({**chunk_base, "choices": [], "usage": usage})
            else:
                yield event({**chunk_base, "choices": [shape.delta(tail, res.finish_reason)], **extras})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=served)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
        prompt = _validate(req)
        return await serve(req, request, _ReplyShape(chat=False), lambda _: prompt)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        chat: ChatCompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        req = chat.as_completion()
        _validate_sampling(req)
        try:
            messages = chat_messages(chat.messages)
        except InvalidMessages as exc:
            raise APIError(400, str(exc), param=exc.param) from exc

        def prompt_for(dep: Deployment) -> str:
            try:
                return render_chat(dep.target_path, messages)
            except InvalidMessages as exc:  # the template itself refused the conversation
                raise APIError(400, str(exc), param=exc.param) from exc
            except (TemplateError, OSError, ValueError) as exc:
                raise APIError(500, f"cannot render the chat prompt: {exc}", "server_error") from exc

        include_usage = chat.stream_options is not None and chat.stream_options.include_usage
        return await serve(
            req, request, _ReplyShape(chat=True, include_stream_usage=include_usage), prompt_for
        )

    return app


def http_serving_config(
    url_template: str,
    api_key: str | None = None,
    ttl_s: float = 1.0,
    timeout_s: float = 5.0,
    stale_s: float = 60.0,
    client: Any = None,
    clock: Callable[[], float] = time.monotonic,
) -> ServingConfigSource:
    """A serving-config source that GETs `url_template.format(model=name)` (the control plane's
    `/v1/accounts/{a}/deployments/{d}/serving-config`), cached for `ttl_s` seconds per model, so a
    promotion reaches the server within about a second. A 404 means an unknown model. When the
    control plane cannot be reached, a cached answer up to `stale_s` old keeps serving (and the
    error is raised only without one): a control-plane restart must not stop completions."""
    import httpx

    http = client if client is not None else httpx.Client(timeout=timeout_s)
    cache: dict[str, tuple[float, Mapping[str, Any] | None]] = {}
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def source(name: str) -> Mapping[str, Any] | None:
        now = clock()
        with lock:
            hit = cache.get(name)
        if hit is not None and now - hit[0] < ttl_s:
            return hit[1]
        try:
            resp = http.get(url_template.format(model=name), headers=headers)
            value: Mapping[str, Any] | None = (
                None if resp.status_code == 404 else resp.raise_for_status().json()
            )
        except (httpx.HTTPError, ValueError):
            if hit is not None and now - hit[0] < stale_s:
                return hit[1]
            raise
        with lock:
            cache[name] = (now, value)
        return value

    return source
