"""pending rollup sums: records whose rollup update a later fold adds

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 21:20:00

Small ingest flushes on PostgreSQL store each record with a row here and leave the rollup
update to a fold that sums many records at once (controlplane.ingest.service). Downgrading
folds whatever is still pending first, so the rollups of a downgraded database count every
stored record.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "acceptance_rollup_pending",
        sa.Column("record_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_acceptance_rollup_pending_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["record_id"],
            ["acceptance_records.id"],
            name=op.f("fk_acceptance_rollup_pending_record_id_acceptance_records"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("record_id", name=op.f("pk_acceptance_rollup_pending")),
    )


def downgrade() -> None:
    from sqlalchemy.orm import Session

    from controlplane.ingest.service import fold_pending_rollups

    session = Session(bind=op.get_bind())
    fold_pending_rollups(session=session)
    session.flush()
    op.drop_table("acceptance_rollup_pending")
