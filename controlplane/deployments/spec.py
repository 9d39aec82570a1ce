"""Pure rules for a deployment's speculation settings, following firectl's flags.

- no speculation flag: inherit the platform's default drafter;
- ``draft_model`` + ``draft_token_count``: speculate with an explicit drafter;
- ``ngram_speculation_length`` + ``draft_token_count``: n-gram prompt lookup;
- ``disable_speculative_decoding``: no speculation at all.
A draft model and n-gram lookup are exclusive, and draft-token-count is required whenever an
explicit drafter or n-gram lookup is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.db.models import Deployment, SpeculationMode

MAX_DRAFT_TOKENS = 16
MAX_NGRAM = 16
DEFAULT_DRAFT_TOKEN_COUNT = 4


class SpeculationConfigError(ValueError):
    """Speculation flags that contradict each other or are out of range."""


@dataclass(frozen=True, slots=True)
class SpeculationRequest:
    """Flags as a caller gave them; None means "not given"."""

    draft_model: str | None = None
    draft_token_count: int | None = None
    ngram_speculation_length: int | None = None
    disable_speculative_decoding: bool | None = None


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """The stored, validated speculation settings of a deployment."""

    mode: SpeculationMode
    draft_model: str | None
    draft_token_count: int | None
    ngram_speculation_length: int | None

    @property
    def effective_draft_token_count(self) -> int:
        if self.mode is SpeculationMode.disabled:
            return 0
        return self.draft_token_count or DEFAULT_DRAFT_TOKEN_COUNT


def speculation_of(deployment: Deployment) -> SpeculationConfig:
    """The speculation settings stored on a deployment row."""
    return SpeculationConfig(
        deployment.speculation_mode,
        deployment.draft_model,
        deployment.draft_token_count,
        deployment.ngram_speculation_length,
    )


def _check_ranges(req: SpeculationRequest) -> None:
    if req.draft_token_count is not None and not 1 <= req.draft_token_count <= MAX_DRAFT_TOKENS:
        raise SpeculationConfigError(f"draft_token_count must be between 1 and {MAX_DRAFT_TOKENS}")
    if req.ngram_speculation_length is not None and not 1 <= req.ngram_speculation_length <= MAX_NGRAM:
        raise SpeculationConfigError(f"ngram_speculation_length must be between 1 and {MAX_NGRAM}")
    if req.draft_model is not None and not req.draft_model.strip():
        raise SpeculationConfigError("draft_model must not be empty")


def resolve_create(req: SpeculationRequest) -> SpeculationConfig:
    """Speculation settings for a new deployment."""
    _check_ranges(req)
    if req.disable_speculative_decoding:
        if req.draft_model or req.ngram_speculation_length or req.draft_token_count:
            raise SpeculationConfigError(
                "disable_speculative_decoding cannot be combined with draft_model, "
                "ngram_speculation_length or draft_token_count"
            )
        return SpeculationConfig(SpeculationMode.disabled, None, None, None)
    if req.draft_model and req.ngram_speculation_length:
        raise SpeculationConfigError("draft_model and ngram_speculation_length are mutually exclusive")
    if req.draft_model:
        if req.draft_token_count is None:
            raise SpeculationConfigError("draft_token_count is required with draft_model")
        return SpeculationConfig(SpeculationMode.draft_model, req.draft_model, req.draft_token_count, None)
    if req.ngram_speculation_length:
        if req.draft_token_count is None:
            raise SpeculationConfigError("draft_token_count is required with ngram_speculation_length")
        return SpeculationConfig(
            SpeculationMode.ngram, None, req.draft_token_count, req.ngram_speculation_length
        )
    # Default drafter; an explicit k overrides the default draft length.
    return SpeculationConfig(SpeculationMode.default, None, req.draft_token_count, None)


def resolve_update(current: SpeculationConfig, req: SpeculationRequest) -> SpeculationConfig:
    """Apply changed flags to existing settings; unchanged flags keep their values."""
    _check_ranges(req)
    if req.draft_model and req.ngram_speculation_length:
        raise SpeculationConfigError("draft_model and ngram_speculation_length are mutually exclusive")
    if req.disable_speculative_decoding:
        return resolve_create(req)
    if req.disable_speculative_decoding is False and current.mode is SpeculationMode.disabled:
        current = SpeculationConfig(SpeculationMode.default, None, None, None)
    if req.draft_model:
        k = req.draft_token_count if req.draft_token_count is not None else current.draft_token_count
        return resolve_create(SpeculationRequest(draft_model=req.draft_model, draft_token_count=k))
    if req.ngram_speculation_length:
        k = req.draft_token_count if req.draft_token_count is not None else current.draft_token_count
        return resolve_create(
            SpeculationRequest(ngram_speculation_length=req.ngram_speculation_length, draft_token_count=k)
        )
    if req.draft_token_count is not None:
        if current.mode is SpeculationMode.disabled:
            raise SpeculationConfigError(
                "speculative decoding is disabled; enable it or choose a drafter "
                "before setting draft_token_count"
            )
        return SpeculationConfig(
            current.mode, current.draft_model, req.draft_token_count, current.ngram_speculation_length
        )
    return current
