"""The shapes traces arrive in, validated into ``TraceInput`` before anything is stored.

Owns the JSON batch body of ``POST .../traces`` (``parse_trace_batch``), the JSONL sample-dataset
body of ``POST .../datasets`` (``parse_dataset``), their limits, and ``TraceValidationError``,
which lists every problem with its place (batch index or file line) and field. Pure: no I/O, no
database, no web framework; the API maps the error onto 413 or 422.

Dataset lines take three shapes: ``{"prompt", "completion"}``, the aliases ``{"input",
"output"}``, and OpenAI chat ``{"messages": [...]}`` where the completion is the last assistant
message and the conversation is every message before it (messages after the last assistant
message have no completion to pair with and are dropped). A batch item gives either ``prompt`` or
``messages`` (the conversation its completion answers). A conversation is kept as its messages and
as its plain rendering (``controlplane.traces.chat_template.PLAIN_TEMPLATE``); storing renders it
with the deployment's target chat template, the prompt the target was given. Unknown keys
are ignored in datasets (exports carry ids and metadata) and refused in batches (a typo such as
"completon" would otherwise store an empty completion). Either shape may name the request's
``category`` and the ``document`` its prompt was cut from (the held-out split's unit).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import orjson

from controlplane.traces.chat_template import render_chat

MAX_TRACES_PER_BATCH: Final = 1_000
MAX_TEXT_BYTES: Final = 64 * 1024  # per prompt and per completion, UTF-8
MAX_CATEGORY_CHARS: Final = 100  # the traces.category column
MAX_DOCUMENT_CHARS: Final = 200  # the traces.document column
MAX_DATASET_BYTES: Final = 50 * 1024 * 1024
MAX_DATASET_LINES: Final = 100_000
# A deployment keeps its traces between 1 day and ten years; the hourly cleanup computes
# "now - retention" and a larger value would overflow a date.
MAX_TRACE_RETENTION_DAYS: Final = 3_650
# A reply listing every bad line of a 100,000-line file would itself be huge.
MAX_REPORTED_PROBLEMS: Final = 100

_BATCH_ITEM_KEYS: Final = frozenset({"prompt", "messages", "completion", "category", "document"})


@dataclass(frozen=True, slots=True)
class TraceInput:
    """One prompt and completion as the caller sent it (not yet scrubbed). A chat carries its
    ``messages`` ({role, content}, the conversation the completion answers) and ``prompt`` is their
    plain rendering, used where the target has no chat template."""

    prompt: str
    completion: str
    category: str | None = None
    document: str | None = None  # the source document's label, as the client named it
    messages: tuple[dict[str, str], ...] | None = None


@dataclass(frozen=True, slots=True)
class Problem:
    """Why one item was refused: its place (batch index or 1-based file line), field, message."""

    place: int | None
    field: str
    message: str
    too_large: bool = False


class TraceValidationError(ValueError):
    """Every problem found; nothing of the batch or file may be stored (all or nothing)."""

    def __init__(self, problems: Iterable[Problem], *, place_name: str, total: int | None = None) -> None:
        self.problems = list(problems)
        self.place_name = place_name  # "index" for batches, "line" for files
        self.total = len(self.problems) if total is None else total
        first = self.problems[0]
        where = "" if first.place is None else f"{place_name} {first.place}: "
        more = f" (and {self.total - 1} more problems)" if self.total > 1 else ""
        super().__init__(f"{where}{first.field or '<body>'}: {first.message}{more}")

    @property
    def too_large(self) -> bool:
        """Whether a size limit was exceeded (the API answers 413 rather than 422)."""
        return any(p.too_large for p in self.problems)

    def as_dicts(self) -> list[dict[str, object]]:
        """The problems as JSON-able dicts for the error body."""
        return [{self.place_name: p.place, "field": p.field, "message": p.message} for p in self.problems]


class _Problems:
    """Collects problems up to the reporting cap while still counting all of them."""

    def __init__(self) -> None:
        self.items: list[Problem] = []
        self.total = 0

    def add(self, place: int | None, field: str, message: str, *, too_large: bool = False) -> None:
        self.total += 1
        # Past the cap, one size problem is still kept: it decides between 413 and 422.
        if len(self.items) < MAX_REPORTED_PROBLEMS or (
            too_large and not any(p.too_large for p in self.items)
        ):
            self.items.append(Problem(place, field, message, too_large))

    def raise_if_any(self, place_name: str) -> None:
        if self.items:
            raise TraceValidationError(self.items, place_name=place_name, total=self.total)


def _utf8_size_over(text: str, limit: int) -> int | None:
    """The UTF-8 size of ``text`` when it exceeds ``limit``, else None (encodes only when needed)."""
    if len(text) * 4 <= limit:
        return None
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return size if size > limit else None


def _check_text(value: Any, place: int, field: str, problems: _Problems) -> str | None:
    if value is None:
        problems.add(place, field, "is required")
        return None
    if not isinstance(value, str):
        problems.add(place, field, f"must be a string, got {type(value).__name__}")
        return None
    size = _utf8_size_over(value, MAX_TEXT_BYTES)
    if size is not None:
        problems.add(place, field, f"{size} bytes exceeds the {MAX_TEXT_BYTES}-byte limit", too_large=True)
        return None
    if "\x00" in value:
        # PostgreSQL text cannot hold NUL; refusing beats silently altering the trace.
        problems.add(place, field, "contains a NUL character")
        return None
    return value


def _check_label(value: Any, place: int, field: str, limit: int, problems: _Problems) -> str | None:
    """An optional short label (``category``, ``document``): a non-empty string within its column."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        problems.add(place, field, "must be a non-empty string or null")
        return None
    if len(value) > limit or "\x00" in value:
        problems.add(place, field, f"must be at most {limit} characters, without NUL")
        return None
    return value


