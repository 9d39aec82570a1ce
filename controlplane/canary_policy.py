"""A canary's policy: how a canary runs and is judged, the one source of its defaults and their
valid ranges, and the three arms it compares. Pure and light (no numpy): the service-wide
Settings check their canary defaults against it at start-up, and
:mod:`controlplane.canary.policy` judges with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

ARM_BASELINE = "baseline"  # no speculation
ARM_INCUMBENT = "incumbent"
ARM_CANDIDATE = "candidate"
ARMS = (ARM_BASELINE, ARM_INCUMBENT, ARM_CANDIDATE)


class CanaryPolicyError(ValueError):
    """A canary policy with out-of-range or unknown fields; ``problems`` names each one."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


# (low, high) for each whole-number field a deployment may set.
_INTEGER_RANGES: dict[str, tuple[int, int]] = {
    "min_samples_per_arm": (5, 100_000),
    "max_requests": (100, 10_000_000),
    "watch_requests": (0, 1_000_000),
    "shadow_prompts": (2, 10_000),
    "shadow_new_tokens": (8, 4096),
    "tuning_requests": (1, 10_000_000),
}
MAX_ALPHA = 0.2  # a canary that promotes a worse drafter one time in five guards nothing


@dataclass(frozen=True, slots=True)
class CanaryPolicy:
    """How a canary runs and is judged: the one source of canary defaults and their valid ranges.

    Margins are relative (0.02 = 2 % of the incumbent's mean). ``tuning_requests``: effective
    sample size (per compared pair of arms) at which the confidence sequences are tightest; place
    it near where decisions are expected. ``srm_alpha``: level of the sample-ratio check (a false
    flag ends a canary, so it is small). ``live_canary`` False decides on the shadow replay alone
    (a fleet that cannot split traffic); ``tune_draft_length`` applies the tuner's k on promotion;
    ``watch_requests`` are checked after a promotion against the canary's estimate.
    ``judge_per_category`` also judges each request category on its own (:func:`judge_categories`);
    a promotion waits for every category holding at least ``category_min_share`` of the requests
    to have ``min_samples_per_arm`` in the compared arms (smaller ones never hold it).
    ``tune_draft_stop`` applies the draft-stop tuner's confidence threshold (or none) on promotion
    (controlplane.tuning.draft_stop).
    """

    live_canary: bool = True
    candidate_weight: float = 0.1
    baseline_weight: float = 0.1
    alpha: float = 0.05
    min_samples_per_arm: int = 50
    max_requests: int = 20_000
    max_duration_s: float = 6 * 3600.0
    non_inferiority_margin: float = 0.02
    harm_alpha: float | None = None  # None: same as alpha
    latency_harm_margin: float = 0.0
    tuning_requests: int = 500
    srm_alpha: float = 0.001
    tune_draft_length: bool = False
    watch_requests: int = 500
    shadow_prompts: int = 24
    shadow_new_tokens: int = 64
    judge_per_category: bool = True
    category_min_share: float = 0.1
    tune_draft_stop: bool = True

    # The fields a deployment's stored policy may set (the rest are the decision rule's internals).
    SETTABLE: ClassVar[frozenset[str]] = frozenset(
        {
            "live_canary",
            "candidate_weight",
            "baseline_weight",
            "alpha",
            "min_samples_per_arm",
            "max_requests",
            "max_duration_s",
            "non_inferiority_margin",
            "tune_draft_length",
            "watch_requests",
            "shadow_prompts",
            "shadow_new_tokens",
            "judge_per_category",
            "tune_draft_stop",
        }
    )

    def __post_init__(self) -> None:
        problems = _problems(self.as_dict())
        if problems:
            raise CanaryPolicyError(problems)

    @property
    def effective_harm_alpha(self) -> float:
        return self.alpha if self.harm_alpha is None else self.harm_alpha

    @property
    def routing_weights(self) -> dict[str, float]:
        return {"candidate": self.candidate_weight, "baseline": self.baseline_weight}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CanaryPolicy:
        """Build from a stored policy dict; keys that are not fields are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def for_deployment(
        cls, stored: Mapping[str, Any] | None, *, alpha: float | None = None, min_samples: int | None = None
    ) -> CanaryPolicy:
        """A deployment's policy: its stored fields over the service-wide defaults (``alpha`` and
        ``min_samples`` from Settings, when given) over this class's defaults."""
        values: dict[str, Any] = {}
        if alpha is not None:
            values["alpha"] = alpha
        if min_samples is not None:
            values["min_samples_per_arm"] = min_samples
        values.update({k: v for k, v in (stored or {}).items() if k in cls.SETTABLE})
        return cls.from_mapping(values)

    @classmethod
    def validate_changes(cls, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Check a patch of a deployment's stored policy; CanaryPolicyError names every bad field."""
        problems: list[str] = []
        unknown = sorted(set(changes) - cls.SETTABLE)
        if unknown:
            problems.append(f"unknown field(s) {unknown}; allowed: {sorted(cls.SETTABLE)}")
        known = {k: v for k, v in changes.items() if k in cls.SETTABLE}
        problems += _problems({**cls().as_dict(), **known}, only=set(known) | {"candidate_weight"})
        if problems:
            raise CanaryPolicyError(problems)
        return dict(changes)

    def settable(self) -> dict[str, Any]:
        """The fields a deployment may set, as stored and shown by the API."""
        return {k: v for k, v in self.as_dict().items() if k in self.SETTABLE}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _problems(values: Mapping[str, Any], only: set[str] | None = None) -> list[str]:
    """Every out-of-range field of a complete policy dict (only those in ``only``, when given)."""

    def checked(key: str) -> bool:
        return only is None or key in only

    problems: list[str] = []
    for key in ("live_canary", "tune_draft_length", "judge_per_category", "tune_draft_stop"):
        if checked(key) and not isinstance(values[key], bool):
            problems.append(f"{key} must be true or false")
    for key in ("candidate_weight", "baseline_weight"):
        if checked(key) and not (_is_number(values[key]) and 0 < values[key] < 0.5):
            problems.append(f"{key} must be a share in (0, 0.5)")
    if checked("alpha") and not (_is_number(values["alpha"]) and 0 < values["alpha"] <= MAX_ALPHA):
        problems.append(f"alpha must be in (0, {MAX_ALPHA}]")
    harm = values.get("harm_alpha")
    if checked("harm_alpha") and harm is not None and not (_is_number(harm) and 0 < harm <= MAX_ALPHA):
        problems.append(f"harm_alpha must be in (0, {MAX_ALPHA}]")
    for key in ("non_inferiority_margin", "latency_harm_margin"):
        if checked(key) and not (_is_number(values[key]) and 0 <= values[key] < 0.5):
            problems.append(f"{key} must be in [0, 0.5)")
    if checked("max_duration_s") and not (
        _is_number(values["max_duration_s"]) and 60 <= values["max_duration_s"] <= 30 * 86400
    ):
        problems.append("max_duration_s must be in [60, 2592000] seconds")
    if checked("category_min_share") and not (
        _is_number(values["category_min_share"]) and 0 <= values["category_min_share"] <= 1
    ):
        problems.append("category_min_share must be in [0, 1]")
    if checked("srm_alpha") and not (_is_number(values["srm_alpha"]) and 0 < values["srm_alpha"] < 0.5):
        problems.append("srm_alpha must be in (0, 0.5)")
    for key, (low, high) in _INTEGER_RANGES.items():
        value = values[key]
        if checked(key) and not (
            isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        ):
            problems.append(f"{key} must be an integer in [{low}, {high}]")
    if (
        not problems
        and (checked("min_samples_per_arm") or checked("max_requests"))
        and values["max_requests"] < len(ARMS) * values["min_samples_per_arm"]
    ):
        # Below that a canary could never hold enough requests in every arm to be judged.
        problems.append(
            f"max_requests must be at least {len(ARMS)} x min_samples_per_arm "
            f"({len(ARMS) * values['min_samples_per_arm']})"
        )
    weights_ok = _is_number(values["candidate_weight"]) and _is_number(values["baseline_weight"])
    if (
        not problems
        and checked("candidate_weight")
        and weights_ok
        and values["candidate_weight"] + values["baseline_weight"] >= 0.9
    ):
        problems.append("candidate_weight + baseline_weight must leave the incumbent at least 10% of traffic")
    return problems
