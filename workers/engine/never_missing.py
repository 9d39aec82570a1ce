"""Never-missing drafters: the target's own greedy continuation, at a real drafter's cost.

Owns `Continuations` (each prompt's known greedy output, from a no-speculation run of the same
target) and the two proposers that draft from it, `NeverMissingDraftProposer` (a small drafter)
and `NeverMissingHeadProposer` (a draft head), built by `never_missing_twin` from the arm they
mirror. Each runs exactly the forwards its real twin runs in a round (the same KV cache rolled
back and fed the same way, one forward per drafted token, the argmax it would take) but feeds and
proposes the continuation's next tokens instead of its own predictions, which it discards. So its
speed-up over no speculation is what that drafter would reach if it never missed, measured on the
same machine in the same run: the measured ceiling a realised speed-up is divided by (the
Leviathan formula at acceptance 1 predicts the same from isolated step costs, without the
engine's per-round work).

Greedy only: a sampled target has no single continuation to know. Where the output leaves the
continuation (past its end, or after a float-rounding tie made the output differ from the
reference) the proposer drafts the drafter's own tokens, as its twin would, so output stays
lossless either way; `off_continuation` counts the drafts made so.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.eagle import EagleHead, HeadProposer
from workers.engine.model import Transformer
from workers.engine.proposers import DraftModelProposer, Proposals, Proposer
from workers.engine.verifier import SamplingParams


class Continuations:
    """Each prompt's greedy continuation by the target (tokens after the prompt, in order)."""

    def __init__(self) -> None:
        self._by_prompt: dict[tuple[int, ...], list[int]] = {}
        self._current: list[int] = []
        self._prompt_len = 0

    def add(self, prompt_ids: Sequence[int], continuation: Sequence[int]) -> None:
        """Greedy is deterministic, so a prompt served twice at two lengths has one continuation:
        the longer one knows more of it."""
        key = tuple(prompt_ids)
        if len(continuation) >= len(self._by_prompt.get(key, ())):
            self._by_prompt[key] = list(continuation)

    def __len__(self) -> int:
        return len(self._by_prompt)

    def start_request(self, prompt_ids: Sequence[int]) -> None:
        """Look the request's continuation up (none known: every draft is the drafter's own)."""
        self._current = self._by_prompt.get(tuple(prompt_ids), [])
        self._prompt_len = len(prompt_ids)

    def next_tokens(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens the target will write after ``context``: none once the output so far
        differs from the continuation or has passed its end."""
        done = len(context) - self._prompt_len
        known = self._current
        if done > len(known) or list(context[self._prompt_len :]) != known[:done]:
            return []
        return known[done : done + k]


def _refuse_sampling(sampling: SamplingParams | None) -> None:
    if sampling is not None and not sampling.greedy:
        raise ValueError("a never-missing drafter knows only the greedy continuation: temperature must be 0")


class NeverMissingDraftProposer(DraftModelProposer):
    """A small drafter's forwards, the continuation's tokens."""

    def __init__(
        self,
        drafter: Transformer,
        continuations: Continuations,
        max_len: int | None = None,
        name: str = "never_missing",
    ) -> None:
        super().__init__(drafter, max_len, name=name)
        self.continuations = continuations
        self.off_continuation = 0  # drafts that were the drafter's own (the continuation unknown there)

    def start_request(self, prompt_ids: Sequence[int]) -> None:
        super().start_request(prompt_ids)
        self.continuations.start_request(prompt_ids)

    @torch.inference_mode()
    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> Proposals:
        _refuse_sampling(sampling)
        if not context:
            return Proposals.empty()
        k = min(k, self.cache.max_len - len(context))
        if k <= 0:
            return Proposals.empty()
        known = self.continuations.next_tokens(context, k)
        # The same feed as the twin's: roll back to the shared prefix, feed the rest in one forward.
        feed = self._sync(context)
        self._ids.extend(feed)
        self._stable = len(context)
        drafter, cache = self.drafter, self.cache
        limit = self.vocab_limit if self.vocab_limit is not None else drafter.config.vocab_size
        logits = drafter.forward_cached(torch.tensor([feed]), cache, last_only=True)[0, -1, :limit]  # [V]
        toks: list[torch.Tensor] = []
        for step in range(k):
            own = logits.argmax(dim=-1, keepdim=True)  # [1]: the twin's draft, paid for, then discarded
            if step < len(known):
                tok = torch.tensor([known[step]])  # [1]
            else:
                tok = own
                self.off_continuation += 1
            toks.append(tok)
            if step == k - 1:
                break
            logits = drafter.forward_cached(tok.view(1, 1), cache)[0, -1, :limit]  # [V]
        drafts = torch.cat(toks)  # [k]
        self._ids.extend(drafts[:-1].tolist())  # the last draft was never fed
        return Proposals(drafts)


class NeverMissingHeadProposer(HeadProposer):
    """A draft head's forwards (over the target states the decoder hands it), the continuation's tokens."""

    def __init__(
        self,
        head: EagleHead,
        continuations: Continuations,
        max_len: int | None = None,
        name: str = "never_missing",
    ) -> None:
        super().__init__(head, max_len, name=name)
        self.continuations = continuations
        self.off_continuation = 0

    def start_request(self, prompt_ids: Sequence[int]) -> None:
        super().start_request(prompt_ids)
        self.continuations.start_request(prompt_ids)

    @torch.inference_mode()
    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> Proposals:
        _refuse_sampling(sampling)
        start = self._pending_start
        fed = sum(len(p) for p in self._pending)
        if fed == 0 or k <= 0:
            return Proposals.empty()
        if len(context) != start + fed + 1:
            raise ValueError(f"context of {len(context)} tokens, but target states through {start + fed - 1}")
        k = min(k, self.cache.max_len - (start + fed))
        if k <= 0:
            return Proposals.empty()
        known = self.continuations.next_tokens(context, k)
        head, cache = self.head, self.cache
        cache.rollback(start)
        states = torch.cat(self._pending).unsqueeze(0)  # [1, T, D]
        tokens = torch.tensor([list(context[start + 1 :])])  # [1, T]
        self._pending, self._pending_start = [], start + fed
        out = head.forward_cached(states, tokens, cache)[:, -1:]  # [1, 1, D]
        blocked = self._limit_mask()
        toks: list[int] = []
        for step in range(k):
            logits = head.logits(out)[0, -1]  # [Vd]
            if blocked is not None:
                logits = logits.masked_fill(blocked, float("-inf"))
            own = int(self._draft_ids[int(logits.argmax())])  # the twin's draft, paid for
            if step < len(known):
                token = known[step]
            else:
                token = own
                self.off_continuation += 1
            toks.append(token)
            if step == k - 1:
                break
            out = head.forward_cached(out, torch.tensor([[token]]), cache)
        return Proposals(torch.tensor(toks, dtype=torch.long))


def never_missing_twin(
    spec: Transformer | Proposer, continuations: Continuations, max_len: int | None = None
) -> NeverMissingDraftProposer | NeverMissingHeadProposer:
    """The never-missing drafter that pays what ``spec`` (a drafter model, its proposer, or a head's
    proposer) pays per drafted token. Its own KV cache: the twin shares weights, never state."""
    if isinstance(spec, Transformer):
        window = spec.config.max_seq_len  # as the replay sizes the twin's own cache
        return NeverMissingDraftProposer(spec, continuations, min(max_len or window, window))
    if isinstance(spec, DraftModelProposer):
        length = max_len if max_len is not None else spec.cache.max_len
        return NeverMissingDraftProposer(spec.drafter, continuations, min(length, spec.cache.max_len))
    if isinstance(spec, HeadProposer):
        length = max_len if max_len is not None else spec.cache.max_len
        return NeverMissingHeadProposer(spec.head, continuations, min(length, spec.cache.max_len))
    raise TypeError(f"no never-missing twin for a {type(spec).__name__}: it has no drafter whose cost to pay")
