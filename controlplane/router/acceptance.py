"""What the router learns from one backend reply: the acceptance record and the completion text.

Pure. The reply is read with the control plane's own ingest adapters (vLLM per-request metrics,
SGLang ``meta_info``, TensorRT-LLM, Fireworks ``perf_metrics``), detected per reply, so any engine
that reports per-request acceptance works behind the router. A reply with none of them (an engine
serving without speculation) is a no-speculation record whose length comes from ``usage``. The
router then files the record under the arm and drafter version that served it, with the latencies
it measured itself (time to first byte and total, as the client saw them minus the router's own
queueing), which are comparable across engines where engines' self-reported timings are not.

Streamed replies are scanned incrementally (``SseScanner``) as the chunks pass through: only
events that can carry metrics or usage are decoded, and text is kept only for sampled traces.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from controlplane.ingest.formats import NATIVE_FIELDS, BatchValidationError, parse_record
from controlplane.ingest.record import AcceptanceRecord
from controlplane.speculation_math import ms_per_token
from controlplane.traces.chat_template import render_chat

# Substrings of an SSE event that may carry acceptance or usage; other events are not decoded.
_METRIC_HINTS: Final = (
    b'"metrics"',
    b'"perf_metrics"',
    b'"meta_info"',
    b'"usage"',
    b'"speculative_decoding"',
)


class UnreadableReply(ValueError):
    """The reply names acceptance metrics the adapters refuse; the message says why."""


@dataclass
class SseScanner:
    """Follows an SSE stream chunk by chunk: merges the events that carry metrics or usage into
    one reply-shaped object, counts content events, and keeps the text when ``keep_text``."""

    keep_text: bool = False
    reply: dict[str, Any] = field(default_factory=dict)
    content_events: int = 0
    text: list[str] = field(default_factory=list)
    _partial: bytes = b""

    def feed(self, chunk: bytes) -> None:
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(b"\n") + 1
        self._partial = data[end:]
        if not self.keep_text and not any(hint in data for hint in _METRIC_HINTS):
            # The common case: content events only. Count them without splitting lines.
            self.content_events += data.count(b'"choices"', 0, end)
            return
        for line in data[:end].split(b"\n"):
            self._line(line.rstrip(b"\r"))

    def close(self) -> None:
        if self._partial:
            self._line(self._partial.rstrip(b"\r"))
            self._partial = b""

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            return
        carries_metrics = any(hint in payload for hint in _METRIC_HINTS)
        if not carries_metrics and not self.keep_text:
            self.content_events += 1 if b'"choices"' in payload else 0
            return
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        piece = completion_text(event, streamed=True)
        if piece:
            self.content_events += 1
            if self.keep_text:
                self.text.append(piece)
        if carries_metrics:
            for key, value in event.items():
                if key == "choices":
                    self._merge_choice(value)
                elif value is not None or key not in self.reply:
                    self.reply[key] = value

    def _merge_choice(self, choices: object) -> None:
        """Engines that report per choice (vLLM's ``speculative_decoding`` in choices[0], SGLang's
        ``meta_info``) are read from the choice; keep its non-text keys."""
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            kept = {k: v for k, v in choices[0].items() if k not in ("text", "delta", "logprobs")}
            if any(k not in ("index", "finish_reason") for k in kept):
                previous = self.reply.get("choices") or [{}]
                self.reply["choices"] = [{**previous[0], **kept}]


def completion_text(reply: Mapping[str, Any], *, streamed: bool = False) -> str:
    """The first choice's text (completions) or message content (chat), streamed or whole."""
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if isinstance(choice.get("text"), str):
        return str(choice["text"])
    holder = choice.get("delta" if streamed else "message")
    if isinstance(holder, dict) and isinstance(holder.get("content"), str):
        return str(holder["content"])
    return ""


