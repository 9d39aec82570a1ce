"""Run the reference server: `python -m workers.serve --config serving.json --port 8001`.

The config file maps model names to serving-config entries (see `workers.serve.server`), or
`--serving-config-url` reads them from the control plane per request.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import uvicorn

from workers.serve.server import ServerConfig, create_app, http_serving_config


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m workers.serve", description=__doc__)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help='JSON file: {"models": {name: entry}} or {name: entry}')
    src.add_argument(
        "--serving-config-url", help="URL template with {model}, e.g. .../v1/{model}/serving-config"
    )
    ap.add_argument("--api-key", default=None, help="bearer key for --serving-config-url")
    ap.add_argument("--model", action="append", default=[], help="model names to list in /v1/models")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.config is not None:
        raw = json.loads(args.config.read_text())
        config = ServerConfig(serving_config=raw.get("models", raw), model_names=args.model)
    else:
        config = ServerConfig(
            serving_config=http_serving_config(args.serving_config_url, args.api_key), model_names=args.model
        )
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
