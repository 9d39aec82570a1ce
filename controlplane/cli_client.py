"""The CLI's HTTP client and its output: every resource verb (``controlplane.cli`` and the verb
modules it registers, ``cli_canary``, ``cli_models``, ``cli_scrape``) talks to the API through
:class:`ApiClient` and prints with :func:`show` / :func:`fail`.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

import httpx
import typer

from controlplane.config import Settings, dev_key_file


class ApiClient:
    """A small HTTP client that turns API errors into readable CLI failures."""

    def __init__(self, settings: Settings) -> None:
        key = settings.api_key
        if key is None and dev_key_file(settings).exists():
            key = dev_key_file(settings).read_text().strip()
        if not key:
            fail("no API key: set CONTROLPLANE_API_KEY (printed once by `controlplane init`)")
        self._http = httpx.Client(
            base_url=settings.api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30.0
        )
        self._account: str | None = None

    @property
    def account(self) -> str:
        if self._account is None:
            self._account = str(self.request("GET", "/v1/whoami")["account"])
        return self._account

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> Any:
        try:
            response = self._http.request(
                method, path, json=body, timeout=timeout_s if timeout_s is not None else self._http.timeout
            )
        except httpx.HTTPError as exc:
            fail(f"cannot reach the API at {self._http.base_url}: {exc}")
        if response.status_code >= 400:
            try:
                error = response.json().get("error", {})
                message = error.get("message", response.text)
                details = error.get("details")
            except ValueError:
                message, details = response.text, None
            fail(
                f"{response.status_code}: {message}"
                + (f"\n{json.dumps(details, indent=2)}" if details else "")
            )
        return response.json() if response.content else None


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def show(data: Any) -> None:
    """Print an API answer as indented JSON."""
    typer.echo(json.dumps(data, indent=2, sort_keys=True))