def _check_category(value: Any, place: int, problems: _Problems) -> str | None:
    return _check_label(value, place, "category", MAX_CATEGORY_CHARS, problems)


def _check_document(value: Any, place: int, problems: _Problems) -> str | None:
    return _check_label(value, place, "document", MAX_DOCUMENT_CHARS, problems)


def parse_trace_batch(body: bytes) -> list[TraceInput]:
    """``{"traces": [{"prompt", "completion", "category"?, "document"?}, ...]}`` into inputs, or
    every problem."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        problem = Problem(None, "", f"body is not valid JSON: {exc}")
        raise TraceValidationError([problem], place_name="index") from exc
    if not isinstance(payload, dict) or not isinstance(payload.get("traces"), list):
        raise TraceValidationError(
            [Problem(None, "traces", 'body must be a JSON object {"traces": [...]}')], place_name="index"
        )
    unexpected = sorted(set(payload) - {"traces"})
    raw_items: list[Any] = payload["traces"]
    if len(raw_items) > MAX_TRACES_PER_BATCH:
        raise TraceValidationError(
            [
                Problem(
                    None,
                    "traces",
                    f"batch of {len(raw_items)} traces exceeds the limit of {MAX_TRACES_PER_BATCH}",
                    too_large=True,
                )
            ],
            place_name="index",
        )
    problems = _Problems()
    if unexpected:
        problems.add(None, unexpected[0], f"unknown top-level key(s): {', '.join(unexpected)}")
    if not raw_items:
        problems.add(None, "traces", "batch holds no traces")
    items: list[TraceInput] = []
    for index, raw in enumerate(raw_items):
        if not isinstance(raw, dict):
            problems.add(index, "", "each trace must be a JSON object")
            continue
        for key in sorted(set(raw) - _BATCH_ITEM_KEYS):
            problems.add(
                index, key, "unknown field (expected prompt or messages, completion, category, document)"
            )
        messages: tuple[dict[str, str], ...] | None = None
        if "messages" in raw:
            if "prompt" in raw:
                problems.add(index, "messages", "give either prompt or messages, not both")
                continue
            messages = _conversation(raw["messages"], index, problems)
            if messages is None:
                continue
            prompt = _check_text(render_chat(None, messages), index, "messages", problems)
        else:
            prompt = _check_text(raw.get("prompt"), index, "prompt", problems)
        completion = _check_text(raw.get("completion"), index, "completion", problems)
        category = _check_category(raw.get("category"), index, problems)
        document = _check_document(raw.get("document"), index, problems)
        if prompt is not None and completion is not None:
            items.append(TraceInput(prompt, completion, category, document, messages))
    problems.raise_if_any("index")
    return items


def _message_text(content: Any) -> str | None:
    """A chat message's text: a string, or the text parts of a multi-part content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(p, str) for p in parts):
            return "".join(p for p in parts if isinstance(p, str))
    return None


