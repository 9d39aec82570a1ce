"""Rendering a chat into the one prompt a model continues: the model folder's Hugging Face chat template.

Owns `render_chat(folder, messages)`: `messages` ({role, content} dicts) rendered with the chat
template of the model folder at `folder`: the `chat_template` key of tokenizer_config.json (a
string, or a list of named templates of which "default" is used), else a `chat_template.jinja` file
beside it. The template is compiled once per folder, in jinja2's immutable sandbox, with the
variables Hugging Face passes: `messages`, `add_generation_prompt=True`, `bos_token` and `eos_token`
from the tokenizer config, and a `raise_exception` helper. A folder without a chat template (the
bundled reference models have none) gets `PLAIN_TEMPLATE`, "<role>: <content>" lines followed by
"assistant: ", so any base model can still be chatted with.

The reference server renders a chat request with it, and trace ingestion renders a traced chat
with the deployment's target folder, so a drafter trains on the very prompt the target was given.
It reads only the folder's template files: it sits low enough for both.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

# The fallback, written as a template so both paths render the same way.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class InvalidMessages(ValueError):
    """Chat messages a request cannot be served with; `param` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class TemplateError(ValueError):
    """A chat template that does not compile or fails while rendering: the folder's fault."""


def _token_text(value: Any) -> str:
    # Tokenizer configs write special tokens as plain strings or as AddedToken dicts.
    if isinstance(value, Mapping):
        return str(value.get("content") or "")
    return str(value) if value is not None else ""


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to refuse a conversation (e.g. roles that do not alternate): the caller's fault.
    raise InvalidMessages(message, "messages")


@functools.cache
def _compiled(folder: str | None) -> tuple[Any, dict[str, str]]:
    """(compiled template, special-token variables) of one folder (None: the plain template);
    cached because templates are large and every chat of a deployment renders with the same one."""
    from jinja2.exceptions import TemplateError as JinjaTemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    config: dict[str, Any] = {}
    source: Any = None
    if folder is not None:
        root = Path(folder)
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the "default" one serves plain chat
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source and (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text()
    # Hugging Face's environment: block tags do not leave their own newline and indentation behind.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    try:
        template = env.from_string(str(source) if source else PLAIN_TEMPLATE)
    except JinjaTemplateError as exc:
        raise TemplateError(f"the chat template of {folder} does not compile: {exc}") from exc
    tokens = {
        "bos_token": _token_text(config.get("bos_token")),
        "eos_token": _token_text(config.get("eos_token")),
    }
    return template, tokens


def render_chat(folder: str | None, messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt the model at `folder` continues to answer `messages` as the assistant (`folder`
    None: the plain rendering)."""
    from jinja2.exceptions import TemplateError as JinjaTemplateError

    template, tokens = _compiled(folder)
    try:
        return str(template.render(messages=list(messages), add_generation_prompt=True, **tokens))
    except JinjaTemplateError as exc:
        raise TemplateError(f"the chat template of {folder} failed: {exc}") from exc
