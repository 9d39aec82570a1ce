"""`controlplane ...`: serve the API, initialise an account, and firectl-like resource verbs.

Resource verbs talk to the API over HTTP (CONTROLPLANE_API_URL, CONTROLPLANE_API_KEY; in
development the key falls back to var/admin.key written at first start).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from controlplane.cli_client import ApiClient, fail, show
from controlplane.config import environment_for_child, get_settings

app = typer.Typer(no_args_is_help=True, help="Control plane for speculative-decoding drafters.")
deployment_app = typer.Typer(no_args_is_help=True, help="Create, update, get, list and delete deployments.")
key_app = typer.Typer(no_args_is_help=True, help="Manage API keys of your account.")
app.add_typer(deployment_app, name="deployment")
app.add_typer(key_app, name="key")
models_app = typer.Typer(no_args_is_help=True, help="Build the reference target and generic drafter.")
app.add_typer(models_app, name="models")
job_app = typer.Typer(no_args_is_help=True, help="List, get and cancel realignment jobs.")
app.add_typer(job_app, name="job")


@app.command()
def init(account: Annotated[str, typer.Option(help="name of the first account")] = "default") -> None:
    """Migrate the database and create the first account, printing its admin key once."""
    # Imported here: the database layer costs seconds to import, and the HTTP commands need none.
    from controlplane.bootstrap import init_account

    settings = get_settings()
    issued = init_account(settings, account_name=account)
    if issued is None:
        fail("an account already exists; keys are only printed when they are created")
    typer.echo(f"account: {account}\nadmin API key (shown once, store it now): {issued.secret}")


@app.command()
def migrate() -> None:
    """Upgrade the database to the newest schema (alembic upgrade head)."""
    from controlplane.db.migrate import upgrade_to_head

    upgrade_to_head(get_settings().database_url)
    typer.echo("database at head")


@app.command()
def router(
    config: Annotated[
        Path | None,
        typer.Option("--config", help="the router's TOML file (default: CONTROLPLANE_ROUTER_CONFIG)"),
    ] = None,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8700,
    account: Annotated[str | None, typer.Option(help="overrides control_plane.account")] = None,
    workers: Annotated[int, typer.Option(min=1, help="router processes sharing the port")] = 1,
) -> None:
    """Run the arm router: an OpenAI-compatible proxy in front of the serving fleet's backends."""
    import os

    import uvicorn

    from controlplane.router.app import create_app as create_router
    from controlplane.router.config import RouterConfigError, load_config

    settings = get_settings()
    path = config or settings.router_config
    if path is None:
        typer.echo("error: give --config FILE (or set CONTROLPLANE_ROUTER_CONFIG)", err=True)
        raise typer.Exit(2)
    try:
        loaded = load_config(path)
        if account is not None:
            link = loaded.control_plane.model_copy(update={"account": account})
            loaded = loaded.model_copy(update={"control_plane": link})
        app_ = create_router(loaded, settings.router_api_key)
    except RouterConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"router on http://{host}:{port} for {', '.join(d.name for d in loaded.deployments)}")
    serving = {
        "host": host,
        "port": port,
        "log_level": "warning",
        "access_log": False,
        "loop": "uvloop",
        "http": "httptools",
        "timeout_graceful_shutdown": 10,
    }
    if workers == 1:
        uvicorn.run(app_, **serving)  # type: ignore[arg-type]
        return
    # Several processes on one port (the kernel spreads connections): each builds its router from
    # the same file and keeps its own spool slot. uvicorn starts them from an import path.
    overrides = {"CONTROLPLANE_ROUTER_CONFIG": str(Path(path).resolve())}
    if account is not None:
        overrides["CONTROLPLANE_ROUTER_ACCOUNT"] = account
    argv = [sys.executable, "-m", "uvicorn", "controlplane.router.app:from_settings", "--factory"]
    argv += ["--host", host, "--port", str(port), "--workers", str(workers), "--log-level", "warning"]
    argv += [
        "--no-access-log",
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--timeout-graceful-shutdown",
        "10",
    ]
    # Replace this process, so that a supervisor's SIGTERM reaches uvicorn's own shutdown.
    os.execve(sys.executable, argv, environment_for_child(**overrides))


