"""The canary automation: record a shadow replay, wait for a candidate pool, judge a live split
from ingested records, watch a promotion, and apply the guardrails. Each function runs in the
caller's transaction and is safe to run again (the beat task calls ``evaluate_deployment`` every
few seconds).

Per-request observations come from acceptance records, labelled by arm: ``live`` (the incumbent),
``canary:<version>`` (the candidate) and ``baseline`` (no speculation). The two primary metrics are
tokens per verify step (generated ÷ verify steps: exact, noise-free of the machine's load) and
latency per output token in ms (what users feel). Only records written under a serving key
(``from_serving_key``) are judged or watched: an ingest key can write arm labels, but it must not
steer a promotion, a rollback or a guardrail. The judge and the watch keep running per-arm sums
(``canary.tally``) on the canary row with a watermark, so each tick reads only new records. The
judge's sums are split by request category too; ``arms["per_category"]`` shows each category's
figures and verdict.

Edges that sum their traffic per window send the same observations as window aggregates
(``controlplane.ingest.aggregates``), one per arm and category. The judge folds the canary's
aggregates (again only those sent under a serving key) into the same sums, with a second
watermark over edge-window ids; a record the edge sent as a sample of aggregated traffic
(``counted_in_aggregate``) is not judged again. Records and aggregates may be mixed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.audit.service import record_change
from controlplane.canary import policy as decision_policy
from controlplane.canary.phases import CanaryDecision, CanaryPhase
from controlplane.canary.service import (
    POOL_READY,
    POOL_WAITING,
    UnverifiedArtifactError,
    canary_policy,
    close_watch,
    end_inconclusive,
    go_live,
    open_canary,
    pool_deadline_passed,
    pool_ready,
    pool_state,
    promote,
    reject,
    rollback,
    wait_for_pool,
)
from controlplane.canary.statistics import ArmAccumulator
from controlplane.canary.tally import ArmTally, JudgeTally
from controlplane.canary.tuning_view import arm_draft_stop_counts, draft_stop_plan, verify_cost_of
from controlplane.canary_policy import CanaryPolicy
from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceAggregateRow,
    AcceptanceRecordRow,
    Canary,
    Deployment,
    DrafterVersion,
    DriftResolution,
    EdgeWindowRow,
    SpeculationMode,
)
from controlplane.deployments.lookup import lock_deployment, resource_of
from controlplane.drafters.service import active_drafter
from controlplane.drift.service import latest_record_id
from controlplane.fleet.actuators import waits_for_pool
from controlplane.fleet.readiness import Probe, check_candidate_pool
from controlplane.ingest.aggregate_store import aggregate_from_row
from controlplane.ingest.aggregates import WindowAggregate
from controlplane.ingest.record import ARM_BASELINE, ARM_CANARY_PREFIX, ARM_LIVE
from controlplane.jobs.service import enter_guardrail_fallback
from controlplane.speculation_math import mean_of
from controlplane.timestamps import parse_utc, utcnow
from controlplane.tuning.draft_length import plan_draft_length

log = logging.getLogger(__name__)

# Arm names of the decision statistics vs the record labels.
INCUMBENT, CANDIDATE, BASELINE = "incumbent", "candidate", "baseline"
ARM_NAMES = (INCUMBENT, CANDIDATE, BASELINE)
# At most this many records are folded per tick: a canary that fell far behind catches up over
# several ticks instead of loading everything at once.
JUDGE_BATCH_LIMIT = 50_000
# Likewise at most this many aggregate rows a tick (one per arm and category of a window, so
# thousands of windows), in whole windows.
JUDGE_WINDOW_ROW_LIMIT = 20_000


def _arm_labels(session: Session, canary: Canary) -> dict[str, str]:
    """Record arm label -> decision arm."""
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    return {
        ARM_LIVE: INCUMBENT,
        f"{ARM_CANARY_PREFIX}{candidate.version}": CANDIDATE,
        ARM_BASELINE: BASELINE,
    }


def _judged_records(
    session: Session, canary: Canary, labels: dict[str, str], *, after: int, limit: int
) -> list[Any]:
    """The canary's arm-labelled records after id ``after``, in id order. Only records written
    under a serving key count: an ingest key must not be able to steer a canary."""
    return list(
        session.execute(
            select(
                AcceptanceRecordRow.id,
                AcceptanceRecordRow.arm,
                AcceptanceRecordRow.generated_tokens,
                AcceptanceRecordRow.verify_steps,
                AcceptanceRecordRow.drafted_tokens,
                AcceptanceRecordRow.accepted_tokens,
                AcceptanceRecordRow.accepted_per_position,
                AcceptanceRecordRow.inter_token_ms,
                AcceptanceRecordRow.total_ms,
                AcceptanceRecordRow.ttft_ms,
                AcceptanceRecordRow.category,
            )
            .where(
                AcceptanceRecordRow.deployment_id == canary.deployment_id,
                AcceptanceRecordRow.id > after,
                AcceptanceRecordRow.arm.in_(list(labels)),
                AcceptanceRecordRow.from_serving_key.is_(True),
                # A sample of aggregated traffic: its window's sums are judged instead.
                AcceptanceRecordRow.counted_in_aggregate.is_(False),
            )
            .order_by(AcceptanceRecordRow.id)
            .limit(limit)
        ).all()
    )


@dataclass(frozen=True, slots=True)
class JudgedWindow:
    """One edge window's aggregates of a canary's arms (``id``: the edge-window id)."""

    id: int
    aggregates: list[WindowAggregate]


def latest_edge_window_id(session: Session) -> int:
    """The newest edge-window id visible now (one ledger for every account and deployment)."""
    return int(session.scalar(select(func.max(EdgeWindowRow.id))) or 0)


def edge_window_at_start(session: Session, canary: Canary) -> int:
    """The newest edge window received when the canary went live: the judge reads windows after it,
    as it reads records after ``live_since_record_id``. A canary without a start time (none live
    ever lacks one) starts from the newest window now."""
    started = canary.arms.get("live_started_at")
    if not started:
        return latest_edge_window_id(session)
    newest = session.scalar(
        select(EdgeWindowRow.id)
        .where(EdgeWindowRow.received_at <= parse_utc(started))
        .order_by(EdgeWindowRow.received_at.desc(), EdgeWindowRow.id.desc())
        .limit(1)
    )
    return int(newest or 0)


def _judged_windows(
    session: Session, canary: Canary, labels: dict[str, str], *, after: int, row_limit: int | None
) -> tuple[list[JudgedWindow], bool]:
    """The canary's arm-labelled aggregates of edge windows after id ``after``, whole windows in id
    order, and whether ``row_limit`` cut the read short (more windows may follow). Only aggregates
    sent under a serving key count, as for records. Within a window, aggregates come in category
    order, which is the order new categories are admitted in."""
    agg = AcceptanceAggregateRow
    query = (
        select(
            agg.edge_window_id,
            agg.arm,
            agg.drafter_version,
            agg.category,
            agg.requests,
            agg.speculated_requests,
            agg.timed_requests,
            agg.drafted_tokens,
            agg.accepted_tokens,
            agg.verify_steps,
            agg.generated_tokens,
            agg.prompt_tokens,
            agg.sums,
        )
        .where(
            agg.deployment_id == canary.deployment_id,
            agg.edge_window_id > after,
            agg.arm.in_(list(labels)),
            agg.from_serving_key.is_(True),
        )
        .order_by(agg.edge_window_id, agg.category, agg.arm)
    )
    rows: Sequence[Any] = session.execute(query if row_limit is None else query.limit(row_limit)).all()
    cut_short = row_limit is not None and len(rows) >= row_limit
    if cut_short:
        last = rows[-1].edge_window_id
        whole = [row for row in rows if row.edge_window_id != last]
        # The last window may be cut: left for the next read, unless it is the only one.
        rows = whole or session.execute(query.where(agg.edge_window_id == last)).all()
    windows: list[JudgedWindow] = []
    for row in rows:
        if not windows or windows[-1].id != row.edge_window_id:
            windows.append(JudgedWindow(int(row.edge_window_id), []))
        windows[-1].aggregates.append(aggregate_from_row(row))
    return windows, cut_short


def _fold_settled(
    tally: JudgeTally,
    items: Sequence[Any],
    fold: Callable[[JudgeTally, Any], None],
    *,
    horizon: int,
    max_requests: int | None = None,
) -> int:
    """Fold the leading ``items`` (in id order) with ids up to ``horizon`` into ``tally``, each
    whole, while it holds fewer than ``max_requests``; returns how many were folded."""
    folded = 0
    for item in items:
        if item.id > horizon or (max_requests is not None and tally.records >= max_requests):
            break
        fold(tally, item)
        folded += 1
    return folded


def _next_marks(
    items: Sequence[Any],
    folded: int,
    *,
    watermark: int,
    horizon: int,
    latest: int,
    read: bool,
    cut_short: bool,
) -> tuple[int, int]:
    """The watermark and horizon after ``folded`` of the settled ``items`` went into the stored
    tally: ``latest`` becomes the horizon once everything up to the old one was consumed."""
    if not read:
        return watermark, horizon
    settled = sum(1 for item in items if item.id <= horizon)
    if folded < settled or (cut_short and items and folded == len(items)):
        # Stopped inside the settled range (the read's limit or the request cap): the rest later.
        return (items[folded - 1].id if folded else watermark), horizon
    return horizon, max(latest, horizon)


def _advance(
    stored: JudgeTally,
    rows: list[Any],
    fold: Callable[[JudgeTally, Any], None],
    *,
    watermark: int,
    horizon: int,
    latest: int,
    limit: int,
) -> tuple[JudgeTally, int, int]:
    """Fold ``rows`` (ids after ``watermark``, in order, at most ``limit``) into ``stored`` up to
    the settled ``horizon`` and into a view beyond it; returns the view, the new watermark and the
    new horizon (``latest``, once everything up to the old one was consumed)."""
    folded = _fold_settled(stored, rows, fold, horizon=horizon)
    view = stored.copy()
    for row in rows[folded:]:
        fold(view, row)
    watermark, horizon = _next_marks(
        rows,
        folded,
        watermark=watermark,
        horizon=horizon,
        latest=latest,
        read=limit > 0,
        cut_short=len(rows) == limit,
    )
    return view, watermark, horizon


def advance_judge(
    *,
    session: Session,
    canary: Canary,
    max_requests: int,
    batch_limit: int = JUDGE_BATCH_LIMIT,
    window_row_limit: int = JUDGE_WINDOW_ROW_LIMIT,
) -> JudgeTally:
    """This tick's view of a live canary: its stored tally advanced over the settled records and
    edge windows, plus those not yet settled (folded into the returned view only).

    As in the drift monitor (``drift.service``), ids become visible when their transaction
    commits, so only ids up to the newest id the previous tick saw (the horizon) are folded into
    the stored tally and pass the watermark; newer ones are read again next tick. Records and
    edge windows each have their own watermark and horizon (``judge_state["edge_watermark"]`` and
    ``["edge_horizon"]``; a state without them, written before windows were judged, starts at the
    canary's start). Each tick folds its records, then its windows. The view thus holds every
    record and window visible now, in id order, capped at ``max_requests`` requests (and, for a
    canary far behind, at ``batch_limit`` new records and ``window_row_limit`` aggregate rows a
    tick): the figures a read of everything since the canary went live gives.

    A window is folded whole, all its arms and categories at once, and only while the tally
    holds fewer than ``max_requests`` requests: the last window folded may carry the tally past
    the cap by up to its own requests, and no record or window is folded after that.
    """
    labels = _arm_labels(session, canary)
    state = canary.judge_state or {}
    if state.get("tally"):
        stored = JudgeTally.from_state(state["tally"], ARM_NAMES)
        watermark, horizon = int(canary.judge_watermark_record_id), int(state["horizon"])
    else:  # the first tick since the canary went live
        stored = JudgeTally.empty(ARM_NAMES)
        watermark = horizon = int(canary.arms.get("live_since_record_id") or 0)
    if "edge_watermark" in state:
        edge_watermark, edge_horizon = int(state["edge_watermark"]), int(state["edge_horizon"])
    else:
        edge_watermark = edge_horizon = edge_window_at_start(session, canary)
    latest = latest_record_id(session, canary.deployment_id)
    latest_window = latest_edge_window_id(session)
    limit = min(batch_limit, max_requests - stored.records)
    rows = _judged_records(session, canary, labels, after=watermark, limit=limit) if limit > 0 else []
    read_windows = stored.records < max_requests
    windows, windows_cut = (
        _judged_windows(session, canary, labels, after=edge_watermark, row_limit=window_row_limit)
        if read_windows
        else ([], False)
    )

    def fold(tally: JudgeTally, row: Any) -> None:
        tally.fold(labels[row.arm], row)

    def fold_window(tally: JudgeTally, window: JudgedWindow) -> None:
        for agg in window.aggregates:
            tally.fold_aggregate(labels[agg.arm], agg)

    folded = _fold_settled(stored, rows, fold, horizon=horizon)
    folded_windows = _fold_settled(
        stored, windows, fold_window, horizon=edge_horizon, max_requests=max_requests
    )
    view = stored.copy()
    # The same order next tick: these records, then these windows, settled by then.
    for row in rows[folded:]:
        if view.records >= max_requests:
            break
        fold(view, row)
    for window in windows[folded_windows:]:
        if view.records >= max_requests:
            break
        fold_window(view, window)
    watermark, horizon = _next_marks(
        rows,
        folded,
        watermark=watermark,
        horizon=horizon,
        latest=latest,
        read=limit > 0,
        cut_short=len(rows) == limit,
    )
    edge_watermark, edge_horizon = _next_marks(
        windows,
        folded_windows,
        watermark=edge_watermark,
        horizon=edge_horizon,
        latest=latest_window,
        read=read_windows,
        cut_short=windows_cut,
    )
    canary.judge_watermark_record_id = watermark
    canary.judge_state = {
        **state,
        "tally": stored.to_state(),
        "horizon": horizon,
        "edge_watermark": edge_watermark,
        "edge_horizon": edge_horizon,
    }
    return view


WATCH_ARM = "live"


def advance_watch(
    *,
    session: Session,
    canary: Canary,
    version: int,
    since: int,
    k: int | None,
    max_requests: int,
    batch_limit: int = JUDGE_BATCH_LIMIT,
) -> JudgeTally:
    """The post-promotion watch's view, kept as the judge's is: drafted and accepted tokens of the
    promoted ``version``'s live requests after record ``since`` (at draft length ``k``, when
    given), stored under ``judge_state["watch"]``; a new ``since`` or ``k`` starts it over."""
    state = canary.judge_state or {}
    watch = state.get("watch")
    key = [since, k]
    if isinstance(watch, dict) and watch.get("key") == key:
        stored = JudgeTally.from_state(watch["tally"], (WATCH_ARM,))
        watermark, horizon = int(watch["watermark"]), int(watch["horizon"])
    else:
        stored = JudgeTally.empty((WATCH_ARM,))
        watermark = horizon = since
    latest = latest_record_id(session, canary.deployment_id)
    limit = min(batch_limit, max_requests - stored.records)
    rows: list[Any] = []
    if limit > 0:
        query = select(
            AcceptanceRecordRow.id, AcceptanceRecordRow.drafted_tokens, AcceptanceRecordRow.accepted_tokens
        ).where(
            AcceptanceRecordRow.deployment_id == canary.deployment_id,
            AcceptanceRecordRow.id > watermark,
            AcceptanceRecordRow.arm == ARM_LIVE,
            AcceptanceRecordRow.drafter_version == version,
            AcceptanceRecordRow.from_serving_key.is_(True),  # an ingest key cannot force a rollback
        )
        if k is not None:
            query = query.where(AcceptanceRecordRow.k == k)
        rows = list(session.execute(query.order_by(AcceptanceRecordRow.id).limit(limit)).all())

    def fold(tally: JudgeTally, row: Any) -> None:
        tally.fold_counts(WATCH_ARM, row)

    view, watermark, horizon = _advance(
        stored, rows, fold, watermark=watermark, horizon=horizon, latest=latest, limit=limit
    )
    canary.judge_state = {
        **state,
        "watch": {"key": key, "tally": stored.to_state(), "watermark": watermark, "horizon": horizon},
    }
    return view


def recount_judge(*, session: Session, canary: Canary, max_requests: int) -> JudgeTally:
    """Every judged record, then every judged edge window, since the canary went live, folded in
    one read: what ``advance_judge`` keeps incrementally (kept for checks and repairs; the beat
    never calls it). With records only, it equals the ticks' tally float for float; with windows
    too, the ticks interleave the two by arrival, so the floats may differ in the last bits (and
    the category admitted last before the limit may differ)."""
    labels = _arm_labels(session, canary)
    since = int(canary.arms.get("live_since_record_id") or 0)
    tally = JudgeTally.empty(ARM_NAMES)
    for row in _judged_records(session, canary, labels, after=since, limit=max_requests):
        tally.fold(labels[row.arm], row)
    if tally.records < max_requests:
        after = edge_window_at_start(session, canary)
        windows, _ = _judged_windows(session, canary, labels, after=after, row_limit=None)
        for window in windows:
            if tally.records >= max_requests:
                break
            for agg in window.aggregates:
                tally.fold_aggregate(labels[agg.arm], agg)
    return tally


def category_figures(tally: JudgeTally, categories: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per category bucket: each arm's requests, hit rate, tokens/step and latency/token, with the
    decision's verdict and comparisons (``categories`` is a decision's ``figures["categories"]``)."""
    verdicts = categories.get("verdicts") or {}
    out: dict[str, dict[str, Any]] = {}
    ordered = sorted(
        tally.categories.items(), key=lambda item: (-sum(t.timed for t in item[1].values()), item[0])
    )
    for bucket, per_arm in ordered:
        figures: dict[str, Any] = {}
        for name, arm in per_arm.items():
            n = arm.timed
            figures[name] = {
                "requests": n,
                "hit_rate": _rounded(arm.hit_rate, 4),
                "tokens_per_step": _rounded(mean_of(arm.tokens_per_step_sum, n), 4),
                "latency_per_token_ms": _rounded(mean_of(arm.ms_per_token_sum, n), 4),
            }
        judged = verdicts.get(bucket) or {}
        figures["verdict"] = judged.get("verdict", "no requests to judge")
        figures["comparisons"] = judged.get("comparisons", {})
        out[bucket] = figures
    return out


