"""Day 0: how long a deployment without a drafter waits for its first one, and what it gains.

    python bench/drafters_day0.py [--quick] [--skip-demo] [--skip-init]

Two measurements, written to bench/results/drafters_day0.json:

1. The day-0 demo (``scenarios/day0.toml`` through ``workers.demo``, real processes on the embedded
   default): a new deployment of the reference target with no drafter serves structured requests
   without speculation; the service trains a first drafter from the target's own weights,
   canaries it against no speculation and promotes it. Read back from its database and REST API:
   ``day0_first_promotion_s``, from the deployment's first request to the promotion (target <=
   600 s), and ``day0_speedup_vs_nospec``, the live arm's decode throughput on the promoted
   drafter over the live arm's before the first canary started (no speculation then), both from
   the stats API. ``--quick`` runs the demo with ``--fast``.
2. The first drafter's initial weights: the default narrow drafter, its embeddings projected from
   the target's (``workers.training.first_drafter``), against the same shape randomly initialised
   and against a cut of the target (its first layers, embeddings and LM head), each distilled by
   ``workers.training.realign`` within the same time budget on the same structured traces (the
   target's greedy completions of validation-split prompts), then measured on held-out test-split
   prompts (greedy, k=4, each request ended at its first line as a client's stop would): hit
   rate and tokens per verify step, before and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.drafters_partial import run_demo  # noqa: E402
from bench.realign import decode_figures, eval_prompts, load_reference, make_traces  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SCENARIO = ROOT / "scenarios" / "day0.toml"
DEPLOYMENT = "day0"
TARGET_FIRST_PROMOTION_S = 600.0
STRUCTURED_STOP = ("\n",)


def demo_database(folder: Path) -> str:
    return f"sqlite:///{folder / 'var' / 'demo' / 'controlplane.db'}"


def _minute_floor(moment: str) -> str:
    from datetime import datetime

    return datetime.fromisoformat(moment).replace(second=0, microsecond=0).isoformat()


def day0_figures(database_url: str, deployment: str = DEPLOYMENT) -> dict[str, Any]:
    """What the day-0 run did, read back from its database and its REST API (in process): the
    first-drafter job, the promoting canary, and the live arm's throughput before and after."""
    from fastapi.testclient import TestClient
    from sqlalchemy import func, select

    from controlplane.accounts.service import first_account, issue_key
    from controlplane.app import create_app
    from controlplane.config import Settings
    from controlplane.db.models import AcceptanceRecordRow, Deployment, Role
    from controlplane.db.session import unit_of_work
    from controlplane.timestamps import as_utc, parse_utc

    settings = Settings(database_url=database_url, environment="test", drift_enqueue_on_ingest=False)
    with unit_of_work(database_url) as session:
        account = first_account(session=session)
        assert account is not None, "the demo created no account"
        key = issue_key(
            session=session, account=account, name="bench", role=Role.viewer, secret=settings.secret_key
        )
        account_name = account.name
        pk = session.scalars(select(Deployment.id).where(Deployment.name == deployment)).one()
        first_record = session.scalar(
            select(func.min(AcceptanceRecordRow.created_at)).where(AcceptanceRecordRow.deployment_id == pk)
        )
    headers = {"Authorization": f"Bearer {key.secret}"}
    base = f"/v1/accounts/{account_name}/deployments/{deployment}"
    with TestClient(create_app(settings)) as client:
        jobs = client.get(f"{base}/jobs", headers=headers).json()["jobs"]
        canaries = client.get(f"{base}/canaries", headers=headers).json()["canaries"]
        described = client.get(base, headers=headers).json()
        promoted = [c for c in canaries if c["decision"] == "promote"]
        first_canary = min(canaries, key=lambda c: c["canary_id"]) if canaries else None
        out: dict[str, Any] = {
            "first_drafter_jobs": [
                {"id": j["id"], "state": j["state"], "trigger": j["trigger"]}
                for j in jobs
                if j["kind"] == "realign" and j["trigger"] == "first_drafter"
            ],
            "canaries": [
                {"id": c["canary_id"], "version": c["candidate_version"], "decision": c["decision"]}
                for c in canaries
            ],
            "speculation_mode": described["speculation_mode"],
            "active_drafter_version": described["active_drafter_version"],
            "draft_token_count": described["draft_token_count"],
        }
        if not promoted or first_canary is None or first_record is None:
            return out
        canary = min(promoted, key=lambda c: c["canary_id"])
        decided = parse_utc(canary["decided_at"])
        nospec = client.get(
            f"{base}/stats",
            # Minute buckets, ending at the start of the minute the first canary started in: an
            # hour's bucket, or that minute's, can also hold the live arm's records after the promotion.
            params={"arm": "live", "end": _minute_floor(first_canary["started_at"]), "bucket_seconds": 60},
            headers=headers,
        ).json()["total"]
        promoted_live = client.get(
            f"{base}/stats",
            params={"arm": "live", "drafter_version": canary["candidate_version"], "bucket_seconds": 3600},
            headers=headers,
        ).json()["total"]
        baseline = client.get(
            f"{base}/stats", params={"arm": "baseline", "bucket_seconds": 3600}, headers=headers
        ).json()["total"]
    before, after = nospec.get("decode_tokens_per_s"), promoted_live.get("decode_tokens_per_s")
    split = canary["arms"].get("decision_figures", {}).get("arm_counts", {})
    out.update(
        {
            "promoted_version": canary["candidate_version"],
            "day0_first_promotion_s": round((decided - as_utc(first_record)).total_seconds(), 1),
            "nospec_live": {"requests": nospec["requests"], "decode_tokens_per_s": before},
            "promoted_live": {
                "requests": promoted_live["requests"],
                "hit_rate": promoted_live["hit_rate"],
                "decode_tokens_per_s": after,
            },
            "baseline_arm": {
                "requests": baseline["requests"],
                "decode_tokens_per_s": baseline.get("decode_tokens_per_s"),
            },
            "day0_speedup_vs_nospec": round(after / before, 3) if after and before else None,
            "canary_split_ms_per_token": {arm: figures.get("ms_per_token") for arm, figures in split.items()},
        }
    )
    return out


