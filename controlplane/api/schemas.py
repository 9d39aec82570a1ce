"""The JSON replies of the REST API, one Pydantic model per reply, grouped by resource.

Services hand back plain dicts (``describe``, ``version_summary``, ``job_summary``, ...); routes
validate them into these models, so ``/openapi.json`` names every field a client gets back.
Timestamps are typed as the ISO 8601 strings the services write (a ``datetime`` field would
re-format them). JSON the database stores free-form (metrics, evidence, arms, policies) is typed
``dict[str, Any]``: its shape belongs to whoever writes it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from controlplane.db.models import (
    DrafterState,
    DriftState,
    JobKind,
    JobState,
    Role,
    SpeculationMode,
    TraceSource,
)


class Reply(BaseModel):
    """A reply whose every field is declared: a field a service adds without a schema here fails
    loudly (a 500 in tests) instead of vanishing from the reply or from the document."""

    model_config = ConfigDict(extra="forbid")


# --- health ---------------------------------------------------------------------------------


class Health(Reply):
    status: str


class Readiness(Reply):
    status: str
    migration: str | None = Field(description="the migration the database schema is at (the newest)")


class Unready(Reply):
    """Why the service is not ready: the database is unreachable, or its schema is behind."""

    status: str
    database: str | None = Field(default=None, description="present when the database is unreachable")
    migration: str | None = Field(default=None, description="present when the schema is behind")
    head: str | None = Field(default=None, description="the newest migration, when the schema is behind")


# --- keys -----------------------------------------------------------------------------------


class Whoami(Reply):
    account: str
    key: str
    role: Role


class ApiKey(Reply):
    id: int
    name: str
    prefix: str = Field(description="the key's first characters, to recognise it by")
    role: Role
    created_at: str
    revoked_at: str | None


class ApiKeyList(Reply):
    api_keys: list[ApiKey]


class IssuedApiKey(ApiKey):
    key: str = Field(description="the secret; shown this once and never again")


# --- deployments and audit ------------------------------------------------------------------


class Deployment(Reply):
    name: str = Field(description="resource name, accounts/{account}/deployments/{deployment}")
    deployment_id: str
    display_name: str | None
    target_model: str
    speculation_mode: SpeculationMode
    draft_model: str | None
    draft_token_count: int | None
    effective_draft_token_count: int
    ngram_speculation_length: int | None
    draft_confidence_threshold: float | None = Field(
        description="draft rounds stop at the first token the drafter gives less than this "
        "probability (null: off); set by the draft-stop tuner when a canary promotes"
    )
    active_drafter_version: int | None
    registered_drafter: str | None = Field(
        description="the registered drafter speculated with while no trained version is active"
    )
    registered_drafter_source: str = Field(
        description="explicit (draft_model), target_default (the target's default drafter), "
        "none (no drafter: no speculation) or not_applicable (n-gram or disabled)"
    )
    speculation_note: str
    drafter_stale: bool = Field(description="the active drafter was trained for another target")
    drafter_stale_reason: str | None
    auto_realign: bool
    drift_policy: dict[str, Any] = Field(description="the stored overrides of the drift policy")
    trace_sample_rate: float
    trace_retention_days: int
    raw_record_sample_rate: float = Field(
        description="share of requests an aggregating edge also sends as raw records"
    )
    row_version: int = Field(description="send it back in an update to fail with 409 if it moved")
    created_at: str
    updated_at: str


class DeploymentList(Reply):
    deployments: list[Deployment]


class AuditEntry(Reply):
    id: int
    actor: str
    action: str
    resource: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    created_at: str


class AuditLog(Reply):
    entries: list[AuditEntry]


# --- acceptance ingest and statistics -------------------------------------------------------


class PrometheusPushResult(Reply):
    """What a Prometheus push stored: the counter deltas since the last push, as records."""

    received: int
    inserted: int
    duplicates: int
    duplicate_request_ids: list[str]
    label_sets: int = Field(description="label sets whose counters moved (one record each)")
    baseline_label_sets: int = Field(
        description="label sets seen for the first time (or after a gap too long for one record): "
        "their counters are remembered as the baseline, not counted"
    )


class AcceptanceFigures(Reply):
    """Counts and derived figures over a span; a ratio without a denominator is null."""

    requests: int
    drafted_tokens: int
    accepted_tokens: int
    verify_steps: int
    generated_tokens: int
    hit_rate: float | None
    mean_accepted_length: float | None
    per_position_acceptance: list[float | None]
    per_position_conditional_acceptance: list[float | None]
    inter_token_latency_ms_p50: float | None
    inter_token_latency_ms_p95: float | None
    total_latency_ms_p50: float | None
    total_latency_ms_p95: float | None
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    throughput_tokens_per_s: float
    decode_tokens_per_s: float | None


class AcceptanceBucket(AcceptanceFigures):
    start: str


class CategoryFigures(Reply):
    """One request category's figures over the whole range ("" holds records without one)."""

    category: str
    requests: int
    drafted_tokens: int
    accepted_tokens: int
    generated_tokens: int
    hit_rate: float | None
    mean_accepted_length: float | None
    decode_tokens_per_s: float | None
    no_speculation_requests: int = Field(description="records of the no-speculation arm in this category")
    speedup_vs_no_speculation: float | None = Field(
        description="no-speculation ms per token / speculating arms' ms per token, same category and range"
    )


