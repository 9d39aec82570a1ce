"""The router's configuration file (TOML): where the control plane is, how to reach it, and each
deployment's backend pools.

::

    [control_plane]
    url = "http://127.0.0.1:8600"
    account = "default"
    api_key_file = "/run/secrets/router-key"       # a serving key; else CONTROLPLANE_ROUTER_API_KEY

    [router]
    spool_dir = "var/router-spool"     # records and traces wait here while the control plane is away
    client_key_header = "x-session-id"

    [[deployments]]
    name = "support-bot"               # the `model` clients send
    backend_model = "meta-llama/Llama-3.1-8B-Instruct"   # the name the engines serve (default: name)

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
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Pool = Literal["incumbent", "candidate", "baseline", "follower"]
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,99}$")


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