def _rounded(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None


def category_accumulators(tally: JudgeTally) -> dict[str, dict[str, ArmAccumulator]]:
    """The decision's running state per category bucket and arm."""
    return {bucket: live_accumulators(per_arm) for bucket, per_arm in tally.categories.items()}


def arm_figures(arms: dict[str, ArmTally]) -> dict[str, dict[str, Any]]:
    """Plain per-arm figures for the canary row (the decision adds its confidence intervals)."""
    out: dict[str, dict[str, Any]] = {}
    for name, tally in arms.items():
        n = tally.timed
        hit_rate_se = tally.hit_rate_spread()[0]
        out[name] = {
            "requests": n,
            "hit_rate": _rounded(tally.hit_rate, 4),
            # Request-level standard error: what the post-promotion watch allows for.
            "hit_rate_se": _rounded(hit_rate_se, 5),
            "tokens_per_step": _rounded(mean_of(tally.tokens_per_step_sum, n), 4),
            "ms_per_token": _rounded(mean_of(tally.ms_per_token_sum, n), 4),
            "accepted_per_position": list(tally.accepted_per_position),
            "verify_steps": tally.verify_steps,
        }
    return out


def record_shadow_result(
    *, session: Session, canary_id: int, result: dict[str, Any], settings: Settings
) -> str:
    """Store a shadow replay on the canary and move it on: broken or harmful → reject; else go live
    (or decide now, when the deployment cannot split live traffic). Returns the canary's phase.
    """
    canary = session.get_one(Canary, canary_id)
    if canary.phase != CanaryPhase.shadow or pool_state(canary) is not None:
        return canary.phase  # a redelivered replay after the canary moved on (or waits for its pool)
    deployment = session.get_one(Deployment, canary.deployment_id)
    policy = canary_policy(deployment, settings)
    canary.arms = {**canary.arms, "shadow": result, **shadow_ceiling_fields(result)}
    broken = [arm for arm, figures in result.get("arms", {}).items() if figures.get("broken")]
    if CANDIDATE in broken:
        reject(
            session=session,
            canary=canary,
            actor="system",
            reason="candidate broken: its greedy output differs from no speculation "
            f"({result['arms'][CANDIDATE].get('broken')})",
            figures={"shadow": result},
        )
        return canary.phase
    outcome = decision_policy.decide(shadow_accumulators(result), policy)
    canary.arms = {**canary.arms, "shadow_decision": outcome.as_dict()}
    if outcome.decision == CanaryDecision.reject:
        reject(
            session=session,
            canary=canary,
            actor="system",
            reason=f"shadow replay: {outcome.reason}",
            figures=outcome.figures,
        )
        return canary.phase
    if not policy.live_canary:
        _apply_decision(session, canary, outcome, policy, source="shadow replay", arms=None)
        return canary.phase
    live_k_for_a_first_drafter(canary, result, policy)
    if waits_for_pool(deployment):
        # The fleet loads the candidate first: traffic splits once its pool is ready.
        wait_for_pool(
            session=session,
            canary=canary,
            deployment=deployment,
            shadow_decision=outcome.decision,
            settings=settings,
        )
        return canary.phase
    go_live(session=session, canary=canary, policy=policy, shadow_decision=outcome.decision)
    return canary.phase


SHADOW_CEILING_FIGURES = (
    "of",
    "share_of_ceiling",
    "never_missing_speedup",
    "never_missing_hit_rate",
    "analytic_ceiling_speedup",
    "analytic_share_of_ceiling",
)


def shadow_ceiling_fields(result: dict[str, Any]) -> dict[str, Any]:
    """The candidate's share of its measured ceiling, from a replay that ran the never-missing arm,
    under ``shadow_ceiling`` for the API and the dashboard (nothing when the replay ran none).

    ``share_of_ceiling`` is the candidate's decode speed-up over no speculation divided by that of
    an arm drafting the target's own continuation through the candidate's forwards, both measured
    in the replay; the analytic (Leviathan, acceptance 1) figure stays beside it as a cross-check.
    """
    ceiling = result.get("ceiling")
    if not isinstance(ceiling, dict):
        return {}
    figures = {name: ceiling.get(name) for name in SHADOW_CEILING_FIGURES}
    speedups = ceiling.get("speedup_over_baseline") or {}
    figures["speedup_over_baseline"] = speedups.get(ceiling.get("of")) if isinstance(speedups, dict) else None
    return {"shadow_ceiling": figures}


def live_k_for_a_first_drafter(canary: Canary, result: dict[str, Any], policy: CanaryPolicy) -> None:
    """Against an incumbent that does not speculate (a deployment's first drafter), the candidate
    goes live at the k its own shadow replay says pays best, not the deployment's configured k.

    A first drafter is cut from the target, so it costs more per step than a purpose-built one;
    judged live at a k its costs cannot carry, it would lose to no speculation and be rejected
    although a shorter draft pays. With a speculating incumbent the candidate keeps the
    incumbent's k, so the two drafters are compared like for like; the tuner then picks k from
    live records at promotion.
    """
    if not policy.tune_draft_length:
        return
    arms = result.get("arms") or {}
    incumbent, candidate = arms.get(INCUMBENT) or {}, arms.get(CANDIDATE) or {}
    if incumbent.get("speculative", True) or not candidate.get("verify_steps"):
        return
    costs = result.get("costs") or {}
    # Measured during the replay itself where it was (target and drafter sharing the caches, as
    # in serving), else on its own.
    in_situ = (costs.get("in_situ") or {}).get(CANDIDATE) or {}
    cost_ratio = (
        in_situ.get("cost_ratio")
        or (costs.get("cost_ratio_by_arm") or {}).get(CANDIDATE)
        or costs.get("cost_ratio")
    )
    if not isinstance(cost_ratio, int | float) or cost_ratio <= 0:
        return
    plan = plan_draft_length(
        candidate.get("accepted_per_position") or [],
        int(candidate["verify_steps"]),
        float(cost_ratio),
        verify_cost=verify_cost_of(costs),
    )
    if plan.best_k < 1:
        return  # no k pays by the replay's measure: the live split judges the configured k
    canary.arms = {
        **canary.arms,
        "k": plan.best_k,
        "live_k_source": {
            "reason": "first drafter: k from its shadow replay's per-position acceptance and costs",
            "configured_k": canary.arms.get("k"),
            "expected_speedup": plan.best_speedup,
            "cost_ratio": float(cost_ratio),
        },
    }


def shadow_accumulators(result: dict[str, Any]) -> dict[str, ArmAccumulator]:
    """The replay's per-prompt figures as the decision's running state (paired prompts fed as
    independent arms: valid, only conservative)."""
    out: dict[str, ArmAccumulator] = {}
    for arm, per_prompt in (result.get("per_prompt") or {}).items():
        if arm not in (INCUMBENT, CANDIDATE, BASELINE):
            continue
        acc = ArmAccumulator()
        for tokens_per_step, ms_per_token in zip(
            per_prompt.get("tokens_per_step", []), per_prompt.get("ms_per_token", []), strict=False
        ):
            if not tokens_per_step or not ms_per_token or tokens_per_step <= 0 or ms_per_token <= 0:
                continue  # a prompt the arm produced no timed tokens for
            acc.add(tokens_per_step=float(tokens_per_step), latency_ms_per_token=float(ms_per_token))
        out[arm] = acc
    return out


def live_accumulators(arms: dict[str, ArmTally]) -> dict[str, ArmAccumulator]:
    return {name: tally.stats for name, tally in arms.items()}


def _chosen_k(canary: Canary, arms: dict[str, ArmTally] | None) -> tuple[int | None, dict[str, Any]]:
    """The tuner's best k for the candidate, from its per-position acceptance and measured costs."""
    shadow = canary.arms.get("shadow") or {}
    costs = shadow.get("costs") or {}
    cost_ratio = costs.get("cost_ratio")
    if arms is not None and arms[CANDIDATE].verify_steps > 0:
        per_position, steps = arms[CANDIDATE].accepted_per_position, arms[CANDIDATE].verify_steps
    else:
        figures = (shadow.get("arms") or {}).get(CANDIDATE) or {}
        per_position, steps = (
            list(figures.get("accepted_per_position") or []),
            int(figures.get("verify_steps") or 0),
        )
    if not isinstance(cost_ratio, int | float) or steps <= 0 or not per_position:
        return None, {"note": "no cost measurement or acceptance counts: k unchanged"}
    plan = plan_draft_length(per_position, steps, float(cost_ratio), verify_cost=verify_cost_of(costs))
    return plan.best_k, plan.as_dict()


def _chosen_threshold(session: Session, canary: Canary) -> tuple[float | None, dict[str, Any]]:
    """The draft-stop tuner's threshold for the candidate (None: none), from the counterfactual
    counts of its live records and the measured costs. The candidate arm drafts without a
    threshold (serving config), so every threshold of the grid is observable there; drafting
    without one is what the canary measured, and what stands when no threshold pays."""
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    counts = arm_draft_stop_counts(
        session,
        canary.deployment_id,
        f"{ARM_CANARY_PREFIX}{candidate.version}",
        after_record_id=int(canary.arms.get("live_since_record_id") or 0),
        serving_key_only=True,  # an ingest key must not steer what the fleet serves
        limit=JUDGE_BATCH_LIMIT,
    )
    costs = (canary.arms.get("shadow") or {}).get("costs") or {}
    return draft_stop_plan(counts, costs)


def _k_or_threshold(
    new_k: int | None,
    canary_k: int,
    k_tuning: dict[str, Any],
    threshold: float | None,
    stop_tuning: dict[str, Any],
) -> tuple[int | None, float | None]:
    """The thresholds were counted at the canary's k: when both tuners want a change, the
    promotion makes the one expected to gain more (each against what the canary ran)."""
    if threshold is None or new_k is None or new_k == canary_k:
        return new_k, threshold
    rows = {int(r["k"]): float(r["expected_speedup"]) for r in k_tuning.get("rows", [])}
    k_gain = rows[new_k] / rows[canary_k] if canary_k in rows and new_k in rows else float("inf")
    stop_gain = float(stop_tuning.get("gain") or 1.0)
    if stop_gain > k_gain:
        stop_tuning["k_kept"] = (
            f"k stays {canary_k}: threshold x{stop_gain:.3f} beats k={new_k} x{k_gain:.3f}"
        )
        return None, threshold
    stop_tuning["threshold_dropped"] = (
        f"k={new_k} (x{k_gain:.3f}) beats threshold {threshold} (x{stop_gain:.3f}), which was "
        f"counted at k={canary_k}: no threshold"
    )
    return new_k, None


def _apply_draft_stop(session: Session, canary: Canary, threshold: float | None, reason: str) -> None:
    """A promotion serves the tuner's threshold (None: none): the candidate's own, not the old
    drafter's; the watch knows it, to revert it with k if the promoted drafter falls short."""
    deployment = lock_deployment(session=session, deployment_id=canary.deployment_id)
    before = deployment.draft_confidence_threshold
    watch = dict(canary.arms.get("watch") or {})
    canary.arms = {
        **canary.arms,
        "draft_stop": {"candidate_threshold": None, "chosen_threshold": threshold},
        "watch": {**watch, "canary_threshold": None, "tuned_threshold": threshold},
    }
    if before == threshold:
        return
    deployment.draft_confidence_threshold = threshold
    deployment.row_version += 1
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor="system",
        action="deployment.draft_stop_tuned",
        resource=resource_of(session, deployment),
        before={"draft_confidence_threshold": before},
        after={"draft_confidence_threshold": threshold, "reason": reason, "canary_id": canary.id},
    )


