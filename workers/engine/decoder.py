"""The decoding loop: prefill, then rounds of propose -> score -> verify -> roll back, with metrics.

Owns `SpeculativeDecoder` (one request at a time, batch size 1, the latency-bound case speculation
is for), its `GenerationResult`, and two plain helpers: `greedy_reference` (recomputes the whole
sequence each step, no cache: the ground truth tests compare against) and `generate_batch` (batched
plain decoding of equal-length prompts, for producing training traces quickly).

Per-round overhead is what separates realised speed-ups from the Leviathan prediction on a CPU, so
the loop keeps it small: preallocated KV caches rolled back in O(1), one target forward per round,
one host sync (the accepted count), append-only Python lists for the context, and no per-token
allocation beyond a 1-element tensor. `torch.set_num_threads` is left to the caller, except that
`multi_row_threads` lets passes over several rows (prefill, verification) use more threads than
one-row steps (`MultiRowThreads`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from workers.engine.metrics import RequestMetrics
from workers.engine.model import Transformer
from workers.engine.proposers import DraftModelProposer, PredictedOutputProposer, Proposals, Proposer
from workers.engine.tokenizer import Tokenizer
from workers.engine.verifier import (
    SamplingParams,
    logits_to_probs,
    sample_from,
    sample_token,
    score,
    verify_greedy,
    verify_sampled,
)

log = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """The prompt plus the requested new tokens do not fit the model's context window."""


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens, without a final end-of-text token
    text: str
    metrics: RequestMetrics
    finish_reason: str  # "stop" (end-of-text) or "length" (max_new_tokens reached)
    prompt_ids: list[int]


TokenCallback = Callable[[list[int]], None]


