"""six-hour rollup tier: backfill 6 h rows from the hourly rows already stored

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 10:00:00

From this revision ingestion also writes a 6-hour tier (controlplane.ingest.rollups). The stats
planner reads a 6-hour row wherever one fits inside a range, so rows must exist for every past
6-hour bucket: each is built here as the exact sum of its six hourly rows (hourly rows are the
exact sums of their minutes, written in the same transactions). The merge uses the project's
own histogram functions, the same ones ingestion uses, so the backfilled rows equal what
ingestion would have written. No schema change: resolution_s is a plain column.
"""

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

from controlplane.ingest.rollups import hist_merge, merge_positions, row_percentiles

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

HOUR = 3600
SIX_HOURS = 6 * 3600
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
KEY = ("deployment_id", "arm", "drafter_version")
INSERT_CHUNK = 1000

rollups = sa.table(
    "acceptance_rollups",
    sa.column("id", sa.BigInteger),
    sa.column("deployment_id", sa.Integer),
    sa.column("resolution_s", sa.Integer),
    sa.column("bucket_start", sa.DateTime(timezone=True)),
    sa.column("arm", sa.String),
    sa.column("drafter_version", sa.Integer),
    *(sa.column(name, sa.Float if name == "total_ms_sum" else sa.BigInteger) for name in SUMS),
    sa.column("accepted_per_position", sa.JSON),
    *(sa.column(name, sa.JSON) for name in HISTOGRAMS),
    *(sa.column(name, sa.Float) for name in PERCENTILES),
)


def _six_hour_start(value: datetime) -> datetime:
    aware = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    seconds = int(aware.timestamp())
    return datetime.fromtimestamp(seconds - seconds % SIX_HOURS, tz=UTC)


def _groups(connection: sa.Connection, deployment_id: int) -> Iterator[list[Any]]:
    """One deployment's hourly rows, in key and time order, grouped by their 6-hour bucket."""
    query = (
        sa.select(rollups)
        .where(rollups.c.resolution_s == HOUR, rollups.c.deployment_id == deployment_id)
        .order_by(*(rollups.c[name] for name in KEY), rollups.c.bucket_start)
    )
    group: list[Any] = []
    group_key: tuple[Any, ...] | None = None
    for row in connection.execute(query).all():
        key = (*(row._mapping[name] for name in KEY), _six_hour_start(row.bucket_start))
        if key != group_key and group:
            yield group
            group = []
        group_key = key
        group.append(row)
    if group:
        yield group


def _summed(group: list[Any]) -> dict[str, Any]:
    first = group[0]._mapping
    positions: list[int] = []
    for row in group:
        merge_positions(positions, row.accepted_per_position or [])
    hists = [hist_merge(row._mapping[name] or [] for row in group) for name in HISTOGRAMS]
    return {
        **{name: first[name] for name in KEY},
        "resolution_s": SIX_HOURS,
        "bucket_start": _six_hour_start(first["bucket_start"]),
        **{name: sum(row._mapping[name] for row in group) for name in SUMS},
        "accepted_per_position": positions,
        **dict(zip(HISTOGRAMS, hists, strict=True)),
        **dict(zip(PERCENTILES, row_percentiles(hists), strict=True)),
    }


def upgrade() -> None:
    connection = op.get_bind()
    # Rerunnable: rows of the tier written by a half-finished earlier attempt are rebuilt.
    connection.execute(sa.delete(rollups).where(rollups.c.resolution_s == SIX_HOURS))
    deployments = connection.scalars(
        sa.select(rollups.c.deployment_id).where(rollups.c.resolution_s == HOUR).distinct()
    ).all()
    # One deployment at a time: its hourly rows (a year is 8,760 per arm and version) are read
    # whole before its 6-hour rows are written, which keeps memory bounded and works on SQLite.
    for deployment_id in deployments:
        built = [_summed(group) for group in _groups(connection, deployment_id)]
        for start in range(0, len(built), INSERT_CHUNK):
            connection.execute(sa.insert(rollups), built[start : start + INSERT_CHUNK])


def downgrade() -> None:
    op.get_bind().execute(sa.delete(rollups).where(rollups.c.resolution_s == SIX_HOURS))
