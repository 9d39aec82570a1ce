"""the serving fleet: backend pools, scrape targets, promotion actuators and their deliveries

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 01:00:00

A deployment's fleet is declared as backends (per pool: incumbent, candidate, baseline) that the
router sends each arm to; scrape targets are backends' /metrics the control plane pulls; the
actuator (reference | webhook | command) is how promotions reach the fleet, and every event it
was handed is kept with its attempts. Existing deployments keep today's behaviour (reference).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN, never a batch copy: on SQLite a batch rebuild drops the old deployments
    # table, and its ON DELETE CASCADE children (every acceptance record) would go with it.
    op.add_column(
        "deployments", sa.Column("actuator", sa.String(length=20), server_default="reference", nullable=False)
    )
    op.add_column("deployments", sa.Column("actuator_config", sa.JSON(), server_default="{}", nullable=False))

    op.create_table(
        "serving_backends",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("pool", sa.String(length=20), nullable=False),
        sa.Column("url", sa.String(length=500), nullable=False),
        sa.Column("drafter_version", sa.Integer(), nullable=True),
        sa.Column("readiness_url", sa.String(length=500), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_serving_backends_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_serving_backends")),
        sa.UniqueConstraint("deployment_id", "name", name="uq_serving_backends_deployment_name"),
    )
    op.create_index(
        op.f("ix_serving_backends_deployment_id"), "serving_backends", ["deployment_id"], unique=False
    )

    op.create_table(
        "scrape_targets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("urls", sa.JSON(), nullable=False),
        sa.Column("arm", sa.String(length=40), nullable=False),
        sa.Column("drafter_version", sa.Integer(), nullable=True),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("snapshot", sa.JSON(), nullable=True),
        sa.Column("scrapes", sa.Integer(), nullable=False),
        sa.Column("records_stored", sa.BigInteger(), nullable=False),
        sa.Column("last_scraped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_scrape_targets_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scrape_targets")),
        sa.UniqueConstraint("deployment_id", "name", name="uq_scrape_targets_deployment_name"),
    )
    op.create_index(
        op.f("ix_scrape_targets_deployment_id"), "scrape_targets", ["deployment_id"], unique=False
    )

    op.create_table(
        "actuator_deliveries",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("canary_id", sa.Integer(), nullable=True),
        sa.Column("event", sa.String(length=40), nullable=False),
        sa.Column("actuator", sa.String(length=20), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_actuator_deliveries_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["canary_id"],
            ["canaries.id"],
            name=op.f("fk_actuator_deliveries_canary_id_canaries"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_actuator_deliveries")),
    )
    op.create_index(
        "ix_actuator_deliveries_deployment_time",
        "actuator_deliveries",
        ["deployment_id", "created_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_actuator_deliveries_deployment_time", table_name="actuator_deliveries")
    op.drop_table("actuator_deliveries")
    op.drop_index(op.f("ix_scrape_targets_deployment_id"), table_name="scrape_targets")
    op.drop_table("scrape_targets")
    op.drop_index(op.f("ix_serving_backends_deployment_id"), table_name="serving_backends")
    op.drop_table("serving_backends")
    op.drop_column("deployments", "actuator_config")
    op.drop_column("deployments", "actuator")
