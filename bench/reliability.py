"""Reliability under faults and hostile input, with real processes on private servers (a PostgreSQL
cluster and a Redis of the bench's own, tests/fleet/services.py). Writes bench/results/reliability.json.

    python bench/reliability.py [--quick] [--only fuzz,tenants,ingest,poison,loop,pii]

1. fuzz_state_changing_2xx / fuzz_server_errors / fuzz_transport_errors: schemathesis
   (tests/fleet/fuzz.py) over every operation of the running API's /openapi.json, valid and invalid
   requests, once with a key of each role (admin, ingest, viewer, serving) of an account seeded
   with real objects of every kind (tests/fleet/seed_objects.py: drafter versions active, in a
   live canary and candidate, an open drift event raised by the monitor, a queued realign job,
   actuator deliveries, keys, backends, scrape targets, a model). Three cases in four address
   those objects by id, two of those three with a body the API documents as valid where one is
   known; ids that replies name are followed, and an object a case consumed is made again before
   the next case.
   Counted: 2xx answers of POST/PUT/PATCH/DELETE (state changes that ran), 5xx answers, and
   requests that got no answer (connection refused or reset, timeout: a crashed or hung server),
   which fail the run like 5xx do. Also: 2xx bodies off their documented model
   (fuzz_schema_violations) and every status by operation.
2. idor_probes / idor_leaks: both accounts seeded with objects of every kind; every operation that
   addresses an object, with the attacker's key of each role (and, for the canary's ready
   callback, the attacker's own webhook signature), naming the victim's objects by id or name
   from the attacker's own account and deployment, from the attacker's account with the victim's
   deployment name, and from the victim's own path; generated bodies and a documented-valid one.
   A leak is a 2xx to such a probe, a reply carrying a victim marker (display name, trace text,
   key or webhook secrets) that the request did not carry, or any change in the victim's objects
   between snapshots taken before and after (states, counts, the audit log). The control: the
   victim's own key reads the same objects by the same ids (control_victim_reads_by_id).
3. records_lost / rollup_double_counted_records / rollup_missing_records: retrying ingest clients
   (tests/fleet/ingest_load.py: unique request ids, the same batch re-sent until a 2xx; batches of
   10 records, whose rollup sums the API defers to its fold, and of 100, stored by COPY and summed
   in place) against the API on PostgreSQL while PostgreSQL is restarted cleanly twice (once at
   once, once down for 3 s), crashed twice (postmaster and its children SIGKILLed, then started
   with crash recovery, at once and after 3 s) and the API is SIGKILLed and restarted once; two
   edges meanwhile send windows of aggregates of the same deployment, folded into the same
   rollups by a thread standing in for the beat task. Lost: acknowledged ids not stored
   (records_duplicated, ids stored twice or never sent, is kept; the unique key makes it 0 by
   construction). Then, once both folds have caught up, every rollup tier against the stored raw
   records and rolled-up aggregates (tests/fleet/rollup_audit.py): requests a bucket counts beyond
   them are double counted, fewer are missing (the worst tier of each is the figure). A control
   repeats one crash on an API that acknowledges before its WAL is written (a documented setting
   that may lose the last acknowledged records in a crash): it should lose some.
4. promotions_per_loop / stalled_events: the whole loop (as `controlplane demo --fast` drives it)
   on private PostgreSQL and Redis, with the gpu worker SIGKILLed once while the realign job runs
   and once while the canary's shadow replay runs (each restarted at once), and Redis restarted
   once; promotions of the deployment, and drift events still open at the end.
5. poisoned_requests_collateral: two accounts ingest at once; one sends batches each carrying one
   poisoned record: values the parser refuses (counts 2^40, k=40000, NUL in request ids, year 1
   timestamps, latency 1e307, ...) and records that pass it and fail at the shared write (a
   request id stored before with other content, one sent twice at once with other content, a
   check constraint and a foreign key the parser cannot know, a rollup row the database refuses
   in place and in the deferred fold), besides records at every column's largest storable value;
   requests of the other account that failed. Also checked: all or nothing per poisoned request,
   and the other account's records stored and rolled up exactly once.
6. pii_recall / pii_false_positive_rate: bench.scrub.measure_corpus on the labelled corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controlplane.db.models import Role  # noqa: E402
from controlplane.db.session import get_engine, get_sessionmaker  # noqa: E402
from tests.conftest import TEST_SECRET, Tenant, make_tenant, prepare_database  # noqa: E402
from tests.fleet.fuzz import FuzzedAccount, fuzz, load_schema  # noqa: E402
from tests.fleet.ingest_load import RetryingIngestClients, acceptance_record, count_stored  # noqa: E402
from tests.fleet.processes import ControlPlaneProcess  # noqa: E402
from tests.fleet.seed_objects import AccountSeeder, SeededObjects  # noqa: E402
from tests.fleet.services import PrivatePostgres  # noqa: E402

RESULTS = ROOT / "bench" / "results"
ROLES = (Role.admin, Role.ingest, Role.viewer, Role.serving)
PARTS = ("fuzz", "tenants", "ingest", "poison", "loop", "pii")


def say(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", flush=True)


@contextmanager
def api_on_private_postgres(
    workdir: Path, **env: str
) -> Iterator[tuple[PrivatePostgres, ControlPlaneProcess]]:
    """A migrated private PostgreSQL and the API process on it (no broker: ingest sends nothing)."""
    with PrivatePostgres() as pg:
        prepare_database(pg.url)
        api = ControlPlaneProcess(
            workdir,
            CONTROLPLANE_DATABASE_URL=pg.url,
            CONTROLPLANE_ENVIRONMENT="test",
            CONTROLPLANE_SECRET_KEY=TEST_SECRET,
            CONTROLPLANE_DRIFT_ENQUEUE_ON_INGEST="false",
            CONTROLPLANE_VAR_DIR=str(workdir / "var"),
            **env,
        )
        try:
            yield pg, api.start()
        finally:
            api.stop()
            get_engine(pg.url).dispose()


def new_tenant(pg: PrivatePostgres, name: str) -> Tenant:
    with get_sessionmaker(pg.url)() as session:
        tenant = make_tenant(session, name)
        session.commit()
    return tenant


def create_deployment(api: ControlPlaneProcess, tenant: Tenant, name: str, **extra: Any) -> dict[str, Any]:
    response = api.api(
        "POST",
        f"/v1/accounts/{tenant.name}/deployments",
        {"target_model": "reference-target", "deployment_id": name, **extra},
        key=tenant.keys[Role.admin],
    )
    if response.status_code != 201:
        raise RuntimeError(f"creating deployment {name}: {response.status_code} {response.text}")
    return dict(response.json())


# 1. fuzz ------------------------------------------------------------------------------------------


def run_fuzz(quick: bool) -> dict[str, Any]:
    per_operation = 3 if quick else 10
    from tests.fleet.seed_objects import open_states_present

    out: dict[str, Any] = {"cases_per_operation_per_role": per_operation, "by_role": {}}
    with tempfile.TemporaryDirectory() as tmp, api_on_private_postgres(Path(tmp)) as (pg, api):
        tenant = new_tenant(pg, "acme")
        seeder = AccountSeeder(
            api.url,
            pg.url,
            account="acme",
            admin_key=tenant.keys[Role.admin],
            secret_key=TEST_SECRET,
            marker="fuzzed-account",
        )
        seeded = seeder.seed("svc")
        out["seeded_objects"] = {kind: len(values) for kind, values in seeded.ids.items()}
        out["seeded_states_present"] = open_states_present(seeder.object_states("svc"))
        server_errors: list[dict[str, Any]] = []
        violations: list[str] = []
        statuses: Counter[int] = Counter()
        state_changing: Counter[str] = Counter()
        transport: Counter[str] = Counter()
        repairs: Counter[str] = Counter()
        followed: Counter[str] = Counter()
        repair_failures: list[str] = []
        cases = operations = pinned = valid = 0
        for n, role in enumerate(ROLES):
            account = FuzzedAccount(
                api.url,
                pg.url,
                account_id=tenant.account_id,
                account="acme",
                deployment="svc",
                role=role,
                key=tenant.keys[role],
                seeder=seeder,
                seeded=seeded,
            )
            say(f"fuzz: {role.value} key, {per_operation} case(s) per operation")
            report = fuzz(api.url, target=account, cases_per_operation=per_operation, seed=n)
            cases += report.cases
            pinned += report.pinned_cases
            valid += report.valid_body_cases
            followed.update(account.followed)
            operations = report.operations
            statuses.update(report.statuses)
            state_changing.update(report.state_changing_2xx)
            transport.update(report.transport_errors)
            repairs.update(account.repairs)
            repair_failures += account.repair_failures
            violations += report.schema_violations
            server_errors += [
                {
                    "role": role.value,
                    "operation": e.operation,
                    "status": e.status,
                    "curl": e.curl,
                    "body": e.body,
                }
                for e in report.server_errors
            ]
            out["by_role"][role.value] = {
                "cases": report.cases,
                "seconds": round(report.seconds, 1),
                "statuses": {str(k): v for k, v in sorted(report.statuses.items())},
                "state_changing_2xx": sum(report.state_changing_2xx.values()),
                "server_errors": len(report.server_errors),
                "transport_errors": dict(report.transport_errors),
                "undocumented_statuses": len(report.undocumented_statuses),
            }
        api_alive = api.process is not None and api.process.poll() is None
        tracebacks = api.log_tail(10_000_000).count("Traceback")
    # A server that died or hung answers nothing: those requests are failures, not skipped cases.
    transport_errors = sum(transport.values()) + (0 if api_alive else 1)
    failures = [f"{transport_errors} transport error(s)"] if transport_errors else []
    failures += [f"{len(server_errors)} server error(s)"] if server_errors else []
    missing = [state for state, present in out["seeded_states_present"].items() if not present]
    failures += [f"seeding left no {', '.join(missing)}"] if missing else []
    out.update(
        failures=failures,
        fuzz_cases=cases,
        fuzz_state_changing_2xx=sum(state_changing.values()),
        fuzz_server_errors=len(server_errors),
        fuzz_transport_errors=transport_errors,
        fuzz_schema_violations=len(violations),
        operations=operations,
        pinned_cases=pinned,
        valid_body_cases=valid,
        ids_followed_from_replies=dict(followed),
        statuses={str(k): v for k, v in sorted(statuses.items())},
        state_changing_2xx_by_operation=dict(sorted(state_changing.items())),
        transport_error_cases=dict(transport),
        api_alive_at_end=api_alive,
        objects_made_between_cases=dict(repairs),
        repair_failures=repair_failures[:20],
        server_error_cases=server_errors[:50],
        schema_violation_samples=[v[:600] for v in violations[:10]],
        api_log_tracebacks=tracebacks,
    )
    return out


# 2. cross-tenant ----------------------------------------------------------------------------------

VICTIM_MARKER = "victim-marker-7c1f3a"
# How many of each kind of victim object the probes address (the newest first).
IDS_PER_KIND = 3


def seed_victim(
    api: ControlPlaneProcess, pg: PrivatePostgres, victim: Tenant
) -> tuple[AccountSeeder, SeededObjects]:
    """Real objects of every kind in the victim's account (tests/fleet/seed_objects.py), and three
    drafter versions more than the attacker will have: version numbers count per deployment, so
    only a number the attacker's own deployment lacks names a victim object from the attacker's
    own path."""
    seeder = AccountSeeder(
        api.url,
        pg.url,
        account=victim.name,
        admin_key=victim.keys[Role.admin],
        secret_key=TEST_SECRET,
        marker=VICTIM_MARKER,
    )
    seeded = seeder.seed("vsvc")
    for _ in range(3):
        seeder.fresh_candidate(seeded)
    return seeder, seeded


def run_tenants(quick: bool) -> dict[str, Any]:
    """IDOR probes: every operation that addresses an object, sent with the attacker's key of each
    role, naming the victim's objects by id or name from three paths: the attacker's own account
    and deployment, the attacker's account with the victim's deployment name, and the victim's own
    path. A leak is a 2xx to such a probe, a reply carrying a victim marker the request did not
    carry, or any change to the victim's objects between a snapshot before and one after."""
    import requests

    from controlplane.fleet import payloads
    from tests.fleet.fuzz import operation_order
    from tests.fleet.seed_objects import open_states_present, valid_request

    generated_per_probe = 1 if quick else 3
    with tempfile.TemporaryDirectory() as tmp, api_on_private_postgres(Path(tmp)) as (pg, api):
        victim, attacker = new_tenant(pg, "victim"), new_tenant(pg, "attacker")
        victim_seeder, victim_objects = seed_victim(api, pg, victim)
        attacker_objects = AccountSeeder(
            api.url,
            pg.url,
            account=attacker.name,
            admin_key=attacker.keys[Role.admin],
            secret_key=TEST_SECRET,
            marker="attacker-own-marker",
        ).seed("asvc")
        before = victim_seeder.object_states("vsvc")
        victim_states = open_states_present(before)
        markers = sorted(set(victim_objects.markers) | set(victim.keys.values()))
        # Objects of the victim that no object of the attacker shares an id or name with.
        exclusive = {
            kind: [v for v in values if v not in attacker_objects.ids.get(kind, [])][:IDS_PER_KIND]
            for kind, values in victim_objects.ids.items()
        }
        schema = load_schema(api.url)
        operations = sorted((result.ok() for result in schema.get_all_operations()), key=operation_order)
        http = requests.Session()
        probes = 0
        leaks: list[dict[str, Any]] = []
        statuses: Counter[int] = Counter()
        by_path: dict[str, Counter[int]] = {}
        transport: Counter[str] = Counter()
        # Inside the victim's account anything but a 404 tells the attacker that the path exists.
        answered_otherwise: Counter[str] = Counter()

        def send(case: Any, headers: dict[str, str], role: str, path_kind: str, by_id: bool) -> None:
            nonlocal probes
            sent = case.as_curl_command(headers=headers)
            try:
                response = case.call(base_url=api.url, session=http, headers=headers, timeout=30)
            except requests.RequestException as exc:
                transport[f"{case.operation.label}: {type(exc).__name__}"] += 1
                return
            probes += 1
            statuses[response.status_code] += 1
            by_path.setdefault(path_kind, Counter())[response.status_code] += 1
            if path_kind == "victim path" and response.status_code not in (404, 405):
                answered_otherwise[f"{case.operation.label} -> {response.status_code}"] += 1
            carried = [m for m in markers if m in response.text and m not in sent]
            if (by_id and 200 <= response.status_code < 300) or carried:
                leaks.append(
                    {
                        "role": role,
                        "path": path_kind,
                        "operation": case.operation.label,
                        "path_parameters": case.path_parameters,
                        "status": response.status_code,
                        "markers": len(carried),
                        "body": response.text[:300],
                    }
                )

        for operation in operations:
            names = {p.name for p in operation.path_parameters}
            for path_kind, pinned, by_id in _victim_addresses(
                operation, names, victim_objects, attacker_objects, exclusive
            ):
                cases = _examples(operation, pinned, generated_per_probe)
                valid = valid_request(operation.method.upper(), operation.path, victim_objects, "probe")
                if not by_id and (valid is None or victim_objects.deployment not in json.dumps(valid[0])):
                    continue  # an account-level write whose body names no victim object
                if valid is not None:
                    cases += [_with_body(c, valid) for c in _examples(operation, pinned, 1)]
                for role in ROLES:
                    headers = {"Authorization": f"Bearer {attacker.keys[role]}"}
                    for case in cases:
                        case.headers = {
                            **{
                                k: v
                                for k, v in (case.headers or {}).items()
                                if k.lower() not in ("authorization", "x-api-key")
                            },
                            **headers,
                        }
                        send(case, headers, role.value, path_kind, by_id)
                if operation.path.endswith("/ready"):
                    # The actuator's way in: signed with the attacker's own webhook secret.
                    body = b"{}"
                    stamp = int(time.time())
                    signed = {
                        payloads.HEADER_TIMESTAMP: str(stamp),
                        payloads.HEADER_SIGNATURE: payloads.sign(
                            attacker_objects.webhook_secret, stamp, body
                        ),
                        "Content-Type": "application/json",
                    }
                    case = _with_body(_examples(operation, pinned, 1)[0], ({}, "application/json"))
                    case.headers = signed
                    send(case, signed, "webhook-signature", path_kind, by_id)
        after = victim_seeder.object_states("vsvc")
        changed = sorted(k for k in before if before[k] != after.get(k))
        # The control: the same reads by id from the victim's own key must succeed, or the probes
        # named nothing real and could not have leaked.
        control: Counter[int] = Counter()
        victim_headers = {"Authorization": f"Bearer {victim.keys[Role.admin]}"}
        for operation in operations:
            if operation.method.upper() != "GET":
                continue
            names = {p.name for p in operation.path_parameters}
            for path_kind, pinned, _ in _victim_addresses(
                operation, names, victim_objects, attacker_objects, exclusive
            ):
                if path_kind == "victim path" and set(pinned) - {"account", "deployment"}:
                    url = api.url + operation.path.format(**pinned)
                    control[http.get(url, headers=victim_headers, timeout=30).status_code] += 1
        api_alive = api.process is not None and api.process.poll() is None
    idor_leaks = len(leaks) + len(changed)
    failures = [f"{idor_leaks} leak(s)"] if idor_leaks else []
    missing = [state for state, present in victim_states.items() if not present]
    failures += [f"the victim had no {', '.join(missing)}"] if missing else []
    failures += [f"{sum(transport.values())} transport error(s)"] if transport else []
    return {
        "failures": failures,
        "idor_probes": probes,
        "idor_leaks": idor_leaks,
        "victim_objects_changed": changed,
        "control_victim_reads_by_id": {str(k): v for k, v in sorted(control.items())},
        "victim_objects": {kind: len(values) for kind, values in victim_objects.ids.items()},
        "victim_states_present": victim_states,
        "operations": len(operations),
        "roles": [r.value for r in ROLES] + ["webhook-signature"],
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "statuses_by_path": {
            kind: {str(k): v for k, v in sorted(c.items())} for kind, c in sorted(by_path.items())
        },
        "transport_errors": dict(transport),
        "api_alive_at_end": api_alive,
        "leak_samples": leaks[:30],
        "victim_paths_not_404": dict(answered_otherwise),
    }