def _conversation(messages: Any, place: int, problems: _Problems) -> tuple[dict[str, str], ...] | None:
    """Chat messages as {role, content} with text content, or None with the problem added."""
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        problems.add(place, "messages", 'must be a non-empty list of {"role": ..., "content": ...} objects')
        return None
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        text = _message_text(message.get("content"))
        if text is None and message.get("content") is not None:
            problems.add(place, f"messages[{i}].content", "must be a string or a list of text parts")
            return None
        out.append({"role": message["role"], "content": text or ""})
    return tuple(out)


def _from_chat(
    messages: Any, line: int, problems: _Problems
) -> tuple[tuple[dict[str, str], ...] | None, Any]:
    """A dataset's chat line: (the conversation before the last assistant message, its text)."""
    conversation = _conversation(messages, line, problems)
    if conversation is None:
        return None, None
    last = max((i for i, m in enumerate(conversation) if m["role"] == "assistant"), default=None)
    if last is None:
        problems.add(line, "messages", "has no assistant message to use as the completion")
        return None, None
    return conversation[:last], conversation[last]["content"]


def _aliased(obj: dict[str, Any], name: str, alias: str, line: int, problems: _Problems) -> Any:
    if name in obj and alias in obj:
        problems.add(line, name, f"give either {name!r} or its alias {alias!r}, not both")
        return None
    return obj.get(name, obj.get(alias))


def parse_dataset(body: bytes) -> list[TraceInput]:
    """A JSONL sample dataset into inputs, or every problem with its 1-based line number."""
    if len(body) > MAX_DATASET_BYTES:
        raise TraceValidationError(
            [Problem(None, "", f"file exceeds the {MAX_DATASET_BYTES}-byte limit", too_large=True)],
            place_name="line",
        )
    problems = _Problems()
    items: list[TraceInput] = []
    records = 0
    for number, raw_line in enumerate(body.removeprefix(b"\xef\xbb\xbf").split(b"\n"), start=1):
        line = raw_line.strip()
        if not line:
            continue  # blank lines (a trailing newline, separators) hold no record
        records += 1
        if records > MAX_DATASET_LINES:
            raise TraceValidationError(
                [Problem(number, "", f"file holds more than {MAX_DATASET_LINES} records", too_large=True)],
                place_name="line",
            )
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.add(number, "", f"not valid JSON: {exc}")
            continue
        if not isinstance(obj, dict):
            problems.add(number, "", "each line must be a JSON object")
            continue
        conversation: tuple[dict[str, str], ...] | None = None
        if "messages" in obj:
            conversation, raw_completion = _from_chat(obj["messages"], number, problems)
            if conversation is None:
                continue
            raw_prompt = render_chat(None, conversation)
        else:
            before = problems.total
            raw_prompt = _aliased(obj, "prompt", "input", number, problems)
            raw_completion = _aliased(obj, "completion", "output", number, problems)
            if problems.total > before:
                continue
            if raw_prompt is None and raw_completion is None:
                problems.add(
                    number, "prompt", 'needs "prompt" + "completion", "input" + "output" or "messages"'
                )
                continue
        prompt = _check_text(raw_prompt, number, "prompt", problems)
        completion = _check_text(raw_completion, number, "completion", problems)
        category = _check_category(obj.get("category"), number, problems)
        document = _check_document(obj.get("document"), number, problems)
        if prompt is not None and completion is not None:
            items.append(TraceInput(prompt, completion, category, document, conversation))
    if records == 0:
        problems.add(None, "", "file holds no records")
    problems.raise_if_any("line")
    return items