def _apply_decision(
    session: Session,
    canary: Canary,
    outcome: decision_policy.Decision,
    policy: CanaryPolicy,
    *,
    source: str,
    arms: dict[str, ArmTally] | None,
    guardrail: decision_policy.GuardrailFinding | None = None,
) -> str:
    figures = {**outcome.figures, "source": source}
    reason = f"{source}: {outcome.reason}"
    if guardrail is not None:
        # The drift event ends on the guardrail's action: say what it measured.
        reason += f"; guardrail: {guardrail.reason}"
    if arms is not None:
        figures["arm_counts"] = arm_figures(arms)
    if outcome.decision == CanaryDecision.promote:
        best_k, tuning = _chosen_k(canary, arms)
        figures["draft_length"] = tuning
        new_k = best_k if policy.tune_draft_length else None
        canary_k = int(canary.arms.get("k") or 0)
        threshold: float | None = None
        stop_tuning: dict[str, Any] = {"note": "tune_draft_stop is off: the threshold is left as set"}
        if policy.tune_draft_stop:
            threshold, stop_tuning = _chosen_threshold(session, canary)
        new_k, threshold = _k_or_threshold(new_k, canary_k, tuning, threshold, stop_tuning)
        figures["draft_stop"] = stop_tuning
        expected_hit = None
        if new_k is not None and new_k != canary_k:
            # accepted / drafted at the new k, from the tuner's (conservative) per-position rates.
            row = next((r for r in tuning.get("rows", []) if r["k"] == new_k), None)
            if row is not None and new_k > 0:
                expected_hit = (float(row["expected_tokens_per_step"]) - 1.0) / new_k
                figures["expected_hit_rate_at_new_k"] = expected_hit
        elif threshold is not None:
            # Stopping at doubtful drafts raises the hit rate: the watch expects what was counted.
            stop_row = next((r for r in stop_tuning.get("rows", []) if r["threshold"] == threshold), None)
            if stop_row is not None and stop_row.get("hit_rate") is not None:
                expected_hit = float(stop_row["hit_rate"])
                figures["expected_hit_rate_at_threshold"] = expected_hit
        candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
        try:
            promote(
                session=session,
                deployment_id=canary.deployment_id,
                version_number=candidate.version,
                actor="system",
                reason=f"{source}: {outcome.reason}",
                canary=canary,
                figures=figures,
                draft_token_count=new_k,
                expected_hit_rate=expected_hit,
            )
        except UnverifiedArtifactError as exc:
            # It won on the numbers, but its files changed since: it must not serve.
            reject(session=session, canary=canary, actor="system", reason=str(exc), figures=figures)
        else:
            if policy.tune_draft_stop:
                _apply_draft_stop(session, canary, threshold, reason=f"{source}: {outcome.reason}")
    elif outcome.decision == CanaryDecision.reject:
        reject(
            session=session,
            canary=canary,
            actor="system",
            reason=reason,
            figures=figures,
            resolution=DriftResolution.guardrail_action
            if guardrail is not None
            else DriftResolution.candidate_rejected,
        )
    elif outcome.decision == CanaryDecision.inconclusive:
        end_inconclusive(
            session=session,
            canary=canary,
            reason=reason,
            figures=figures,
            resolution=DriftResolution.guardrail_action
            if guardrail is not None
            else DriftResolution.canary_inconclusive,
        )
    else:
        canary.arms = {**canary.arms, "live": figures}
    return outcome.decision


