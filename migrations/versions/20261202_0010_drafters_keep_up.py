"""drafters that keep up: rollups per category, tuned draft stopping, standing checks that
speculation pays, what started a job, and each deployment's adaptation policy

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 08:00:00

Rollups gain the request's category in their key, so hit rate and speed-up per category are read
without scanning raw records (existing rows become the empty category: "not given"). Acceptance
records may carry what drafting would have done at each candidate confidence threshold (the
threshold tuner's input). A deployment remembers the draft-stop threshold it serves with (NULL:
off) and its adaptation policy (standing no-speculation share, continuous realignment, the first
drafter of a deployment that has none). A job says what started it. Each deployment has one
standing check of whether speculation pays against its no-speculation share.
"""

from collections.abc import Sequence
from itertools import groupby
from typing import Any

import sqlalchemy as sa
from alembic import op

from controlplane.ingest.rollups import hist_merge, merge_positions, row_percentiles

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROLLUP_KEY_BEFORE = ["deployment_id", "resolution_s", "bucket_start", "arm", "drafter_version"]
SUMS = (
    "requests",
    "drafted_tokens",
    "accepted_tokens",
    "verify_steps",
    "generated_tokens",
    "prompt_tokens",
    "total_ms_sum",
    "timed_requests",
)
HISTOGRAMS = ("inter_token_hist", "total_ms_hist", "ttft_hist")
PERCENTILES = (
    "inter_token_ms_p50",
    "inter_token_ms_p95",
    "total_ms_p50",
    "total_ms_p95",
    "ttft_ms_p50",
    "ttft_ms_p95",
)
rollups = sa.table(
    "acceptance_rollups",
    sa.column("id", sa.BigInteger),
    *(
        sa.column(name, sa.DateTime(timezone=True) if name == "bucket_start" else sa.Integer)
        for name in ROLLUP_KEY_BEFORE
        if name != "arm"
    ),
    sa.column("arm", sa.String),
    sa.column("category", sa.String),
    *(sa.column(name, sa.Float if name == "total_ms_sum" else sa.BigInteger) for name in SUMS),
    sa.column("accepted_per_position", sa.JSON),
    *(sa.column(name, sa.JSON) for name in HISTOGRAMS),
    *(sa.column(name, sa.Float) for name in PERCENTILES),
)


def upgrade() -> None:
    # acceptance_rollups has no children, so SQLite's batch rebuild (the only way to change a
    # unique constraint there) is safe.
    with op.batch_alter_table("acceptance_rollups") as batch:
        batch.add_column(sa.Column("category", sa.String(length=100), server_default="", nullable=False))
        batch.drop_constraint("uq_acceptance_rollups_key", type_="unique")
        batch.create_unique_constraint("uq_acceptance_rollups_key", [*ROLLUP_KEY_BEFORE, "category"])

    # Plain ADD COLUMN on parents: a batch rebuild would drop their ON DELETE CASCADE children.
    op.add_column("acceptance_records", sa.Column("draft_stop_counts", sa.JSON(), nullable=True))
    op.add_column("deployments", sa.Column("draft_confidence_threshold", sa.Float(), nullable=True))
    op.add_column(
        "deployments", sa.Column("adaptation_policy", sa.JSON(), server_default="{}", nullable=False)
    )
    op.add_column("jobs", sa.Column("trigger", sa.String(length=40), nullable=True))

    op.create_table(
        "speculation_checks",
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("watermark_record_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("records_examined", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("state", sa.JSON(), server_default="{}", nullable=False),
        sa.Column("verdict", sa.String(length=20), server_default="unknown", nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("action", sa.String(length=40), nullable=True),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("acted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_speculation_checks_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment_id", name=op.f("pk_speculation_checks")),
    )


def downgrade() -> None:
    op.drop_table("speculation_checks")
    # Plain DROP COLUMN (SQLite 3.35+): a batch rebuild of these parents would drop their
    # ON DELETE CASCADE children.
    op.drop_column("jobs", "trigger")
    op.drop_column("deployments", "adaptation_policy")
    op.drop_column("deployments", "draft_confidence_threshold")
    op.drop_column("acceptance_records", "draft_stop_counts")
    # Pending records fold now, while their category still has a column: the fold a downgrade
    # past the pending table runs later would otherwise meet rollups without it.
    from sqlalchemy.orm import Session

    from controlplane.ingest.service import fold_pending_rollups

    session = Session(bind=op.get_bind())
    fold_pending_rollups(session=session)
    session.flush()
    _merge_categories(op.get_bind())
    with op.batch_alter_table("acceptance_rollups") as batch:
        batch.drop_constraint("uq_acceptance_rollups_key", type_="unique")
        batch.create_unique_constraint("uq_acceptance_rollups_key", ROLLUP_KEY_BEFORE)
        batch.drop_column("category")


def _merge_categories(connection: sa.Connection) -> None:
    """Sum the rows that differ only by category into one, so the old key holds and every record
    is still counted once (histograms and positions merged as ingestion merges them)."""
    key = [rollups.c[name] for name in ROLLUP_KEY_BEFORE]
    split = sa.select(*key).group_by(*key).having(sa.func.count() > 1).subquery()
    rows = connection.execute(
        sa.select(rollups)
        .join(split, sa.and_(*(rollups.c[n] == split.c[n] for n in ROLLUP_KEY_BEFORE)))
        .order_by(*key)
    ).all()
    for _, group_rows in groupby(rows, key=lambda row: tuple(row._mapping[n] for n in ROLLUP_KEY_BEFORE)):
        group = list(group_rows)
        positions: list[int] = []
        for row in group:
            merge_positions(positions, row.accepted_per_position or [])
        hists = [hist_merge(row._mapping[name] or [] for row in group) for name in HISTOGRAMS]
        merged: dict[str, Any] = {
            **{name: sum(row._mapping[name] or 0 for row in group) for name in SUMS},
            "accepted_per_position": positions,
            "category": "",
            **dict(zip(HISTOGRAMS, hists, strict=True)),
            **dict(zip(PERCENTILES, row_percentiles(hists), strict=True)),
        }
        keep, rest = group[0].id, [row.id for row in group[1:]]
        connection.execute(sa.delete(rollups).where(rollups.c.id.in_(rest)))
        connection.execute(sa.update(rollups).where(rollups.c.id == keep).values(**merged))
