"""The ``controlplane benchmark`` command: options in, a benchmark plan run, the reports written.

The same prompts, output lengths, sampling parameters and concurrency levels go to every
configuration given (a named endpoint + model + extra request fields: the inherited default, a
candidate drafter, n-gram settings, speculation disabled...). Reports per configuration and load
TTFT, inter-token latency and request latency (p50/p95), output tokens/s, the acceptance by
position the responses report, and, with ``--latency-bound-ms``, the maximum sustainable request
rate; a table in the terminal, ``benchmark.json``, ``benchmark.csv`` and AIPerf-shaped per-request
records in ``profile_export.jsonl`` under ``--out-dir``, plus AIPerf's own layout per configuration
and load (``aiperf/<config>/<load type>-<load>/`` with ``profile_export.jsonl`` and the summary
``profile_export_aiperf.json``; with a single configuration and load the summary also sits next to
the top-level JSONL), so AIPerf's tooling reads the runs.

``--engine`` (or ``engine=`` per configuration) says whether to send Fireworks'
``perf_metrics_in_response``: ``auto`` sends it and drops it for a configuration whose server
refuses it (see ``loadbench.runner.Configuration``).

Configurations: ``--config NAME=URL[,model=MODEL][,api_key_file=PATH][,extra=JSON]`` (repeatable;
``extra`` comes last since its JSON may hold commas; the model defaults to NAME), or a TOML file
(``--configs``) with ``[[config]]`` tables (``name``, ``url``, ``model``, ``api_key_file``,
``extra``) or ``[config.NAME]`` tables. Prompts: ``--dataset FILE`` (JSONL, JSON, or ``.txt`` with
one prompt a line), else the built-in set of ``--domain`` (see ``loadbench.prompts``).

``controlplane.cli`` registers the command through ``register``; the module itself never imports
torch or the workers.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Annotated, Any

import typer

from loadbench.prompts import DOMAINS, DatasetError, PromptItem, builtin_prompts, load_dataset
from loadbench.runner import ARRIVALS, ENGINES, BenchmarkPlan, Configuration, Sampling, run_benchmark

_CONFIG_KEYS = frozenset({"name", "url", "model", "extra", "api_key_file", "engine"})


class ConfigError(ValueError):
    """A configuration that cannot be used."""


def _api_key(path: str | None, default: str | None) -> str | None:
    if path is None:
        return default
    try:
        return Path(path).expanduser().read_text().strip() or None
    except OSError as exc:
        raise ConfigError(f"cannot read api_key_file {path!r}: {exc}") from exc


def _extra(raw: object, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: extra is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: extra must be a JSON object of request fields")
    return dict(raw)


def _engine(value: str, where: str) -> str:
    if value not in ENGINES:
        raise ConfigError(f"{where}: engine must be one of {', '.join(ENGINES)}, got {value!r}")
    return value


def parse_config_option(
    text: str, default_api_key: str | None = None, default_engine: str = "auto"
) -> Configuration:
    """``NAME=URL[,model=M][,api_key_file=P][,engine=E][,extra=JSON]`` into a configuration."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or not rest:
        raise ConfigError(f"--config {text!r}: expected NAME=URL[,model=...][,extra=JSON]")
    extra_raw: str | None = None
    marker = rest.find(",extra=")
    if marker >= 0:
        rest, extra_raw = rest[:marker], rest[marker + len(",extra=") :]
    url, *pairs = rest.split(",")
    fields: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or key not in {"model", "api_key_file", "engine"}:
            raise ConfigError(
                f"--config {name}: unknown part {pair!r} (model=, api_key_file=, engine=, extra=)"
            )
        fields[key] = value.strip()
    if not url.strip().startswith(("http://", "https://")):
        raise ConfigError(f"--config {name}: URL must start with http:// or https://, got {url!r}")
    return Configuration(
        name=name,
        url=url.strip(),
        model=fields.get("model") or name,
        extra=_extra(extra_raw, f"--config {name}"),
        api_key=_api_key(fields.get("api_key_file"), default_api_key),
        engine=_engine(fields.get("engine") or default_engine, f"--config {name}"),
    )


