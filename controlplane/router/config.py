"""The router's configuration file (TOML): where the control plane is, how to reach it, and each
deployment's backend pools.

::

    [control_plane]
    url = "http://127.0.0.1:8600"
    account = "default"
    api_key_file = "/run/secrets/router-key"       # a serving key; else CONTROLPLANE_ROUTER_API_KEY

    [router]
    spool_dir = "var/router-spool"     # records, traces and windows wait here while the control plane is away
    client_key_header = "x-session-id"
    aggregate_window_s = 60            # seconds per aggregate window (default 0: a raw record per request)
    edge_id = "edge-eu-1"              # this router's name in the windows it sends (default: the host name)

    [[deployments]]
    name = "support-bot"               # the `model` clients send
    backend_model = "meta-llama/Llama-3.1-8B-Instruct"   # the name the engines serve (default: name)
    raw_record_sample_rate = 0.05      # share of requests also sent as raw records (while aggregating)

    [[deployments.backends]]
    name = "incumbent-1"
    pool = "incumbent"                 # incumbent | candidate | baseline | follower
    url = "http://10.0.0.5:8000"
    drafter_version = 3                # the drafter version it serves (omit: none or the configured one)

A deployment named ``"*"`` stands for every deployment not listed: a request for any other ``model``
is served by its backends once the control plane confirms the deployment exists (the router then
follows its serving-config like the listed ones). Backends may also be declared through the API
(``POST .../deployments/{name}/backends``); the router reads them from ``serving-config`` and
merges them with the file's (a name in the file wins).
A ``follower`` backend follows serving-config itself (the reference server) and serves whichever arm
the router names in ``x-speculation-arm``; the other pools serve one fixed configuration each.

With ``aggregate_window_s`` above 0 every served request is summed into the window's aggregates
(``edge-window/v1``) and only a ``raw_record_sample_rate`` share of requests is also sent as a raw
record; the control plane's own rate for a deployment wins over the file's once serving-config
carries one. With 0 (the default) every request is sent as a raw record: a deployment's detector
then steps per request, which notices a drop within a window's worth fewer requests; aggregate
windows are for fleets whose record rate one control plane cannot take (see docs/results.md, Fleet scale).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from controlplane.ingest.aggregates import MAX_WINDOW_S, MIN_WINDOW_S

Pool = Literal["incumbent", "candidate", "baseline", "follower"]
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,99}$")
_EDGE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Room left in the control plane's 200 characters for the boot id and a part suffix.
MAX_EDGE_ID_BASE = 150


class RouterConfigError(ValueError):
    """The configuration file cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _http_url(value: str, field: str) -> str:
    if not re.match(r"^https?://[^\s/]+", value):
        raise ValueError(f"{field} must be an http:// or https:// URL, got {value!r}")
    return value.rstrip("/")


class BackendSpec(_Strict):
    name: str
    pool: Pool
    url: str
    drafter_version: int | None = Field(default=None, ge=1)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must be lowercase letters, digits and '-', at most 100 characters")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _http_url(value, "url")


WILDCARD = "*"
DEPLOYMENT_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class DeploymentRoutes(_Strict):
    name: str
    backend_model: str | None = None
    backends: list[BackendSpec] = Field(default_factory=list)
    # Used until serving-config names the deployment's own rate (and ignored without aggregation).
    raw_record_sample_rate: float = Field(default=1.0, ge=0.0, le=1.0)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value != WILDCARD and not DEPLOYMENT_NAME.match(value):
            raise ValueError('must be a deployment id (lowercase letters, digits, "-") or "*" for any other')
        return value

    @model_validator(mode="after")
    def _unique_backends(self) -> DeploymentRoutes:
        names = [b.name for b in self.backends]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"backend names repeat: {', '.join(repeated)}")
        return self


class ControlPlaneLink(_Strict):
    url: str
    account: str = "default"
    # A file holding the key, role serving: only serving keys read serving-config, and only the
    # records a serving key writes steer a canary. None: the CONTROLPLANE_ROUTER_API_KEY setting.
    api_key_file: str | None = None
    # Serving-config is polled this often (conditionally, by ETag): changes apply within it.
    poll_interval_s: float = Field(default=1.0, gt=0.0, le=5.0)
    timeout_s: float = Field(default=5.0, gt=0.0)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _http_url(value, "control_plane.url")

    def api_key(self, fallback: str | None) -> str | None:
        """The key from ``api_key_file``, else ``fallback`` (the settings' router_api_key)."""
        if self.api_key_file:
            try:
                return Path(self.api_key_file).read_text().strip() or None
            except OSError as exc:
                raise RouterConfigError(f"control_plane.api_key_file: cannot read it: {exc}") from None
        return fallback


class RouterSettings(_Strict):
    spool_dir: str = "var/router-spool"
    # The spool never grows past this; beyond it the oldest batches are dropped and counted.
    spool_max_mb: float = Field(default=256.0, gt=0.0)
    client_key_header: str | None = "x-session-id"
    connect_timeout_s: float = Field(default=2.0, gt=0.0)
    # Until the backend's first byte (a non-streamed completion sends it only when done).
    first_byte_timeout_s: float = Field(default=120.0, gt=0.0)
    breaker_failures: int = Field(default=3, ge=1)
    breaker_cooldown_s: float = Field(default=10.0, gt=0.0)
    report_interval_s: float = Field(default=0.5, gt=0.0)
    report_batch: int = Field(default=500, ge=1, le=10_000)
    # Seconds per aggregate window, aligned to multiples of it since the epoch; 0 sends one raw
    # record per request instead. The control plane takes 10..3600 dividing a day.
    aggregate_window_s: int = 0
    # This router's name in its windows (default: the host name). Each process appends a boot id,
    # so a restarted router (or a second worker) never sends another body for a stored window.
    edge_id: str | None = Field(default=None, min_length=1, max_length=MAX_EDGE_ID_BASE)
    # A window whose body would pass this is sent in parts, each under its own edge id.
    aggregate_max_body_mb: float = Field(default=32.0, gt=0.0, le=1024.0)

    @field_validator("aggregate_window_s")
    @classmethod
    def _window(cls, value: int) -> int:
        if value != 0 and not (MIN_WINDOW_S <= value <= MAX_WINDOW_S and 86_400 % value == 0):
            raise ValueError(
                f"must be 0 (off) or a number of seconds in [{MIN_WINDOW_S}, {MAX_WINDOW_S}] dividing a day"
            )
        return value

    @field_validator("edge_id")
    @classmethod
    def _edge_id(cls, value: str | None) -> str | None:
        if value is not None and not _EDGE_ID.match(value):
            raise ValueError("must be letters, digits, '.', '_' or '-'")
        return value


class RouterConfig(_Strict):
    control_plane: ControlPlaneLink
    router: RouterSettings = Field(default_factory=RouterSettings)
    deployments: list[DeploymentRoutes]

    @model_validator(mode="after")
    def _unique_deployments(self) -> RouterConfig:
        names = [d.name for d in self.deployments]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"deployment names repeat: {', '.join(repeated)}")
        if not names:
            raise ValueError("no [[deployments]] declared")
        return self


def parse_config(raw: dict[str, object], source: str = "<config>") -> RouterConfig:
    try:
        return RouterConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise RouterConfigError(f"{source}: {problems}") from None


def load_config(path: str | Path) -> RouterConfig:
    """Read and check a TOML router configuration; ``RouterConfigError`` says what is wrong."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RouterConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise RouterConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(raw, str(path))
