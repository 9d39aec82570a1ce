"""The lifecycle tables (jobs, drafter versions, drift events, canaries), the canary policy as the
one source of canary defaults and ranges, and the doctests of the small pure modules."""

from __future__ import annotations

import doctest
import enum
from types import ModuleType

import pytest

from controlplane import lifecycle, messaging, timestamps
from controlplane.canary import phases
from controlplane.canary_policy import CanaryPolicy, CanaryPolicyError
from controlplane.config import Settings
from controlplane.db.models import DrafterState, DriftResolution, DriftState, JobState
from controlplane.drafters import states as drafter_states
from controlplane.drift import states as drift_states
from controlplane.jobs import recovery as job_recovery
from controlplane.jobs import states as job_states
from controlplane.traces import holdout


@pytest.mark.parametrize(
    "module",
    [
        job_states,
        job_recovery,
        drafter_states,
        drift_states,
        phases,
        lifecycle,
        messaging,
        timestamps,
        holdout,
    ],
    ids=lambda m: m.__name__,
)
def test_doctests(module: ModuleType) -> None:
    result = doctest.testmod(module, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    ("table", "states", "final"),
    [
        (job_states.ALLOWED, JobState, {JobState.succeeded, JobState.failed, JobState.cancelled}),
        (drafter_states.ALLOWED, DrafterState, {DrafterState.rejected}),
        (drift_states.ALLOWED, DriftState, {DriftState.resolved, DriftState.dismissed}),
        (phases.ALLOWED, phases.CanaryPhase, {phases.CanaryPhase.decided, phases.CanaryPhase.rolled_back}),
    ],
    ids=["job", "drafter", "drift", "canary"],
)
def test_every_table_covers_its_states_and_final_states_have_no_way_out(
    table: dict[enum.StrEnum, frozenset[enum.StrEnum]], states: type[enum.StrEnum], final: set[enum.StrEnum]
) -> None:
    assert set(table) == set(states)
    assert {state for state, nexts in table.items() if not nexts} == final
    for nexts in table.values():
        assert nexts <= set(states)


def test_a_drafter_version_reaches_active_only_from_a_candidate_canary_or_a_rollback() -> None:
    into_active = {s for s, nexts in drafter_states.ALLOWED.items() if DrafterState.active in nexts}
    assert into_active == {DrafterState.candidate, DrafterState.canary, DrafterState.retired}
    with pytest.raises(drafter_states.IllegalTransitionError):
        drafter_states.transition(DrafterState.rejected, DrafterState.candidate)


def test_every_drift_resolution_ends_an_event_and_only_dismissal_dismisses() -> None:
    for resolution in DriftResolution:
        end = drift_states.end_state(resolution)
        assert (
            end in drift_states.ALLOWED[DriftState.open]
            and end in drift_states.ALLOWED[DriftState.realigning]
        )
        assert (end == DriftState.dismissed) == (resolution == DriftResolution.dismissed)


def test_a_decided_canary_cannot_go_live_or_be_promoted() -> None:
    with pytest.raises(phases.IllegalTransitionError):
        phases.move("decided", "watching")
    assert phases.can_move("live", "watching") and phases.can_move("closed", "rolled_back")


def test_the_canary_policy_names_every_bad_field_and_keeps_the_good_ones() -> None:
    with pytest.raises(CanaryPolicyError) as caught:
        CanaryPolicy.validate_changes(
            {"alpha": 0.3, "bogus": 1, "min_samples_per_arm": "x", "live_canary": 1}
        )
    message = str(caught.value)
    for field in ("alpha", "bogus", "min_samples_per_arm", "live_canary"):
        assert field in message
    assert len(caught.value.problems) == 4
    assert CanaryPolicy.validate_changes({"alpha": 0.2, "watch_requests": 0}) == {
        "alpha": 0.2,
        "watch_requests": 0,
    }
    with pytest.raises(CanaryPolicyError, match="at least 10%"):
        CanaryPolicy.validate_changes({"candidate_weight": 0.45, "baseline_weight": 0.45})


def test_the_policy_a_deployment_sees_layers_its_own_fields_over_the_services_defaults() -> None:
    policy = CanaryPolicy.for_deployment({"alpha": 0.1, "unknown": 3}, alpha=0.02, min_samples=30)
    assert policy.alpha == 0.1 and policy.min_samples_per_arm == 30
    assert set(policy.settable()) == CanaryPolicy.SETTABLE
    assert CanaryPolicy.for_deployment(None).settable() == CanaryPolicy().settable()


@pytest.mark.parametrize("env", [{"canary_alpha": 0.3}, {"canary_min_samples_per_arm": 1}])
def test_settings_refuse_service_wide_canary_defaults_outside_the_policys_ranges(
    env: dict[str, float],
) -> None:
    with pytest.raises(ValueError, match="must be"):
        Settings(**env)  # type: ignore[arg-type]
