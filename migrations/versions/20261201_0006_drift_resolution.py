"""drift events record how they ended

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 21:30:00

Every drift event ends in a named resolution (promoted, candidate rejected, canary inconclusive,
realignment failed, not enough data, guardrail action, dismissed). Dismissed events get theirs
here; events resolved before this revision keep none, since what ended them was not recorded.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RESOLUTIONS = (
    "promoted",
    "candidate_rejected",
    "canary_inconclusive",
    "realignment_failed",
    "not_enough_data",
    "guardrail_action",
    "dismissed",
)


def upgrade() -> None:
    # Batch mode: SQLite adds a column with a CHECK constraint only by rebuilding the table.
    with op.batch_alter_table("drift_events") as batch:
        batch.add_column(
            sa.Column(
                "resolution",
                sa.Enum(
                    *RESOLUTIONS,
                    name="drift_resolution",
                    native_enum=False,
                    create_constraint=True,
                    length=32,
                ),
                nullable=True,
            )
        )
    op.execute("UPDATE drift_events SET resolution = 'dismissed' WHERE state = 'dismissed'")


def downgrade() -> None:
    with op.batch_alter_table("drift_events") as batch:
        batch.drop_constraint(op.f("ck_drift_events_drift_resolution"), type_="check")
        batch.drop_column("resolution")
