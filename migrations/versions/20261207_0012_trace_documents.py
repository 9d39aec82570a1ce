"""trace documents: the source document a traced prompt was cut from

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 14:00:00

A trace may name the document its prompt came from (the client's own label, up to 200
characters), so that the held-out split keeps every prompt of one document on one side and the
canary never replays a prompt whose document was trained on. Existing traces name none (NULL):
they are split by their normalised prompt alone.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("traces", sa.Column("document", sa.String(length=200), nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+), as the other revisions drop theirs.
    op.drop_column("traces", "document")