def load_configs_file(
    path: Path, default_api_key: str | None = None, default_engine: str = "auto"
) -> list[Configuration]:
    """Configurations from TOML: ``[[config]]`` tables, or ``[config.NAME]`` tables."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    raw = doc.get("config", doc.get("configs"))
    entries: list[dict[str, Any]]
    if isinstance(raw, list):
        entries = [dict(e) for e in raw if isinstance(e, dict)]
    elif isinstance(raw, dict):
        entries = [{"name": key, **value} for key, value in raw.items() if isinstance(value, dict)]
    else:
        raise ConfigError(f"{path}: expected [[config]] tables (name, url, model, extra)")
    out: list[Configuration] = []
    for i, entry in enumerate(entries):
        where = f"{path}: config {entry.get('name', i)!r}"
        unknown = set(entry) - _CONFIG_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        if not isinstance(entry.get("name"), str) or not isinstance(entry.get("url"), str):
            raise ConfigError(f"{where}: needs string name and url")
        out.append(
            Configuration(
                name=entry["name"],
                url=entry["url"],
                model=str(entry.get("model") or entry["name"]),
                extra=_extra(entry.get("extra"), where),
                api_key=_api_key(entry.get("api_key_file"), default_api_key),
                engine=_engine(str(entry.get("engine") or default_engine), where),
            )
        )
    return out


def _numbers(values: list[str] | None, kind: type[int] | type[float], option: str) -> list[Any]:
    """Repeatable options that may also hold comma-separated lists: ``--concurrency 1,2 --concurrency 4``."""
    out: list[Any] = []
    for value in values or []:
        for part in value.split(","):
            if not part.strip():
                continue
            try:
                number = kind(part)
            except ValueError as exc:
                raise typer.BadParameter(f"{part!r} is not a number", param_hint=option) from exc
            if not (math.isfinite(number) and number > 0):
                raise typer.BadParameter(f"{part!r} must be positive", param_hint=option)
            out.append(number)
    return out


def benchmark(
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            "-c",
            help="NAME=URL[,model=MODEL][,api_key_file=PATH][,engine=ENGINE][,extra=JSON]; repeatable",
        ),
    ] = None,
    configs: Annotated[
        Path | None,
        typer.Option(
            "--configs", help="TOML file: one config table (name, url, model, extra) each", exists=True
        ),
    ] = None,
    dataset: Annotated[
        Path | None,
        typer.Option(
            help="JSONL with a 'prompt' field a line (exported traces work), or .txt with one prompt a line",
            exists=True,
        ),
    ] = None,
    domain: Annotated[
        str, typer.Option(help=f"built-in prompt set when no --dataset: {' | '.join(DOMAINS)}")
    ] = "prose",
    requests: Annotated[int, typer.Option(min=1, help="requests per configuration and concurrency")] = 16,
    prompts: Annotated[
        int | None,
        typer.Option(
            min=1, help="distinct prompts used, at most (default: all of the dataset or built-in set)"
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(min=1, help="output length (a dataset line's max_tokens wins)")
    ] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, max=2.0)] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    seed: Annotated[int | None, typer.Option(help="request i is sent with seed + i")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="ask for exactly max_tokens (vLLM's ignore_eos)")] = False,
    concurrency: Annotated[
        list[str] | None, typer.Option(help="closed-loop concurrency levels, e.g. 1,4,16 (default 1)")
    ] = None,
    latency_bound_ms: Annotated[
        float | None,
        typer.Option(help="search the highest request rate whose p95 request latency stays under this"),
    ] = None,
    rates: Annotated[
        list[str] | None, typer.Option(help="request rates (req/s) to probe instead of searching")
    ] = None,
    search_requests: Annotated[int, typer.Option(min=1, help="requests per probed rate")] = 16,
    max_probes: Annotated[int, typer.Option(min=1, help="most rates probed per configuration")] = 8,
    arrival: Annotated[str, typer.Option(help="open-loop arrivals: poisson | constant")] = "poisson",
    warmup: Annotated[int, typer.Option(min=0, help="unmeasured requests per configuration first")] = 1,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="SSE streaming (client TTFT)")] = True,
    timeout: Annotated[float, typer.Option(min=1.0, help="seconds per request")] = 300.0,
    api_key_file: Annotated[
        Path | None, typer.Option(help="bearer key for every configuration without its own")
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="the servers' engine, for configurations that do not name their own: auto (send "
            "Fireworks' perf_metrics_in_response; if a server refuses it with a 4xx naming the field "
            "or saying extra fields are not permitted, as TensorRT-LLM's does, retry without it and "
            "leave it out for that configuration for the rest of the run), fireworks or reference "
            "(always send it), vllm, sglang or trtllm (never send it)"
        ),
    ] = "auto",
    out_dir: Annotated[
        Path,
        typer.Option(
            help="where benchmark.json, .csv, profile_export.jsonl and AIPerf's per-run folders "
            "(aiperf/<config>/<load>/profile_export.jsonl + profile_export_aiperf.json) go"
        ),
    ] = Path("var/benchmark"),
) -> None:
    """Benchmark configurations of OpenAI-compatible /v1/completions endpoints on the same prompts."""
    from rich.console import Console

    from loadbench.report import render, report_document, write_reports

    console = Console()
    if not console.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 160))
    err = Console(stderr=True)
    if arrival not in ARRIVALS:
        raise typer.BadParameter(f"must be one of {', '.join(ARRIVALS)}", param_hint="--arrival")
    try:
        default_key = _api_key(str(api_key_file), None) if api_key_file is not None else None
        _engine(engine, "--engine")
        chosen: list[Configuration] = [parse_config_option(c, default_key, engine) for c in config or []]
        if configs is not None:
            chosen.extend(load_configs_file(configs, default_key, engine))
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if not chosen:
        raise typer.BadParameter("give at least one --config NAME=URL or a --configs file")
    names = [c.name for c in chosen]
    if len(set(names)) != len(names):
        raise typer.BadParameter(f"configuration names repeat: {names}")
    levels = [int(c) for c in _numbers(concurrency, int, "--concurrency")] or [1]
    rate_list = [float(r) for r in _numbers(rates, float, "--rates")] or None
    if rate_list and latency_bound_ms is None:
        raise typer.BadParameter("--rates needs --latency-bound-ms (the bound the rates are judged by)")
    try:
        items: list[PromptItem] = load_dataset(dataset) if dataset is not None else builtin_prompts(domain)
    except (DatasetError, ValueError, OSError) as exc:
        err.print(f"[red]cannot read prompts:[/red] {exc}")
        raise typer.Exit(2) from exc
    if prompts is not None:
        items = items[:prompts]
    plan = BenchmarkPlan(
        configs=chosen,
        prompts=items,
        sampling=Sampling(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stream=stream,
            seed=seed,
            ignore_eos=ignore_eos,
            timeout_s=timeout,
        ),
        concurrencies=levels,
        requests=requests,
        warmup=warmup,
        latency_bound_ms=latency_bound_ms,
        rates=rate_list,
        search_requests=search_requests,
        max_probes=max_probes,
        arrival=arrival,
    )
    outcome = run_benchmark(plan, progress=lambda line: err.print(f"[dim]{line}[/dim]"))
    params = {
        **plan.describe(),
        "dataset": str(dataset) if dataset is not None else None,
        "domain": None if dataset is not None else domain,
        "warmup_errors": outcome.warmup_errors,
    }
    document = report_document(params, [c.describe() for c in chosen], outcome.results, outcome.searches)
    paths = write_reports(
        out_dir,
        document,
        outcome.results,
        outcome.searches,
        [rec for run in outcome.search_runs for rec in run.records],
    )
    render(console, outcome.results, outcome.searches)
    console.print(f"wrote {paths['json']}, {paths['csv']}, {paths['jsonl']}")
    failed = sum(r.summary["error_request_count"]["avg"] for r in outcome.results)
    if failed and failed == sum(len(r.records) for r in outcome.results):
        err.print("[red]every request failed[/red]")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("benchmark")(benchmark)