class SpeculativeDecoder:
    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer,
        proposer: Proposer | None = None,
        k: int = 4,
        max_len: int | None = None,
        multi_row_threads: int | None = None,
    ) -> None:
        if k < 1 and proposer is not None:
            raise ValueError(f"k must be >= 1 with a proposer, got {k}")
        if isinstance(proposer, DraftModelProposer):
            dv, tv = proposer.drafter.config.vocab_size, target.config.vocab_size
            if dv != tv:
                raise ValueError(f"drafter vocab_size {dv} differs from the target's {tv}")
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.k = k
        self.cache = target.new_cache(1, max_len)
        if multi_row_threads is not None and multi_row_threads < 1:
            raise ValueError(f"multi_row_threads must be >= 1, got {multi_row_threads}")
        self.multi_row_threads = multi_row_threads
        self._thread_choice: MultiRowThreads | None = None

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        stop_at_eos: bool = True,
        prediction: str | Sequence[int] | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` tokens after `prompt`.

        `prediction` (Predicted Outputs) is proposed while the output follows it, with this decoder's
        proposer as the fallback. `on_tokens` receives each round's new tokens (for streaming).
        """
        t0 = time.perf_counter()
        params = SamplingParams(temperature, top_p)
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.cache.max_len:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"context window of {self.cache.max_len} tokens"
            )
        proposer = self.proposer
        metrics = RequestMetrics(k=self.k if proposer is not None or prediction is not None else 0)
        if prediction is not None:
            pred_ids = self.tokenizer.encode(prediction) if isinstance(prediction, str) else list(prediction)
            proposer = PredictedOutputProposer(pred_ids, fallback=self.proposer)
            metrics.prediction_tokens = len(pred_ids)
            metrics.prediction_matched_tokens = 0
        metrics.prompt_tokens = len(prompt_ids)
        eos = self.tokenizer.eos_id if stop_at_eos else None
        k = metrics.k
        target, cache = self.target, self.cache
        greedy = params.greedy

        base_threads = torch.get_num_threads()
        chooser = self._threads_chooser(base_threads)
        prefill_threads = chooser.best() if chooser is not None and len(prompt_ids) > 1 else None
        with torch.inference_mode(), _threads(prefill_threads, base_threads):
            cache.reset()
            logits = target.forward_cached(torch.tensor([prompt_ids]), cache, last_only=True)[0, -1]  # [V]
        with torch.inference_mode():
            first = sample_token(logits, params, generator)
            t_first = time.perf_counter()
            ctx = list(prompt_ids)  # prompt + output, append-only: proposers read it every round
            ctx.append(first)
            out_start = len(prompt_ids)
            metrics.generated_tokens = 1
            if on_tokens is not None:
                on_tokens([first])
            finish: str | None = None
            if eos is not None and first == eos:
                finish = "stop"
            elif max_new_tokens == 1:
                finish = "length"
            if proposer is not None:
                proposer.start_request(prompt_ids)
            last = torch.tensor([first])
            empty = Proposals.empty()
            clock = time.perf_counter
            propose_s = score_s = 0.0
            while finish is None:
                remaining = max_new_tokens - (len(ctx) - out_start)
                # Never draft past max_new_tokens: a step emits at most k'+1 tokens.
                kk = min(k, remaining - 1)
                t_a = clock()
                props = proposer.propose(ctx, kk, params, generator) if proposer and kk > 0 else empty
                drafts = props.token_ids  # [k']
                pos0 = cache.pos
                t_b = clock()
                if chooser is not None and len(drafts):
                    threads = chooser.choose()
                    torch.set_num_threads(threads)
                    try:
                        target_logits = score(target, cache, last, drafts)  # [k'+1, V]
                    finally:
                        torch.set_num_threads(base_threads)
                    t_c = clock()
                    if len(drafts) == k:  # full rounds only: comparable row counts
                        chooser.record(threads, t_c - t_b)
                else:
                    target_logits = score(target, cache, last, drafts)  # [k'+1, V]
                    t_c = clock()
                propose_s += t_b - t_a
                score_s += t_c - t_b
                if greedy:
                    n, emitted = verify_greedy(target_logits, drafts)
                else:
                    n, emitted = verify_sampled(target_logits, drafts, props.probs, params, generator)
                cache.rollback(pos0 + 1 + n)  # keep `last` and the accepted drafts
                if eos is not None and eos in emitted:
                    j = emitted.index(eos)
                    emitted = emitted[: j + 1]
                    n = min(n, j + 1)
                    finish = "stop"
                metrics.record_step(len(drafts), n, len(emitted), props.from_prediction)
                ctx.extend(emitted)
                if on_tokens is not None:
                    on_tokens(emitted)
                if finish is None and len(ctx) - out_start >= max_new_tokens:
                    finish = "length"
                last = torch.tensor(emitted[-1:])
        t_end = time.perf_counter()

        out = ctx[out_start:]
        if finish == "stop" and out and out[-1] == eos:
            out.pop()
        metrics.ttft_ms = (t_first - t0) * 1000.0
        metrics.propose_ms = propose_s * 1000.0
        metrics.score_ms = score_s * 1000.0
        metrics.total_ms = (t_end - t0) * 1000.0
        if metrics.generated_tokens > 1:
            metrics.inter_token_ms = (t_end - t_first) * 1000.0 / (metrics.generated_tokens - 1)
        return GenerationResult(out, self.tokenizer.decode(out), metrics, finish, prompt_ids)

    def _threads_chooser(self, base_threads: int) -> MultiRowThreads | None:
        wanted = self.multi_row_threads
        if wanted is None or wanted == base_threads:
            return None
        choice = self._thread_choice
        if choice is None or choice.options != (base_threads, wanted):
            choice = self._thread_choice = MultiRowThreads(base_threads, wanted)
        return choice


class MultiRowThreads:
    """Picks the torch thread count for verify passes by timing them, as they run.

    On a small CPU a one-row step (memory- and overhead-bound) runs as fast on one thread as on
    two, while a verify pass over k+1 rows is compute-bound: ~20-30% faster on two threads of an
    idle 2-core machine. But when another process keeps a core busy (a training job on the same
    machine), a two-thread pass waits at every barrier for its descheduled thread and takes 2-8x
    longer. So neither count is right everywhere. This keeps a moving average of the verify time
    of the count in use and, now and then, times a short burst of the other count (less often
    each time it loses, so a busy neighbour costs little); it switches when either is clearly
    faster, which follows a neighbour coming and going without flapping on noise.
    """

    SMOOTHING = 0.2
    BURST = 4  # rounds timed on the other count per retry; their median is its figure
    MARGIN = 0.10  # the other count must be this much faster to switch
    FIRST_RETRY = 16  # rounds on the count in use before the other is tried again
    LONGEST_RETRY = 512

    def __init__(self, base: int, wide: int) -> None:
        self.options = (base, wide)
        self._mean: dict[int, float] = {}
        self._best = base
        self._retry_in = self.BURST  # time the process's own count first, then try the other
        self._retry_every = self.FIRST_RETRY
        self._burst: list[float] = []
        self._burst_left = 0

    def _other(self) -> int:
        return self.options[1] if self._best == self.options[0] else self.options[0]

    def best(self) -> int:
        """The count in use: the process's own until the other has been measured faster."""
        return self._best

    def choose(self) -> int:
        """The count for the next verify pass."""
        if self._burst_left > 0:
            return self._other()
        self._retry_in -= 1
        if self._retry_in <= 0:
            self._burst_left, self._burst = self.BURST, []
            return self._other()
        return self._best

    def record(self, option: int, seconds: float) -> None:
        """The time of a verify pass run on ``option`` threads."""
        if option == self._best:
            mean = self._mean.get(option)
            self._mean[option] = seconds if mean is None else mean + self.SMOOTHING * (seconds - mean)
            other = self._mean.get(self._other())
            # The count in use got slow (a neighbour arrived): go back to the other at once.
            if other is not None and other < self._mean[option] * (1 - self.MARGIN):
                self._switch()
            return
        self._burst.append(seconds)
        self._burst_left -= 1
        if self._burst_left > 0:
            return
        self._mean[option] = statistics.median(self._burst)
        if self._mean[option] < self._mean.get(self._best, float("inf")) * (1 - self.MARGIN):
            self._switch()
        else:  # lost again: wait longer before the next try
            self._retry_every = min(self._retry_every * 2, self.LONGEST_RETRY)
            self._retry_in = self._retry_every

    def _switch(self) -> None:
        before, after = self._best, self._other()
        log.info(
            "verify passes now on %d torch threads (%.1f ms vs %.1f ms on %d)",
            after,
            self._mean[after] * 1000,
            self._mean.get(before, float("nan")) * 1000,
            before,
        )
        self._best = after
        self._burst_left = 0
        self._retry_every = self.FIRST_RETRY
        self._retry_in = self._retry_every


@contextmanager
def _threads(count: int | None, restore: int) -> Iterator[None]:
    """Run the block on ``count`` torch threads (None: unchanged), then go back to ``restore``."""
    if count is None:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(restore)


@torch.inference_mode()
def greedy_reference(
    model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int, eos_id: int | None = None
) -> list[int]:
    """Plain greedy decoding that recomputes the full sequence every step (no KV cache)."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(model(torch.tensor([ids]))[0, -1].argmax())
        if tok == eos_id:
            break
        out.append(tok)
        ids.append(tok)
    return out


@torch.inference_mode()
def generate_batch(
    model: Transformer,
    prompts: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Plain decoding of B equal-length prompts [B,T] -> new tokens [B, max_new_tokens].

    No early stop: the caller cuts each row at its end-of-text token. Batching amortises the
    per-step overhead, which makes this several times faster per token than batch-1 decoding.
    """
    b, t = prompts.shape
    cache = model.new_cache(b, t + max_new_tokens)
    logits = model.forward_cached(prompts, cache, last_only=True)[:, -1]  # [B,V]
    out: list[torch.Tensor] = []
    for i in range(max_new_tokens):
        if temperature == 0.0:
            tok = logits.argmax(dim=-1, keepdim=True)  # [B,1]
        else:
            probs = logits_to_probs(logits, temperature, top_p)  # [B,V]
            tok = sample_from(probs, generator)  # [B,1]
        out.append(tok)
        if i < max_new_tokens - 1:
            logits = model.forward_cached(tok, cache)[:, -1]
    return torch.cat(out, dim=1)  # [B, N]