class AcceptanceSeries(Reply):
    start: str
    end: str
    bucket_seconds: int
    arm: str | None
    drafter_version: int | None
    category: str | None = Field(default=None, description="the category filter (null: all categories)")
    buckets: list[AcceptanceBucket] = Field(description="buckets with records only, in time order")
    total: AcceptanceFigures
    quarantined_records: int = Field(
        description="stored records the rollups could not sum (set aside, in no bucket), all time"
    )
    per_category: list[CategoryFigures] = Field(
        default_factory=list,
        description="each category's figures over the range, most requests first (categories past "
        "the rollups' cap of 32 per deployment are counted as the category other)",
    )


# --- traces ---------------------------------------------------------------------------------


class TraceBatchResult(Reply):
    stored: int
    scrubbed: dict[str, int] = Field(description="entities replaced, per kind")
    replaced: int
    sample_rate: float = Field(description="the share of requests the serving side should send")


class DatasetUploadResult(Reply):
    dataset_name: str
    stored: int
    scrubbed: dict[str, int] = Field(description="entities replaced, per kind")
    replaced: int = Field(description="traces of an earlier dataset of this name, now removed")


class Trace(Reply):
    id: int
    created_at: str
    source: TraceSource
    dataset_name: str | None
    category: str | None
    document: str | None = Field(description="the source document the client named (null: none)")
    prompt: str
    completion: str


class TracePage(Reply):
    traces: list[Trace]
    next_after_id: int | None = Field(description="pass back as after_id for the next page; null on the last")


# --- drift ----------------------------------------------------------------------------------


class DriftEvent(Reply):
    id: int
    state: DriftState
    resolution: str | None = Field(default=None, description="how the event was closed; null while open")
    resolution_reason: str | None = Field(
        default=None, description="why it ended that way (a failed realignment's error, ...)"
    )
    detected_at: str
    detector: str
    baseline_rate: float | None
    current_rate: float | None
    drop: float | None
    position_most_affected: int | None
    statistic: float | None
    threshold: float | None
    records_examined: int
    detection_delay_estimate: int | None
    last_record_id: int | None
    evidence: dict[str, Any]
    resolved_at: str | None


class DriftEventList(Reply):
    drift_events: list[DriftEvent]


class DriftPolicy(Reply):
    arl0_requests: int = Field(description="mean requests between false alarms")
    min_drop: float = Field(description="smallest hit-rate drop worth an alarm (0.05 = 5 points)")
    cooldown_s: int
    reference_requests: int


class DriftStatus(Reply):
    policy: DriftPolicy
    open_events: int
    records_examined: int
    watermark_record_id: int
    updated_at: str | None
    detector: dict[str, Any] | None = Field(description="the detector's figures; null before its first run")
    guardrail_recovery: dict[str, Any] | None = Field(
        default=None,
        description="while a guardrail keeps the deployment on its fallback: why, since when, the "
        "drafter it realigns, candidates lost since, and the realignment queued (id, due time)",
    )


# --- jobs -----------------------------------------------------------------------------------


class Job(Reply):
    id: int
    kind: JobKind
    state: JobState
    deployment_id: int
    drift_event_id: int | None
    requested_by: str
    trigger: str | None = Field(
        default=None,
        description="what started it: drift, continuous, first_drafter, unprofitable or manual "
        "(null: not recorded)",
    )
    attempts: int
    progress: float
    progress_message: str
    params: dict[str, Any]
    result: dict[str, Any]
    error: str | None
    created_at: str | None
    enqueued_at: str | None
    started_at: str | None
    finished_at: str | None
    heartbeat_at: str | None = Field(default=None, description="the running attempt's last heartbeat")
    lease_expires_at: str | None = Field(
        default=None, description="the running attempt's lease; once past, the job is queued again"
    )
    next_attempt_at: str | None = Field(
        default=None, description="a failed attempt's retry waits until then (exponential backoff)"
    )


class JobList(Reply):
    jobs: list[Job]


