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

Target and drafter may pad their embeddings to different row counts past the shared tokenizer's
last token: proposing, verifying and sampling read only the ids the tokenizer defines
(`shared_vocab_size`), with or without a drafter, so speculation stays lossless.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from workers.engine.eagle import HeadProposer, check_head_fits
from workers.engine.metrics import DRAFT_STOP_GRID, DraftStopCounts, RequestMetrics
from workers.engine.model import Transformer
from workers.engine.proposers import DraftModelProposer, PredictedOutputProposer, Proposals, Proposer
from workers.engine.stop_strings import parse_stop
from workers.engine.tokenizer import Tokenizer
from workers.engine.verifier import (
    SamplingParams,
    logits_to_probs,
    sample_from,
    sample_token,
    score,
    shared_vocab_size,
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
    finish_reason: str  # "stop" (end-of-text or a stop string) or "length" (max_new_tokens reached)
    prompt_ids: list[int]
    # The stop string the output ended before, if any: `text` omits it (as OpenAI does), but it is
    # what the target wrote, so a trace of the request keeps it (a drafter must learn to end there).
    stop_string: str | None = None


TokenCallback = Callable[[list[int]], None]


class StopStrings:
    """Finds the first of a request's stop strings (OpenAI ``stop``) in its output text as rounds
    append tokens; the output ends before it. Matching is on decoded text, not tokens: a stop string
    may start or end inside a token, and the same text has several tokenisations."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = parse_stop(list(stops))
        self.longest = max((len(s) for s in self.stops), default=0)
        self._seen = 0  # output tokens already searched

    def find(self, output_ids: Sequence[int]) -> tuple[int, str] | None:
        """Where in the output's text the first stop string starts, and which one, or None.

        Called every round, so it decodes only the new tokens and a few before them (a match may
        straddle rounds, and a character whose bytes were split across tokens decodes to
        replacement characters until completed); the whole text only once a stop string shows."""
        tail = self.tokenizer.decode(output_ids[max(0, self._seen - self.longest - 4) :])
        self._seen = len(output_ids)
        if not any(s in tail for s in self.stops):
            return None
        text = self.tokenizer.decode(output_ids)
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    def drafts_through_stop(self, output_ids: Sequence[int], props: Proposals) -> Proposals:
        """The drafts up to the first one that completes a stop string: if that one is accepted
        the output ends there, so verifying drafts after it is wasted work (and counts them as
        rejected). Lossless: the output is the same either way."""
        drafts = props.token_ids.tolist()
        # The stop string can only complete within the last few tokens (the request would have
        # ended already otherwise): decode a short tail, not the whole output, every round.
        tail = list(output_ids[-(self.longest + 4) :])
        start = max(0, len(self.tokenizer.decode(tail)) - self.longest - 4)
        for i in range(len(drafts) - 1):
            text = self.tokenizer.decode([*tail, *drafts[: i + 1]])
            if any(text.find(s, start) >= 0 for s in self.stops):
                n = i + 1
                probs = props.probs[:n] if props.probs is not None else None
                confidences = props.confidences[:n] if props.confidences is not None else None
                return Proposals(props.token_ids[:n], probs, min(props.from_prediction, n), confidences)
        return props

    def tokens_before(self, output_ids: list[int], chars: int) -> list[int]:
        """The shortest prefix of the output whose text reaches ``chars`` characters."""
        m = len(output_ids)
        while m > 0 and len(self.tokenizer.decode(output_ids[: m - 1])) >= chars:
            m -= 1
        return output_ids[:m]


class SpeculativeDecoder:
    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer,
        proposer: Proposer | None = None,
        k: int = 4,
        max_len: int | None = None,
        multi_row_threads: int | None = None,
        draft_stop_grid: Sequence[float] | None = DRAFT_STOP_GRID,
    ) -> None:
        """``draft_stop_grid``: the confidence thresholds whose counterfactual draft counts a
        draft-model request reports (metrics ``draft_stop_counts``; None: none)."""
        if k < 1 and proposer is not None:
            raise ValueError(f"k must be >= 1 with a proposer, got {k}")
        target_rows = target.config.vocab_size
        # The ids every logit comparison reads; past them lie padding rows that are no token.
        self.vocab_size = shared_vocab_size(tokenizer.vocab_size, target_rows)
        for draft_proposer in _draft_models(proposer):
            shared_vocab_size(tokenizer.vocab_size, target_rows, draft_proposer.drafter.config.vocab_size)
            draft_proposer.vocab_limit = self.vocab_size
        self._heads = _heads(proposer)
        for head in self._heads:
            check_head_fits(head.head.config, target.config)
            head.vocab_limit = self.vocab_size
        # The target states the head reads, collected from every target pass (none without a head).
        self._hidden_layers: tuple[int, ...] = self._heads[0].aux_layers if self._heads else ()
        # Only a padded target needs its logits cut (a view, but kept off the common path).
        self._vocab_cut = self.vocab_size if self.vocab_size < target_rows else None
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.k = k
        self.cache = target.new_cache(1, max_len)
        if multi_row_threads is not None and multi_row_threads < 1:
            raise ValueError(f"multi_row_threads must be >= 1, got {multi_row_threads}")
        self.multi_row_threads = multi_row_threads
        self._thread_choice: MultiRowThreads | None = None
        # Thresholds a round of this proposer can show: those at or above the one it stops at.
        self._draft_stop_grid: tuple[float, ...] = ()
        if isinstance(proposer, (DraftModelProposer, HeadProposer)) and draft_stop_grid:
            active = proposer.confidence_threshold
            self._draft_stop_grid = tuple(t for t in draft_stop_grid if t >= active)
            proposer.report_confidences = bool(self._draft_stop_grid)

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
        stop: Sequence[str] = (),
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` tokens after `prompt`.

        `prediction` (Predicted Outputs) is proposed while the output follows it, with this decoder's
        proposer as the fallback. `on_tokens` receives each round's new tokens (for streaming; a
        round that reaches a stop string still passes all its tokens: the text is cut, not the
        work). `stop`: up to four strings; the output ends before the first one it produces
        (finish_reason "stop"). The metrics count every token the engine emitted.
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
        stopper = StopStrings(self.tokenizer, stop) if stop else None
        stop_at: tuple[int, str] | None = None  # (where in the output text, which stop string)
        proposer = self.proposer
        metrics = RequestMetrics(k=self.k if proposer is not None or prediction is not None else 0)
        if prediction is not None:
            pred_ids = self.tokenizer.encode(prediction) if isinstance(prediction, str) else list(prediction)
            proposer = PredictedOutputProposer(pred_ids, fallback=self.proposer)
            metrics.prediction_tokens = len(pred_ids)
            metrics.prediction_matched_tokens = 0
        elif proposer is not None and self._draft_stop_grid:
            # Requests with a prediction mix rounds without drafter confidences: no counts there.
            metrics.draft_stop = DraftStopCounts(self._draft_stop_grid)
        metrics.prompt_tokens = len(prompt_ids)
        eos = self.tokenizer.eos_id if stop_at_eos else None
        k = metrics.k
        target, cache = self.target, self.cache
        greedy = params.greedy

        base_threads = torch.get_num_threads()
        chooser = self._threads_chooser(base_threads)
        prefill_threads = chooser.best() if chooser is not None and len(prompt_ids) > 1 else None
        layers = self._hidden_layers
        hidden: list[torch.Tensor] = []
        with torch.inference_mode(), _threads(prefill_threads, base_threads):
            cache.reset()
            logits = target.forward_cached(
                torch.tensor([prompt_ids]), cache, last_only=True, hidden_layers=layers, hidden_out=hidden
            )[0, -1]  # [V]
        vocab_cut = self._vocab_cut
        with torch.inference_mode():
            if vocab_cut is not None:
                logits = logits[:vocab_cut]
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
            if stopper is not None and (stop_at := stopper.find(ctx[out_start:])) is not None:
                finish = "stop"
            if proposer is not None:
                proposer.start_request(prompt_ids)
            heads = self._heads if proposer is not None else []
            for head in heads:
                head.observe([h[0] for h in hidden], 0)
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
                if stopper is not None and len(props) > 1:
                    props = stopper.drafts_through_stop(ctx[out_start:], props)
                drafts = props.token_ids  # [k']
                pos0 = cache.pos
                hidden.clear()  # this round's target states replace the last round's
                t_b = clock()
                if chooser is not None and len(drafts):
                    threads = chooser.choose()
                    torch.set_num_threads(threads)
                    try:
                        target_logits = score(target, cache, last, drafts, layers, hidden)  # [k'+1, V]
                    finally:
                        torch.set_num_threads(base_threads)
                    t_c = clock()
                    if len(drafts) == k:  # full rounds only: comparable row counts
                        chooser.record(threads, t_c - t_b)
                else:
                    target_logits = score(target, cache, last, drafts, layers, hidden)  # [k'+1, V]
                    t_c = clock()
                if vocab_cut is not None:
                    target_logits = target_logits[:, :vocab_cut]
                propose_s += t_b - t_a
                score_s += t_c - t_b
                if greedy:
                    n, emitted = verify_greedy(target_logits, drafts)
                else:
                    n, emitted = verify_sampled(target_logits, drafts, props.probs, params, generator)
                cache.rollback(pos0 + 1 + n)  # keep `last` and the accepted drafts
                for head in heads:  # the verified rows' states: `last` and the accepted drafts
                    head.observe([h[0, : n + 1] for h in hidden], pos0)
                if eos is not None and eos in emitted:
                    j = emitted.index(eos)
                    emitted = emitted[: j + 1]
                    n = min(n, j + 1)
                    finish = "stop"
                metrics.record_step(len(drafts), n, len(emitted), props.from_prediction)
                if props.confidences is not None and metrics.draft_stop is not None:
                    metrics.record_draft_stop(props.confidences.tolist(), len(drafts), n)
                ctx.extend(emitted)
                if on_tokens is not None:
                    on_tokens(emitted)
                if stopper is not None and (stop_at := stopper.find(ctx[out_start:])) is not None:
                    finish = "stop"
                if finish is None and len(ctx) - out_start >= max_new_tokens:
                    finish = "length"
                last = torch.tensor(emitted[-1:])
        t_end = time.perf_counter()

        out = ctx[out_start:]
        if finish == "stop" and out and out[-1] == eos:
            out.pop()
        stop_string = None
        if stopper is not None and stop_at is not None:
            cut, stop_string = stop_at
            out = stopper.tokens_before(out, cut)
            text = self.tokenizer.decode(out)[:cut]
        else:
            text = self.tokenizer.decode(out)
        metrics.ttft_ms = (t_first - t0) * 1000.0
        metrics.propose_ms = propose_s * 1000.0
        metrics.score_ms = score_s * 1000.0
        metrics.total_ms = (t_end - t0) * 1000.0
        if metrics.generated_tokens > 1:
            metrics.inter_token_ms = (t_end - t_first) * 1000.0 / (metrics.generated_tokens - 1)
        return GenerationResult(out, text, metrics, finish, prompt_ids, stop_string)

    def _threads_chooser(self, base_threads: int) -> MultiRowThreads | None:
        wanted = self.multi_row_threads
        if wanted is None or wanted == base_threads or self.target.steps_in_numpy(self.k + 1):
            return None  # nothing to choose: NumPy takes the verify passes, on one thread
        choice = self._thread_choice
        if choice is None or choice.options != (base_threads, wanted):
            choice = self._thread_choice = MultiRowThreads(base_threads, wanted)
        return choice


def _heads(proposer: Proposer | None) -> list[HeadProposer]:
    """The draft heads that may draft for the decoder: the proposer, or its fallback."""
    found: list[HeadProposer] = []
    while proposer is not None:
        if isinstance(proposer, HeadProposer):
            found.append(proposer)
        proposer = proposer.fallback if isinstance(proposer, PredictedOutputProposer) else None
    return found


def _draft_models(proposer: Proposer | None) -> list[DraftModelProposer]:
    """The draft-model proposers that may draft for the decoder: the proposer, or its fallback."""
    found: list[DraftModelProposer] = []
    while proposer is not None:
        if isinstance(proposer, DraftModelProposer):
            found.append(proposer)
        proposer = proposer.fallback if isinstance(proposer, PredictedOutputProposer) else None
    return found


class MultiRowThreads:
    """Picks the torch thread count for verify passes by timing them, as they run.

    On a small CPU a one-row step (memory- and overhead-bound) runs as fast on one thread as on
    two, while a verify pass over k+1 rows is compute-bound: ~20-30% faster on two threads of an
    idle 2-core machine. But when another process keeps a core busy (a training job on the same
    machine), a two-thread pass waits at every barrier for its descheduled thread and takes 2-8x
    longer. So neither count is right everywhere, and a few passes say little: contention comes
    and goes within seconds, and a short burst on one count can look fast while sustained use
    of it is slow. So the counts are compared back to back over whole trials: TRIAL passes on the
    other count, then TRIAL on the one in use, each timed by the median after a warm-up; the
    other is adopted only when it is clearly faster. Trials recur less often each time the count
    in use wins, and at once when the count in use gets much slower than it measured (a
    neighbour arrived).
    """

    TRIAL = 24  # passes per side of a comparison
    WARMUP = 8  # passes at the start of each side left out of its median
    MARGIN = 0.10  # the other count must be this much faster to be adopted
    FIRST_RETRY = 64  # passes in use before the next comparison
    LONGEST_RETRY = 2048
    SLOWDOWN = 1.5  # in-use passes this much slower than measured start a comparison at once
    EARLY = 4  # a trial whose first passes are SLOWDOWN slower than the count in use stops there
    SMOOTHING = 0.2

    def __init__(self, base: int, wide: int) -> None:
        self.options = (base, wide)
        self._best = base
        self._phase = "trial"  # "trial" (other count), "check" (count in use), "steady"
        self._samples: list[float] = []
        self._trial_median = 0.0
        self._reference: float | None = None  # the count in use's median at the last comparison
        self._recent: float | None = None  # its moving average since
        self._retry_every = self.FIRST_RETRY
        self._retry_in = 0

    def _other(self) -> int:
        return self.options[1] if self._best == self.options[0] else self.options[0]

    def best(self) -> int:
        """The count in use: the process's own until the other has been measured faster."""
        return self._best

    def choose(self) -> int:
        """The count for the next verify pass."""
        return self._other() if self._phase == "trial" else self._best

    def record(self, option: int, seconds: float) -> None:
        """The time of the verify pass just run on ``option`` threads (the count `choose` gave)."""
        if self._phase == "steady":
            recent = self._recent
            self._recent = seconds if recent is None else recent + self.SMOOTHING * (seconds - recent)
            self._retry_in -= 1
            slower = self._reference is not None and self._recent > self._reference * self.SLOWDOWN
            if self._retry_in <= 0 or slower:
                if slower:
                    self._retry_every = self.FIRST_RETRY
                self._phase, self._samples = "trial", []
            return
        self._samples.append(seconds)
        if (
            self._phase == "trial"
            and len(self._samples) == self.EARLY
            and self._reference is not None
            and statistics.median(self._samples) > self._reference * self.SLOWDOWN
        ):
            # Clearly slower from the start (a busy neighbour): no need for the whole trial. The
            # count in use may have slowed too (the whole machine is busier): that is its figure now.
            self._reference = max(self._reference, self._recent or 0.0)
            self._lost()
            return
        if len(self._samples) < self.TRIAL:
            return
        median = statistics.median(self._samples[self.WARMUP :])
        self._samples = []
        if self._phase == "trial":
            self._trial_median, self._phase = median, "check"
            return
        if self._trial_median < median * (1 - self.MARGIN):
            log.info(
                "verify passes now on %d torch threads (%.1f ms vs %.1f ms on %d)",
                self._other(),
                self._trial_median * 1000,
                median * 1000,
                self._best,
            )
            self._best = self._other()
            self._reference = self._trial_median
            self._retry_every = self.FIRST_RETRY
            self._recent = self._reference
            self._phase, self._retry_in = "steady", self._retry_every
        else:
            self._reference = median
            self._lost()

    def _lost(self) -> None:
        """The count in use stays; the next comparison waits twice as long."""
        self._retry_every = min(self._retry_every * 2, self.LONGEST_RETRY)
        self._samples, self._recent = [], self._reference
        self._phase, self._retry_in = "steady", self._retry_every


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
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> list[int]:
    """Plain greedy decoding that recomputes the full sequence every step (no KV cache), over the
    first `vocab_size` ids (default: all of the model's rows)."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(model(torch.tensor([ids]))[0, -1, :vocab_size].argmax())
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
