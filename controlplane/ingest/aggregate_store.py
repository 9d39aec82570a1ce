"""Storing edge windows: once per (account, edge, window), all or nothing, fleet-wide in one call.

The ledger row in ``edge_windows`` is inserted first with ON CONFLICT DO NOTHING, so two API
processes receiving the same window (an edge's retry landing on another replica) race on one
unique key: exactly one stores the aggregates, the other finds the stored digest and answers
"duplicate" (same body) or 409 (a different body for a stored window: the edge is confused, and
overwriting either version would lose data). The aggregates go in the same transaction, so a
window is either wholly visible with its ledger row or not at all. A window naming a deployment
the account does not have (or has deleted) is refused whole, with every unknown name listed.

The ledger id orders windows by arrival: the drift monitor consumes aggregates by it (see
controlplane.drift.aggregate_monitor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceAggregateRow, Deployment, EdgeWindowRow
from controlplane.errors import ConflictError, ValidationProblem
from controlplane.ingest.aggregates import EdgeWindow, WindowAggregate
from controlplane.timestamps import utcnow

MAX_REPORTED_UNKNOWN = 20
# Rows per INSERT statement: bounded so a 50,000-row window does not build one giant statement.
INSERT_CHUNK = 5_000


@dataclass(slots=True)
class EdgeWindowResult:
    """What posting a window did: stored now, or found stored already with the same body (a retry)."""

    edge_window_id: int
    stored: bool
    duplicate: bool
    aggregates: int
    deployments: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "edge_window_id": self.edge_window_id,
            "stored": self.stored,
            "duplicate": self.duplicate,
            "aggregates": self.aggregates,
            "deployments": self.deployments,
        }


def aggregate_sums(agg: WindowAggregate) -> dict[str, Any]:
    """The vector sums of an aggregate, as stored in ``acceptance_aggregates.sums``."""
    return {
        "accepted_per_position": agg.accepted_per_position,
        "reached_per_position": agg.reached_per_position,
        "position_moments": agg.position_moments,
        "prompt_log_length": agg.prompt_log_length,
        "tokens_per_step": agg.tokens_per_step,
        "ms_per_token": agg.ms_per_token,
        "spread": agg.spread,
    }


def aggregate_from_row(row: Any, deployment: str = "") -> WindowAggregate:
    """A stored row (any object with the table's columns) back as a :class:`WindowAggregate`."""
    sums = row.sums or {}
    return WindowAggregate(
        deployment=deployment,
        arm=row.arm,
        drafter_version=row.drafter_version or None,
        category=row.category,
        requests=int(row.requests),
        drafted_tokens=int(row.drafted_tokens),
        accepted_tokens=int(row.accepted_tokens),
        verify_steps=int(row.verify_steps),
        generated_tokens=int(row.generated_tokens),
        prompt_tokens=int(row.prompt_tokens),
        speculated_requests=int(row.speculated_requests),
        accepted_per_position=[int(v) for v in sums.get("accepted_per_position", [])],
        reached_per_position=[int(v) for v in sums.get("reached_per_position", [])],
        position_moments=[float(v) for v in sums.get("position_moments", [])],
        prompt_log_length=[float(v) for v in sums.get("prompt_log_length", [0.0, 0.0, 0.0])],
        timed_requests=int(row.timed_requests),
        tokens_per_step=[float(v) for v in sums.get("tokens_per_step", [0.0, 0.0, 0.0])],
        ms_per_token=[float(v) for v in sums.get("ms_per_token", [0.0, 0.0, 0.0])],
        spread=[int(v) for v in sums.get("spread", [0] * 6)],
        latency=dict(getattr(row, "latency", None) or {}),
    )


def _resolve(session: Session, account_id: int, names: set[str]) -> dict[str, int]:
    ids: dict[str, int] = {}
    wanted = sorted(names)
    for start in range(0, len(wanted), 5_000):
        chunk = wanted[start : start + 5_000]
        for deployment_id, name in session.execute(
            select(Deployment.id, Deployment.name).where(
                Deployment.account_id == account_id,
                Deployment.deleted_at.is_(None),
                Deployment.name.in_(chunk),
            )
        ):
            ids[name] = int(deployment_id)
    unknown = sorted(names - set(ids))
    if unknown:
        raise ValidationProblem(
            f"{len(unknown)} deployment(s) of this window do not exist in the account; nothing was stored",
            details=[
                {"field": "aggregates.deployment", "message": f"no deployment named {name!r}"}
                for name in unknown[:MAX_REPORTED_UNKNOWN]
            ],
        )
    return ids


def store_edge_window(
    *, session: Session, account_id: int, window: EdgeWindow, from_serving_key: bool
) -> EdgeWindowResult:
    """Store one edge window in the caller's transaction (see the module docstring)."""
    ids = _resolve(session, account_id, {agg.deployment for agg in window.aggregates})
    digest = window.digest()
    dialect = session.get_bind().dialect.name
    dialect_insert = pg_insert if dialect == "postgresql" else sqlite_insert
    ledger = (
        dialect_insert(EdgeWindowRow)
        .values(
            account_id=account_id,
            edge_id=window.edge_id,
            window_start=window.window_start,
            window_s=window.window_s,
            digest=digest,
            aggregates=len(window.aggregates),
            received_at=utcnow(),
        )
        .on_conflict_do_nothing(index_elements=["account_id", "edge_id", "window_start"])
        .returning(EdgeWindowRow.id)
    )
    new_id = session.scalar(ledger)
    if new_id is None:
        stored = session.execute(
            select(EdgeWindowRow.id, EdgeWindowRow.digest, EdgeWindowRow.window_s).where(
                EdgeWindowRow.account_id == account_id,
                EdgeWindowRow.edge_id == window.edge_id,
                EdgeWindowRow.window_start == window.window_start,
            )
        ).one()
        if stored.digest != digest or stored.window_s != window.window_s:
            raise ConflictError(
                f"edge {window.edge_id!r} already sent the window starting "
                f"{window.window_start.isoformat()} with other content; nothing was stored"
            )
        return EdgeWindowResult(int(stored.id), False, True, len(window.aggregates), len(ids))
    rows = [
        {
            "deployment_id": ids[agg.deployment],
            "window_start": window.window_start,
            "edge_window_id": int(new_id),
            "arm": agg.arm,
            "drafter_version": agg.drafter_version or 0,
            "category": agg.category,
            "window_s": window.window_s,
            "requests": agg.requests,
            "speculated_requests": agg.speculated_requests,
            "timed_requests": agg.timed_requests,
            "drafted_tokens": agg.drafted_tokens,
            "accepted_tokens": agg.accepted_tokens,
            "verify_steps": agg.verify_steps,
            "generated_tokens": agg.generated_tokens,
            "prompt_tokens": agg.prompt_tokens,
            "sums": aggregate_sums(agg),
            "latency": agg.latency,
            "from_serving_key": from_serving_key,
        }
        for agg in window.aggregates
    ]
    for start in range(0, len(rows), INSERT_CHUNK):
        session.execute(insert(AcceptanceAggregateRow), rows[start : start + INSERT_CHUNK])
    return EdgeWindowResult(int(new_id), True, False, len(rows), len(ids))