class RealignResult(Job):
    created: bool = Field(description="false: a realignment was already queued or running, and this is it")


# --- drafter versions, canaries, serving config, draft length -------------------------------


class ModelRef(Reply):
    """Where a model's files are and the digests every load verifies them by."""

    name: str
    uri: str = Field(description="file:// folder or s3:// artifact")
    files: dict[str, str] = Field(description="a registered model's sha256 per file")
    manifest_sha256: str | None = Field(description="a drafter artifact's MANIFEST.json sha256")
    identity: str


class ServingArm(Reply):
    arm: str
    weight: float
    speculation: SpeculationMode
    drafter: ModelRef | None
    drafter_version: int | None
    k: int
    ngram_length: int
    draft_confidence_threshold: float | None = Field(
        default=None,
        description="draft rounds stop at the first draft below this probability (null: never early)",
    )


class ServingBackend(Reply):
    """An engine endpoint of one pool; the router sends the pool's arm to it."""

    name: str
    pool: str = Field(description="incumbent, candidate or baseline")
    url: str = Field(description="the engine's base URL, e.g. http://10.0.0.5:8000")
    drafter_version: int | None = Field(
        description="the version it serves (null: the configured drafter or none)"
    )
    readiness_url: str | None = Field(description="answers 2xx once the backend is ready to serve")


class ServingConfig(Reply):
    model: str
    target: ModelRef
    trace_sample_rate: float
    raw_record_sample_rate: float = Field(
        description="share of requests an aggregating edge also sends as raw records"
    )
    arms: list[ServingArm]
    backends: list[ServingBackend] = Field(description="the fleet's backends, by name")
    config_version: str = Field(description="changes whenever anything else in this reply changes")


class DrafterVersion(Reply):
    version: int
    drafter_kind: str = Field(
        description="draft_model: a small causal LM; eagle3: a head over the target's hidden states"
    )
    state: DrafterState
    parent_version_id: int | None
    training_job_id: int | None
    artifact_uri: str
    artifact_sha256: str
    manifest_sha256: str | None
    traffic_window_start: str | None
    traffic_window_end: str | None
    training_metrics: dict[str, Any]
    eval_metrics: dict[str, Any]
    created_at: str
    activated_at: str | None


class DrafterVersionList(Reply):
    drafter_versions: list[DrafterVersion]


class Canary(Reply):
    canary_id: int
    phase: str
    candidate_version: int | None
    incumbent_version: int | None
    job_id: int | None
    routing_weights: dict[str, Any]
    arms: dict[str, Any] = Field(description="per-arm figures and the shadow replay, as stored")
    decision: str | None
    reason: str | None
    started_at: str
    decided_at: str | None


class CanaryList(Reply):
    canaries: list[Canary]


class RollbackResult(Reply):
    active_version: int | None
    draft_token_count: int | None
    speculation_mode: SpeculationMode


class CanaryPolicy(Reply):
    live_canary: bool
    candidate_weight: float
    baseline_weight: float
    alpha: float
    min_samples_per_arm: int
    max_requests: int
    max_duration_s: float
    non_inferiority_margin: float
    tune_draft_length: bool
    watch_requests: int
    shadow_prompts: int
    shadow_new_tokens: int
    judge_per_category: bool
    tune_draft_stop: bool


class DraftLengthRow(Reply):
    k: int
    conditional_acceptance: float | None
    expected_tokens_per_step: float
    cost_per_step: float
    expected_speedup: float
    extrapolated: bool


class DraftLengthTable(Reply):
    """Expected speed-up per k. Before any live record of the active drafter there is no plan: the
    reply then carries ``table`` (empty), ``best_k`` (null) and ``note``, and none of the plan's
    fields."""

    drafter_version: int | None
    current_k: int
    verify_steps_observed: int
    costs: dict[str, Any] = Field(description="the cost ratio used, and where it was measured")
    table: list[DraftLengthRow] | None = None
    best_k: int | None
    note: str | None = None
    best_speedup: float | None = None
    observed_k: int | None = None
    cost_ratio: float | None = None
    extrapolated_acceptance: float | None = None
    rows: list[DraftLengthRow] | None = None
    draft_stop: dict[str, Any] | None = Field(
        default=None,
        description="expected speed-up per draft-stop confidence threshold from the live records' "
        "counterfactual counts (only thresholds at or above the serving one are observable), and "
        "the threshold the tuner would serve",
    )


# --- registered models -------------------------------------------------------------------------


