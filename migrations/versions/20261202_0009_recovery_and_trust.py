"""recovery and trust: job leases, resolution reasons, shadow re-sends, judge watermarks, the
serving role, quarantined rollup records

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 04:00:00

Running jobs hold a lease renewed by a heartbeat and wait out a backoff between attempts; drift
events say why they ended; canaries remember when their shadow replay was sent (to re-send a lost
one) and how far their judge has read; acceptance records remember whether the fleet's own
serving key wrote them (only those steer a canary); a record the rollup fold cannot add is set
aside with its reason. Existing rows keep today's meaning: records from before are not from a
serving key, and a live canary's judge starts reading from the beginning.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROLES_BEFORE = ("admin", "ingest", "viewer")
ROLES_AFTER = (*ROLES_BEFORE, "serving")


def _role_enum(roles: tuple[str, ...]) -> sa.Enum:
    return sa.Enum(*roles, name="role", native_enum=False, create_constraint=True, length=32)


def upgrade() -> None:
    # api_keys has no children, so SQLite's batch rebuild (the only way to change its CHECK) is safe.
    with op.batch_alter_table("api_keys") as batch:
        batch.alter_column(
            "role",
            existing_type=_role_enum(ROLES_BEFORE),
            type_=_role_enum(ROLES_AFTER),
            existing_nullable=False,
        )

    # Plain ADD COLUMN everywhere else: on SQLite a batch rebuild of a parent table would drop its
    # ON DELETE CASCADE children with it.
    op.add_column(
        "acceptance_records",
        sa.Column("from_serving_key", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.add_column("drift_events", sa.Column("resolution_reason", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("canaries", sa.Column("shadow_sent_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "canaries", sa.Column("shadow_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column(
        "canaries",
        sa.Column("judge_watermark_record_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column("canaries", sa.Column("judge_state", sa.JSON(), server_default="{}", nullable=False))

    op.create_table(
        "quarantined_rollup_records",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("record_id", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_quarantined_rollup_records_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quarantined_rollup_records")),
    )
    op.create_index(
        op.f("ix_quarantined_rollup_records_deployment_id"),
        "quarantined_rollup_records",
        ["deployment_id"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_quarantined_rollup_records_deployment_id"), table_name="quarantined_rollup_records"
    )
    op.drop_table("quarantined_rollup_records")
    for column in ("judge_state", "judge_watermark_record_id", "shadow_attempts", "shadow_sent_at"):
        with op.batch_alter_table("canaries") as batch:
            batch.drop_column(column)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("next_attempt_at")
        batch.drop_column("lease_expires_at")
        batch.drop_column("heartbeat_at")
    with op.batch_alter_table("drift_events") as batch:
        batch.drop_column("resolution_reason")
    with op.batch_alter_table("acceptance_records") as batch:
        batch.drop_column("from_serving_key")
    op.execute("DELETE FROM api_keys WHERE role = 'serving'")
    with op.batch_alter_table("api_keys") as batch:
        batch.alter_column(
            "role",
            existing_type=_role_enum(ROLES_AFTER),
            type_=_role_enum(ROLES_BEFORE),
            existing_nullable=False,
        )