@app.command()
def serve(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    workers: Annotated[int, typer.Option(help="API processes")] = 1,
) -> None:
    """Run the API server."""
    import uvicorn

    from controlplane.app import create_app

    settings = get_settings()
    settings.ensure_local_dirs()
    host = host or settings.api_host
    port = port or settings.api_port
    typer.echo(f"control plane API on http://{host}:{port}  (OpenAPI: http://{host}:{port}/docs)")
    if workers > 1:
        # Separate processes (each with its own group-commit writer) read settings from the
        # environment, so they are built from the factory's import path.
        uvicorn.run(
            "controlplane.app:create_app",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_level="warning",
        )
        return
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")


def _exec_celery(*args: str, env: dict[str, str] | None = None) -> None:
    import subprocess

    # The worker imports torch-backed task code, so it runs as its own process, never in here.
    command = [sys.executable, "-m", "celery", "-A", "workers.celery_app", *args]
    raise typer.Exit(subprocess.call(command, env=env))


@app.command()
def worker(
    queues: Annotated[str, typer.Option(help="comma-separated: default, gpu")] = "default,gpu",
    concurrency: Annotated[int, typer.Option()] = 1,
) -> None:
    """Run a Celery worker (queues: default for monitoring, gpu for training and canary replay)."""
    # Tasks size their torch threads by the worker's process count (Settings.worker_torch_threads).
    env = environment_for_child(CONTROLPLANE_WORKER_CONCURRENCY=str(concurrency))
    _exec_celery("worker", "-Q", queues, "-c", str(concurrency), "--loglevel=INFO", env=env)


@app.command()
def beat() -> None:
    """Run Celery beat (the drift monitor every few seconds, trace retention hourly)."""
    settings = get_settings()
    settings.ensure_local_dirs()
    _exec_celery("beat", "--schedule", str(settings.var_dir / "celerybeat-schedule"), "--loglevel=INFO")


@app.command()
def up(
    serve_port: Annotated[int, typer.Option(help="reference server port")] = 8601,
    router_port: Annotated[int, typer.Option(help="arm router port (send traffic here)")] = 8700,
    worker_concurrency: Annotated[int, typer.Option(help="worker processes (prefork)")] = 2,
    trace_sample_rate: Annotated[float, typer.Option(help="when a deployment does not set one")] = 0.1,
    grace: Annotated[float, typer.Option(help="seconds between SIGTERM and SIGKILL at stop")] = 10.0,
    serve_multi_row_threads: Annotated[
        int | None,
        typer.Option(
            help="torch threads the reference server's verify passes may try, timed as it serves "
            "(default: its own share; more pays only on a machine nothing else keeps busy)",
            min=1,
        ),
    ] = None,
) -> None:
    """Run API, Celery worker (default + gpu queues), beat, the reference server and the arm router
    in front of it; Ctrl-C stops all."""
    from controlplane.supervisor import UpOptions, run_up

    options = UpOptions(
        serve_port=serve_port,
        router_port=router_port,
        worker_concurrency=worker_concurrency,
        trace_sample_rate=trace_sample_rate,
        grace_s=grace,
        serve_multi_row_threads=serve_multi_row_threads,
    )
    raise typer.Exit(run_up(get_settings(), options, echo=typer.echo))


# `--help` goes through to the demo's own parser, which lists every option (typer knows none).
@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)
def demo(ctx: typer.Context) -> None:
    """The whole loop on this machine: traffic shifts, the service detects, realigns, canaries and
    promotes on its own; prints a summary table (every option: controlplane demo --help).

    Runs in its own process: it drives the reference engine's traffic, which the control plane
    never imports.
    """
    import subprocess

    raise typer.Exit(subprocess.call([sys.executable, "-m", "workers.demo", *ctx.args]))