def _victim_addresses(
    operation: Any,
    names: set[str],
    victim: SeededObjects,
    attacker: SeededObjects,
    exclusive: dict[str, list[str]],
) -> list[tuple[str, dict[str, str], bool]]:
    """(which path, path parameters, whether the path names a victim object) for every way an
    operation can address the victim's objects: its own account and deployment with each of the
    victim's object ids, its account with the victim's deployment name, and the victim's path."""
    if "account" not in names:
        return []
    object_names = sorted(names - {"account", "deployment"})
    model_route = "/models/" in operation.path

    def kind_of(name: str) -> str:
        return "model" if name == "name" and model_route else name

    def with_ids(base: dict[str, str], ids: dict[str, list[str]]) -> list[dict[str, str]]:
        if not object_names:
            return [base]
        combos = [base]
        for name in object_names:
            combos = [{**c, name: value} for c in combos for value in ids.get(kind_of(name), [])]
        return combos

    all_victim = {kind: values[:IDS_PER_KIND] for kind, values in victim.ids.items()}
    own = {"account": attacker.account}
    if "deployment" in names:
        own["deployment"] = attacker.deployment
    addresses: list[tuple[str, dict[str, str], bool]] = []
    if object_names:
        addresses += [("own path, victim ids", p, True) for p in with_ids(own, exclusive)]
    if "deployment" in names:
        own_account = {"account": attacker.account, "deployment": victim.deployment}
        addresses += [("own account, victim deployment", p, True) for p in with_ids(own_account, all_victim)]
    victim_path = {"account": victim.account}
    if "deployment" in names:
        victim_path["deployment"] = victim.deployment
    addresses += [("victim path", p, True) for p in with_ids(victim_path, all_victim)]
    if not object_names and "deployment" not in names and operation.method.upper() != "GET":
        # Account-level writes may name the victim's deployment in the body (edge aggregates):
        # sent from the attacker's own path, they are judged by markers and the victim's snapshot.
        addresses.append(("own path, victim named in body", own, False))
    return addresses


