"""Proposers: where draft tokens come from. One interface, three sources.

Owns the `Proposer` protocol, the `Proposals` it returns, and:
- `DraftModelProposer`: k autoregressive steps of a small drafter on its own KV cache. Instead of
  relying on accept/reject callbacks it re-synchronises from the context on every call: it keeps the
  ids whose keys/values are cached, rolls the cache back to the longest prefix shared with the
  context (undoing rejected drafts) and feeds the rest (usually the target's correction or bonus
  token, plus the last draft when all were accepted) in one forward. Per round that is k drafter
  forwards and O(k) Python work, and it stays correct when another proposer drafted some rounds.
  With a `confidence_threshold` it stops a round early once the drafter gives its own token less
  than that probability (dynamic draft length, as Hugging Face's assistant_confidence_threshold):
  a draft past a token the drafter doubts is mostly rejected, yet costs drafter steps and verify
  rows. Stopping depends on the drafter alone, so verification stays exact. With
  `report_confidences` (the decoder sets it to count what other thresholds would have drafted) each
  proposal carries the probability the drafter gave each draft, the very number the stop rule
  compares, read from the distribution the step computed anyway. It proposes only ids
  below `vocab_limit` (set by the decoder to the range target and drafter share), so a drafter whose
  embedding is padded past the target's never proposes an id the target has no row for.
- `NgramProposer(n)`: prompt lookup (`--ngram-speculation-length n`): find the most recent earlier
  occurrence of the context's last n tokens and propose the tokens that followed it; no match means
  no proposal (the step is plain decoding). An incremental n-gram index keeps lookups O(1).
- `PredictedOutputProposer(predicted_ids, fallback)`: Fireworks-style Predicted Outputs. While the
  output follows the prediction it proposes the prediction's next tokens; when the output diverges it
  re-aligns on the last few output tokens (an edit inserted or deleted text) and, until it does,
  defers to `fallback` (for example the draft model), so both can serve one request.

Greedy proposers return `probs=None`; a drafter that samples returns its distribution q [k', V] so
the verifier can run exact rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from workers.engine.model import Transformer
from workers.engine.verifier import SamplingParams, logits_to_probs, sample_from

_EMPTY = torch.empty(0, dtype=torch.long)


@dataclass
class Proposals:
    token_ids: torch.Tensor  # [k'] long, k' <= k
    probs: torch.Tensor | None = None  # [k', V] draft distribution q; None = deterministic proposer
    from_prediction: int = 0  # leading proposals taken from a predicted output (for its metrics)
    # [k'] float: the probability the drafter gave each draft (what a confidence threshold compares);
    # None when not asked for or not a draft model's proposals.
    confidences: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.token_ids.numel())

    @classmethod
    def empty(cls) -> Proposals:
        return cls(_EMPTY)


@runtime_checkable
class Proposer(Protocol):
    def start_request(self, prompt_ids: Sequence[int]) -> None:
        """Forget the previous request (called before the first `propose` of each request)."""
        ...

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> Proposals:
        """Up to k draft tokens continuing `context` (prompt + output so far, append-only)."""
        ...


def check_confidence_threshold(threshold: float) -> None:
    """A draft-stopping threshold is a probability below 1 (0: never stop early)."""
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"confidence_threshold must be in [0, 1), got {threshold}")


class DraftModelProposer:
    def __init__(
        self,
        drafter: Transformer,
        max_len: int | None = None,
        name: str = "drafter",
        confidence_threshold: float = 0.0,
    ) -> None:
        check_confidence_threshold(confidence_threshold)
        self.drafter = drafter
        self.name = name
        self.confidence_threshold = confidence_threshold
        self.report_confidences = False
        self.cache = drafter.new_cache(1, max_len)
        # Ids at or above this are never proposed (None: all of the drafter's rows). The decoder
        # sets it to `shared_vocab_size`, so drafts and their distribution q cover exactly the ids
        # the target's logits are verified over.
        self.vocab_limit: int | None = None
        self._ids: list[int] = []  # tokens whose keys/values are in the cache, in order
        self._stable = 0  # prefix of _ids known to equal the context at the last call

    def start_request(self, prompt_ids: Sequence[int]) -> None:
        self.cache.reset()
        self._ids.clear()
        self._stable = 0

    def _sync(self, context: Sequence[int]) -> list[int]:
        """Roll the cache back to the shared prefix; return the context tokens still to feed."""
        ids = self._ids
        limit = min(len(ids), len(context))
        i = min(self._stable, limit)
        while i < limit and ids[i] == context[i]:
            i += 1
        if i == len(context):  # everything cached: re-feed the last token to get its logits
            i -= 1
        del ids[i:]
        self.cache.rollback(i)
        return list(context[i:])

    @torch.inference_mode()
    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> Proposals:
        if not context:
            return Proposals.empty()
        k = min(k, self.cache.max_len - len(context))  # the drafter may have a shorter context window
        if k <= 0:
            return Proposals.empty()
        feed = self._sync(context)
        self._ids.extend(feed)
        self._stable = len(context)
        drafter, cache = self.drafter, self.cache
        limit = self.vocab_limit if self.vocab_limit is not None else drafter.config.vocab_size
        logits = drafter.forward_cached(torch.tensor([feed]), cache, last_only=True)[0, -1, :limit]  # [V]
        greedy = sampling is None or sampling.greedy
        threshold = self.confidence_threshold
        confident = bool(threshold) or self.report_confidences
        toks: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        confidences: list[torch.Tensor] = []
        for step in range(k):
            if greedy:
                tok = logits.argmax(dim=-1, keepdim=True)  # [1]
            else:
                assert sampling is not None
                q = logits_to_probs(logits, sampling.temperature, sampling.top_p)  # [V]
                tok = sample_from(q, generator)  # [1]
                qs.append(q)
            toks.append(tok)
            if confident:
                confidences.append(self._confidence(logits, tok, qs[-1] if qs else None))  # [1]
            if step == k - 1:
                break
            if threshold and float(confidences[-1]) < threshold:
                break
            logits = drafter.forward_cached(tok.view(1, 1), cache)[0, -1, :limit]  # [V]
        drafts = torch.cat(toks)  # [k'], k' <= k
        self._ids.extend(drafts[:-1].tolist())  # the last draft was never fed
        return Proposals(
            drafts,
            torch.stack(qs) if qs else None,
            confidences=torch.cat(confidences) if self.report_confidences else None,  # [k']
        )

    @staticmethod
    def _confidence(logits: torch.Tensor, tok: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        """[1]: the probability the drafter gave its chosen token (greedy: the distribution's
        maximum; sampled: q at the sampled token), the number a confidence threshold compares."""
        if q is None:
            return torch.softmax(logits, dim=-1).max().view(1)
        return q[tok]


class NgramProposer:
    def __init__(self, n: int = 3) -> None:
        if n < 1:
            raise ValueError(f"n-gram length must be >= 1, got {n}")
        self.n = n
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> end index of its latest occurrence
        self._indexed = 0  # n-grams ending before this index are in _index
        self._len_seen = 0

    def start_request(self, prompt_ids: Sequence[int]) -> None:
        self._index.clear()
        self._indexed = 0
        self._len_seen = 0

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> Proposals:
        n, length = self.n, len(context)
        if length < self._len_seen:  # a different request without start_request: rebuild
            self.start_request(())
        self._len_seen = length
        if k <= 0 or length <= n:
            return Proposals.empty()
        # Index every n-gram except the final one, so a lookup finds only earlier occurrences;
        # later occurrences overwrite earlier ones, so the most recent wins.
        index = self._index
        for end in range(max(self._indexed, n - 1), length - 1):
            index[tuple(context[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, length - 1)
        found = index.get(tuple(context[length - n :]))
        if found is None:
            return Proposals.empty()
        follow = context[found + 1 : found + 1 + k]
        return Proposals(torch.tensor(follow, dtype=torch.long)) if follow else Proposals.empty()


class PredictedOutputProposer:
    def __init__(
        self, predicted_ids: Sequence[int], fallback: Proposer | None = None, realign_n: int = 3
    ) -> None:
        self.predicted = list(predicted_ids)
        self.fallback = fallback
        self.realign_n = max(1, realign_n)
        # n-gram of the prediction -> first end index, for re-aligning after a divergence.
        self._index: dict[tuple[int, ...], list[int]] = {}
        pred, rn = self.predicted, self.realign_n
        for end in range(rn - 1, len(pred)):
            self._index.setdefault(tuple(pred[end - rn + 1 : end + 1]), []).append(end)
        self._prompt_len = 0
        self._seen = 0  # output tokens already matched against the prediction
        self._ptr: int | None = 0  # index in the prediction of the next expected output token
        self._last_good = 0  # _ptr at the last token that matched

    def start_request(self, prompt_ids: Sequence[int]) -> None:
        self._prompt_len = len(prompt_ids)
        self._seen = 0
        self._ptr = 0
        self._last_good = 0
        if self.fallback is not None:
            self.fallback.start_request(prompt_ids)

    def _advance(self, context: Sequence[int]) -> None:
        out_len = len(context) - self._prompt_len
        pred, ptr = self.predicted, self._ptr
        for j in range(self._seen, out_len):
            tok = context[self._prompt_len + j]
            if ptr is not None and ptr < len(pred) and pred[ptr] == tok:
                ptr += 1
                self._last_good = ptr
            else:
                ptr = None
        self._seen = out_len
        if ptr is None and out_len >= self.realign_n:
            ends = self._index.get(tuple(context[len(context) - self.realign_n :]))
            if ends:
                # Prefer the first occurrence after the last aligned point, so that a repeated line
                # in the prediction does not send us back to its earlier copy.
                end = next((e for e in ends if e >= self._last_good), ends[-1])
                ptr = end + 1
        self._ptr = ptr

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> Proposals:
        self._advance(context)
        ptr = self._ptr
        if k > 0 and ptr is not None and ptr < len(self.predicted):
            follow = self.predicted[ptr : ptr + k]
            return Proposals(torch.tensor(follow, dtype=torch.long), None, from_prediction=len(follow))
        if self.fallback is not None:
            return self.fallback.propose(context, k, sampling, generator)
        return Proposals.empty()