def compare_initialisations(*, quick: bool) -> dict[str, Any]:
    """The default first drafter (narrow, embeddings projected from the target's) against the same
    shape randomly initialised and against a cut of the target's leading layers, each distilled
    within the same time budget on the same traces, as the worker distils a first drafter."""
    import torch

    from workers.engine.model import Transformer
    from workers.training.first_drafter import (
        FIRST_DRAFTER_MAX_EPOCHS,
        choose_layers,
        cost_fraction,
        first_drafter_from_target,
        narrow_drafter_from_target,
        step_weights,
    )
    from workers.training.realign import RealignConfig, realign

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    target, tokenizer, _generic = load_reference()
    n_traces, new_tokens = (200, 48) if quick else (400, 48)
    budget_s = 90.0 if quick else 180.0
    traces = make_traces(target, tokenizer, "structured", n_traces, new_tokens, seed=0)
    prompts = eval_prompts(tokenizer, "structured", 12 if quick else 32)
    n_layers = choose_layers(target.config)
    narrow = narrow_drafter_from_target(target)
    torch.manual_seed(0)
    narrow_random = Transformer(narrow.config).to(dtype=torch.float32)
    out: dict[str, Any] = {
        "narrow_shape": [narrow.config.n_layers, narrow.config.dim],
        "narrow_cost_fraction_weights": round(step_weights(narrow.config) / step_weights(target.config), 3),
        "cut_layers": n_layers,
        "target_layers": target.config.n_layers,
        "cut_cost_fraction_weights": round(cost_fraction(target.config, n_layers), 3),
        "time_budget_s": budget_s,
        "max_epochs": FIRST_DRAFTER_MAX_EPOCHS,
        "traces": len(traces),
        "eval_prompts": len(prompts),
        "arms": {},
    }
    for name, initial in (
        ("narrow_projected", narrow),
        ("narrow_random", narrow_random),
        ("target_cut", first_drafter_from_target(target, n_layers)),
    ):
        start = decode_figures(target, tokenizer, initial, prompts, new_tokens, stop=STRUCTURED_STOP)
        initial.invalidate_fast_path()  # decoding cached packed weights that cannot be copied
        t0 = time.perf_counter()
        cfg = RealignConfig(seed=0, time_budget_s=budget_s, max_epochs=FIRST_DRAFTER_MAX_EPOCHS)
        result = realign(target, initial, tokenizer, traces, [], cfg)
        trained_s = time.perf_counter() - t0
        end = decode_figures(target, tokenizer, result.model, prompts, new_tokens, stop=STRUCTURED_STOP)
        metrics = result.metrics
        out["arms"][name] = {
            "before_training": start,
            "after_training": end,
            "realign_wall_s": round(trained_s, 1),
            "steps_run": metrics.get("steps_run"),
            "teacher": metrics.get("teacher"),
            "held_out_before": metrics.get("held_out_before"),
            "held_out_after": metrics.get("held_out_after"),
        }
        print(f"{name}: before {start}, after {end} ({trained_s:.0f} s)", flush=True)
    arms = out["arms"]
    out["projected_beats_random"] = (
        arms["narrow_projected"]["after_training"]["hit_rate"]
        > arms["narrow_random"]["after_training"]["hit_rate"]
    )
    return out


