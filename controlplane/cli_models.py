"""`controlplane model ...`: register, list, get, set a target's default drafter, delete.

Thin verbs over the REST API (``/v1/accounts/{account}/models``); registered onto the main app by
``controlplane.cli``.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from controlplane.config import get_settings

model_app = typer.Typer(
    no_args_is_help=True,
    help="The model registry: the targets and drafters deployments may name.",
)
# Registration hashes every file of the folder on the server: minutes for a multi-GB model.
REGISTER_TIMEOUT_S = 1800.0


def _client() -> Any:
    from controlplane.cli import ApiClient  # the main CLI module owns the HTTP client

    return ApiClient(get_settings())


def _show(data: Any) -> None:
    from controlplane.cli import _show as show

    show(data)


def _fail(message: str) -> None:
    from controlplane.cli import _fail as fail

    fail(message)


@model_app.command("register")
def model_register(
    name: Annotated[str, typer.Argument(help="the name deployments will use")],
    path: Annotated[
        str | None, typer.Option(help="a Hugging Face folder under one of the operator's model roots")
    ] = None,
    hf_id: Annotated[
        str | None,
        typer.Option("--hf-id", help="ORG/NAME[@REVISION], resolved through the Hugging Face cache"),
    ] = None,
    drafter_for: Annotated[
        list[str] | None, typer.Option("--drafter-for", help="a target this model may draft for (repeat)")
    ] = None,
    default_for: Annotated[
        list[str] | None,
        typer.Option("--default-for", help="a target that gets this drafter by default (repeat)"),
    ] = None,
) -> None:
    """Register a model from a folder (--path) or a Hugging Face id (--hf-id)."""
    if (path is None) == (hf_id is None):
        _fail("give exactly one of --path DIR or --hf-id ORG/NAME[@REVISION]")
    drafts = list(drafter_for or [])
    defaults = list(default_for or [])
    body = {
        "name": name,
        "path": path,
        "hf_id": hf_id,
        "drafter_for": sorted(set(drafts) | set(defaults)),
        "default_for": defaults,
    }
    client = _client()
    _show(client.request("POST", f"/v1/accounts/{client.account}/models", body, timeout_s=REGISTER_TIMEOUT_S))


@model_app.command("list")
def model_list() -> None:
    """List the models this account may name: its own, then the platform's."""
    client = _client()
    rows = client.request("GET", f"/v1/accounts/{client.account}/models")["models"]
    for row in rows:
        drafts = ",".join(row["drafter_for"]) or "-"
        typer.echo(
            f"{row['name']}\t{row['scope']}\t{row['family']}\t{row['parameter_count']:,} params\t"
            f"{row['dtype']}\tdrafts for: {drafts}\tdefault drafter: {row['default_drafter'] or '-'}"
        )
    if not rows:
        typer.echo("no models registered", err=True)


@model_app.command("get")
def model_get(name: Annotated[str, typer.Argument()]) -> None:
    """Show one model: family, size, dtype, tokenizer, files and their sha256."""
    client = _client()
    _show(client.request("GET", f"/v1/accounts/{client.account}/models/{name}"))


@model_app.command("set-default-drafter")
def model_set_default(
    target: Annotated[str, typer.Argument(help="the target model")],
    drafter: Annotated[str | None, typer.Argument(help="a drafter registered for it; omit to clear")] = None,
) -> None:
    """Choose the drafter deployments of this target get when they set no speculation flags."""
    client = _client()
    _show(
        client.request(
            "PATCH", f"/v1/accounts/{client.account}/models/{target}", {"default_drafter": drafter}
        )
    )


@model_app.command("delete")
def model_delete(name: Annotated[str, typer.Argument()]) -> None:
    """Unregister a model (refused while a deployment uses it); its files are left alone."""
    client = _client()
    client.request("DELETE", f"/v1/accounts/{client.account}/models/{name}")
    typer.echo(f"deleted model {name}")


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")