def evaluate_deployment(
    *, session: Session, deployment_id: int, settings: Settings, probe: Probe | None = None
) -> dict[str, Any] | None:
    """One tick of the automation for a deployment: check a waiting canary's candidate pool
    (with ``probe``, default a real HTTP GET), judge its live canary or watch its promotion, and
    apply the guardrails. Returns what happened (None: nothing to do)."""
    canary = open_canary(session=session, deployment_id=deployment_id)
    if canary is None:
        return None
    deployment = session.get_one(Deployment, deployment_id)
    policy = canary_policy(deployment, settings)
    if canary.phase == CanaryPhase.shadow:
        if pool_state(canary) != POOL_WAITING:
            return None  # the replay is still running
        return _await_pool(session, canary, policy, probe)
    if canary.phase == CanaryPhase.watching:
        return _watch(session, canary, policy)
    tally = advance_judge(session=session, canary=canary, max_requests=policy.max_requests)
    arms = tally.arms
    weights = canary.routing_weights or {}
    routing = {
        INCUMBENT: 1.0 - float(weights.get("candidate", 0)) - float(weights.get("baseline", 0)),
        CANDIDATE: float(weights.get("candidate", 0)),
        BASELINE: float(weights.get("baseline", 0)),
    }
    started = canary.arms.get("live_started_at")
    elapsed = (utcnow() - parse_utc(started)).total_seconds() if started else 0.0
    outcome = decision_policy.decide(
        live_accumulators(arms),
        policy,
        elapsed_s=elapsed,
        routing_weights=routing,
        categories=category_accumulators(tally),
    )
    canary.arms = {
        **canary.arms,
        "per_category": category_figures(tally, outcome.figures.get("categories") or {}),
        "per_category_judge": {
            key: value
            for key, value in (outcome.figures.get("categories") or {}).items()
            if key != "verdicts"
        }
        | {
            "records_covered": tally.category_records,
            "records": tally.records,
            "aggregated_requests": tally.aggregated_requests,
        },
    }
    findings = _guardrails(arms, deployment)
    if findings:
        canary.arms = {**canary.arms, "guardrails": [f.as_dict() for f in findings]}
    acting = _acting_guardrail(findings)
    decision = _apply_decision(
        session, canary, outcome, policy, source="live canary", arms=arms, guardrail=acting
    )
    if acting is not None and decision in (CanaryDecision.reject, CanaryDecision.inconclusive):
        _act_on_guardrail(session, deployment, acting, settings=settings, canary=canary)
    return {"canary_id": canary.id, "decision": decision, "reason": outcome.reason}


