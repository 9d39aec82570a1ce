"""Run the reference server: `python -m workers.serve --config serving.json --port 8001`.

Serving config comes from one of:
  --config FILE               a JSON file mapping model names to serving-config entries
                              (see `workers.serve.server`);
  --control-plane URL         the control plane: per model name (= deployment name) it reads
                              URL/v1/accounts/ACCOUNT/deployments/{model}/serving-config and posts
                              the acceptance records and sampled traces back to .../acceptance and
                              .../traces (batched, from a background thread; --no-report: don't);
  --serving-config-url T      any URL template with {model} (--report-url T: where to post, the
                              deployment's base URL template, also with {model}).
The API key is read from --api-key-file (kept out of the process list) or --api-key.

--metrics-style fireworks (default) answers `perf_metrics_in_response` with Fireworks'
`perf_metrics`; --metrics-style vllm makes every reply carry vLLM's per-request
`metrics.speculative_decoding` instead (as `vllm serve --per-request-spec-decode-metrics summary`),
so the server stands in for a vLLM backend. Requests may pin an arm with `x-speculation-arm`;
replies say what served in `x-speculation-arm` / `x-drafter-version`. A --config FILE whose model
has one arm makes a fixed backend (incumbent drafter, candidate drafter, or speculation disabled).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import uvicorn

from controlplane.config import get_settings
from workers.engine.proposers import check_confidence_threshold
from workers.loading import VerifiedModels
from workers.serve.reporter import ControlPlaneReporter
from workers.serve.server import METRICS_STYLES, ServerConfig, create_app, http_serving_config


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m workers.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help='JSON file: {"models": {name: entry}} or {name: entry}')
    src.add_argument("--control-plane", help="control plane base URL, e.g. http://127.0.0.1:8600")
    src.add_argument("--serving-config-url", help="URL template with {model}")
    ap.add_argument("--account", default="default", help="account name (with --control-plane)")
    ap.add_argument("--report-url", default=None, help="deployment base URL template with {model} to post to")
    ap.add_argument("--no-report", action="store_true", help="do not post records and traces")
    ap.add_argument("--api-key", default=None, help="bearer key for the control plane")
    ap.add_argument("--api-key-file", type=Path, default=None, help="file holding the bearer key")
    ap.add_argument(
        "--trace-sample-rate",
        type=float,
        default=0.0,
        help="share of requests whose prompt and completion are posted as traces, when the serving "
        "config does not give the deployment's own trace_sample_rate",
    )
    ap.add_argument(
        "--config-ttl", type=float, default=1.0, help="seconds a fetched serving config is reused"
    )
    ap.add_argument(
        "--metrics-style",
        choices=METRICS_STYLES,
        default="fireworks",
        help="per-request metrics in replies: fireworks (perf_metrics when the request asks, the "
        "default) or vllm (metrics.speculative_decoding on every reply, as vLLM's "
        "--per-request-spec-decode-metrics summary)",
    )
    ap.add_argument("--model", action="append", default=[], help="model names to list in /v1/models")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument(
        "--multi-row-threads",
        type=int,
        default=None,
        help="threads verify passes may use instead; the faster of the two, as timed while serving, "
        "is used (default: --threads for every pass)",
    )
    ap.add_argument(
        "--draft-confidence-threshold",
        type=float,
        default=0.0,
        help="end a draft-model round at the first token the drafter gives less than this "
        "probability (0, the default: always draft k)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.threads:
        torch.set_num_threads(args.threads)
    api_key = args.api_key_file.read_text().strip() if args.api_key_file is not None else args.api_key
    report_url: str | None = args.report_url
    if args.config is not None:
        raw = json.loads(args.config.read_text())
        config = ServerConfig(serving_config=raw.get("models", raw), model_names=args.model)
    else:
        url = args.serving_config_url
        if args.control_plane is not None:
            base = f"{args.control_plane.rstrip('/')}/v1/accounts/{args.account}/deployments/{{model}}"
            url = f"{base}/serving-config"
            report_url = report_url or base
        config = ServerConfig(
            serving_config=http_serving_config(url, api_key, ttl_s=args.config_ttl), model_names=args.model
        )
    # Model refs from the control plane resolve through the same settings as the workers: the
    # model roots, and the artifact store with its verified local cache.
    config.model_locator = VerifiedModels(get_settings()).path_of
    config.trace_sample_rate = args.trace_sample_rate
    config.metrics_style = args.metrics_style
    config.multi_row_threads = args.multi_row_threads
    try:  # drafters load on the first request: refuse a bad value now, not then
        check_confidence_threshold(args.draft_confidence_threshold)
    except ValueError as exc:
        raise SystemExit(f"--draft-confidence-threshold: {exc}") from exc
    config.draft_confidence_threshold = args.draft_confidence_threshold
    if report_url and not args.no_report:
        reporter = ControlPlaneReporter(report_url, api_key=api_key)
        config.on_record = reporter.record
        config.on_trace = reporter.trace
        # What completed before the stop still reaches the control plane (bounded wait).
        config.on_shutdown = lambda: reporter.close(timeout_s=5.0)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