def _with_body(case: Any, valid: tuple[Any, str]) -> Any:
    """``case``, now carrying the documented-valid body ``valid`` and no query."""
    case.body, case.media_type = valid
    case.query = None
    return case


def _examples(operation: Any, pinned: dict[str, str], count: int) -> list[Any]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    drawn: list[Any] = []

    @settings(
        max_examples=max(count, 1) * 4,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(path_parameters=pinned))
    def draw(case: Any) -> None:
        drawn.append(case)

    hypothesis_seed(7)(draw)()
    return drawn[:count]


# 3. ingest under faults ---------------------------------------------------------------------------


def run_ingest(quick: bool) -> dict[str, Any]:
    from datetime import timedelta

    from controlplane.ingest.service import fold_pending_rollups
    from tests.fleet.ingest_load import AggregateRollupFolder, RetryingEdgeClients, windows_lost
    from tests.fleet.rollup_audit import audit_rollups

    gap_s = 4.0 if quick else 15.0
    with tempfile.TemporaryDirectory() as tmp, api_on_private_postgres(Path(tmp)) as (pg, api):
        tenant = new_tenant(pg, "acme")
        create_deployment(api, tenant, "svc")
        url = f"{api.url}/v1/accounts/acme/deployments/svc/acceptance"
        # Five clients of 10-record batches (their rollup sums deferred to the API's fold) and one
        # of 100 (stored by COPY, summed in the same transaction): both ways into the rollups.
        clients = RetryingIngestClients(
            url,
            tenant.keys[Role.ingest],
            clients=6,
            batch=(10, 10, 10, 10, 10, 100),
            categories=("code", "prose", "sql"),
            give_up_after_s=120,
        ).start()
        # Two edges send windows of aggregates of the same deployment, summed into the same rollup
        # rows by a fold that beat runs in production (here a thread of the bench), windows from
        # six days back (an edge may send up to seven days late).
        edges = RetryingEdgeClients(
            f"{api.url}/v1/accounts/acme/aggregates",
            tenant.keys[Role.ingest],
            "svc",
            first_window=datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(days=6),
            give_up_after_s=120,
        ).start()
        folder = AggregateRollupFolder(pg.url).start()
        timeline: list[str] = []
        started = time.monotonic()

        def mark(what: str) -> None:
            timeline.append(
                f"{time.monotonic() - started:6.1f}s {what} (acknowledged {clients.acknowledged_count()})"
            )
            say(f"ingest: {what}")

        def kill_api() -> None:
            api.stop(kill=True)
            time.sleep(1.0)
            api.start()

        faults: list[tuple[str, Callable[[], None]]] = [
            ("postgres clean restart (fast stop, immediate start)", pg.restart),
            ("postgres crash (postmaster SIGKILLed, immediate start with recovery)", pg.crash),
            ("postgres clean restart (down 3 s)", lambda: pg.restart(down_s=3.0)),
            ("postgres crash (down 3 s, start with recovery)", lambda: pg.crash(down_s=3.0)),
            ("api SIGKILLed, restarted after 1 s", kill_api),
        ]
        for what, fault in faults:
            time.sleep(gap_s)
            mark(what)
            fault()
        time.sleep(gap_s)
        tally = clients.stop()
        edge_tally = edges.stop()
        folder.stop()
        mark("clients stopped")
        alive_after = api.process is not None and api.process.poll() is None
        deployment_id = _deployment_pk(pg, "acme", "svc")
        counted = count_stored(pg.admin_dsn(), deployment_id, tally)
        # The API folds deferred sums within a fraction of a second, retrying each second after a
        # failure: wait for it, then fold what is left as every reader of rollups would.
        pending_left = _wait_for_fold(pg, deployment_id, timeout_s=30.0)
        folded_by_audit = 0
        if pending_left:
            with get_sessionmaker(pg.url)() as session:
                folded_by_audit = fold_pending_rollups(session=session, deployment_ids=[deployment_id])
                session.commit()
        folder.drain()
        audit = audit_rollups(pg.admin_dsn(), [deployment_id])
        lost_windows = windows_lost(pg.admin_dsn(), edge_tally)
        recoveries = pg.recoveries()
        api_log = api.log_tail(10_000_000)
    control = _relaxed_commit_control(gap_s)
    return {
        "records_lost": counted.lost,
        "records_duplicated": counted.duplicated,
        **audit.as_dict(),
        "faults": [what for what, _ in faults],
        "control_relaxed_commit_crash": control,
        "postgres_crash_recoveries": recoveries,
        "pending_after_api_fold_wait": pending_left,
        "folded_by_audit": folded_by_audit,
        "api_fold_failures_logged": api_log.count("rollup fold failed"),
        "acknowledged": counted.acknowledged,
        "stored": counted.stored,
        "sent": len(tally.sent),
        "abandoned": len(tally.abandoned),
        "refused": len(tally.refused),
        "attempts": tally.attempts,
        "failed_attempts_total": sum(tally.failures.values()),
        "failed_attempts": dict(tally.failures.most_common(10)),
        "edge_windows_lost": lost_windows,
        "edge_windows_acknowledged": len(edge_tally.acknowledged),
        "edge_windows_abandoned": len(edge_tally.abandoned),
        "edge_windows_refused": len(edge_tally.refused),
        "edge_window_failed_attempts": dict(edge_tally.failures.most_common(10)),
        "aggregate_folds": folder.folds,
        "aggregate_fold_failures": dict(folder.failures),
        "api_alive_at_end": alive_after,
        "timeline": timeline,
        "seconds": round(time.monotonic() - started, 1),
    }


