"""Settings: the one place that reads the environment (prefix ``CONTROLPLANE_``).

Defaults are the embedded development setup (SQLite under ./var, no services). Outside
development the service refuses to start while a secret still has its default value.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.canary_policy import CanaryPolicy

DEFAULT_SECRET = "dev-insecure-secret-change-me"
VAR_DIR = Path("var")


class UnsafeSettingsError(RuntimeError):
    """Raised when production-like settings still carry development defaults."""


class Settings(BaseSettings):
    """Everything configurable about the control plane, validated at start-up."""

    model_config = SettingsConfigDict(env_prefix="CONTROLPLANE_", env_file=".env", extra="ignore")

    environment: Literal["development", "test", "production"] = "development"
    database_url: str = f"sqlite:///{VAR_DIR}/controlplane.db"
    broker_url: str = f"sqla+sqlite:///{VAR_DIR}/broker.db"
    result_backend_url: str = f"db+sqlite:///{VAR_DIR}/celery-results.db"
    var_dir: Path = VAR_DIR
    artifact_dir: Path = VAR_DIR / "artifacts"
    # The bundled reference pair, registered as platform models by `controlplane init`.
    reference_models_dir: Path = Path(__file__).resolve().parents[1] / "workers" / "models" / "reference"
    # Folders a model may be registered from (``model register --path``); nothing outside them
    # (after resolving symlinks) is ever registered or loaded. The bundled models' folder is one.
    model_roots: list[Path] = Field(
        default_factory=lambda: [
            Path(__file__).resolve().parents[1] / "workers" / "models",
            VAR_DIR / "models",
        ]
    )
    # Hugging Face cache for ``model register --hf-id`` (None: huggingface_hub's own default).
    # HF_HUB_OFFLINE=1 makes registration use only what the cache already holds.
    hf_cache_dir: Path | None = None
    # Where drafter artifacts live, shared by workers and the serving side: file:///shared/dir or
    # s3://bucket/prefix (None: file:// on artifact_dir). Loads copy into artifact_cache_dir and
    # verify every file of the artifact's manifest first.
    artifact_store_uri: str | None = None
    artifact_cache_dir: Path = VAR_DIR / "artifact-cache"
    # An S3-compatible endpoint (MinIO, Ceph, moto); credentials come from the usual AWS_* variables.
    s3_endpoint_url: str | None = None
    # The arm router (`controlplane router`): its TOML file (the CLI's --config wins), and the API
    # key it reads serving-config and writes records with when the file names no api_key_file.
    router_config: Path | None = None
    router_api_key: str | None = None
    router_account: str | None = None  # overrides the file's control_plane.account
    # Peppers the API-key hash so a leaked database alone cannot be brute-forced offline.
    secret_key: str = DEFAULT_SECRET
    api_host: str = "127.0.0.1"
    api_port: int = 8600
    # Where the CLI sends its HTTP requests, and the key it sends.
    api_url: str = "http://127.0.0.1:8600"
    api_key: str | None = None

    # How long a verified API key is trusted without a lookup (revocation delay on other processes).
    auth_cache_ttl_s: float = Field(default=5.0, ge=0)
    # Move everything alive once the API has started out of the cyclic collector's view (see
    # controlplane.app). Off for apps built and thrown away by the hundred, as in tests: frozen
    # objects in reference cycles are never reclaimed.
    api_gc_freeze: bool = True
    # Ingestion nudges the drift monitor right away (beat also runs it every few seconds).
    drift_enqueue_on_ingest: bool = True
    # PostgreSQL: whether an ingest flush waits for its WAL to reach disk before acknowledging.
    # Off, a commit returns at once and the WAL writer flushes within ~0.6 s: a database crash
    # may then lose the last acknowledged records (never a part of a batch, never a rollup
    # without its records), and no request waits out a slow disk flush (this machine's disk
    # stalls an fdatasync for ~200 ms now and then, which sets single-record p99 when it hits).
    ingest_synchronous_commit: bool = True
    max_batch_records: int = Field(default=10_000, ge=1)
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    rollup_bucket_seconds: int = 60
    # Prometheus ingestion: label sets (engines) one push or scraped page may carry; more is a
    # 413. Also bounds the label sets a snapshot keeps (vanished ones are remembered for a while).
    prometheus_max_label_sets: int = Field(default=1000, ge=1, le=100_000)

    # Drift and canary thresholds (defaults per deployment; each deployment may override).
    # The drift monitor over edge aggregates runs as this many shards of deployments (by id), one
    # Celery task each on the default queue: workers share them, so more workers go faster.
    drift_monitor_shards: int = Field(default=4, ge=1, le=1024)
    drift_arl0_requests: int = Field(default=50_000, ge=100)
    drift_min_drop: float = Field(default=0.05, gt=0, lt=1)
    drift_cooldown_s: int = Field(default=600, ge=0)
    drift_reference_requests: int = Field(default=1000, ge=50, le=100_000)
    # Service-wide canary defaults; their valid ranges are CanaryPolicy's (checked below).
    canary_alpha: float = 0.05
    canary_min_samples_per_arm: int = 50
    # A shadow replay that shows no sign of life (no result, no worker heartbeat) this long after
    # its message was sent is sent again, at most shadow_max_sends times in all; after the last
    # one the canary ends inconclusive with that reason and the incumbent keeps serving.
    shadow_resend_after_s: float = Field(default=600.0, gt=0, le=7 * 86400)
    shadow_max_sends: int = Field(default=3, ge=1, le=100)

    # Realignment. Redis re-delivers an unacknowledged task (its worker died) only after this
    # long, so it must exceed the longest job; tests shorten it to see a redelivery quickly.
    celery_visibility_timeout_s: int = Field(default=6 * 3600, ge=1)
    # A realign job still queued (never started) this long after its message was sent gets its
    # message sent again by the beat sweeper (the first send failed, or the broker lost it).
    realign_resend_after_s: float = Field(default=120.0, gt=0)
    # Training time budget of a job whose params do not set one (None: the worker's default).
    realign_time_budget_s: float | None = Field(default=None, ge=1, le=24 * 3600)
    # A drift-triggered realignment waits for this much post-drift traffic (traces), at most
    # realign_max_wait_s, before it trains: minutes after an alarm there is little to learn from.
    realign_min_traces: int = Field(default=200, ge=1)
    # torch threads per worker process (0: the cores divided among the worker's processes). On a
    # shared CPU, more threads than cores make OpenMP spin-wait: 10x slower, not faster.
    worker_torch_threads: int = Field(default=0, ge=0)
    worker_concurrency: int = Field(default=2, ge=1)
    # Where workers run models: "auto" (the first GPU when there is one), "cpu", "cuda" or "cuda:N".
    worker_device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    # Memory a realignment may spend at once on the teacher's top-K pass (its logits are chunked).
    worker_teacher_memory_mb: int = Field(default=1024, ge=16)
    realign_max_wait_s: float = Field(default=600.0, ge=0)

    # Recovery of realign jobs. An attempt that raised is retried after realign_retry_backoff_s *
    # 2^(n-1) (n: attempts so far) until realign_max_attempts, then the job fails. A running
    # attempt holds a lease of realign_lease_s that its worker renews every third of it; once the
    # lease lapses the worker counts as dead, and the beat sweep queues the job again (or fails
    # it when its attempts are spent). Too little traffic to train on is never retried.
    realign_max_attempts: int = Field(default=3, ge=1, le=10)
    realign_retry_backoff_s: float = Field(default=60.0, gt=0, le=3600)
    realign_lease_s: float = Field(default=60.0, ge=1, le=3600)

    # The programs a `command` actuator may run, by name: {"reload": ["/usr/local/bin/reload"]}
    # (env CONTROLPLANE_ACTUATOR_COMMANDS as JSON). The API only ever picks one of these names:
    # an API key must never be able to make the control plane's hosts run a program of its choice.
    actuator_commands: dict[str, list[str]] = Field(default_factory=dict)
    # How long one command actuator run may take before it is killed (and the attempt failed).
    actuator_command_timeout_s: float = Field(default=60.0, gt=0)

    # Request limits (controlplane.api.gate). Every route other than the ingest ones (whose bodies
    # max_body_bytes bounds) takes a JSON body of at most this size.
    max_json_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    # Requests per second and burst, per API key, on the ingest routes (records, pushes, traces,
    # datasets) and on every other route. Each API process keeps its own buckets: N processes
    # let a key through N times as fast. The defaults sit far above what the benchmarks and a
    # router send (a batch is one request), so only a runaway client meets them.
    ingest_rate_per_s: float = Field(default=2000.0, gt=0)
    ingest_rate_burst: int = Field(default=4000, ge=1)
    admin_rate_per_s: float = Field(default=100.0, gt=0)
    admin_rate_burst: int = Field(default=1000, ge=1)

    @model_validator(mode="after")
    def _refuse_unsafe_defaults(self) -> Settings:
        if self.environment == "production" and self.secret_key == DEFAULT_SECRET:
            raise UnsafeSettingsError(
                "CONTROLPLANE_SECRET_KEY still has its development default; "
                "set a random secret before running with CONTROLPLANE_ENVIRONMENT=production"
            )
        return self

    @model_validator(mode="after")
    def _canary_defaults_are_a_valid_policy(self) -> Settings:
        CanaryPolicy.for_deployment(
            None, alpha=self.canary_alpha, min_samples=self.canary_min_samples_per_arm
        )
        return self

    @model_validator(mode="after")
    def _realign_budget_fits_the_visibility_timeout(self) -> Settings:
        # A task still running when the broker's visibility timeout passes is handed to a second
        # worker: the configured budget must leave the trace wait and the margin below it.
        budget, ceiling = self.realign_time_budget_s, self.realign_budget_ceiling_s
        if budget is not None and budget > ceiling:
            raise ValueError(
                f"realign_time_budget_s ({budget:g} s) must stay below celery_visibility_timeout_s "
                f"({self.celery_visibility_timeout_s} s) less realign_max_wait_s "
                f"({self.realign_max_wait_s:g} s) and a margin of {self.realign_margin_s:g} s: "
                f"at most {ceiling:g} s"
            )
        return self

    @property
    def realign_margin_s(self) -> float:
        """What a realign task spends besides waiting and training (loading the models, the
        held-out scoring, saving and uploading the artifact): 10% of the visibility timeout,
        at least a minute."""
        return max(60.0, 0.1 * self.celery_visibility_timeout_s)

    @property
    def realign_budget_ceiling_s(self) -> float:
        """The longest training budget a realign job may have: its whole task (trace wait,
        training, margin) then ends before the broker's visibility timeout."""
        return self.celery_visibility_timeout_s - self.realign_max_wait_s - self.realign_margin_s

    @property
    def artifact_store(self) -> str:
        """The artifact store's URI: the configured one, else file:// on artifact_dir."""
        return self.artifact_store_uri or self.artifact_dir.resolve().as_uri()

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    def ensure_local_dirs(self) -> None:
        """Create ./var and the artifact directory used by the embedded default."""
        if self.is_sqlite:
            path = self.database_url.removeprefix("sqlite:///")
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.artifact_dir.mkdir(parents=True, exist_ok=True)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()


def environment_for_child(**overrides: str) -> dict[str, str]:
    """This process's environment plus ``overrides``, for a child process (a worker, a server).

    The one place outside Settings that touches os.environ: children read their settings from it.
    """
    return {**os.environ, **overrides}


def dev_key_file(settings: Settings) -> Path:
    """Where development keeps the first admin key for the local CLI and the demo (mode 0600)."""
    return settings.var_dir / "admin.key"