def prompt_text(body: Mapping[str, Any]) -> str | None:
    """The prompt a trace keeps: a completion's prompt, or a chat rendered as "role: content"
    lines ending in "assistant: " (the plain rendering the reference server falls back to)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = trace_messages(body)
    return render_chat(None, messages) if messages is not None else None


def trace_messages(body: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """A chat request's messages as the trace keeps them ({role, content}), or None for a
    completion or a chat whose contents are not all text. Ingestion renders them with the
    target's chat template: the prompt the target was given, not ``prompt_text``'s plain lines."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return None
        out.append({"role": str(message.get("role")), "content": message["content"]})
    return out


def usage_completion_tokens(reply: Mapping[str, Any]) -> int | None:
    usage = reply.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return None


def acceptance_record(
    reply: Mapping[str, Any],
    *,
    request_id: str,
    arm: str,
    drafter_version: int | None,
    category: str | None,
    ttft_ms: float | None,
    total_ms: float,
    content_events: int = 0,
    finished_at: datetime | None = None,
) -> dict[str, Any]:
    """The native record for one reply, filed under ``arm``/``drafter_version`` with the router's
    own latencies. ``UnreadableReply`` when the reply's metrics are present but refused."""
    return native(
        acceptance_of(
            reply,
            request_id=request_id,
            arm=arm,
            drafter_version=drafter_version,
            category=category,
            ttft_ms=ttft_ms,
            total_ms=total_ms,
            content_events=content_events,
            finished_at=finished_at,
        )
    )


def acceptance_of(
    reply: Mapping[str, Any],
    *,
    request_id: str,
    arm: str,
    drafter_version: int | None,
    category: str | None,
    ttft_ms: float | None,
    total_ms: float,
    content_events: int = 0,
    finished_at: datetime | None = None,
) -> AcceptanceRecord:
    """``acceptance_record`` before it is rendered as JSON: what a window's aggregates sum."""
    envelope: dict[str, Any] = {
        "request_id": request_id,
        "arm": arm,
        "drafter_version": drafter_version,
        "category": category,
    }
    candidate = {k: v for k, v in reply.items() if k not in ("id", "created", "object", "model")}
    candidate.update(envelope)
    try:
        record = parse_record(candidate)
    except BatchValidationError as exc:
        if not all(p.field == "" and "cannot detect the format" in p.message for p in exc.problems):
            raise UnreadableReply(str(exc)) from None
        record = _without_speculation(reply, envelope, content_events)
    if usage_completion_tokens(reply) is None and content_events > record.generated_tokens:
        # A stream without usage: the adapters' lower bound (accepted + verify steps) misses the
        # prefill's token; each content event carries at least one token. Clients that send
        # stream_options.include_usage get exact counts.
        record.generated_tokens = content_events
    generated = record.generated_tokens
    record.ttft_ms = ttft_ms
    record.total_ms = total_ms
    # Measured here, so the record carries it: the decode time per token (TTFT left out).
    record.inter_token_ms = ms_per_token(None, total_ms, ttft_ms, generated) if ttft_ms is not None else None
    record.created_at = finished_at or datetime.now(UTC)
    return record


def _without_speculation(
    reply: Mapping[str, Any], envelope: dict[str, Any], content_events: int
) -> AcceptanceRecord:
    """No acceptance block: nothing was drafted. Its length is ``usage.completion_tokens``, else
    the number of streamed content events (one token each on the engines we know)."""
    generated = usage_completion_tokens(reply)
    if generated is None:
        generated = content_events or len(completion_text(reply).split()) or 0
    usage = reply.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return AcceptanceRecord(
        request_id=envelope["request_id"],
        drafted_tokens=0,
        accepted_tokens=0,
        verify_steps=0,
        generated_tokens=generated,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
        arm=envelope["arm"],
        drafter_version=envelope["drafter_version"],
        category=envelope["category"],
    )


def native(record: AcceptanceRecord) -> dict[str, Any]:
    """An ``AcceptanceRecord`` as the ingest API's native JSON record."""
    out: dict[str, Any] = {}
    for name in NATIVE_FIELDS:
        value = getattr(record, name)
        if value is None:
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, Sequence) and not isinstance(value, str):
            value = list(value)
        out[name] = value
    return out