def _await_pool(
    session: Session, canary: Canary, policy: CanaryPolicy, probe: Probe | None
) -> dict[str, Any]:
    """A passed shadow canary waiting for its candidate pool: live once every candidate backend
    with a readiness URL answers 2xx; inconclusive once ``ready_timeout_s`` has passed."""
    check = check_candidate_pool(session=session, deployment_id=canary.deployment_id, probe=probe)
    if check.ready and pool_ready(
        session=session,
        canary=canary,
        policy=policy,
        by="readiness check",
        evidence={"check": check.as_dict()},
    ):
        return {"canary_id": canary.id, "pool": POOL_READY, "phase": canary.phase}
    pool = dict(canary.arms.get("pool") or {})
    if pool_deadline_passed(canary):
        timeout = pool.get("ready_timeout_s")
        end_inconclusive(
            session=session,
            canary=canary,
            reason=f"the candidate pool never became ready within {timeout} s; the incumbent keeps serving",
            figures={"pool": {**pool, "check": check.as_dict()}},
        )
        canary.arms = {**canary.arms, "pool": {**pool, "state": "timed_out", "check": check.as_dict()}}
        return {"canary_id": canary.id, "decision": CanaryDecision.inconclusive, "reason": canary.reason}
    canary.arms = {
        **canary.arms,
        "pool": {**pool, "check": check.as_dict(), "checked_at": utcnow().isoformat()},
    }
    return {"canary_id": canary.id, "pool": POOL_WAITING}


