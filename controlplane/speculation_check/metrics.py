"""Prometheus families of the speculation check, computed from the database on every scrape (as
every family in ``controlplane.observability.metrics``): whether speculation pays per deployment,
and the actions taken (from the audit log, so every API process counts the same)."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.db.models import AuditEntry, SpeculationCheck
from controlplane.deployments.lookup import resource_name
from controlplane.speculation_check.sequential import NOT_PAYING, PAYS
from controlplane.speculation_check.service import ACTIONS, AUDIT_PREFIX

PAYS_VALUE: dict[str, float] = {PAYS: 1.0, NOT_PAYING: -1.0}  # anything else (unknown, never checked): 0


def speculation_families(
    *, session: Session, account_id: int, account: str, names: dict[int, str]
) -> list[Metric]:
    """``specctl_speculation_pays`` and ``specctl_speculation_check_actions_total`` for the
    account's live deployments (``names``: id -> name)."""
    pays = GaugeMetricFamily(
        "specctl_speculation_pays",
        "Does speculation pay against the standing no-speculation arm: 1 pays, 0 unknown, -1 not paying.",
        labels=["account", "deployment"],
    )
    actions = CounterMetricFamily(
        "specctl_speculation_check_actions",
        "Actions the speculation check took when speculation did not pay, by kind (from the audit log).",
        labels=["account", "deployment", "kind"],
    )
    verdicts: dict[int, str] = {
        int(deployment_id): str(verdict)
        for deployment_id, verdict in session.execute(
            select(SpeculationCheck.deployment_id, SpeculationCheck.verdict).where(
                SpeculationCheck.deployment_id.in_(list(names))
            )
        )
    }
    resources = {resource_name(account, name): name for name in names.values()}
    counts: dict[tuple[str, str], int] = defaultdict(int)
    rows = session.execute(
        select(AuditEntry.resource, AuditEntry.action, func.count())
        .where(AuditEntry.account_id == account_id, AuditEntry.action.like(f"{AUDIT_PREFIX}%"))
        .group_by(AuditEntry.resource, AuditEntry.action)
    )
    for resource, action, count in rows:
        name = resources.get(resource)
        if name is not None:
            counts[(name, action.removeprefix(AUDIT_PREFIX))] += int(count)
    for deployment_id, name in names.items():
        pays.add_metric([account, name], PAYS_VALUE.get(verdicts.get(deployment_id, ""), 0.0))
        for kind in ACTIONS:
            actions.add_metric([account, name, kind], float(counts.get((name, kind), 0)))
    return [pays, actions]
