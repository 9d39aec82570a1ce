"""realign automation: a drafter version's target model, a job's last enqueue time

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 03:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD/DROP COLUMN on both dialects (SQLite >= 3.35 drops an unindexed column in place),
    # so no table is recreated and the partial unique indexes stay exactly as 0001 made them.
    op.add_column("drafter_versions", sa.Column("target_model", sa.String(length=500), nullable=True))
    op.add_column("jobs", sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=True))
    # Until now a deployment's target could not change, so every existing version was trained
    # against its deployment's current target; and every existing job was sent when created.
    op.execute(
        "UPDATE drafter_versions SET target_model = "
        "(SELECT d.target_model FROM deployments d WHERE d.id = drafter_versions.deployment_id)"
    )
    op.execute("UPDATE jobs SET enqueued_at = created_at")


def downgrade() -> None:
    op.drop_column("jobs", "enqueued_at")
    op.drop_column("drafter_versions", "target_model")