def _guardrails(arms: dict[str, ArmTally], deployment: Deployment) -> list[decision_policy.GuardrailFinding]:
    incumbent = arms[INCUMBENT]
    return decision_policy.guardrail_check(
        incumbent.stats,
        arms[BASELINE].stats,
        speculation_mode=deployment.speculation_mode.value,
        drafted_tokens=incumbent.drafted,
        accepted_tokens=incumbent.accepted,
        verify_steps=incumbent.verify_steps,
    )


def _acting_guardrail(
    findings: list[decision_policy.GuardrailFinding],
) -> decision_policy.GuardrailFinding | None:
    """The finding that changes the deployment if the canary ends without a promotion: the
    incumbent measured critically slower than no speculation."""
    return next((f for f in findings if f.kind == "speculation_slower" and f.severity == "critical"), None)


def _act_on_guardrail(
    session: Session,
    deployment: Deployment,
    finding: decision_policy.GuardrailFinding,
    *,
    settings: Settings,
    canary: Canary,
) -> None:
    """The incumbent stays, but it was measured slower than no speculation: stop paying for it
    until a drafter that pays is promoted (a promotion switches back to the drafter). The loop
    keeps realigning the drafter that served, on the traffic since the switch, and canaries each
    candidate against the fallback (``jobs.service.enter_guardrail_fallback``)."""
    previous_version = active_drafter(session=session, deployment_id=deployment.id)
    previous_draft_model = deployment.draft_model
    before = {
        "speculation_mode": deployment.speculation_mode.value,
        "draft_model": deployment.draft_model,
        "ngram_speculation_length": deployment.ngram_speculation_length,
    }
    if finding.action == "switch_to_ngram":
        deployment.speculation_mode = SpeculationMode.ngram
        deployment.draft_model = None  # n-gram and a draft model are exclusive (a DB constraint)
        deployment.ngram_speculation_length = deployment.ngram_speculation_length or 3
    else:
        deployment.speculation_mode = SpeculationMode.disabled
    deployment.row_version += 1
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor="system",
        action="guardrail.speculation_slower",
        resource=resource_of(session, deployment),
        before=before,
        after={"speculation_mode": deployment.speculation_mode.value, "reason": finding.reason},
    )
    job = enter_guardrail_fallback(
        session=session,
        deployment=deployment,
        settings=settings,
        previous_draft_model=previous_draft_model,
        previous_version=previous_version.version if previous_version is not None else None,
        reason=finding.reason,
        canary_id=canary.id,
    )
    canary.arms = {
        **canary.arms,
        "guardrail_switch": {
            "to": deployment.speculation_mode.value,
            "at": utcnow().isoformat(),
            "realign_job_id": job.id if job is not None else None,
        },
    }