def _speculation_body(
    draft_model: str | None,
    draft_token_count: int | None,
    ngram_speculation_length: int | None,
    disable_speculative_decoding: bool | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if draft_model is not None:
        body["draft_model"] = draft_model
    if draft_token_count is not None:
        body["draft_token_count"] = draft_token_count
    if ngram_speculation_length is not None:
        body["ngram_speculation_length"] = ngram_speculation_length
    if disable_speculative_decoding is not None:
        body["disable_speculative_decoding"] = disable_speculative_decoding
    return body


DraftModel = Annotated[str | None, typer.Option("--draft-model", help="drafter model to speculate with")]
DraftTokenCount = Annotated[
    int | None, typer.Option("--draft-token-count", help="tokens drafted per step (k)")
]
NgramLength = Annotated[
    int | None, typer.Option("--ngram-speculation-length", help="n-gram prompt-lookup length")
]
DisableSpec = Annotated[
    bool | None,
    typer.Option(
        "--disable-speculative-decoding/--enable-speculative-decoding", help="turn speculation off/on"
    ),
]


@deployment_app.command("create")
def deployment_create(
    target_model: Annotated[str, typer.Argument(help="the target model to serve")],
    deployment_id: Annotated[str | None, typer.Option("--deployment-id")] = None,
    display_name: Annotated[str | None, typer.Option("--display-name")] = None,
    draft_model: DraftModel = None,
    draft_token_count: DraftTokenCount = None,
    ngram_speculation_length: NgramLength = None,
    disable_speculative_decoding: DisableSpec = None,
    auto_realign: Annotated[bool, typer.Option("--auto-realign/--no-auto-realign")] = True,
) -> None:
    """Create a deployment (no speculation flag: inherit the default drafter)."""
    client = ApiClient(get_settings())
    body = {
        "target_model": target_model,
        "deployment_id": deployment_id,
        "display_name": display_name,
        "auto_realign": auto_realign,
        **_speculation_body(
            draft_model, draft_token_count, ngram_speculation_length, disable_speculative_decoding
        ),
    }
    show(client.request("POST", f"/v1/accounts/{client.account}/deployments", body))


@deployment_app.command("update")
def deployment_update(
    deployment_id: Annotated[str, typer.Argument()],
    draft_model: DraftModel = None,
    draft_token_count: DraftTokenCount = None,
    ngram_speculation_length: NgramLength = None,
    disable_speculative_decoding: DisableSpec = None,
    auto_realign: Annotated[bool | None, typer.Option("--auto-realign/--no-auto-realign")] = None,
    display_name: Annotated[str | None, typer.Option("--display-name")] = None,
) -> None:
    """Change the drafter, draft-token count or options of a deployment."""
    client = ApiClient(get_settings())
    body = _speculation_body(
        draft_model, draft_token_count, ngram_speculation_length, disable_speculative_decoding
    )
    if auto_realign is not None:
        body["auto_realign"] = auto_realign
    if display_name is not None:
        body["display_name"] = display_name
    if not body:
        fail("nothing to update: pass at least one flag")
    show(client.request("PATCH", f"/v1/accounts/{client.account}/deployments/{deployment_id}", body))


@deployment_app.command("get")
def deployment_get(deployment_id: Annotated[str, typer.Argument()]) -> None:
    """Show one deployment."""
    client = ApiClient(get_settings())
    show(client.request("GET", f"/v1/accounts/{client.account}/deployments/{deployment_id}"))


@deployment_app.command("list")
def deployment_list() -> None:
    """List the account's deployments."""
    client = ApiClient(get_settings())
    rows = client.request("GET", f"/v1/accounts/{client.account}/deployments")["deployments"]
    for row in rows:
        k = row["effective_draft_token_count"]
        typer.echo(f"{row['name']}\t{row['target_model']}\t{row['speculation_mode']}\tk={k}")
    if not rows:
        typer.echo("no deployments", err=True)


@deployment_app.command("delete")
def deployment_delete(deployment_id: Annotated[str, typer.Argument()]) -> None:
    """Delete a deployment (its history is kept)."""
    client = ApiClient(get_settings())
    client.request("DELETE", f"/v1/accounts/{client.account}/deployments/{deployment_id}")
    typer.echo(f"deleted {deployment_id}")


@deployment_app.command("realign")
def deployment_realign(
    deployment_id: Annotated[str, typer.Argument()],
    time_budget_s: Annotated[float | None, typer.Option(help="training time budget in seconds")] = None,
    drafter_kind: Annotated[
        str | None,
        typer.Option(help="draft_model | eagle3 (a head over the target's states); default: the incumbent's"),
    ] = None,
) -> None:
    """Start a realignment now (returns the running one if there is one already)."""
    client = ApiClient(get_settings())
    params: dict[str, object] = {"time_budget_s": time_budget_s} if time_budget_s is not None else {}
    if drafter_kind is not None:
        params["drafter_kind"] = drafter_kind
    show(
        client.request(
            "POST", f"/v1/accounts/{client.account}/deployments/{deployment_id}:realign", {"params": params}
        )
    )


@job_app.command("list")
def job_list(
    deployment_id: Annotated[str, typer.Argument()],
    state: Annotated[
        str | None, typer.Option(help="queued | running | succeeded | failed | cancelled")
    ] = None,
) -> None:
    """List a deployment's jobs, newest first."""
    client = ApiClient(get_settings())
    path = f"/v1/accounts/{client.account}/deployments/{deployment_id}/jobs"
    rows = client.request("GET", path + (f"?state={state}" if state else ""))["jobs"]
    for row in rows:
        typer.echo(
            f"{row['id']}\t{row['kind']}\t{row['state']}\t{row['progress']:.0%}\t{row['progress_message']}"
        )
    if not rows:
        typer.echo("no jobs", err=True)


@job_app.command("get")
def job_get(
    deployment_id: Annotated[str, typer.Argument()], job_id: Annotated[int, typer.Argument()]
) -> None:
    """Show one job: state, attempts, progress, result."""
    client = ApiClient(get_settings())
    show(client.request("GET", f"/v1/accounts/{client.account}/deployments/{deployment_id}/jobs/{job_id}"))


@job_app.command("cancel")
def job_cancel(
    deployment_id: Annotated[str, typer.Argument()], job_id: Annotated[int, typer.Argument()]
) -> None:
    """Cancel a queued or running job (a running one stops at its next progress checkpoint)."""
    client = ApiClient(get_settings())
    path = f"/v1/accounts/{client.account}/deployments/{deployment_id}/jobs/{job_id}:cancel"
    show(client.request("POST", path))


@key_app.command("create")
def key_create(
    name: Annotated[str, typer.Argument()],
    role: Annotated[
        str, typer.Option(help="admin | ingest | viewer | serving (the fleet: router, servers)")
    ] = "viewer",
) -> None:
    """Issue a key; the secret is printed once."""
    client = ApiClient(get_settings())
    show(client.request("POST", f"/v1/accounts/{client.account}/api-keys", {"name": name, "role": role}))


@key_app.command("list")
def key_list() -> None:
    """List the account's keys (never their secrets)."""
    client = ApiClient(get_settings())
    show(client.request("GET", f"/v1/accounts/{client.account}/api-keys"))


@key_app.command("revoke")
def key_revoke(key_id: Annotated[int, typer.Argument()]) -> None:
    """Revoke a key at once."""
    client = ApiClient(get_settings())
    client.request("DELETE", f"/v1/accounts/{client.account}/api-keys/{key_id}")
    typer.echo(f"revoked key {key_id}")


# `--help` goes through to the builder's own parser, which lists every option (typer knows none).
@models_app.command(
    "build",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def models_build(ctx: typer.Context) -> None:
    """Train the reference models from the built-in corpora (resumable; every option: --help).

    Runs in its own process: training needs torch, which the control plane never imports.
    """
    import subprocess

    command = [sys.executable, "-m", "workers.training.build_reference", *ctx.args]
    raise typer.Exit(subprocess.call(command))


def _register_resource_verbs() -> None:
    from controlplane.cli_canary import register
    from controlplane.cli_models import register as register_models
    from controlplane.cli_scrape import register as register_scrape
    from loadbench.cli import register as register_benchmark

    register(app)
    register_models(app)
    register_scrape(app)
    register_benchmark(app)


_register_resource_verbs()


def main() -> None:  # pragma: no cover - console entry point
    app(sys.argv[1:])
