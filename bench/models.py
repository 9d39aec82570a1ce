"""Model registry, model families and the artifact store, measured end to end.

1. Families: the engine's parity with transformers on every model family it runs
   (``bench/model_families.py``'s ``parity_report``): the largest absolute logit difference over all
   variants, and whether greedy decoding matches transformers' tokens on each.
2. An unregistered target: creating a deployment for ``llama-3.1-8b`` through the API on a fresh
   SQLite database is refused (the status code) and leaves no deployment and no job behind.
3. Artifact tampering: the bundled generic drafter saved as a drafter artifact and uploaded to a
   real S3-compatible server (moto's standalone server, as the tests use); every object of the
   artifact, MANIFEST.json included, has one byte changed in the bucket in turn, and a fresh
   ``VerifiedArtifactCache`` must refuse each (``ArtifactVerificationError``); then the original is
   put back and accepted again.
4. A registered pair realigned through the API: the reference target and generic drafter registered
   under new names (``acme-target``, ``acme-drafter``) from a model root, a deployment of the pair at
   k=4, the target's own structured-domain completions posted as traces (prose traces before them,
   replayed against forgetting, as ``bench/realign.py`` does), ``:realign`` requested through the API
   and the Celery task run in this process against the S3-compatible store. The candidate is read
   back through the verified cache and its hit rate measured at k=4 on held-out structured requests
   exactly as ``bench/realign.py`` measures it, beside the generic drafter's. The API scrubs
   personal data from the traces it stores (an e-mail address becomes ``<EMAIL>``); the entities
   it replaced are reported.

Trace generation stands in for the serving side and is not timed (its results are cached under
bench/results/trace-cache, shared with bench/realign.py). Writes bench/results/models.json.

Usage: .venv/bin/python bench/models.py [--time-budget-s 240] [--shifted-traces 384]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from bench.model_families import parity_report  # noqa: E402
from bench.realign import STOPS, K, decode_figures, eval_prompts, make_traces  # noqa: E402
from controlplane.api.deps import get_work_queue  # noqa: E402
from controlplane.app import create_app  # noqa: E402
from controlplane.artifacts.manifest import ArtifactVerificationError  # noqa: E402
from controlplane.artifacts.store import VerifiedArtifactCache, open_store  # noqa: E402
from controlplane.bootstrap import init_account  # noqa: E402
from controlplane.config import Settings, get_settings  # noqa: E402
from controlplane.db.models import Deployment, Job  # noqa: E402
from controlplane.db.session import get_engine, unit_of_work  # noqa: E402
from controlplane.timestamps import utcnow  # noqa: E402
from tests.s3_server import TEST_CREDENTIALS, s3_client, start_s3_server, stop_s3_server  # noqa: E402
from workers.engine.hf_io import load_hf_folder  # noqa: E402
from workers.training.realign import save_drafter  # noqa: E402

REFERENCE = ROOT / "workers" / "models" / "reference"
RESULTS = ROOT / "bench" / "results"
SECRET = "bench-models-secret"
ACCOUNT = "acme"
DOMAIN = "structured"  # the structured (tool-call) shift of bench/realign.py
UNKNOWN_TARGET = "llama-3.1-8b"
TRACE_BATCH = 200  # the API takes at most 1000 traces per batch
TARGETS = {
    "families": ">= 4",
    "parity_max_abs_diff": "<= 1e-4",
    "unknown_model_status": "422",
    "artifact_tamper_refused": "1",
    "registered_pair_realigned_hit_rate": ">= 0.75",
}

STARTED = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {message}", flush=True)


class DiscardingWorkQueue:
    """Stands in for the app's Celery work queue: records the job ids instead of sending them (the
    bench runs the realign task itself, in this process)."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def enqueue_realign(self, job_id: int) -> None:
        self.sent.append(job_id)

    def enqueue_shadow_replay(self, job_id: int) -> None:
        self.sent.append(job_id)


def settings_for(tmp: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": f"sqlite:///{tmp / 'controlplane.db'}",
        "broker_url": "memory://",
        "result_backend_url": "cache+memory://",
        "var_dir": tmp / "var",
        "artifact_dir": tmp / "var" / "artifacts",
        "artifact_cache_dir": tmp / "artifact-cache",
        "environment": "test",
        "secret_key": SECRET,
        "drift_enqueue_on_ingest": False,
        "api_gc_freeze": False,
    }
    return Settings(**(values | overrides))


