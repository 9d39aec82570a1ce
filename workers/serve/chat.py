"""Chat requests for the reference server: checking chat messages before they are rendered.

Owns `chat_messages(raw)` (OpenAI-style `messages` checked into plain {role, content} dicts, or
`InvalidMessages` naming the offending parameter). Rendering them into one prompt with the model
folder's chat template is `controlplane.traces.chat_template.render_chat`, which trace ingestion
shares, so traces hold the prompt the target was given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from controlplane.traces.chat_template import PLAIN_TEMPLATE, InvalidMessages, TemplateError, render_chat

__all__ = ["CHAT_ROLES", "PLAIN_TEMPLATE", "InvalidMessages", "TemplateError", "chat_messages", "render_chat"]

CHAT_ROLES = ("system", "user", "assistant")


def chat_messages(raw: Sequence[Any]) -> list[dict[str, str]]:
    """The request's messages as {role, content} dicts, or `InvalidMessages`."""
    if not raw:
        raise InvalidMessages("messages must hold at least one message", "messages")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, Mapping):
            raise InvalidMessages(f"messages[{i}] must be an object with role and content", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidMessages(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, not {role!r}",
                f"messages[{i}].role",
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidMessages(
                f"messages[{i}].content must be a string (content parts are not supported)",
                f"messages[{i}].content",
            )
        out.append({"role": str(role), "content": content})
    return out
