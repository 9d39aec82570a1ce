"""drift monitor state

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 01:01:08
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "drift_monitor_states",
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("detector_state", sa.JSON(), nullable=True),
        sa.Column("watermark_record_id", sa.BigInteger(), nullable=False),
        sa.Column("pending_horizon_record_id", sa.BigInteger(), nullable=False),
        sa.Column("active_drafter_version", sa.Integer(), nullable=True),
        sa.Column("policy", sa.JSON(), nullable=False),
        sa.Column("records_examined", sa.BigInteger(), nullable=False),
        sa.Column("last_alarm_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_drift_monitor_states_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment_id", name=op.f("pk_drift_monitor_states")),
    )


def downgrade() -> None:
    op.drop_table("drift_monitor_states")