def _watch(session: Session, canary: Canary, policy: CanaryPolicy) -> dict[str, Any]:
    """After a promotion: roll back if the live hit rate falls significantly short of the canary's."""
    watch = dict(canary.arms.get("watch") or {})
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    expected = watch.get("expected_hit_rate")
    reverted = watch.get("draft_length_reverted")
    tally = advance_watch(
        session=session,
        canary=canary,
        version=candidate.version,
        since=int(watch.get("since_record_id") or 0),
        # Servers pick a reverted k up within a config poll: judge only what ran at it.
        k=int(reverted["to"]) if reverted and reverted.get("to") is not None else None,
        max_requests=policy.watch_requests * 4 or 1,
    )
    live = tally.arms[WATCH_ARM]
    if not isinstance(expected, int | float) or not 0 < expected < 1:
        close_watch(canary, "no canary hit-rate estimate to watch against")
        return {"canary_id": canary.id, "watch": "closed"}
    expected_se = watch.get("expected_hit_rate_se")
    verdict = decision_policy.rollback_check(
        float(expected),
        live.drafted,
        live.accepted,
        tally.records,
        watch_requests=policy.watch_requests,
        estimate_standard_error=float(expected_se) if isinstance(expected_se, int | float) else 0.0,
        measured_design_effect=live.hit_rate_spread()[1],
    )
    watch.update({"requests": tally.records, "verdict": verdict.as_dict()})
    canary.arms = {**canary.arms, "watch": watch}
    if verdict.rollback and _revert_draft_length(session, canary, watch, verdict.reason):
        return {"canary_id": canary.id, "watch": "draft length reverted", "reason": verdict.reason}
    if verdict.rollback:
        rollback(session=session, deployment_id=canary.deployment_id, actor="system", reason=verdict.reason)
        return {"canary_id": canary.id, "watch": "rolled back", "reason": verdict.reason}
    if not verdict.watching:
        close_watch(canary, verdict.reason)
        return {"canary_id": canary.id, "watch": "closed", "reason": verdict.reason}
    return {"canary_id": canary.id, "watch": "watching", "reason": verdict.reason}