def api_client(settings: Settings) -> tuple[TestClient, DiscardingWorkQueue]:
    app = create_app(settings)
    queue = DiscardingWorkQueue()
    app.dependency_overrides[get_work_queue] = lambda: queue
    return TestClient(app), queue


def expect(response: Any, status: int) -> dict[str, Any]:
    if response.status_code != status:
        raise RuntimeError(
            f"{response.request.method} {response.request.url}: {response.status_code} {response.text}"
        )
    return dict(response.json())


# ------------------------------------------------------------------------------------ 1. families


def families_figures() -> dict[str, Any]:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per saved variant otherwise
    report = parity_report()
    per_family = {
        name: {
            "family": entry.get("family", name),
            "max_abs_diff": entry["max_abs_diff"],
            "greedy_identical": bool(entry["greedy_identical"]),
        }
        for name, entry in report["per_family"].items()
    }
    family_names = sorted({entry["family"] for entry in per_family.values()})
    return {
        "families": len(family_names),
        "family_names": family_names,
        "variants": list(report["families"]),
        "per_family": per_family,
        "parity_max_abs_diff": report["parity_max_abs_diff"],
        "greedy_identical_all": all(e["greedy_identical"] for e in per_family.values()),
    }


# ------------------------------------------------------------------------- 2. an unknown target


def unknown_model_figures(tmp: Path) -> dict[str, Any]:
    settings = settings_for(tmp)
    issued = init_account(settings, account_name=ACCOUNT)
    assert issued is not None
    headers = {"Authorization": f"Bearer {issued.secret}"}
    client, queue = api_client(settings)
    with client:
        response = client.post(
            f"/v1/accounts/{ACCOUNT}/deployments",
            json={"deployment_id": "bench", "target_model": UNKNOWN_TARGET},
            headers=headers,
        )
    with unit_of_work(settings.database_url) as session:
        jobs = int(session.scalar(select(func.count()).select_from(Job)) or 0)
        deployments = int(session.scalar(select(func.count()).select_from(Deployment)) or 0)
    get_engine(settings.database_url).dispose()
    assert jobs == 0 and deployments == 0 and not queue.sent, (jobs, deployments, queue.sent)
    return {
        "unknown_model_status": response.status_code,
        "unknown_model_error": response.json().get("error", response.json()),
        "unknown_model_jobs": jobs,
        "unknown_model_deployments": deployments,
    }


# ------------------------------------------------------------------------- 3. artifact tampering