def _relaxed_commit_control(gap_s: float) -> dict[str, Any]:
    """The crash again, on an API that acknowledges before its WAL is written
    (CONTROLPLANE_INGEST_SYNCHRONOUS_COMMIT=false, documented to lose the last acknowledged
    records in a crash): it should lose some, which shows the fault is a crash that records_lost
    can see (a clean stop writes every WAL record first). The rollups must still match."""
    from controlplane.ingest.service import fold_pending_rollups
    from tests.fleet.rollup_audit import audit_rollups

    with (
        tempfile.TemporaryDirectory() as tmp,
        api_on_private_postgres(Path(tmp), CONTROLPLANE_INGEST_SYNCHRONOUS_COMMIT="false") as (pg, api),
    ):
        tenant = new_tenant(pg, "acme")
        create_deployment(api, tenant, "svc")
        clients = RetryingIngestClients(
            f"{api.url}/v1/accounts/acme/deployments/svc/acceptance",
            tenant.keys[Role.ingest],
            clients=6,
            batch=10,
            give_up_after_s=120,
        ).start()
        time.sleep(gap_s)
        say("ingest control: postgres crash under relaxed commits")
        pg.crash()
        time.sleep(gap_s)
        tally = clients.stop()
        deployment_id = _deployment_pk(pg, "acme", "svc")
        counted = count_stored(pg.admin_dsn(), deployment_id, tally)
        if _wait_for_fold(pg, deployment_id, timeout_s=30.0):
            with get_sessionmaker(pg.url)() as session:
                fold_pending_rollups(session=session, deployment_ids=[deployment_id])
                session.commit()
        audit = audit_rollups(pg.admin_dsn(), [deployment_id])
        return {
            "records_lost": counted.lost,
            "acknowledged": counted.acknowledged,
            "rollup_double_counted_records": audit.double_counted_records,
            "rollup_missing_records": audit.missing_records,
            "postgres_crash_recoveries": pg.recoveries(),
        }


