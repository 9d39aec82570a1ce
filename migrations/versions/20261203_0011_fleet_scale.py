"""fleet scale: edge aggregates, their idempotency ledger, retention and raw-record sampling

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 08:00:00

Edges send one window of per-deployment sums instead of one row per request: ``edge_windows``
stores each (account, edge, window) once, ``acceptance_aggregates`` its rows (keyed by deployment
first, so the table can be distributed by deployment later). The drift monitor keeps a watermark
over edge windows next to the one over records; each window is marked once its sums are in the
rollups (``rolled_up_at``, indexed while unset). Accounts choose how long raw records and
aggregates are kept; deployments choose the share of requests also sent as raw records. On
PostgreSQL ``acceptance_aggregates`` is partitioned by day of ``window_start``, so that retention
drops whole days (see controlplane.ingest.partitions); on SQLite it is a plain table.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from controlplane.ingest.partitions import ensure_partitions
from controlplane.timestamps import utcnow

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "edge_windows",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("edge_id", sa.String(200), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("window_s", sa.Integer, nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("aggregates", sa.Integer, nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("rolled_up_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("account_id", "edge_id", "window_start", name="uq_edge_windows_key"),
    )
    op.create_index("ix_edge_windows_received", "edge_windows", ["received_at"])
    op.create_index(
        "ix_edge_windows_rollup_pending",
        "edge_windows",
        ["id"],
        postgresql_where=sa.text("rolled_up_at IS NULL"),
        sqlite_where=sa.text("rolled_up_at IS NULL"),
    )
    postgresql = op.get_bind().dialect.name == "postgresql"
    op.create_table(
        "acceptance_aggregates",
        sa.Column(
            "deployment_id", sa.Integer, sa.ForeignKey("deployments.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("edge_window_id", sa.BigInteger, nullable=False),
        sa.Column("arm", sa.String(40), nullable=False),
        sa.Column("drafter_version", sa.Integer, nullable=False),
        sa.Column("category", sa.String(100), nullable=False),
        sa.Column("window_s", sa.Integer, nullable=False),
        *(
            sa.Column(name, sa.BigInteger, nullable=False)
            for name in (
                "requests",
                "speculated_requests",
                "timed_requests",
                "drafted_tokens",
                "accepted_tokens",
                "verify_steps",
                "generated_tokens",
                "prompt_tokens",
            )
        ),
        sa.Column("sums", sa.JSON, nullable=False),
        sa.Column("latency", sa.JSON, nullable=False),
        sa.Column("from_serving_key", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.PrimaryKeyConstraint(
            "deployment_id", "window_start", "edge_window_id", "arm", "drafter_version", "category"
        ),
        # One partition per UTC day (controlplane.ingest.partitions): retention drops whole days
        # instead of deleting rows. The partition key is in the primary key, as PostgreSQL requires.
        postgresql_partition_by="RANGE (window_start)" if postgresql else None,
    )
    # On the partitioned table this index is created on every partition, present and future.
    op.create_index("ix_acceptance_aggregates_edge_window", "acceptance_aggregates", ["edge_window_id"])
    if postgresql:
        # Windows may arrive up to seven days late, and the maintenance task may not have run yet:
        # a DEFAULT partition takes any row whose day has no partition, so an insert never fails.
        # The task creates each day's partition ahead and moves such rows in, so it stays empty.
        ensure_partitions(bind=op.get_bind(), now=utcnow())
    with op.batch_alter_table("drift_monitor_states") as batch:
        batch.add_column(
            sa.Column("watermark_edge_window_id", sa.BigInteger, nullable=False, server_default="0")
        )
    with op.batch_alter_table("accounts") as batch:
        batch.add_column(
            sa.Column("acceptance_retention_days", sa.Integer, nullable=False, server_default="14")
        )
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("raw_record_sample_rate", sa.Float, nullable=False, server_default="1.0"))
    with op.batch_alter_table("acceptance_records") as batch:
        batch.add_column(
            sa.Column("counted_in_aggregate", sa.Boolean, nullable=False, server_default=sa.text("false"))
        )


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+): a batch rebuild of these parents would drop their
    # ON DELETE CASCADE children (on SQLite, every deployment and record with the accounts).
    op.drop_column("acceptance_records", "counted_in_aggregate")
    op.drop_column("deployments", "raw_record_sample_rate")
    op.drop_column("accounts", "acceptance_retention_days")
    op.drop_column("drift_monitor_states", "watermark_edge_window_id")
    op.drop_index("ix_acceptance_aggregates_edge_window", table_name="acceptance_aggregates")
    # On PostgreSQL this drops every partition with the table.
    op.drop_table("acceptance_aggregates")
    op.drop_index("ix_edge_windows_rollup_pending", table_name="edge_windows")
    op.drop_index("ix_edge_windows_received", table_name="edge_windows")
    op.drop_table("edge_windows")
