"""`controlplane drafter ...` and `controlplane canary ...`: versions, canaries, promotion, rollback.

Thin verbs over the REST API (admin key for the changing ones); registered onto the main app by
``controlplane.cli``.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from controlplane.cli_client import ApiClient, show
from controlplane.config import get_settings

drafter_app = typer.Typer(
    no_args_is_help=True, help="Drafter versions: list, get, promote, canary, rollback."
)
canary_app = typer.Typer(no_args_is_help=True, help="Canaries: list, get, promote, reject.")


def _client() -> ApiClient:
    return ApiClient(get_settings())


def _base(client: Any, deployment_id: str) -> str:
    return f"/v1/accounts/{client.account}/deployments/{deployment_id}"


def _act(deployment_id: str, suffix: str, reason: str) -> None:
    """POST an audited action (its reason goes to the audit log) and show the answer."""
    client = _client()
    show(client.request("POST", f"{_base(client, deployment_id)}{suffix}", {"reason": reason}))


Reason = Annotated[str, typer.Option(help="recorded in the audit log")]


@drafter_app.command("list")
def drafter_list(deployment_id: Annotated[str, typer.Argument()]) -> None:
    """List a deployment's drafter versions, newest first."""
    client = _client()
    rows = client.request("GET", f"{_base(client, deployment_id)}/drafter-versions")["drafter_versions"]
    for row in rows:
        hit = (row.get("training_metrics") or {}).get("held_out_after", {}).get("expected_acceptance")
        typer.echo(f"{row['version']}\t{row['state']}\t{row['created_at']}\theld-out acceptance {hit}")
    if not rows:
        typer.echo("no drafter versions", err=True)


@drafter_app.command("get")
def drafter_get(
    deployment_id: Annotated[str, typer.Argument()], version: Annotated[int, typer.Argument()]
) -> None:
    """Show one version: state, lineage, checksum, training metrics."""
    client = _client()
    show(client.request("GET", f"{_base(client, deployment_id)}/drafter-versions/{version}"))


@drafter_app.command("promote")
def drafter_promote(
    deployment_id: Annotated[str, typer.Argument()],
    version: Annotated[int, typer.Argument()],
    reason: Reason = "by hand",
) -> None:
    """Promote a candidate now, without a canary (admin)."""
    _act(deployment_id, f"/drafter-versions/{version}:promote", reason)


@drafter_app.command("canary")
def drafter_canary(
    deployment_id: Annotated[str, typer.Argument()],
    version: Annotated[int, typer.Argument()],
    reason: Reason = "by hand",
) -> None:
    """Start a canary for a candidate (shadow replay, then the live split) (admin)."""
    _act(deployment_id, f"/drafter-versions/{version}:canary", reason)


@drafter_app.command("rollback")
def drafter_rollback(
    deployment_id: Annotated[str, typer.Argument()],
    reason: Reason = "by hand",
) -> None:
    """Undo the last promotion: the previous drafter and its k serve again (admin)."""
    _act(deployment_id, ":rollback", reason)


@canary_app.command("list")
def canary_list(deployment_id: Annotated[str, typer.Argument()]) -> None:
    """List a deployment's canaries, newest first."""
    client = _client()
    rows = client.request("GET", f"{_base(client, deployment_id)}/canaries")["canaries"]
    for row in rows:
        typer.echo(
            f"{row['canary_id']}\tv{row['candidate_version']} vs v{row['incumbent_version']}\t"
            f"{row['phase']}\t"
            f"{row['decision'] or '-'}\t{row['reason'] or ''}"
        )
    if not rows:
        typer.echo("no canaries", err=True)


@canary_app.command("get")
def canary_get(
    deployment_id: Annotated[str, typer.Argument()], canary_id: Annotated[int, typer.Argument()]
) -> None:
    """Show one canary: arms, figures, decision and why."""
    client = _client()
    show(client.request("GET", f"{_base(client, deployment_id)}/canaries/{canary_id}"))


@canary_app.command("promote")
def canary_promote(
    deployment_id: Annotated[str, typer.Argument()],
    canary_id: Annotated[int, typer.Argument()],
    reason: Reason = "by hand",
) -> None:
    """Promote the canary's candidate now (admin)."""
    _act(deployment_id, f"/canaries/{canary_id}:promote", reason)


@canary_app.command("reject")
def canary_reject(
    deployment_id: Annotated[str, typer.Argument()],
    canary_id: Annotated[int, typer.Argument()],
    reason: Reason = "by hand",
) -> None:
    """Reject the canary's candidate; the incumbent keeps serving (admin)."""
    _act(deployment_id, f"/canaries/{canary_id}:reject", reason)


def register(app: typer.Typer) -> None:
    app.add_typer(drafter_app, name="drafter")
    app.add_typer(canary_app, name="canary")