def _wait_for_fold(pg: PrivatePostgres, deployment_id: int, timeout_s: float) -> int:
    """Wait until no record of the deployment waits for the rollup fold; returns how many still do."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    while True:
        with psycopg.connect(pg.admin_dsn()) as conn:
            row = conn.execute(
                "SELECT count(*) FROM acceptance_rollup_pending WHERE deployment_id = %s", (deployment_id,)
            ).fetchone()
        pending = int(row[0]) if row else 0
        if pending == 0 or time.monotonic() > deadline:
            return pending
        time.sleep(0.5)


def _deployment_pk(pg: PrivatePostgres, account: str, name: str) -> int:
    import psycopg

    with psycopg.connect(pg.admin_dsn()) as conn:
        row = conn.execute(
            "SELECT d.id FROM deployments d JOIN accounts a ON a.id = d.account_id"
            " WHERE a.name = %s AND d.name = %s",
            (account, name),
        ).fetchone()
    if row is None:
        raise RuntimeError(f"no deployment {account}/{name}")
    return int(row[0])


# 5. poisoned requests -----------------------------------------------------------------------------


# A record the poisoning account stores before the run: the conflict case re-sends its id with
# other content, the retry case with the same.
STORED_BEFORE: dict[str, Any] = {
    "request_id": "stored-before",
    "drafted_tokens": 8,
    "accepted_tokens": 5,
    "verify_steps": 2,
    "generated_tokens": 7,
    "accepted_per_position": [2, 2, 1, 0],
    "k": 4,
    "total_ms": 50.0,
}
# Rules the bench's database holds and the parser cannot know (as an operator's constraint or a
# newer schema revision would be): values that pass every check of the API and fail at the shared
# write. Categories are registered in a table of known ones (a foreign key); one registered
# category is refused by a check on the records, another by a check on the rollup rows.
KNOWN_CATEGORIES = ("code", "prose", "refused-by-check", "refused-in-rollup", "é" * 100)
DATABASE_RULES = """
ALTER TABLE acceptance_records ADD CONSTRAINT bench_known_category
    FOREIGN KEY (category) REFERENCES bench_known_categories (name);
ALTER TABLE acceptance_records ADD CONSTRAINT bench_refused_category
    CHECK (category IS DISTINCT FROM 'refused-by-check');
ALTER TABLE acceptance_rollups ADD CONSTRAINT bench_refused_rollup
    CHECK (category <> 'refused-in-rollup');