def _revert_draft_length(session: Session, canary: Canary, watch: dict[str, Any], reason: str) -> bool:
    """A promotion that also changed k or the draft-stop threshold and then falls short: go back
    to the k and threshold the canary measured.

    The shortfall may be the tuners' doing (an extrapolation to a longer draft, a threshold that
    cut more accepted drafts than counted), not the drafter: the drafter keeps serving at the
    canary's settings, and the watch starts over against the rate measured there. Only a
    shortfall there rolls the drafter back. Returns whether anything was reverted.
    """
    canary_k, measured = watch.get("canary_k"), watch.get("measured_hit_rate")
    if watch.get("draft_length_reverted"):
        return False
    if not isinstance(measured, int | float) or not 0 < measured < 1:
        return False
    deployment = lock_deployment(session=session, deployment_id=canary.deployment_id)
    tuned_k = deployment.draft_token_count
    revert_k = isinstance(canary_k, int) and canary_k > 0 and tuned_k is not None and tuned_k != canary_k
    tuned_threshold = watch.get("tuned_threshold")
    revert_threshold = (
        tuned_threshold is not None and deployment.draft_confidence_threshold == tuned_threshold
    )
    if not revert_k and not revert_threshold:
        return False
    to_k = canary_k if revert_k else tuned_k
    to_threshold = (
        watch.get("canary_threshold") if revert_threshold else deployment.draft_confidence_threshold
    )
    deployment.draft_token_count = to_k
    deployment.draft_confidence_threshold = to_threshold
    deployment.row_version += 1
    # A new dict: ``watch`` is already the stored value (flushed by the lock's query), and an
    # in-place change of it would compare equal to itself and never be written.
    reverted = {
        "from": tuned_k,
        "to": to_k,
        "threshold_from": tuned_threshold if revert_threshold else to_threshold,
        "threshold_to": to_threshold,
        "reason": reason,
        "at": utcnow().isoformat(),
    }
    watch = {
        **watch,
        "draft_length_reverted": reverted,
        "expected_hit_rate": measured,
        "since_record_id": latest_record_id(session, deployment.id),
        "requests": 0,
    }
    canary.arms = {**canary.arms, "watch": watch}
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor="system",
        action="drafter.draft_length_reverted",
        resource=resource_of(session, deployment),
        before={"draft_token_count": tuned_k, "draft_confidence_threshold": reverted["threshold_from"]},
        after={"draft_token_count": to_k, "draft_confidence_threshold": to_threshold, "reason": reason},
    )
    return True