def tamper_figures(tmp: Path, endpoint: str) -> dict[str, Any]:
    s3 = s3_client(endpoint)
    bucket = "bench-tamper"
    s3.create_bucket(Bucket=bucket)
    model, tokenizer = load_hf_folder(REFERENCE / "generic-drafter")
    artifact = save_drafter(model, tokenizer, tmp / "artifact", metadata={"bench": "models"})
    uri = open_store(f"s3://{bucket}/artifacts", s3_endpoint_url=endpoint).upload_folder(
        artifact.path, "bench/job-1"
    )
    attempts = 0

    def fresh_load() -> Path:
        # A fresh cache each time: a copy already verified in a cache is served from disk without
        # asking the store again, so only a fresh cache sees what the bucket holds now.
        nonlocal attempts
        attempts += 1
        cache = VerifiedArtifactCache(tmp / f"cache-{attempts}", s3_endpoint_url=endpoint)
        return cache.local_folder(uri, artifact.manifest_sha256)

    fresh_load()
    prefix = "artifacts/bench/job-1/"
    keys = sorted(item["Key"] for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"])
    refused: dict[str, str] = {}
    accepted: list[str] = []
    for key in keys:
        original = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        changed = bytearray(original)
        changed[len(changed) // 2] ^= 0x01
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(changed))
        try:
            fresh_load()
            accepted.append(key)
        except ArtifactVerificationError as exc:
            refused[key] = str(exc)[:200]
        finally:
            s3.put_object(Bucket=bucket, Key=key, Body=original)
    fresh_load()  # the restored artifact is accepted again
    names = [key.removeprefix(prefix) for key in keys]
    say(f"tamper: {len(refused)}/{len(keys)} one-byte changes refused ({', '.join(names)})")
    return {
        "artifact_tamper_refused": int(len(refused) == len(keys) and not accepted and len(keys) > 0),
        "files_checked": len(keys),
        "files_refused": len(refused),
        "files": names,
        "manifest_files": sorted(artifact.manifest["files"]),
        "accepted_after_tamper": [key.removeprefix(prefix) for key in accepted],
    }


# --------------------------------------------------------------- 4. a registered pair, realigned


def post_traces(
    client: TestClient, headers: dict[str, str], traces: list[Any], category: str, scrubbed: dict[str, int]
) -> int:
    """Post ``traces`` in batches; returns how many were stored and adds the entities the API
    scrubbed from them (an e-mail address becomes a placeholder) to ``scrubbed``."""
    stored = 0
    for lo in range(0, len(traces), TRACE_BATCH):
        body = {
            "traces": [
                {"prompt": t.prompt, "completion": t.completion, "category": category}
                for t in traces[lo : lo + TRACE_BATCH]
            ]
        }
        reply = expect(
            client.post(f"/v1/accounts/{ACCOUNT}/deployments/bench/traces", json=body, headers=headers), 200
        )
        stored += int(reply["stored"])
        for entity, count in reply["scrubbed"].items():
            scrubbed[entity] = scrubbed.get(entity, 0) + int(count)
    return stored


def registered_pair_figures(tmp: Path, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    bucket = "bench-registry"
    s3_client(endpoint).create_bucket(Bucket=bucket)
    models_dir = tmp / "models"
    shutil.copytree(REFERENCE / "target", models_dir / "target")
    shutil.copytree(REFERENCE / "generic-drafter", models_dir / "generic-drafter")
    settings = settings_for(
        tmp,
        model_roots=[models_dir],
        artifact_store_uri=f"s3://{bucket}/artifacts",
        s3_endpoint_url=endpoint,
        realign_min_traces=1,
    )
    # The task reads its settings from the environment (get_settings), as a worker process does.
    env = {
        "CONTROLPLANE_DATABASE_URL": settings.database_url,
        "CONTROLPLANE_BROKER_URL": settings.broker_url,
        "CONTROLPLANE_RESULT_BACKEND_URL": settings.result_backend_url,
        "CONTROLPLANE_MODEL_ROOTS": json.dumps([str(models_dir)]),
        "CONTROLPLANE_ARTIFACT_STORE_URI": str(settings.artifact_store_uri),
        "CONTROLPLANE_S3_ENDPOINT_URL": endpoint,
        "CONTROLPLANE_ARTIFACT_CACHE_DIR": str(settings.artifact_cache_dir),
        "CONTROLPLANE_ARTIFACT_DIR": str(settings.artifact_dir),
        "CONTROLPLANE_VAR_DIR": str(settings.var_dir),
        "CONTROLPLANE_ENVIRONMENT": "test",
        "CONTROLPLANE_SECRET_KEY": SECRET,
        "CONTROLPLANE_REALIGN_MIN_TRACES": "1",
        "CONTROLPLANE_DRIFT_ENQUEUE_ON_INGEST": "false",
        "CONTROLPLANE_WORKER_TORCH_THREADS": str(torch.get_num_threads()),
        "CONTROLPLANE_WORKER_DEVICE": "cpu",
    }
    os.environ.update(env)
    get_settings.cache_clear()
    from workers.tasks import run_realign  # after the environment: the Celery app reads it on import

    issued = init_account(settings, account_name=ACCOUNT)
    assert issued is not None
    headers = {"Authorization": f"Bearer {issued.secret}"}
    client, queue = api_client(settings)
    figures: dict[str, Any] = {}
    with client:
        expect(
            client.post(
                f"/v1/accounts/{ACCOUNT}/models",
                json={"name": "acme-target", "path": "target"},
                headers=headers,
            ),
            201,
        )
        expect(
            client.post(
                f"/v1/accounts/{ACCOUNT}/models",
                json={"name": "acme-drafter", "path": "generic-drafter", "drafter_for": ["acme-target"]},
                headers=headers,
            ),
            201,
        )
        deployment = expect(
            client.post(
                f"/v1/accounts/{ACCOUNT}/deployments",
                json={
                    "deployment_id": "bench",
                    "target_model": "acme-target",
                    "draft_model": "acme-drafter",
                    "draft_token_count": K,
                    "auto_realign": False,
                },
                headers=headers,
            ),
            201,
        )
        say(f"registered acme-target, acme-drafter; deployment bench ({deployment.get('speculation_mode')})")

        target, tokenizer = load_hf_folder(models_dir / "target")
        t0 = time.perf_counter()
        prose = make_traces(target, tokenizer, "prose", args.prose_traces, args.trace_tokens, args.seed)
        shifted = make_traces(target, tokenizer, DOMAIN, args.shifted_traces, args.trace_tokens, args.seed)
        trace_s = time.perf_counter() - t0
        say(f"traces: {len(shifted)} {DOMAIN}, {len(prose)} prose ({trace_s:.0f}s, not timed)")
        scrubbed: dict[str, int] = {}
        stored_prose = post_traces(client, headers, prose, "prose", scrubbed)
        since = utcnow()  # the structured traffic starts here; the prose before it is replayed
        time.sleep(0.01)
        stored_shifted = post_traces(client, headers, shifted, DOMAIN, scrubbed)
        say(f"posted {stored_shifted} {DOMAIN} traces after {stored_prose} prose traces")

        job = expect(
            client.post(
                f"/v1/accounts/{ACCOUNT}/deployments/bench:realign",
                json={
                    "params": {
                        "time_budget_s": args.time_budget_s,
                        "seed": args.seed,
                        "since": since.isoformat(),
                    }
                },
                headers=headers,
            ),
            202,
        )
        job_id = int(job["id"])
        assert queue.sent == [job_id], queue.sent
        say(f"realign job {job_id} queued; running the task in this process")
        t0 = time.perf_counter()
        outcome = run_realign.apply(args=[job_id], throw=True).get()
        task_wall_s = time.perf_counter() - t0
        say(f"task done in {task_wall_s:.0f}s: {outcome}")
        job = expect(
            client.get(f"/v1/accounts/{ACCOUNT}/deployments/bench/jobs/{job_id}", headers=headers), 200
        )
        if job["state"] != "succeeded":
            raise RuntimeError(f"realign job {job_id} is {job['state']}: {job.get('error')}")
        version = expect(
            client.get(f"/v1/accounts/{ACCOUNT}/deployments/bench/drafter-versions/1", headers=headers), 200
        )
    get_engine(settings.database_url).dispose()
    uri = version["artifact_uri"]
    if not uri.startswith("s3://"):
        raise RuntimeError(f"the candidate was stored at {uri}, not in the S3-compatible store")

    cache = VerifiedArtifactCache(tmp / "measure-cache", s3_endpoint_url=endpoint)
    candidate, candidate_tok = load_hf_folder(cache.local_folder(uri, version["manifest_sha256"]))
    generic, _ = load_hf_folder(models_dir / "generic-drafter")
    assert candidate_tok.fingerprint == tokenizer.fingerprint
    prompts = eval_prompts(tokenizer, DOMAIN, args.eval_prompts)
    stop = STOPS.get(DOMAIN, ())
    t0 = time.perf_counter()
    before = decode_figures(target, tokenizer, generic, prompts, args.eval_tokens, stop)
    after = decode_figures(target, tokenizer, candidate, prompts, args.eval_tokens, stop)
    say(f"measured {len(prompts)} held-out {DOMAIN} requests per drafter ({time.perf_counter() - t0:.0f}s)")
    m = version["training_metrics"]
    figures.update(
        {
            "registered_pair_realigned_hit_rate": round(after["hit_rate"], 4),
            "registered_pair_generic_hit_rate": round(before["hit_rate"], 4),
            "registered_pair_realigned_tokens_per_step": round(after["tokens_per_step"], 4),
            "registered_pair_generic_tokens_per_step": round(before["tokens_per_step"], 4),
            "k": K,
            "domain": DOMAIN,
            "job_state": job["state"],
            "drafter_version": version["version"],
            "drafter_state": version["state"],
            "artifact_uri": uri,
            "manifest_sha256": version["manifest_sha256"],
            "traces_posted": {DOMAIN: stored_shifted, "prose": stored_prose},
            "entities_scrubbed_from_traces": {k: v for k, v in scrubbed.items() if v},
            "task_wall_s": round(task_wall_s, 1),
            "realign_wall_s": m.get("wall_s"),
            "time_budget_s": m.get("time_budget_s"),
            "teacher": m.get("teacher"),
            "teacher_s": m.get("teacher_s"),
            "train_s": m.get("train_s"),
            "steps_run": m.get("steps_run"),
            "best_step": m.get("best_step"),
            "stop_reason": m.get("stop_reason"),
            "train_rows": m.get("train_rows"),
            "replay_rows": m.get("replay_rows"),
            "train_tokens_per_s": m.get("train_tokens_per_s"),
            "held_out_before": m.get("held_out_before"),
            "held_out_after": m.get("held_out_after"),
            "train_threads": m.get("threads"),
        }
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shifted-traces", type=int, default=384)
    parser.add_argument("--prose-traces", type=int, default=128)
    parser.add_argument("--trace-tokens", type=int, default=128)
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--eval-tokens", type=int, default=96)
    parser.add_argument("--time-budget-s", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(max(1, args.threads))
    say(f"cpu threads {torch.get_num_threads()}, torch {torch.__version__}")

    out: dict[str, Any] = {}
    families = families_figures()
    out.update(families)
    names = ", ".join(families["family_names"])
    say(f"families: {families['families']} ({names}), {len(families['variants'])} variants")

    # The code under test reads the test server's credentials from the environment, and no AWS
    # config or profile of the machine's.
    os.environ.update(TEST_CREDENTIALS)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)
    for name in ("NO_PROXY", "no_proxy"):
        os.environ[name] = "127.0.0.1,localhost"
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp_name:
        tmp = Path(tmp_name)
        os.environ["AWS_CONFIG_FILE"] = str(tmp / "no-aws-config")
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(tmp / "no-aws-credentials")
        process, endpoint = start_s3_server(tmp / "moto.log")
        try:
            say(f"S3-compatible server at {endpoint}")
            (tmp / "unknown").mkdir()
            out.update(unknown_model_figures(tmp / "unknown"))
            say(f"deployment for unregistered {UNKNOWN_TARGET}: {out['unknown_model_status']}, no job")
            (tmp / "tamper").mkdir()
            out["artifact_tamper"] = tamper_figures(tmp / "tamper", endpoint)
            out["artifact_tamper_refused"] = out["artifact_tamper"]["artifact_tamper_refused"]
            (tmp / "registry").mkdir()
            out["registered_pair"] = registered_pair_figures(tmp / "registry", endpoint, args)
            out["registered_pair_realigned_hit_rate"] = out["registered_pair"][
                "registered_pair_realigned_hit_rate"
            ]
        finally:
            stop_s3_server(process)

    wall_s = time.perf_counter() - STARTED
    out.update(
        {
            "wall_s": round(wall_s, 1),
            "threads": torch.get_num_threads(),
            "cpu_cores": os.cpu_count(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "eval_prompts": args.eval_prompts,
            "eval_new_tokens": args.eval_tokens,
            "targets": TARGETS,
            "rerun": ".venv/bin/python bench/models.py (or make bench)",
        }
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "models.json").write_text(json.dumps(out, indent=1) + "\n")

    print(f"\n{'variant':<14}{'family':<9}{'max abs diff':>13}  greedy")
    for name, entry in out["per_family"].items():
        print(
            f"{name:<14}{entry['family']:<9}{entry['max_abs_diff']:>13.2e}  "
            f"{'same' if entry['greedy_identical'] else 'DIFF'}"
        )
    pair = out["registered_pair"]
    tamper = out["artifact_tamper"]
    rows = [
        ("families", f"{out['families']} ({', '.join(out['family_names'])})", TARGETS["families"]),
        ("parity_max_abs_diff", f"{out['parity_max_abs_diff']:.2e}", TARGETS["parity_max_abs_diff"]),
        ("unknown_model_status", str(out["unknown_model_status"]), TARGETS["unknown_model_status"]),
        (
            "artifact_tamper_refused",
            f"{out['artifact_tamper_refused']} ({tamper['files_refused']}/{tamper['files_checked']} files)",
            TARGETS["artifact_tamper_refused"],
        ),
        (
            "registered_pair_realigned_hit_rate",
            f"{pair['registered_pair_realigned_hit_rate']:.1%} "
            f"(generic {pair['registered_pair_generic_hit_rate']:.1%})",
            TARGETS["registered_pair_realigned_hit_rate"],
        ),
        (
            "tokens per verify step",
            f"{pair['registered_pair_generic_tokens_per_step']:.2f} -> "
            f"{pair['registered_pair_realigned_tokens_per_step']:.2f}",
            "",
        ),
    ]
    print(f"\n{'figure':<36}{'measured':<36}target")
    for name, value, target in rows:
        print(f"{name:<36}{value:<36}{target}")
    print(
        f"realignment through the API: task {pair['task_wall_s']:.0f}s "
        f"(realign wall {pair['realign_wall_s']}s; targets: {pair['teacher']}, {pair['teacher_s']}s; "
        f"training {pair['train_s']}s, {pair['steps_run']} steps, best at {pair['best_step']}, "
        f"{pair['stop_reason']}); {pair['train_rows']} rows + {pair['replay_rows']} replayed; "
        f"training {pair['train_tokens_per_s']} tokens/s"
    )
    print(f"wall {wall_s:.0f}s; load average (1 min) {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"wrote {RESULTS / 'models.json'}")


if __name__ == "__main__":
    main()
