"""A small vLLM-style OpenAI server for router tests and benchmarks: real HTTP, no model.

    python -m tests.fleet.vllm_style_backend --port 9001 [--drafter-version 3] [--k 4]
        [--accept 0.7] [--tokens 16] [--delay-ms 0] [--no-speculation] [--chunk-delay-ms 0]

It answers ``/v1/completions`` and ``/v1/chat/completions`` whole or streamed (SSE, one event per
token, vLLM's final usage/metrics event), with vLLM's per-request metrics shape
(``metrics.speculative_decoding``: ``num_spec_steps``, ``num_draft_tokens``,
``num_accepted_draft_tokens``, ``acceptance_histogram``, ...) drawn per request from a seeded
generator, so the router under test sees exactly what a vLLM backend would send and nothing that
only our reference server sends. ``GET /stats`` tells how many replies (and acceptance records'
worth of counts) it produced; ``POST /fail`` with ``{"status": 503}`` makes it answer that status
until ``{"status": null}``. A raw ASGI app on uvicorn, so that its own cost stays far below what a
router benchmark measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from typing import Any

Scope = dict[str, Any]


class Backend:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.replies = 0
        self.drafted = 0
        self.accepted = 0
        self.fail_status: int | None = None

    def metrics(self) -> dict[str, Any] | None:
        if self.args.no_speculation:
            return None
        k, tokens = self.args.k, self.args.tokens
        hist = [0] * (k + 1)
        produced = steps = 0
        while produced < tokens:
            accepted = 0
            while accepted < k and self.rng.random() < self.args.accept:
                accepted += 1
            hist[accepted] += 1
            steps += 1
            produced += accepted + 1
        accepted_total = sum(i * n for i, n in enumerate(hist))
        self.drafted += steps * k
        self.accepted += accepted_total
        return {
            "speculative_decoding": {
                "num_spec_steps": steps,
                "num_draft_tokens": steps * k,
                "num_accepted_draft_tokens": accepted_total,
                "draft_acceptance_rate": accepted_total / (steps * k),
                "mean_acceptance_length": 1 + accepted_total / steps,
                "acceptance_histogram": hist,
            }
        }

    def reply(self, chat: bool, model: str) -> dict[str, Any]:
        text = " ".join(f"w{i}" for i in range(self.args.tokens))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out: dict[str, Any] = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": self.args.tokens,
                "total_tokens": 8 + self.args.tokens,
            },
        }
        metrics = self.metrics()
        if metrics is not None:
            out["metrics"] = metrics
        return out

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/stats":
            await _json(
                send, 200, {"replies": self.replies, "drafted": self.drafted, "accepted": self.accepted}
            )
            return
        if path in ("/health", "/healthz"):
            await _json(send, 200, {"ok": True})
            return
        if path == "/fail":
            self.fail_status = json.loads(body).get("status")
            await _json(send, 200, {"fail_status": self.fail_status})
            return
        if path not in ("/v1/completions", "/v1/chat/completions"):
            await _json(send, 404, {"error": {"message": "not found", "type": "not_found"}})
            return
        if self.fail_status is not None:
            await _json(
                send, self.fail_status, {"error": {"message": "failing on purpose", "type": "server_error"}}
            )
            return
        request = json.loads(body or b"{}")
        if {"category", "document", "perf_metrics_in_response"} & set(request):
            # vLLM-style strictness here keeps the router honest about what it forwards.
            await _json(send, 400, {"error": {"message": "unknown field", "type": "invalid_request_error"}})
            return
        if self.args.delay_ms:
            await asyncio.sleep(self.args.delay_ms / 1000.0)
        chat = path.endswith("chat/completions")
        out = self.reply(chat, str(request.get("model", "")))
        self.replies += 1
        if not request.get("stream"):
            await _json(send, 200, out)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for i in range(self.args.tokens):
            piece = f"w{i} " if i < self.args.tokens - 1 else f"w{i}"
            delta: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                delta["delta"] = {"content": piece}
            else:
                delta["text"] = piece
            event = {
                "id": out["id"],
                "object": out["object"] + ".chunk",
                "created": out["created"],
                "model": out["model"],
                "choices": [delta],
            }
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                    "more_body": True,
                }
            )
            if self.args.chunk_delay_ms:
                await asyncio.sleep(self.args.chunk_delay_ms / 1000.0)
        final = {k: v for k, v in out.items() if k != "choices"}
        final["choices"] = []
        await send(
            {
                "type": "http.response.body",
                "body": b"data: " + json.dumps(final).encode() + b"\n\n",
                "more_body": True,
            }
        )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _json(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--drafter-version", type=int, default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--accept", type=float, default=0.7)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--chunk-delay-ms", type=float, default=0.0)
    ap.add_argument("--no-speculation", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import uvicorn

    uvicorn.run(
        Backend(args),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()
