"""`controlplane scrape ...`: register, list, delete and scrape now a deployment's scrape targets.

Thin verbs over the REST API (``/v1/accounts/{account}/deployments/{deployment}/scrape-targets``);
registered onto the main app by ``controlplane.cli``.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from controlplane.cli_client import ApiClient, show
from controlplane.config import get_settings

scrape_app = typer.Typer(
    no_args_is_help=True,
    help="Pull backends' Prometheus /metrics into a deployment's acceptance records.",
)


def _client() -> ApiClient:
    return ApiClient(get_settings())


def _path(client: Any, deployment: str, name: str | None = None) -> str:
    path = f"/v1/accounts/{client.account}/deployments/{deployment}/scrape-targets"
    return path if name is None else f"{path}/{name}"


@scrape_app.command("add")
def scrape_add(
    deployment: Annotated[str, typer.Argument(help="the deployment its records are filed under")],
    name: Annotated[str, typer.Argument(help="unique in the deployment: a-z, 0-9 and '-'")],
    url: Annotated[
        list[str],
        typer.Option("--url", help="the engine's /metrics URL; repeat for more API servers of one engine"),
    ],
    arm: Annotated[str, typer.Option(help='"live", "baseline" or "canary:<drafter version>"')] = "live",
    drafter_version: Annotated[
        int | None, typer.Option("--drafter-version", help="the drafter version the engine serves")
    ] = None,
) -> None:
    """Register a scrape target; beat pulls it from then on (every 15 s)."""
    client = _client()
    body = {"name": name, "urls": list(url), "arm": arm, "drafter_version": drafter_version}
    show(client.request("POST", _path(client, deployment), body))


@scrape_app.command("list")
def scrape_list(deployment: Annotated[str, typer.Argument()]) -> None:
    """List a deployment's scrape targets with their last outcome."""
    client = _client()
    rows = client.request("GET", _path(client, deployment))["scrape_targets"]
    for row in rows:
        typer.echo(
            f"{row['name']}\t{row['arm']}\tv{row['drafter_version'] or '-'}\t{','.join(row['urls'])}\t"
            f"scrapes: {row['scrapes']}\trecords: {row['records_stored']}\t"
            f"last: {row['last_scraped_at'] or '-'}\terror: {row['last_error'] or '-'}"
        )
    if not rows:
        typer.echo("no scrape targets", err=True)


@scrape_app.command("delete")
def scrape_delete(
    deployment: Annotated[str, typer.Argument()], name: Annotated[str, typer.Argument()]
) -> None:
    """Stop scraping a target (the records it stored stay)."""
    client = _client()
    client.request("DELETE", _path(client, deployment, name))
    typer.echo(f"deleted scrape target {name}")


@scrape_app.command("now")
def scrape_now(deployment: Annotated[str, typer.Argument()], name: Annotated[str, typer.Argument()]) -> None:
    """Scrape a target now and show what it stored (or why it failed; exit status 1 then)."""
    client = _client()
    outcome = client.request("POST", f"{_path(client, deployment, name)}/scrape")
    show(outcome)
    if not outcome["ok"]:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    app.add_typer(scrape_app, name="scrape")
