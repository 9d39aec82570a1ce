"""Chat traffic domains for instruction-tuned targets: requests that are lists of chat messages.

Two domains, kept apart from the completion domains (prose, code, structured) that the bundled
reference models learned:

- ``chat``: general assistant chat (explanations, how-to questions, advice, rewrites, summaries,
  short messages), :mod:`workers.corpora.chat_general`;
- ``chat_structured``: structured work (JSON extraction, JSON tool calls, SQL) with a known
  expected answer, :mod:`workers.corpora.chat_structured`.

Document ``index`` of stream ``stream`` of a split is one request, generated from its own
``Random`` seeded by its id ``<split>:<stream>:<index>``; its ``doc_id`` also names the task kind
(``<kind>:<split>:<stream>:<index>``), so a held-out split keyed by ``<domain>:<doc_id>`` works as
for the other domains and the ids of two domains, streams or splits never meet. There is no upper
bound on their number.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.traces.chat_template import render_chat
from workers.corpora import chat_general, chat_structured
from workers.corpora.chat_general import Message

CHAT_DOMAINS = ("chat", "chat_structured")


@dataclass(frozen=True)
class ChatDocument:
    """One generated chat request: its messages, the task kind and the expected answer ("" for
    open-ended chat)."""

    domain: str
    doc_id: str
    kind: str
    messages: tuple[Message, ...]
    reference: str


def document(domain: str, split: str, stream: int, index: int) -> ChatDocument:
    """Document ``index`` of ``domain``'s stream ``stream`` of ``split``: the same on every call."""
    rng = random.Random(f"chat:{domain}:{split}:{stream}:{index}")
    if domain == "chat":
        kind, messages = rng.choice(chat_general.MAKERS)(rng)
        reference = ""
    elif domain == "chat_structured":
        kind, messages, reference = rng.choice(chat_structured.MAKERS)(rng)
    else:
        raise ValueError(f"unknown chat domain {domain!r}; expected one of {CHAT_DOMAINS}")
    doc_id = f"{kind}:{split}:{stream}:{index}"
    return ChatDocument(domain, doc_id, kind, tuple(messages), reference)


def plain_text(messages: Sequence[Message]) -> str:
    """The messages as one text: "<role>: <content>" lines and "assistant: ", the reference server's
    rendering for a model without a chat template and the prompt the router's traces keep
    (``controlplane.router.acceptance.prompt_text``), so repeats and held-out overlap are counted
    on the very text a trace holds."""
    return render_chat(None, messages)


def last_user_turn(messages: Sequence[Message]) -> str:
    """The request a conversation asks to answer: its last user message."""
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


def prepare() -> None:
    """Build every pool the chat makers draw from (Faker's, seconds), before any clock starts."""
    chat_general.prepare()
    chat_structured.prepare()
