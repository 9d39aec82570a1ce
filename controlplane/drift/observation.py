"""The unit every drift detector consumes: one served request's per-position acceptance counts.

Position ``i`` of a draft is *tried* only in the verify steps where position ``i - 1`` was accepted
(position 0 is tried in every step), so the per-position counts are conditional Bernoulli trials:
``trials[i] = accepted_per_position[i - 1]`` (``trials[0] = verify_steps``) and
``successes[i] = accepted_per_position[i]``. The request, not the token, is the unit of
observation, because tokens within one request share its prompt and are strongly dependent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from controlplane import speculation_math


@dataclass(frozen=True, slots=True)
class RequestObservation:
    """One request's speculation outcome, validated; build it with :meth:`from_counts`."""

    k: int
    verify_steps: int
    accepted_per_position: tuple[int, ...]
    drafted_tokens: int
    accepted_tokens: int
    category: str | None = None
    prompt_tokens: int | None = None

    @classmethod
    def from_counts(
        cls,
        *,
        k: int,
        verify_steps: int,
        accepted_per_position: Sequence[int],
        drafted_tokens: int,
        accepted_tokens: int,
        category: str | None = None,
        prompt_tokens: int | None = None,
    ) -> RequestObservation:
        """Validate raw counts (as ingested) into an observation; raise ``ValueError`` if inconsistent."""
        counts = tuple(int(a) for a in accepted_per_position)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if verify_steps < 0 or drafted_tokens < 0 or accepted_tokens < 0:
            raise ValueError("counts must be non-negative")
        if not counts:
            # Pooled counts cannot be split into conditional per-position trials.
            raise ValueError("accepted_per_position is required (per-position counts)")
        if len(counts) > k:
            raise ValueError(f"accepted_per_position has {len(counts)} entries for k={k}")
        previous = verify_steps
        for i, a in enumerate(counts):
            if a < 0 or a > previous:
                raise ValueError(
                    f"accepted_per_position[{i}]={a} must lie in [0, {previous}] (non-increasing, <= steps)"
                )
            previous = a
        if accepted_tokens > drafted_tokens:
            raise ValueError("accepted_tokens exceeds drafted_tokens")
        if prompt_tokens is not None and prompt_tokens < 0:
            raise ValueError("prompt_tokens must be non-negative")
        return cls(
            k=k,
            verify_steps=verify_steps,
            accepted_per_position=counts,
            drafted_tokens=drafted_tokens,
            accepted_tokens=accepted_tokens,
            category=category,
            prompt_tokens=prompt_tokens,
        )

    def trials(self, n_positions: int) -> list[int]:
        """Conditional trials per position, padded with zeros (or cut) to ``n_positions``."""
        out = [self.verify_steps, *self.accepted_per_position[:-1]]
        return (out + [0] * n_positions)[:n_positions]

    def successes(self, n_positions: int) -> list[int]:
        """Conditional successes per position, padded with zeros (or cut) to ``n_positions``."""
        out = list(self.accepted_per_position)
        return (out + [0] * n_positions)[:n_positions]

    @property
    def hit_rate(self) -> float | None:
        """Accepted over drafted tokens (None for a request that drafted nothing)."""
        return speculation_math.hit_rate(self.accepted_tokens, self.drafted_tokens)