"""
LARGEST = 2**31 - 1  # the INTEGER columns' largest value
# How long a client waits for an answer: a request unanswered by then counts as failed. Generous,
# because this machine is shared: a run with 30 s, niced at a load average of 17 on 2 cores, had
# 6 of 359 requests unanswered in one 30-second stall of every client of both accounts (every
# answer was a 200; the next run's slowest answer took 0.8 s).
CLIENT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PoisonCase:
    """One poisoned batch: ``batch`` records of the poisoning account, the last one overridden by
    ``override``; ``fails_at`` says where it must fail ("parser", "database", "rollup fold", or
    "" for a value that must be stored) and ``expected`` the status the whole request must get.
    A ``race`` case is sent twice at once, the second copy's poisoned record with other content
    under the same request id: one must be stored and the other answered 409."""

    what: str
    fails_at: str
    expected: int
    override: dict[str, Any]
    batch: int = 5
    race: bool = False


def _quantiles(values: list[float], qs: tuple[float, ...]) -> list[float]:
    """The qs-quantiles of ``values`` (nearest rank), in seconds to the millisecond."""
    ordered = sorted(values)
    if not ordered:
        return []
    return [round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) for q in qs]


def poison_values() -> list[PoisonCase]:
    """Every poisoned batch the poisoning account sends, in turn."""
    parser = [
        ("drafted_tokens 2^40", {"drafted_tokens": 2**40, "accepted_tokens": 1}),
        ("accepted_tokens 2^40", {"accepted_tokens": 2**40}),
        ("generated_tokens 2^40", {"generated_tokens": 2**40}),
        ("verify_steps 2^40", {"verify_steps": 2**40}),
        ("prompt_tokens 2^40", {"prompt_tokens": 2**40}),
        ("per-position count 2^40", {"accepted_per_position": [2**40, 0, 0, 0]}),
        ("drafted_tokens 2^63", {"drafted_tokens": 2**63}),
        ("k 40000", {"k": 40_000}),
        ("drafter_version 30 digits", {"drafter_version": 10**29}),
        ("category 150 chars", {"category": "c" * 150}),
        ("arm 150 chars", {"arm": "a" * 150}),
        ("request_id with NUL", {"request_id": "bad\x00id"}),
        ("request_id 300 chars", {"request_id": "r" * 300}),
        ("created_at year 1", {"created_at": "0001-01-01T00:00:00+00:00"}),
        ("created_at year 9999", {"created_at": "9999-12-31T23:59:59+00:00"}),
        ("total_ms 1e307", {"total_ms": 1e307}),
        ("ttft_ms 1e307", {"ttft_ms": 1e307}),
        ("inter_token_ms -1e307", {"inter_token_ms": -1e307}),
        ("category with NUL", {"category": "x\x00y"}),
    ]
    return [
        *(PoisonCase(what, "parser", 422, override) for what, override in parser),
        PoisonCase(
            "request id stored before, other content", "database", 409, {**STORED_BEFORE, "total_ms": 51.0}
        ),
        PoisonCase("request id sent twice at once, other content", "database", 409, {}, race=True),
        PoisonCase(
            "check constraint the parser does not know", "database", 422, {"category": "refused-by-check"}
        ),
        PoisonCase(
            "check constraint the parser does not know, 100 records (COPY)",
            "database",
            422,
            {"category": "refused-by-check"},
            batch=100,
        ),
        PoisonCase("foreign key the parser does not know", "database", 422, {"category": "unregistered"}),
        PoisonCase(
            "rollup row the database refuses (deferred to the fold)",
            "rollup fold",
            200,
            {"category": "refused-in-rollup"},
        ),
        PoisonCase(
            "rollup row the database refuses, 100 records (summed in place)",
            "database",
            422,
            {"category": "refused-in-rollup"},
            batch=100,
        ),
        PoisonCase("a true retry of a stored record beside new ones", "", 200, dict(STORED_BEFORE)),
        PoisonCase("the other account's request ids", "", 200, {}),
        PoisonCase(
            "every column at its largest storable value",
            "",
            200,
            {
                "request_id": "\U0001f600" * 200,
                "drafted_tokens": LARGEST,
                "accepted_tokens": LARGEST,
                "verify_steps": LARGEST,
                "generated_tokens": LARGEST,
                "prompt_tokens": LARGEST,
                "accepted_per_position": [LARGEST],
                "k": 1,
                "arm": f"canary:{LARGEST}",
                "total_ms": 86_400_000.0,
                "ttft_ms": 86_400_000.0,
                "inter_token_ms": 86_400_000.0,
                "created_at": "2099-12-31T23:59:59.999999+00:00",
                "category": "é" * 100,
            },
        ),
        PoisonCase(
            "k 64, 64 positions",
            "",
            200,
            {
                "drafted_tokens": 64,
                "accepted_tokens": 64,
                "verify_steps": 1,
                "generated_tokens": 65,
                "accepted_per_position": [1] * 64,
                "k": 64,
            },
        ),
    ]


def run_poison(quick: bool) -> dict[str, Any]:
    import re
    from concurrent.futures import ThreadPoolExecutor

    import psycopg

    from controlplane.ingest.service import fold_pending_rollups
    from tests.fleet.rollup_audit import audit_rollups

    duration_s = 10.0 if quick else 40.0
    cases = poison_values()
    with tempfile.TemporaryDirectory() as tmp, api_on_private_postgres(Path(tmp)) as (pg, api):
        with psycopg.connect(pg.admin_dsn()) as conn:
            conn.execute("CREATE TABLE bench_known_categories (name varchar(100) PRIMARY KEY)")
            conn.execute(
                "INSERT INTO bench_known_categories SELECT unnest(%s::text[])", (list(KNOWN_CATEGORIES),)
            )
            conn.execute(DATABASE_RULES)
        good, bad = new_tenant(pg, "good"), new_tenant(pg, "bad")
        create_deployment(api, good, "svc")
        create_deployment(api, bad, "svc")
        good_url = f"{api.url}/v1/accounts/good/deployments/svc/acceptance"
        bad_url = f"{api.url}/v1/accounts/bad/deployments/svc/acceptance"
        stored_before = api.api(
            "POST",
            "/v1/accounts/bad/deployments/svc/acceptance",
            {"records": [STORED_BEFORE]},
            key=bad.keys[Role.ingest],
        )
        if stored_before.status_code != 200:
            raise RuntimeError(
                f"storing the record to conflict with: {stored_before.status_code} {stored_before.text}"
            )
        stop = threading.Event()
        good_outcomes: Counter[str] = Counter()
        good_acknowledged: set[str] = set()
        bad_outcomes: dict[str, Counter[int]] = {}
        # Ids of the poisoning account's requests answered 200, and of those answered otherwise.
        bad_acknowledged: set[str] = {STORED_BEFORE["request_id"]}
        bad_refused: set[str] = set()
        race_pairs: Counter[str] = Counter()
        good_seconds: list[float] = []
        lock = threading.Lock()

        def good_client(n: int) -> None:
            rng = random.Random(n)
            sequence = 0
            with httpx.Client(
                timeout=CLIENT_TIMEOUT_S, headers={"Authorization": f"Bearer {good.keys[Role.ingest]}"}
            ) as http:
                while not stop.is_set():
                    ids = [f"g{n}-{sequence + i}" for i in range(5)]
                    sequence += 5
                    body = {"records": [acceptance_record(i, rng, categories=("code", "prose")) for i in ids]}
                    sent_at = time.monotonic()
                    try:
                        status = str(http.post(good_url, json=body).status_code)
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    with lock:
                        good_seconds.append(time.monotonic() - sent_at)
                        good_outcomes[status] += 1
                        if status == "200":
                            good_acknowledged.update(ids)

        def batch_of(
            case: PoisonCase, prefix: str, rng: random.Random, n: int, sent: int
        ) -> list[dict[str, Any]]:
            records = [acceptance_record(f"{prefix}-{i}", rng) for i in range(case.batch)]
            override = dict(case.override)
            if case.what == "the other account's request ids":
                override["request_id"] = f"g{n}-{sent}"  # the id the good account's client n sends
            elif case.what == "every column at its largest storable value":
                override["request_id"] = override["request_id"][:-12] + f"{n:03d}{sent:09d}"
            records[-1].update(override)
            if override.get("request_id") == STORED_BEFORE["request_id"]:
                del records[-1]["created_at"]  # as stored: the server stamped it
            return records

        def bad_client(n: int) -> None:
            rng = random.Random(100 + n)
            sequence = 0
            sent_of: Counter[str] = Counter()
            with (
                httpx.Client(
                    timeout=CLIENT_TIMEOUT_S, headers={"Authorization": f"Bearer {bad.keys[Role.ingest]}"}
                ) as http,
                ThreadPoolExecutor(2) as pair,
            ):

                def post(records: list[dict[str, Any]]) -> int:
                    try:
                        return http.post(bad_url, json={"records": records}).status_code
                    except httpx.HTTPError:
                        return -1

                while not stop.is_set():
                    for case in cases:
                        bodies = [batch_of(case, f"b{n}-{sequence}", rng, n, sent_of[case.what])]
                        if case.race:
                            twin = batch_of(case, f"b{n}-{sequence}-twin", rng, n, sent_of[case.what])
                            bodies[0][-1]["request_id"] = twin[-1]["request_id"] = f"race-{n}-{sequence}"
                            twin[-1]["total_ms"] = bodies[0][-1]["total_ms"] + 1.0
                            bodies.append(twin)
                        sequence += 1
                        sent_of[case.what] += 1
                        statuses = list(pair.map(post, bodies))
                        with lock:
                            for records, status in zip(bodies, statuses, strict=True):
                                bad_outcomes.setdefault(case.what, Counter())[status] += 1
                                ids = {str(r["request_id"]) for r in records}
                                if status == 200:
                                    bad_acknowledged.update(ids)
                                elif status >= 400:  # answered; no answer (-1) leaves it unknown
                                    bad_refused.update(ids)
                            if case.race:
                                race_pairs["+".join(map(str, sorted(statuses)))] += 1
                        if stop.is_set():
                            return

        # Six clients of the other account keep requests queued beside the poisoned ones, so that
        # flushes hold both (counted below from the API's log).
        threads = [threading.Thread(target=good_client, args=(n,)) for n in range(6)]
        threads += [threading.Thread(target=bad_client, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(duration_s)
        stop.set()
        for thread in threads:
            thread.join(60)
        good_id, bad_id = _deployment_pk(pg, "good", "svc"), _deployment_pk(pg, "bad", "svc")
        # The API's fold is shared by both accounts: how far behind the poison left it, then what
        # is left folded as every reader of rollups would, so the audits below cover every record.
        unfolded = {
            deployment_id: _wait_for_fold(pg, deployment_id, timeout_s=30.0)
            for deployment_id in (good_id, bad_id)
        }
        with get_sessionmaker(pg.url)() as session:
            fold_pending_rollups(session=session, deployment_ids=[good_id, bad_id])
            session.commit()
        with psycopg.connect(pg.admin_dsn()) as conn:
            stored = {
                deployment_id: {
                    row[0]
                    for row in conn.execute(
                        "SELECT request_id FROM acceptance_records WHERE deployment_id = %s", (deployment_id,)
                    )
                }
                for deployment_id in (good_id, bad_id)
            }
        good_audit = audit_rollups(pg.admin_dsn(), [good_id])
        bad_audit = audit_rollups(pg.admin_dsn(), [bad_id])
        api_log = api.log_tail(10_000_000)
    good_total = sum(good_outcomes.values())
    collateral = sum(n for status, n in good_outcomes.items() if status != "200")
    by_where: Counter[str] = Counter()
    unexpected: dict[str, dict[str, int]] = {}
    for case in cases:
        outcomes = bad_outcomes.get(case.what, Counter())
        by_where[case.fails_at or "stored"] += sum(outcomes.values())
        if case.race:  # judged by pair: one stored, the other a conflict
            wrong = {pair: n for pair, n in race_pairs.items() if pair != "200+409"}
        else:
            wrong = {str(status): n for status, n in outcomes.items() if status != case.expected}
        if wrong:
            unexpected[case.what] = wrong
    # A refused request's ids that some acknowledged request did not also carry (the race's shared
    # id, the retried record) must not be stored: all or nothing per request.
    partial = bad_refused - bad_acknowledged
    # The poisoning account has at most four requests in flight (two clients, a race sends two at
    # once): a failed flush of more requests held the other account's too.
    split_sizes = [int(n) for n in re.findall(r"a flush of (\d+) requests failed", api_log)]
    return {
        "poisoned_requests_collateral": collateral,
        "good_requests": good_total,
        "good_outcomes": dict(good_outcomes),
        "good_request_seconds_p50_p99_max": _quantiles(good_seconds, (0.5, 0.99, 1.0)),
        "good_records_lost": len(good_acknowledged - stored[good_id]),
        "good_records_unfolded_30s_after": unfolded[good_id],
        "bad_records_unfolded_30s_after": unfolded[bad_id],
        "good_records_stored_unacknowledged": len(stored[good_id] - good_acknowledged),
        "good_rollup_double_counted_records": good_audit.double_counted_records,
        "good_rollup_missing_records": good_audit.missing_records,
        "good_rollup_mismatched_buckets": good_audit.mismatched_buckets,
        "bad_requests": sum(sum(c.values()) for c in bad_outcomes.values()),
        "bad_requests_by_where_they_fail": dict(by_where),
        "bad_outcomes": {what: {str(k): v for k, v in c.items()} for what, c in bad_outcomes.items()},
        "bad_unexpected_outcomes": unexpected,
        "bad_requests_unanswered": sum(c[-1] for c in bad_outcomes.values()),
        "bad_server_errors": sum(
            n for c in bad_outcomes.values() for status, n in c.items() if status >= 500
        ),
        "bad_race_pairs": dict(race_pairs),
        "bad_records_stored_of_refused_requests": len(partial & stored[bad_id]),
        "bad_records_lost": len(bad_acknowledged - stored[bad_id]),
        "bad_rollup_double_counted_records": bad_audit.double_counted_records,
        "bad_rollup_missing_records": bad_audit.missing_records,
        "bad_rollup_quarantined_records": bad_audit.quarantined_records,
        "shared_flushes_split_apart": len(split_sizes),
        "shared_flushes_split_apart_holding_the_other_account": sum(1 for n in split_sizes if n > 4),
        "largest_flush_split_apart": max(split_sizes, default=0),
        "folds_retried_deployment_by_deployment": api_log.count("folding deployment by deployment"),
        "semantics": (
            "all or nothing per request: a batch with one record the parser or the database refuses "
            "is answered 422 (409 for a request id stored with other content) and none of its "
            "records, the valid ones included, is stored; a record whose rollup row the database "
            "refuses in the deferred fold is stored and acknowledged, and set aside from the rollups "
            "(quarantined_rollup_records)"
        ),
    }


# 6. PII -------------------------------------------------------------------------------------------


def run_pii(quick: bool) -> dict[str, Any]:
    try:
        from bench.scrub import measure_corpus  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise RuntimeError(
            "bench/scrub.py with measure_corpus() is missing: the PII figures cannot be measured "
            f"({exc}); no numbers are written for them"
        ) from exc
    measured = measure_corpus()
    # In sample (the corpus written beside the rules) keeps the old names; out of sample is the
    # corpus generated apart from them (tests/data/make_scrub_out_of_sample.py). Both count an
    # entity as caught only if every character of it was replaced.
    names = (
        "pii_recall",
        "pii_false_positive_rate",
        "pii_recall_out_of_sample",
        "pii_false_positive_rate_out_of_sample",
        "pii_false_positive_rate_tokens_out_of_sample",
        "surrogate_same_kind_share",
        "surrogate_checksum_share",
    )
    missing = [name for name in names if name not in measured]
    if missing:
        raise RuntimeError(f"measure_corpus() returned no {missing}: {sorted(measured)}")
    figures = {name: measured[name] for name in names}
    figures["pii_recall_by_type_out_of_sample"] = measured["out_of_sample"]["recall_by_type"]
    return figures


# 4. the loop --------------------------------------------------------------------------------------


LOOP_MAX_SHIFT_S = [900.0]


def run_loop(quick: bool) -> dict[str, Any]:
    from bench.reliability_loop import run_loop_under_faults

    return run_loop_under_faults(quick=quick, say=say, max_shift_s=LOOP_MAX_SHIFT_S[0])


RUNNERS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "fuzz": run_fuzz,
    "tenants": run_tenants,
    "ingest": run_ingest,
    "poison": run_poison,
    "loop": run_loop,
    "pii": run_pii,
}

FIGURES = [
    ("fuzz", "fuzz_cases", ">= 2000"),
    ("fuzz", "fuzz_state_changing_2xx", ">= 200"),
    ("fuzz", "fuzz_server_errors", "0"),
    ("fuzz", "fuzz_transport_errors", "0"),
    ("tenants", "idor_probes", ">= 500"),
    ("tenants", "idor_leaks", "0"),
    ("ingest", "records_lost", "0"),
    ("ingest", "rollup_double_counted_records", "0"),
    ("ingest", "rollup_missing_records", "0"),
    ("loop", "promotions_per_loop", "1"),
    ("loop", "stalled_events", "0"),
    ("poison", "poisoned_requests_collateral", "0"),
    ("pii", "pii_recall", ">= 0.95"),
    ("pii", "pii_false_positive_rate", "<= 0.01"),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {','.join(PARTS)}")
    parser.add_argument(
        "--loop-max-shift-s",
        type=float,
        default=900.0,
        help="how long the loop may take to decide after the shift",
    )
    args = parser.parse_args()
    LOOP_MAX_SHIFT_S[0] = args.loop_max_shift_s
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "reliability.json"
    measured: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    for part in parts:
        say(f"part {part}")
        started = time.monotonic()
        try:
            result = RUNNERS[part](args.quick)
        except Exception as exc:
            failed.append(part)
            result = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"part {part} failed: {result['error']}")
        if result.get("failures"):  # what a part found wrong fails the run, beside its figures
            failed.append(part)
        result["seconds"] = round(time.monotonic() - started, 1)
        result["quick"] = args.quick
        result["measured_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        measured[part] = result
    # A partial run keeps the figures of the parts it did not run (read now, not at the start: a
    # concurrent partial run may have written its own parts meanwhile).
    out: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    out.setdefault("parts", {}).update(measured)
    out.pop("cross_tenant_leaks", None)  # replaced by idor_probes / idor_leaks
    for source, name, _ in FIGURES:
        if source in measured:
            out[name] = measured[source].get(name)
    out["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    path.write_text(json.dumps(out, indent=2, sort_keys=True, default=str) + "\n")
    print()
    print(f"{'figure':32} {'value':>12}  target   (part, measured)")
    for source, name, target in FIGURES:
        part_result = out["parts"].get(source, {})
        value = out.get(name)
        shown = "-" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))
        when = part_result.get("measured_at", "never")
        flag = "  ERROR: " + part_result["error"][:80] if "error" in part_result else ""
        print(f"{name:32} {shown:>12}  {target:8} ({source}, {when}){flag}")
    print(f"\nwrote {path}")
    if failed:
        raise SystemExit(f"part(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
