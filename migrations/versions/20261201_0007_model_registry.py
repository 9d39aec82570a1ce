"""a registry of the models deployments may name; drafter artifacts record their manifest

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 22:30:00

Deployments name registered models only. A platform model (account_id NULL) is visible to every
account; an account's own models only to it. Drafter versions gain the sha256 of their artifact's
MANIFEST.json, checked before every load; versions written before this revision keep NULL and are
verified against the manifest inside their folder alone.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "registered_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("account_id", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("hf_id", sa.String(length=300), nullable=True),
        sa.Column("hf_revision", sa.String(length=100), nullable=True),
        sa.Column("location", sa.String(length=1000), nullable=False),
        sa.Column("family", sa.String(length=32), nullable=False),
        sa.Column("architecture", sa.String(length=100), nullable=True),
        sa.Column("parameter_count", sa.BigInteger(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("vocab_size", sa.Integer(), nullable=False),
        sa.Column("embedding_rows", sa.Integer(), nullable=False),
        sa.Column("tokenizer_size", sa.Integer(), nullable=False),
        sa.Column("tokenizer_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("files", sa.JSON(), nullable=False),
        sa.Column("manifest_sha256", sa.String(length=64), nullable=False),
        sa.Column("total_bytes", sa.BigInteger(), nullable=False),
        sa.Column("drafter_for", sa.JSON(), nullable=False),
        sa.Column("default_drafter_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["account_id"],
            ["accounts.id"],
            name=op.f("fk_registered_models_account_id_accounts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["default_drafter_id"],
            ["registered_models.id"],
            name=op.f("fk_registered_models_default_drafter_id_registered_models"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_registered_models")),
    )
    op.create_index(
        op.f("ix_registered_models_account_id"), "registered_models", ["account_id"], unique=False
    )
    op.create_index(
        "uq_registered_models_account_name",
        "registered_models",
        ["account_id", "name"],
        unique=True,
        postgresql_where=sa.text("account_id IS NOT NULL"),
        sqlite_where=sa.text("account_id IS NOT NULL"),
    )
    op.create_index(
        "uq_registered_models_platform_name",
        "registered_models",
        ["name"],
        unique=True,
        postgresql_where=sa.text("account_id IS NULL"),
        sqlite_where=sa.text("account_id IS NULL"),
    )
    with op.batch_alter_table("drafter_versions") as batch:
        batch.add_column(sa.Column("manifest_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("drafter_versions") as batch:
        batch.drop_column("manifest_sha256")
    op.drop_index("uq_registered_models_platform_name", table_name="registered_models")
    op.drop_index("uq_registered_models_account_name", table_name="registered_models")
    op.drop_index(op.f("ix_registered_models_account_id"), table_name="registered_models")
    op.drop_table("registered_models")