def measure(quick: bool = False, *, demo: bool = True, initialisations: bool = True) -> dict[str, Any]:
    """Run the day-0 demo (and the initial-weights comparison); the figures, flat at the top."""
    out: dict[str, Any] = {"quick": quick, "load_average_1m": os.getloadavg()[0]}
    if demo:
        with tempfile.TemporaryDirectory(prefix="day0-") as tmp:
            folder = Path(tmp)
            started = time.monotonic()
            summary = run_demo(quick=quick, var_dir=folder, scenario=SCENARIO, embedded=True, timeout_s=1800)
            output = summary.pop("_output")
            figures = day0_figures(demo_database(folder))
            out.update(
                {
                    "day0_first_promotion_s": figures.get("day0_first_promotion_s"),
                    "day0_speedup_vs_nospec": figures.get("day0_speedup_vs_nospec"),
                    "target_first_promotion_s": TARGET_FIRST_PROMOTION_S,
                    "demo_wall_s": round(time.monotonic() - started, 1),
                    "demo": figures,
                    "demo_summary_speedup_vs_nospec": summary.get("stages", {})
                    .get("after_promotion_live", {})
                    .get("speedup_vs_nospec"),
                    "demo_decision": summary.get("decision"),
                    "demo_decision_reason": summary.get("decision_reason"),
                }
            )
            if figures.get("day0_first_promotion_s") is None:
                out["demo_output_tail"] = output[-3000:]
    if initialisations:
        out["initial_weights"] = compare_initialisations(quick=quick)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the demo's --fast run and a shorter comparison")
    ap.add_argument("--skip-demo", action="store_true", help="only the initial-weights comparison")
    ap.add_argument("--skip-init", action="store_true", help="only the day-0 demo")
    args = ap.parse_args()
    result = measure(args.quick, demo=not args.skip_demo, initialisations=not args.skip_init)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "drafters_day0.json"
    if path.is_file() and (args.skip_demo or args.skip_init):
        # Keep the part not measured this time (each part takes minutes on a shared machine).
        earlier = json.loads(path.read_text())
        if args.skip_demo:
            kept = {k: v for k, v in earlier.items() if k.startswith(("day0_", "demo", "target_"))}
        else:
            kept = {k: v for k, v in earlier.items() if k == "initial_weights"}
        result = {**kept, **result}
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
