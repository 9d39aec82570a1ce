"""SQLAlchemy 2.0 typed models for the whole data model (see docs/architecture.md).

Invariants live in the database, not only in Python: request ids are unique per deployment,
at most one drafter version per deployment is active, at most one realignment job per
deployment is queued or running, and every reference is a foreign key.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    case,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from controlplane.timestamps import utcnow

# Stable constraint names keep Alembic revisions reproducible across dialects.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments INTEGER PRIMARY KEY, so big ids fall back to Integer there.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Role(enum.StrEnum):
    admin = "admin"
    ingest = "ingest"
    viewer = "viewer"
    # The serving fleet (router, engines): its records are the only ones the canary judges, and
    # it alone (with admin) reads what to serve.
    serving = "serving"


class SpeculationMode(enum.StrEnum):
    default = "default"  # inherit the platform's default drafter
    draft_model = "draft_model"
    ngram = "ngram"
    disabled = "disabled"


class DrafterState(enum.StrEnum):
    candidate = "candidate"
    canary = "canary"
    active = "active"
    retired = "retired"
    rejected = "rejected"


class JobKind(enum.StrEnum):
    realign = "realign"
    canary = "canary"


class JobState(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


class DriftState(enum.StrEnum):
    open = "open"
    realigning = "realigning"
    resolved = "resolved"
    dismissed = "dismissed"


class DriftResolution(enum.StrEnum):
    """How a drift event ended (see controlplane.drift.states)."""

    promoted = "promoted"
    candidate_rejected = "candidate_rejected"
    canary_inconclusive = "canary_inconclusive"
    realignment_failed = "realignment_failed"
    not_enough_data = "not_enough_data"
    guardrail_action = "guardrail_action"
    dismissed = "dismissed"


class CanaryPhase(enum.StrEnum):
    """Where a canary stands (stored as a string; see controlplane.canary.phases)."""

    shadow = "shadow"
    live = "live"
    decided = "decided"
    watching = "watching"
    closed = "closed"
    rolled_back = "rolled_back"


class CanaryDecision(enum.StrEnum):
    promote = "promote"
    reject = "reject"
    inconclusive = "inconclusive"


class TraceSource(enum.StrEnum):
    sampled = "sampled"
    dataset = "dataset"


def _enum(cls: type[enum.StrEnum], name: str) -> Enum:
    # Non-native enums are VARCHAR + CHECK on both PostgreSQL and SQLite: adding a value later
    # is a plain constraint change instead of an ALTER TYPE.
    return Enum(cls, name=name, native_enum=False, create_constraint=True, length=32)


class Account(Base):
    __tablename__ = "accounts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # How long this account's raw acceptance records and edge aggregates are kept (rollups stay).
    acceptance_retention_days: Mapped[int] = mapped_column(Integer, default=14, server_default="14")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    # The public prefix finds the row; only an HMAC of the full key is stored.
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    role: Mapped[Role] = mapped_column(_enum(Role, "role"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Deployment(Base):
    __tablename__ = "deployments"
    __table_args__ = (
        # Names are reusable once a deployment is deleted (soft delete keeps its history).
        Index(
            "uq_deployments_account_name_live",
            "account_id",
            "name",
            unique=True,
            postgresql_where=text("deleted_at IS NULL"),
            sqlite_where=text("deleted_at IS NULL"),
        ),
        CheckConstraint("draft_token_count IS NULL OR draft_token_count BETWEEN 1 AND 16", name="k_range"),
        CheckConstraint(
            "ngram_speculation_length IS NULL OR ngram_speculation_length BETWEEN 1 AND 16",
            name="ngram_range",
        ),
        CheckConstraint(
            "NOT (draft_model IS NOT NULL AND ngram_speculation_length IS NOT NULL)", name="exclusive"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    display_name: Mapped[str | None] = mapped_column(String(200))
    target_model: Mapped[str] = mapped_column(String(500))
    speculation_mode: Mapped[SpeculationMode] = mapped_column(_enum(SpeculationMode, "speculation_mode"))
    draft_model: Mapped[str | None] = mapped_column(String(500))
    draft_token_count: Mapped[int | None] = mapped_column(SmallInteger)
    ngram_speculation_length: Mapped[int | None] = mapped_column(SmallInteger)
    auto_realign: Mapped[bool] = mapped_column(Boolean, default=True)
    # Drafting stops at the first token the drafter gives less than this probability (NULL: off).
    draft_confidence_threshold: Mapped[float | None] = mapped_column(Float)
    # Standing no-speculation share, continuous realignment, a first drafter for a deployment
    # without one (controlplane.adaptation_policy).
    adaptation_policy: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict, server_default="{}")
    drift_policy: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    canary_policy: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    trace_sample_rate: Mapped[float] = mapped_column(Float, default=0.1)
    trace_retention_days: Mapped[int] = mapped_column(Integer, default=30)
    # Share of served requests the edge also sends as raw per-request records (its aggregates
    # always count every request); 1.0 sends them all.
    raw_record_sample_rate: Mapped[float] = mapped_column(Float, default=1.0, server_default="1.0")
    # How a promotion, a rollback or a canary's start reaches the serving fleet: `reference`
    # (the servers follow serving-config), `webhook` or `command` (controlplane.fleet.actuators).
    actuator: Mapped[str] = mapped_column(String(20), default="reference", server_default="reference")
    actuator_config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    row_version: Mapped[int] = mapped_column(Integer, default=1)

    __mapper_args__ = {"version_id_col": row_version}


class RegisteredModel(Base):
    """A model folder deployments may name: a target, a drafter (it lists the targets it may
    serve), or both. ``account_id`` NULL is a platform model every account can use."""

    __tablename__ = "registered_models"
    __table_args__ = (
        Index(
            "uq_registered_models_account_name",
            "account_id",
            "name",
            unique=True,
            postgresql_where=text("account_id IS NOT NULL"),
            sqlite_where=text("account_id IS NOT NULL"),
        ),
        Index(
            "uq_registered_models_platform_name",
            "name",
            unique=True,
            postgresql_where=text("account_id IS NULL"),
            sqlite_where=text("account_id IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    account_id: Mapped[int | None] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    # Where it came from: a folder under a model root, or a Hugging Face id at a revision.
    source: Mapped[str] = mapped_column(String(16))
    hf_id: Mapped[str | None] = mapped_column(String(300))
    hf_revision: Mapped[str | None] = mapped_column(String(100))
    # The resolved local folder (inside a model root or the Hugging Face cache).
    location: Mapped[str] = mapped_column(String(1000))
    family: Mapped[str] = mapped_column(String(32))
    architecture: Mapped[str | None] = mapped_column(String(100))
    parameter_count: Mapped[int] = mapped_column(BigInteger)
    dtype: Mapped[str] = mapped_column(String(16))
    vocab_size: Mapped[int] = mapped_column(Integer)
    embedding_rows: Mapped[int] = mapped_column(Integer)
    tokenizer_size: Mapped[int] = mapped_column(Integer)
    tokenizer_fingerprint: Mapped[str] = mapped_column(String(64))
    # sha256 of every file loading reads, verified before each load; the digest names the set.
    files: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    manifest_sha256: Mapped[str] = mapped_column(String(64))
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    # Names of the targets this model may draft for (empty: a target only).
    drafter_for: Mapped[list[Any]] = mapped_column(JSON, default=list)
    # The drafter a deployment of this target gets when it sets no speculation flags.
    default_drafter_id: Mapped[int | None] = mapped_column(
        ForeignKey("registered_models.id", ondelete="SET NULL")
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DrafterVersion(Base):
    __tablename__ = "drafter_versions"
    __table_args__ = (
        UniqueConstraint("deployment_id", "version", name="uq_drafter_versions_deployment_version"),
        Index(
            "uq_drafter_versions_one_active",
            "deployment_id",
            unique=True,
            postgresql_where=text("state = 'active'"),
            sqlite_where=text("state = 'active'"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    parent_version_id: Mapped[int | None] = mapped_column(
        ForeignKey("drafter_versions.id", ondelete="SET NULL")
    )
    training_job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    traffic_window_start: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    traffic_window_end: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    artifact_path: Mapped[str] = mapped_column(String(1000))
    artifact_sha256: Mapped[str] = mapped_column(String(64))
    # sha256 of the artifact's MANIFEST.json: every load verifies it, then every file it lists.
    manifest_sha256: Mapped[str | None] = mapped_column(String(64))
    # The target model the drafter was trained against (the deployment's target_model then): when
    # the deployment's target changes, versions trained for another target are stale.
    target_model: Mapped[str | None] = mapped_column(String(500))
    state: Mapped[DrafterState] = mapped_column(_enum(DrafterState, "drafter_state"))
    training_metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    eval_metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    activated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class AcceptanceRecordRow(Base):
    __tablename__ = "acceptance_records"
    __table_args__ = (
        # Retried batches are idempotent: the same request id is stored once per deployment.
        UniqueConstraint("deployment_id", "request_id", name="uq_acceptance_records_deployment_request"),
        Index("ix_acceptance_records_deployment_time", "deployment_id", "created_at"),
        CheckConstraint("accepted_tokens <= drafted_tokens", name="accepted_le_drafted"),
        CheckConstraint(
            "drafted_tokens >= 0 AND accepted_tokens >= 0 AND verify_steps >= 0 AND generated_tokens >= 0",
            name="counts_non_negative",
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    request_id: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    arm: Mapped[str] = mapped_column(String(40))
    drafter_version: Mapped[int | None] = mapped_column(Integer)
    k: Mapped[int | None] = mapped_column(SmallInteger)
    drafted_tokens: Mapped[int] = mapped_column(Integer)
    accepted_tokens: Mapped[int] = mapped_column(Integer)
    verify_steps: Mapped[int] = mapped_column(Integer)
    generated_tokens: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    accepted_per_position: Mapped[list[Any]] = mapped_column(JSON)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    inter_token_ms: Mapped[float | None] = mapped_column(Float)
    total_ms: Mapped[float | None] = mapped_column(Float)
    category: Mapped[str | None] = mapped_column(String(100))
    # Written under a serving key (the fleet itself): only such records steer a canary, so an
    # ingest key cannot forge arm labels into promotion or rollback.
    from_serving_key: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    # What drafting would have done under each candidate draft-stop threshold (engines that
    # report it; see controlplane.tuning.draft_stop): the threshold tuner's live input.
    draft_stop_counts: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # A sample of traffic the edge also counted in a window aggregate: never summed again.
    counted_in_aggregate: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))


class AcceptanceRollupPendingRow(Base):
    """A stored acceptance record whose rollup sums are not added yet (PostgreSQL only).

    A small ingest flush stores its records and one of these rows each, in one statement, and
    leaves the rollup update (a read-merge-write of five hot rows, more than half of a
    single-record flush) to a fold that takes many records at once within a fraction of a
    second (controlplane.ingest.service.fold_pending_rollups). The fold deletes the rows it
    adds in the same transaction, so every record is summed exactly once; readers of rollups
    fold first, so nothing they read lags what was acknowledged.
    """

    __tablename__ = "acceptance_rollup_pending"

    record_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("acceptance_records.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))


class AcceptanceRollupRow(Base):
    """Sums of acceptance records over one time bucket, at every rollup resolution.

    Each record is summed into one row per resolution (1 min, 5 min, 1 h, 6 h, 1 day; see
    controlplane.ingest.rollups), so a long range in wide buckets reads a few hundred rows
    instead of one per minute. Every figure the stats API reports is derived from these raw
    counts, never from stored ratios, so rows of any resolution combine exactly. Rows of every
    resolution load as this class; AcceptanceRollup is the per-minute subset.
    """

    __tablename__ = "acceptance_rollups"
    __table_args__ = (
        UniqueConstraint(
            "deployment_id",
            "resolution_s",
            "bucket_start",
            "arm",
            "drafter_version",
            "category",
            name="uq_acceptance_rollups_key",
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    # Bucket length in seconds; bucket_start is a multiple of it since the Unix epoch (UTC).
    resolution_s: Mapped[int] = mapped_column(Integer)
    bucket_start: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    arm: Mapped[str] = mapped_column(String(40))
    # 0 stands for "no drafter version" so that the unique key has no NULLs (NULLs never collide).
    drafter_version: Mapped[int] = mapped_column(Integer, default=0)
    # The records' category ("" where none was given), so per-category figures read rollups too.
    category: Mapped[str] = mapped_column(String(100), default="", server_default="")
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    drafted_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    accepted_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    verify_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    generated_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    total_ms_sum: Mapped[float] = mapped_column(Float, default=0.0)
    timed_requests: Mapped[int] = mapped_column(BigInteger, default=0)
    accepted_per_position: Mapped[list[Any]] = mapped_column(JSON, default=list)
    # Dense log-bucket histograms [first bucket index, count, count, ...] (empty: []); see
    # controlplane.ingest.rollups. Needed only to merge rows into a wider bucket.
    inter_token_hist: Mapped[list[Any]] = mapped_column(JSON, default=list)
    total_ms_hist: Mapped[list[Any]] = mapped_column(JSON, default=list)
    ttft_hist: Mapped[list[Any]] = mapped_column(JSON, default=list)
    # Percentiles of this row's own histograms, refreshed on every update, so that a query whose
    # bucket is exactly one row reads them instead of decoding and walking histograms.
    inter_token_ms_p50: Mapped[float | None] = mapped_column(Float)
    inter_token_ms_p95: Mapped[float | None] = mapped_column(Float)
    total_ms_p50: Mapped[float | None] = mapped_column(Float)
    total_ms_p95: Mapped[float | None] = mapped_column(Float)
    ttft_ms_p50: Mapped[float | None] = mapped_column(Float)
    ttft_ms_p95: Mapped[float | None] = mapped_column(Float)

    # Single-table inheritance on "minute or coarser": ORM queries through AcceptanceRollup get
    # "minute rows only" added, so summing it still counts every record exactly once.
    __mapper_args__ = {
        "polymorphic_on": case((resolution_s == 60, "minute"), else_="coarser"),
        "polymorphic_identity": "coarser",
    }


class AcceptanceRollup(AcceptanceRollupRow):
    """Per-minute sums of acceptance records so dashboards never scan the raw table."""

    __mapper_args__ = {"polymorphic_identity": "minute"}


class EdgeWindowRow(Base):
    """One edge's window of aggregates, stored once: the unit of idempotency of aggregate ingest.

    ``id`` orders windows by arrival (the drift monitor's watermark over aggregates); ``digest``
    tells a retry of the same body (acknowledged, nothing stored) from a different body for a
    window already stored (a conflict). ``rolled_up_at`` is set in the transaction that adds the
    window's sums to the rollups (controlplane.ingest.aggregate_rollups): exactly once.
    """

    __tablename__ = "edge_windows"
    __table_args__ = (
        UniqueConstraint("account_id", "edge_id", "window_start", name="uq_edge_windows_key"),
        Index("ix_edge_windows_received", "received_at"),
        # Only the windows not rolled up yet: the fold finds them without scanning the ledger.
        Index(
            "ix_edge_windows_rollup_pending",
            "id",
            postgresql_where=text("rolled_up_at IS NULL"),
            sqlite_where=text("rolled_up_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"))
    edge_id: Mapped[str] = mapped_column(String(200))
    window_start: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    window_s: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64))
    aggregates: Mapped[int] = mapped_column(Integer)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    rolled_up_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class AcceptanceAggregateRow(Base):
    """One window's sums for one deployment, arm, drafter version and category, from one edge.

    The high-volume table of a large fleet: time-partitioned on PostgreSQL (by ``window_start``,
    see controlplane.ingest.partitions) with ``deployment_id`` first in the primary key, so the
    table can later be distributed by deployment. ``sums`` holds the vectors of
    controlplane.ingest.aggregates.WindowAggregate; ``latency`` its DDSketches.
    """

    __tablename__ = "acceptance_aggregates"
    __table_args__ = (Index("ix_acceptance_aggregates_edge_window", "edge_window_id"),)

    deployment_id: Mapped[int] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    window_start: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    edge_window_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    arm: Mapped[str] = mapped_column(String(40), primary_key=True)
    # 0 stands for "no drafter version" so that the key has no NULLs.
    drafter_version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    category: Mapped[str] = mapped_column(String(100), primary_key=True)
    window_s: Mapped[int] = mapped_column(Integer)
    requests: Mapped[int] = mapped_column(BigInteger)
    speculated_requests: Mapped[int] = mapped_column(BigInteger)
    timed_requests: Mapped[int] = mapped_column(BigInteger)
    drafted_tokens: Mapped[int] = mapped_column(BigInteger)
    accepted_tokens: Mapped[int] = mapped_column(BigInteger)
    verify_steps: Mapped[int] = mapped_column(BigInteger)
    generated_tokens: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    sums: Mapped[dict[str, Any]] = mapped_column(JSON)
    latency: Mapped[dict[str, Any]] = mapped_column(JSON)
    from_serving_key: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))


class QuarantinedRollupRecord(Base):
    """An acceptance record the rollup fold could not add (a sum it cannot hold): set aside with
    the reason, so one bad row is reported once instead of failing every fold after it."""

    __tablename__ = "quarantined_rollup_records"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    record_id: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(String(500))
    quarantined_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CounterSnapshotRow(Base):
    """Last Prometheus counter values pushed per deployment, to turn counters into deltas."""

    __tablename__ = "counter_snapshots"

    deployment_id: Mapped[int] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True
    )
    snapshot: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Trace(Base):
    __tablename__ = "traces"
    __table_args__ = (Index("ix_traces_deployment_time", "deployment_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    source: Mapped[TraceSource] = mapped_column(_enum(TraceSource, "trace_source"))
    dataset_name: Mapped[str | None] = mapped_column(String(200))
    category: Mapped[str | None] = mapped_column(String(100))
    # The source document the prompt was cut from, as the client named it (None: not given): the
    # held-out split keeps every prompt of one document on one side (controlplane.traces.holdout).
    document: Mapped[str | None] = mapped_column(String(200))
    prompt: Mapped[str] = mapped_column(Text)
    completion: Mapped[str] = mapped_column(Text)


class DriftEvent(Base):
    __tablename__ = "drift_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    detected_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    state: Mapped[DriftState] = mapped_column(_enum(DriftState, "drift_state"), default=DriftState.open)
    detector: Mapped[str] = mapped_column(String(100))
    baseline_rate: Mapped[float | None] = mapped_column(Float)
    current_rate: Mapped[float | None] = mapped_column(Float)
    drop: Mapped[float | None] = mapped_column(Float)
    position_most_affected: Mapped[int | None] = mapped_column(Integer)
    statistic: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float)
    records_examined: Mapped[int] = mapped_column(BigInteger, default=0)
    first_record_id: Mapped[int | None] = mapped_column(BigInteger)
    last_record_id: Mapped[int | None] = mapped_column(BigInteger)
    detection_delay_estimate: Mapped[int | None] = mapped_column(Integer)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    resolved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    resolution: Mapped[DriftResolution | None] = mapped_column(_enum(DriftResolution, "drift_resolution"))
    # Why it ended that way, in words (a failed realignment's error, a replay's timeout...).
    resolution_reason: Mapped[str | None] = mapped_column(Text)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        # Two simultaneous drift events must start a single realignment.
        Index(
            "uq_jobs_one_active_realign",
            "deployment_id",
            unique=True,
            postgresql_where=text("kind = 'realign' AND state IN ('queued', 'running')"),
            sqlite_where=text("kind = 'realign' AND state IN ('queued', 'running')"),
        ),
        CheckConstraint("progress >= 0 AND progress <= 1", name="progress_fraction"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    kind: Mapped[JobKind] = mapped_column(_enum(JobKind, "job_kind"))
    state: Mapped[JobState] = mapped_column(_enum(JobState, "job_state"), default=JobState.queued)
    drift_event_id: Mapped[int | None] = mapped_column(ForeignKey("drift_events.id", ondelete="SET NULL"))
    requested_by: Mapped[str] = mapped_column(String(200), default="system")
    # What started it: drift, continuous, first_drafter, unprofitable, manual (NULL: before this
    # was recorded).
    trigger: Mapped[str | None] = mapped_column(String(40))
    celery_task_id: Mapped[str | None] = mapped_column(String(200))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    progress_message: Mapped[str] = mapped_column(String(500), default="")
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    result: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # When a message for the job was last sent to the workers; the sweeper re-sends a job that is
    # still queued long after it.
    enqueued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # A running attempt's lease, renewed by its worker's heartbeat: once it expires the worker is
    # presumed dead and the job is queued again (or failed once its attempts are spent).
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # A failed attempt waits until then before the next one (exponential backoff).
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Canary(Base):
    __tablename__ = "canaries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    candidate_version_id: Mapped[int] = mapped_column(ForeignKey("drafter_versions.id", ondelete="CASCADE"))
    incumbent_version_id: Mapped[int | None] = mapped_column(
        ForeignKey("drafter_versions.id", ondelete="SET NULL")
    )
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    phase: Mapped[str] = mapped_column(String(20), default="shadow")
    routing_weights: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    arms: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    decision: Mapped[str | None] = mapped_column(String(20))
    reason: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    decided_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The shadow replay's message: when it was last sent and how many times, so a lost one is
    # re-sent and one that never answers ends the canary with a reason.
    shadow_sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    shadow_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # The judge's running per-arm sums and the last acceptance record folded into them: each tick
    # reads only records after the watermark.
    judge_watermark_record_id: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    judge_state: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict, server_default="{}")


class AuditEntry(Base):
    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_account_time", "account_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"))
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(100))
    resource: Mapped[str] = mapped_column(String(500))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SpeculationCheck(Base):
    """Per deployment: the standing test of whether speculation pays against the no-speculation
    share of its traffic, how far it has read, its verdict and what the service did about it."""

    __tablename__ = "speculation_checks"

    deployment_id: Mapped[int] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True
    )
    watermark_record_id: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    records_examined: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    state: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict, server_default="{}")
    # unknown | pays | not_paying
    verdict: Mapped[str] = mapped_column(String(20), default="unknown", server_default="unknown")
    reason: Mapped[str | None] = mapped_column(Text)
    action: Mapped[str | None] = mapped_column(String(40))
    checked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    acted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class DriftMonitorState(Base):
    """Per deployment: the drift detector's persisted state and how far it has read.

    ``watermark_record_id`` is the last acceptance record consumed; ``pending_horizon_record_id``
    the newest id seen on the previous run (only ids up to it are settled, see drift.service);
    ``version`` is the compare-and-set guard that makes concurrent monitor runs safe.
    """

    __tablename__ = "drift_monitor_states"

    deployment_id: Mapped[int] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True
    )
    detector_state: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    watermark_record_id: Mapped[int] = mapped_column(BigInteger, default=0)
    pending_horizon_record_id: Mapped[int] = mapped_column(BigInteger, default=0)
    # The last edge window whose aggregates this detector consumed (aggregates and per-request
    # records of one deployment feed the same detector; each input has its own watermark).
    watermark_edge_window_id: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    active_drafter_version: Mapped[int | None] = mapped_column(Integer)
    policy: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    records_examined: Mapped[int] = mapped_column(BigInteger, default=0)
    last_alarm_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    version: Mapped[int] = mapped_column(Integer, default=0)


class ServingBackend(Base):
    """One engine endpoint of a deployment's serving fleet: the pool it belongs to (incumbent,
    candidate or baseline), its base URL, the drafter version it serves (None: no drafter) and
    where it says it is ready. The router sends each arm's traffic to its pool."""

    __tablename__ = "serving_backends"
    __table_args__ = (UniqueConstraint("deployment_id", "name", name="uq_serving_backends_deployment_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    pool: Mapped[str] = mapped_column(String(20))
    url: Mapped[str] = mapped_column(String(500))
    drafter_version: Mapped[int | None] = mapped_column(Integer)
    readiness_url: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ScrapeTarget(Base):
    """A backend's Prometheus ``/metrics`` the control plane pulls: one or more URLs of the same
    engine (several API servers in front of one engine count once), the arm and drafter version
    its records are filed under, and the last counters seen (to turn counters into deltas)."""

    __tablename__ = "scrape_targets"
    __table_args__ = (UniqueConstraint("deployment_id", "name", name="uq_scrape_targets_deployment_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    urls: Mapped[list[str]] = mapped_column(JSON)
    arm: Mapped[str] = mapped_column(String(40), default="live")
    drafter_version: Mapped[int | None] = mapped_column(Integer)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    snapshot: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    scrapes: Mapped[int] = mapped_column(Integer, default=0)
    records_stored: Mapped[int] = mapped_column(BigInteger, default=0)
    last_scraped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ActuatorDelivery(Base):
    """One event (canary start, promotion, rollback) handed to a deployment's actuator, with
    every attempt's outcome, so an operator can see what the fleet was told and when."""

    __tablename__ = "actuator_deliveries"
    __table_args__ = (Index("ix_actuator_deliveries_deployment_time", "deployment_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    canary_id: Mapped[int | None] = mapped_column(ForeignKey("canaries.id", ondelete="SET NULL"))
    event: Mapped[str] = mapped_column(String(40))
    actuator: Mapped[str] = mapped_column(String(20))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(20), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_status: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