class RegisteredModel(Reply):
    name: str
    scope: str = Field(description="account (this account's own) or platform (every account's)")
    source: str = Field(description="path (a folder under a model root) or hf (a Hugging Face id)")
    hf_id: str | None
    hf_revision: str | None
    family: str
    architecture: str | None
    parameter_count: int
    dtype: str
    vocab_size: int
    embedding_rows: int
    tokenizer_size: int
    tokenizer_fingerprint: str
    files: dict[str, str] = Field(description="sha256 of every file loading reads")
    manifest_sha256: str
    total_bytes: int
    drafter_for: list[str] = Field(description="targets this model may draft for")
    default_drafter: str | None = Field(description="the drafter deployments of this target get by default")
    created_at: str


class RegisteredModelList(Reply):
    models: list[RegisteredModel]


# --- serving fleet: actuator and deliveries ---------------------------------------------------


class ServingBackendList(Reply):
    backends: list[ServingBackend]


class Actuator(Reply):
    kind: str = Field(description="reference, webhook or command")
    url: str | None = Field(description="a webhook's URL")
    command: str | None = Field(description="a command actuator's operator-configured command name")
    ready_timeout_s: int | None = Field(description="how long a canary waits for its candidate pool")
    signing_secret: str | None = Field(
        description="a webhook's signing secret: only in the reply that set it, never again"
    )


class ActuatorDelivery(Reply):
    id: int
    event: str = Field(description="canary-start, promotion or rollback")
    actuator: str
    canary_id: int | None
    state: str = Field(description="pending, delivered or failed")
    attempts: int
    last_status: int | None = Field(description="HTTP status, or a command's exit code")
    last_error: str | None
    payload: dict[str, Any]
    created_at: str | None
    next_attempt_at: str | None
    delivered_at: str | None


class ActuatorDeliveryList(Reply):
    deliveries: list[ActuatorDelivery]


# --- adaptation policy ------------------------------------------------------------------------


class AdaptationSkip(Reply):
    trigger: str | None
    reason: str | None
    at: str | None


class AdaptationStatus(Reply):
    gpu_seconds_last_24h: float = Field(description="run time of the deployment's jobs in the last 24 h")
    has_drafter: bool = Field(description="whether a drafter model serves the live arm")
    next_trigger: str | None = Field(
        description="the automatic realignment the next monitor pass would request (null: none)"
    )
    reason: str = Field(description="why, or why not")
    last_skip: AdaptationSkip | None = Field(description="the last automatic realignment skipped over budget")


class AdaptationPolicy(Reply):
    standing_baseline_share: float
    pays_alpha: float
    pays_min_requests_per_arm: int
    continuous: bool
    continuous_every_traces: int
    continuous_every_minutes: float
    gpu_seconds_per_day: float
    first_drafter: bool
    status: AdaptationStatus


# --- does speculation pay ---------------------------------------------------------------------


class SpeculationCheckArm(Reply):
    requests: int = Field(description="requests with a latency in the current test")
    ms_per_token: float | None = Field(description="mean latency per output token (ms)")


class SpeculationCheckAction(Reply):
    action: str
    at: str
    detail: str
    ratio: float | None


class SpeculationCheck(Reply):
    verdict: str = Field(
        description="not_paying: the live arm is slower than no speculation at the policy's "
        "pays_alpha (anytime-valid); pays: faster; unknown: not enough evidence yet"
    )
    reason: str | None
    action: str | None = Field(
        description="the last action taken: draft_length, realign, fallback_ngram or fallback_disabled"
    )
    acted_at: str | None
    checked_at: str | None
    records_examined: int
    standing_baseline_share: float
    alpha: float
    min_requests_per_arm: int
    arms: dict[str, SpeculationCheckArm] = Field(description="live and baseline (no speculation)")
    ratio: float | None = Field(description="live / no-speculation latency per token (above 1: slower)")
    ratio_low: float | None = Field(description="anytime-valid lower bound of the ratio, one-sided at alpha")
    ratio_high: float | None = Field(description="anytime-valid upper bound of the ratio, one-sided at alpha")
    serving: dict[str, Any] | None = Field(
        description="the set-up the current test measures (mode, drafter version, k, threshold)"
    )
    test_started_at: str | None
    draft_length_plan: dict[str, Any] | None = Field(
        description="the k the live acceptance and measured step cost say pays best: best_k, "
        "best_speedup, cost_ratio, measured_step_cost, cost_model (measured_verify_cost: split with "
        "a shadow replay's verify-cost curve for this target, named by verify_cost_source; "
        "flat_verify_unmeasured: Leviathan's flat verify, never acted on), verify_cost_at_live_k, "
        "verify_cost_at_best_k, worst_case_speedup, actionable (whether the check would change k "
        "on it) and why"
    )
    ladder: list[str] = Field(description="actions tried since speculation last paid, in order")
    history: list[SpeculationCheckAction]
