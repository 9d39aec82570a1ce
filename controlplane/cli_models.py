"""`controlplane model ...`: register, import a GGUF file, list, get, set a target's default
drafter, delete.

Thin verbs over the REST API (``/v1/accounts/{account}/models``); registered onto the main app by
``controlplane.cli``. `import-gguf` converts in its own process (``python -m workers.gguf_import``:
torch and transformers, which the control plane never imports) and then registers like
`register --path`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli_client import ApiClient, fail, show
from controlplane.config import Settings, get_settings

model_app = typer.Typer(
    no_args_is_help=True,
    help="The model registry: the targets and drafters deployments may name.",
)
# Registration hashes every file of the folder on the server: minutes for a multi-GB model.
REGISTER_TIMEOUT_S = 1800.0


def _client() -> ApiClient:
    return ApiClient(get_settings())


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
        fail("give exactly one of --path DIR or --hf-id ORG/NAME[@REVISION]")
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
    show(client.request("POST", f"/v1/accounts/{client.account}/models", body, timeout_s=REGISTER_TIMEOUT_S))


GGUF_MAGIC = b"GGUF"


def gguf_model_name(path: Path) -> str:
    """A registry-safe name from a GGUF file's name: `SmolLM2-135M-Instruct.Q4_1.gguf` →
    `smollm2-135m-instruct-q4_1`."""
    stem = path.name.removesuffix(".gguf")
    cleaned = "".join(c if c.isalnum() or c in "_-" else "-" for c in stem.lower()).strip("-_")
    return cleaned[:100] or "gguf-model"


def _writable(folder: Path) -> bool:
    """Whether ``folder`` can be written to, or created under its nearest existing parent."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK)


def default_import_root(settings: Settings) -> Path:
    """The first writable model root, leaving out the folder the bundled models ship in."""
    bundled = settings.reference_models_dir.resolve().parent
    for root in settings.model_roots:
        if root.resolve() != bundled and _writable(root):
            return root
    fail(
        "no writable model root to import into: pass --out DIR inside one of "
        f"{', '.join(str(r) for r in settings.model_roots)} (CONTROLPLANE_MODEL_ROOTS)"
    )


@model_app.command("import-gguf")
def model_import_gguf(
    file: Annotated[Path, typer.Argument(help="a .gguf model file (llama, qwen2, qwen3)")],
    name: Annotated[str | None, typer.Option(help="the model's name (default: from the file name)")] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="the folder to write (default: <first writable model root>/NAME)"),
    ] = None,
    register_model: Annotated[
        bool, typer.Option("--register", help="register the folder once imported and checked")
    ] = False,
    overwrite: Annotated[bool, typer.Option(help="replace an existing output folder")] = False,
    tolerance: Annotated[
        float | None, typer.Option(help="largest |logit difference| accepted against transformers")
    ] = None,
) -> None:
    """Convert a GGUF file into a float32 Hugging Face folder, check it against transformers, and
    optionally register it."""
    if not file.is_file():
        fail(f"{file} does not exist")
    with open(file, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        fail(f"{file} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    model_name = name or gguf_model_name(file)
    folder = out if out is not None else default_import_root(get_settings()) / model_name
    if folder.exists() and not overwrite:
        fail(f"{folder} already exists; choose --out DIR or --name NAME, or pass --overwrite")
    command = [sys.executable, "-m", "workers.gguf_import", str(file), str(folder), "--name", model_name]
    if overwrite:
        command.append("--overwrite")
    if tolerance is not None:
        command += ["--tolerance", str(tolerance)]
    # stderr stays on the terminal: loading progress, and the worker's own error line on refusal.
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        fail(f"GGUF import of {file} failed (exit status {done.returncode}); nothing was written")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    show(summary)
    if register_model:
        client = _client()
        body = {"name": model_name, "path": summary["folder"], "drafter_for": [], "default_for": []}
        show(
            client.request(
                "POST", f"/v1/accounts/{client.account}/models", body, timeout_s=REGISTER_TIMEOUT_S
            )
        )


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
    show(client.request("GET", f"/v1/accounts/{client.account}/models/{name}"))


@model_app.command("set-default-drafter")
def model_set_default(
    target: Annotated[str, typer.Argument(help="the target model")],
    drafter: Annotated[str | None, typer.Argument(help="a drafter registered for it; omit to clear")] = None,
) -> None:
    """Choose the drafter deployments of this target get when they set no speculation flags."""
    client = _client()
    show(
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
