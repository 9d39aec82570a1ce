"""firectl rules for speculation settings, as pure functions."""

from __future__ import annotations

import pytest

from controlplane.db.models import SpeculationMode
from controlplane.deployments.spec import (
    SpeculationConfig,
    SpeculationConfigError,
    SpeculationRequest,
    resolve_create,
    resolve_update,
)


def test_no_flags_inherits_the_default_drafter() -> None:
    config = resolve_create(SpeculationRequest())
    assert config.mode is SpeculationMode.default
    assert config.effective_draft_token_count == 4


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            SpeculationRequest(draft_model="d", ngram_speculation_length=2, draft_token_count=3),
            "mutually exclusive",
        ),
        (SpeculationRequest(draft_model="d"), "draft_token_count is required"),
        (SpeculationRequest(ngram_speculation_length=2), "draft_token_count is required"),
        (SpeculationRequest(disable_speculative_decoding=True, draft_model="d"), "cannot be combined"),
        (SpeculationRequest(draft_model="d", draft_token_count=0), "between 1 and 16"),
        (SpeculationRequest(ngram_speculation_length=17, draft_token_count=2), "between 1 and 16"),
        (SpeculationRequest(draft_model="  ", draft_token_count=2), "must not be empty"),
    ],
)
def test_contradictions_are_refused(request_: SpeculationRequest, message: str) -> None:
    with pytest.raises(SpeculationConfigError, match=message):
        resolve_create(request_)


def test_explicit_modes() -> None:
    assert resolve_create(SpeculationRequest(draft_model="d", draft_token_count=5)) == SpeculationConfig(
        SpeculationMode.draft_model, "d", 5, None
    )
    assert resolve_create(
        SpeculationRequest(ngram_speculation_length=3, draft_token_count=2)
    ) == SpeculationConfig(SpeculationMode.ngram, None, 2, 3)
    disabled = resolve_create(SpeculationRequest(disable_speculative_decoding=True))
    assert disabled.mode is SpeculationMode.disabled and disabled.effective_draft_token_count == 0


def test_update_keeps_unchanged_flags_and_switches_modes() -> None:
    current = SpeculationConfig(SpeculationMode.draft_model, "d1", 4, None)
    assert resolve_update(current, SpeculationRequest(draft_token_count=6)).draft_token_count == 6
    assert resolve_update(current, SpeculationRequest(draft_model="d2")) == SpeculationConfig(
        SpeculationMode.draft_model, "d2", 4, None
    )
    switched = resolve_update(current, SpeculationRequest(ngram_speculation_length=3))
    assert switched == SpeculationConfig(SpeculationMode.ngram, None, 4, 3)
    assert resolve_update(current, SpeculationRequest()) == current


def test_update_of_a_disabled_deployment() -> None:
    disabled = SpeculationConfig(SpeculationMode.disabled, None, None, None)
    with pytest.raises(SpeculationConfigError, match="disabled"):
        resolve_update(disabled, SpeculationRequest(draft_token_count=3))
    # Choosing a drafter without k on a deployment that never had one is refused like on create.
    with pytest.raises(SpeculationConfigError, match="required"):
        resolve_update(disabled, SpeculationRequest(draft_model="d"))
    enabled = resolve_update(disabled, SpeculationRequest(disable_speculative_decoding=False))
    assert enabled.mode is SpeculationMode.default
