"""Real objects of every kind in one account of a running control plane, made the way users and
the loop make them: through the API where the API creates the kind, else through the control
plane's own service functions on the same database (the drafter versions a realignment registers,
the shadow replay's verdict, the drift event the monitor raises from ingested records).

One deployment ends up with: records, traces and a dataset; three backends and a scrape target; a
webhook actuator; a registered model and a marked API key; drafter versions in every state a
deployment holds at once (active, canary, candidate); a live canary; an open drift event; a queued
realign job and finished ones; actuator deliveries. ``ids`` maps every ``{...}`` path parameter of
the API to the values naming them, so a caller can address each object by its real id.

The repair methods (``fresh_*``) make one more object of a kind in a state its operations accept
(a candidate to promote, an undecided canary, an open event, a queued job, ...): the fuzzer calls
them when a case consumed the one it had.
"""

from __future__ import annotations

import random
import time
import zlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceRecordRow,
    Account,
    ActuatorDelivery,
    ApiKey,
    AuditEntry,
    Canary,
    Deployment,
    DrafterState,
    DrafterVersion,
    DriftEvent,
    DriftMonitorState,
    DriftState,
    Job,
    JobKind,
    JobState,
    RegisteredModel,
    ScrapeTarget,
    ServingBackend,
    Trace,
)
from controlplane.db.session import unit_of_work

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_DRAFTER_FOLDER = ROOT / "workers" / "models" / "reference" / "generic-drafter"
# Records the drift monitor reads: a stable stretch to freeze its reference window on, then a drop
# (the sizes of tests/integration/test_drift_monitor.py, which alarm there on every seed).
STABLE_RECORDS = 1600
DROPPED_RECORDS = 400
# Every path parameter the API's spec names (tests/integration/test_tenant_isolation_by_id.py checks
# that no operation names another, so a new kind of object cannot go unseeded).
PATH_PARAMETERS = (
    "account",
    "deployment",
    "version",
    "canary_id",
    "event_id",
    "job_id",
    "delivery_id",
    "key_id",
    "name",
    "backend",
)


@dataclass
class SeededObjects:
    """What one account holds after seeding: path parameter -> values naming real objects (the
    first is the one to use; ``name`` lists scrape targets, ``model`` the registered models), and
    strings that only this account's objects carry."""

    account: str
    deployment: str
    ids: dict[str, list[str]] = field(default_factory=dict)
    markers: list[str] = field(default_factory=list)
    webhook_secret: str = ""

    def path_values(self, path: str) -> dict[str, str]:
        """A real value for each path parameter of ``path`` (a model route's ``{name}`` names a
        model, a scrape target route's a scrape target)."""
        values = {name: ids[0] for name, ids in self.ids.items() if ids}
        values["account"] = self.account
        values["deployment"] = self.deployment
        if "/models/" in path and self.ids.get("model"):
            values["name"] = self.ids["model"][0]
        return values

    def add(self, kind: str, value: str, *, first: bool = True) -> None:
        values = self.ids.setdefault(kind, [])
        if value in values:
            values.remove(value)
        values.insert(0 if first else len(values), value)


class AccountSeeder:
    """Seeds and repairs the objects of one account's deployment through a running API."""

    def __init__(
        self,
        base_url: str,
        database_url: str,
        *,
        account: str,
        admin_key: str,
        secret_key: str,
        marker: str,
    ) -> None:
        self.base_url = base_url
        self.database_url = database_url
        self.account = account
        self.admin_key = admin_key
        self.marker = marker
        self.settings = Settings(database_url=database_url, environment="test", secret_key=secret_key)
        self.http = httpx.Client(base_url=base_url, timeout=60.0)
        self._counter = 0

    # --- plumbing -------------------------------------------------------------------------------

    def call(self, method: str, path: str, *, expect: tuple[int, ...], **kwargs: Any) -> httpx.Response:
        extra = kwargs.pop("headers", {})
        response = self.http.request(
            method, path, headers={"Authorization": f"Bearer {self.admin_key}", **extra}, **kwargs
        )
        if response.status_code == 401:  # a fuzzed case revoked the key: the account's owner issues another
            self._reissue_admin_key()
            response = self.http.request(
                method, path, headers={"Authorization": f"Bearer {self.admin_key}", **extra}, **kwargs
            )
        if response.status_code not in expect:
            raise RuntimeError(f"seeding {method} {path}: {response.status_code} {response.text[:500]}")
        return response

    def _reissue_admin_key(self) -> None:
        from controlplane.accounts.service import issue_key
        from controlplane.db.models import Role

        with unit_of_work(self.database_url) as session:
            owner = session.scalars(select(Account).where(Account.name == self.account)).one()
            self.admin_key = issue_key(
                session=session,
                account=owner,
                name="seeder",
                role=Role.admin,
                secret=self.settings.secret_key,
            ).secret

    def _unique(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}-{self._counter}"

    def _base(self, deployment: str) -> str:
        return f"/v1/accounts/{self.account}/deployments/{deployment}"

    def _deployment_pk(self, deployment: str) -> int:
        with unit_of_work(self.database_url) as session:
            row = session.scalar(
                select(Deployment.id)
                .join(Account, Account.id == Deployment.account_id)
                .where(
                    Account.name == self.account,
                    Deployment.name == deployment,
                    Deployment.deleted_at.is_(None),
                )
            )
        if row is None:
            raise RuntimeError(f"no deployment {self.account}/{deployment}")
        return int(row)

    # --- the whole account ----------------------------------------------------------------------

    def seed(self, deployment: str) -> SeededObjects:
        """Every kind of object in ``deployment`` (created here) and the account."""
        seeded = SeededObjects(self.account, deployment, markers=[self.marker])
        self.call(
            "POST",
            f"/v1/accounts/{self.account}/deployments",
            expect=(201,),
            json={
                "target_model": "reference-target",
                "deployment_id": deployment,
                "display_name": self.marker,
                "draft_model": "reference-drafter",
                "draft_token_count": 4,
            },
        )
        self.seed_objects(seeded)
        return seeded

    def seed_objects(self, seeded: SeededObjects) -> None:
        """Every kind of object in the existing deployment ``seeded.deployment``."""
        deployment = seeded.deployment
        base = self._base(deployment)
        # An open drift event stays open only while the deployment does not answer it itself.
        self.call("PATCH", base, expect=(200,), json={"auto_realign": False})
        self._records_and_traces(seeded)
        self._fleet(seeded)
        self.fresh_model(seeded)
        self.fresh_key(seeded)
        # Drafter versions as realignments make them: v1 promoted (active), v2 in a live canary,
        # v3 a candidate; each promotion and canary start hands the actuator a delivery.
        self.fresh_candidate(seeded)
        self.call("POST", f"{base}/drafter-versions/{seeded.ids['version'][0]}:promote", expect=(200,))
        self.fresh_candidate(seeded)
        self.fresh_canary(seeded)
        self.fresh_candidate(seeded)
        self.fresh_drift_event(seeded, through_monitor=True)
        self.fresh_job(seeded)
        self.refresh_deliveries(seeded)

    def _records_and_traces(self, seeded: SeededObjects) -> None:
        base = self._base(seeded.deployment)
        rng = random.Random(zlib.crc32(self.marker.encode()))
        records = [_request_record(f"{self.marker}-{i}", rng, 0.8) for i in range(STABLE_RECORDS)]
        self.call("POST", f"{base}/acceptance", expect=(200,), json={"records": records})
        self.call(
            "POST",
            f"{base}/traces",
            expect=(200,),
            json={
                "traces": [
                    {"prompt": f"{self.marker} prompt {i}", "completion": f"{self.marker} completion {i}"}
                    for i in range(5)
                ]
            },
        )
        lines = "\n".join(
            f'{{"prompt": "{self.marker} dataset prompt {i}", "completion": "{self.marker} answer {i}"}}'
            for i in range(5)
        )
        self.call(
            "POST",
            f"{base}/datasets",
            expect=(200,),
            params={"name": "seeded"},
            content=lines.encode(),
            headers={"Content-Type": "application/x-ndjson"},
        )

    def _fleet(self, seeded: SeededObjects) -> None:
        base = self._base(seeded.deployment)
        actuator = self.call(
            "PUT",
            f"{base}/actuator",
            expect=(200,),
            json={"kind": "webhook", "url": "http://127.0.0.1:9/fleet-hook", "ready_timeout_s": 3600},
        )
        seeded.webhook_secret = str(actuator.json()["signing_secret"])
        seeded.markers.append(seeded.webhook_secret)
        for pool in ("baseline", "candidate", "incumbent"):
            self.fresh_backend(seeded, pool=pool)
        self.fresh_scrape_target(seeded)

    # --- one more object of a kind --------------------------------------------------------------

    def fresh_backend(self, seeded: SeededObjects, *, pool: str = "incumbent") -> str:
        name = self._unique(f"{self.account}-{pool}")
        self.call(
            "POST",
            f"{self._base(seeded.deployment)}/backends",
            expect=(201,),
            json={"name": name, "url": f"http://127.0.0.1:9/{pool}", "pool": pool},
        )
        seeded.add("backend", name)
        return name

    def fresh_scrape_target(self, seeded: SeededObjects) -> str:
        name = self._unique(f"{self.account}-target")
        self.call(
            "POST",
            f"{self._base(seeded.deployment)}/scrape-targets",
            expect=(201,),
            json={"name": name, "urls": ["http://127.0.0.1:9/metrics"]},
        )
        seeded.add("name", name)
        return name

    def fresh_model(self, seeded: SeededObjects) -> str:
        name = self._unique(f"{self.account}-drafter")
        self.call(
            "POST",
            f"/v1/accounts/{self.account}/models",
            expect=(201,),
            json={"name": name, "path": str(REFERENCE_DRAFTER_FOLDER), "drafter_for": ["reference-target"]},
        )
        seeded.add("model", name)
        return name

    def fresh_key(self, seeded: SeededObjects) -> str:
        issued = self.call(
            "POST",
            f"/v1/accounts/{self.account}/api-keys",
            expect=(201,),
            json={"name": self._unique(self.marker), "role": "viewer"},
        ).json()
        seeded.add("key_id", str(issued["id"]))
        seeded.markers.append(str(issued["key"]))
        return str(issued["id"])

    def fresh_job(self, seeded: SeededObjects) -> str:
        """A queued realign job, requested through the API (the one already queued, if any)."""
        job = self.call("POST", f"{self._base(seeded.deployment)}:realign", expect=(200, 202), json={})
        job_id = str(job.json()["id"])
        seeded.add("job_id", job_id)
        return job_id

    def fresh_candidate(self, seeded: SeededObjects) -> str:
        """A drafter version registered as a realignment registers it: the API queues a realign
        job, the worker's service calls run it and register its result as the next candidate;
        then the API queues the next realign job, which stays queued."""
        from controlplane.drafters.service import TrainedDrafter, active_drafter, register_candidate
        from controlplane.jobs.service import finish_job, start_job

        job_id = int(self.fresh_job(seeded))
        pk = self._deployment_pk(seeded.deployment)
        with unit_of_work(self.database_url) as session:
            job = session.get_one(Job, job_id)
            if job.state == JobState.queued:
                start_job(session=session, job_id=job_id)
            parent = active_drafter(session=session, deployment_id=pk)
            version = register_candidate(
                session=session,
                trained=TrainedDrafter(
                    deployment_id=pk,
                    training_job_id=job_id,
                    parent_version_id=parent.id if parent else None,
                    target_model="reference-target",
                    artifact_path=str(REFERENCE_DRAFTER_FOLDER),
                    artifact_sha256="0" * 64,
                    manifest_sha256=None,
                    traffic_window_start=None,
                    traffic_window_end=None,
                    training_metrics={"seeded_by": self.marker},
                ),
                actor="worker:seed",
            )
            finish_job(session=session, job_id=job_id, result={"drafter_version": version.version})
            number = str(version.version)
        seeded.add("version", number)
        self.fresh_job(seeded)  # the realignment that ran was the queued one: another waits now
        return number

    def fresh_canary(self, seeded: SeededObjects) -> str:
        """A live canary of the newest candidate: started through the API, its shadow replay's
        passing verdict recorded as the worker records it, its candidate pool declared ready
        through the API (the webhook actuator waits for it)."""
        from controlplane.canary.evaluate import record_shadow_result
        from controlplane.jobs.service import finish_job, start_job
        from tests.fleet.canary_setup import passing_shadow

        base = self._base(seeded.deployment)
        version = self._newest_candidate(seeded)
        canary = self.call("POST", f"{base}/drafter-versions/{version}:canary", expect=(202,)).json()
        canary_id = int(canary["canary_id"])
        with unit_of_work(self.database_url) as session:
            job_id = session.get_one(Canary, canary_id).job_id
            if job_id is not None:
                start_job(session=session, job_id=job_id)
            record_shadow_result(
                session=session, canary_id=canary_id, result=passing_shadow(), settings=self.settings
            )
            if job_id is not None:
                finish_job(session=session, job_id=job_id, result={"seeded": True})
        self.call("POST", f"{base}/canaries/{canary_id}/ready", expect=(200,))
        seeded.add("canary_id", str(canary_id))
        return str(canary_id)

    def _newest_candidate(self, seeded: SeededObjects) -> str:
        listed = self.call("GET", f"{self._base(seeded.deployment)}/drafter-versions", expect=(200,)).json()
        candidates = [v["version"] for v in listed["drafter_versions"] if v["state"] == "candidate"]
        return str(max(candidates)) if candidates else self.fresh_candidate(seeded)

    def fresh_drift_event(self, seeded: SeededObjects, *, through_monitor: bool = False) -> str:
        """An open drift event. The first comes from the monitor itself (a stable stretch of
        records, then a drop); later ones are raised by the monitor's own ``raise_drift_event`` from
        the detector state it stored, which is what an alarm after the cooldown records."""
        pk = self._deployment_pk(seeded.deployment)
        if through_monitor:
            event_id = self._drift_through_monitor(seeded, pk)
        else:
            event_id = self._raise_from_stored_detector(pk)
        seeded.add("event_id", str(event_id))
        return str(event_id)

    def _drift_through_monitor(self, seeded: SeededObjects, pk: int) -> int:
        from controlplane.loop.drift import advance_monitor

        def run_monitor() -> list[int]:
            raised: list[int] = []
            for _ in range(3):  # the first run records the horizon; later runs consume settled ids
                with unit_of_work(self.database_url) as session:
                    raised += advance_monitor(
                        session=session, deployment_id=pk, settings=self.settings
                    ).events_raised
            return raised

        run_monitor()
        rng = random.Random(7)
        dropped = [_request_record(f"{self.marker}-drop-{i}", rng, 0.4) for i in range(DROPPED_RECORDS)]
        self.call(
            "POST", f"{self._base(seeded.deployment)}/acceptance", expect=(200,), json={"records": dropped}
        )
        raised = run_monitor()
        if not raised:
            raise RuntimeError("the drift monitor raised no event on a 0.8 -> 0.4 drop")
        return raised[-1]

    def _raise_from_stored_detector(self, pk: int) -> int:
        from controlplane.drift import policy as drift_policy
        from controlplane.drift.service import DetectorPair, latest_record_id
        from controlplane.loop.drift import raise_drift_event
        from controlplane.timestamps import utcnow

        with unit_of_work(self.database_url) as session:
            deployment = session.get_one(Deployment, pk)
            policy = drift_policy.resolve(deployment.drift_policy, self.settings)
            state = session.get(DriftMonitorState, pk)
            if state is None or not state.detector_state:
                raise RuntimeError("no stored detector to raise a drift event from")
            detectors = DetectorPair.from_state(state.detector_state, policy)
            event_id, _job = raise_drift_event(
                session=session,
                deployment=deployment,
                detectors=detectors,
                policy=policy,
                active_version=state.active_drafter_version,
                examined=state.records_examined,
                last_record_id=latest_record_id(session, pk),
                now=utcnow(),
            )
        return event_id

    def refresh_deliveries(self, seeded: SeededObjects) -> list[str]:
        """The deployment's actuator deliveries, newest first (promotions and canary starts made them)."""
        listed = self.call("GET", f"{self._base(seeded.deployment)}/deliveries", expect=(200,)).json()
        ids = [str(d["id"]) for d in listed["deliveries"]]
        if not ids:
            raise RuntimeError("the actuator was handed no delivery")
        seeded.ids["delivery_id"] = ids
        return ids

    # --- keeping every kind usable ------------------------------------------------------------

    def ensure_usable(self, seeded: SeededObjects) -> list[str]:
        """Re-order ``seeded.ids`` so that each kind's first value names an object its operations
        accept (a candidate version, an undecided canary, an open drift event, a queued realign
        job, an unrevoked key), making one where none is left; returns the kinds it made. Keys are
        only ever the ones in ``seeded.ids`` (made by seeding or learnt from replies), never the
        keys a caller authenticates with."""
        made: list[str] = []
        if not self._deployment_live(seeded.deployment):
            self._recreate(seeded)
            return ["deployment"]
        usable = self._usable(seeded)
        if not usable["canary_id"]:
            if not usable["version"]:
                self.fresh_candidate(seeded)
            self.fresh_canary(seeded)
            made.append("canary_id")
            usable = self._usable(seeded)
        if not usable["version"]:
            self.fresh_candidate(seeded)
            made.append("version")
        if not usable["event_id"]:
            self.fresh_drift_event(seeded, through_monitor=not self._detector_stored(seeded))
            made.append("event_id")
        if not usable["job_id"]:
            self.fresh_job(seeded)
            made.append("job_id")
        if not usable["backend"]:
            self.fresh_backend(seeded)
            made.append("backend")
        if not usable["name"]:
            self.fresh_scrape_target(seeded)
            made.append("name")
        if not usable["model"]:
            self.fresh_model(seeded)
            made.append("model")
        if not usable["key_id"]:
            self.fresh_key(seeded)
            made.append("key_id")
        if not usable["delivery_id"]:
            self.fresh_canary(seeded)
            self.fresh_candidate(seeded)
            made.append("delivery_id")
        usable = self._usable(seeded)
        for kind, values in usable.items():
            seeded.ids[kind] = values + [v for v in seeded.ids.get(kind, []) if v not in values]
        return made

    def _deployment_live(self, deployment: str) -> bool:
        try:
            self._deployment_pk(deployment)
        except RuntimeError:
            return False
        return True

    def _recreate(self, seeded: SeededObjects) -> None:
        """A deployment deleted by a case comes back with every kind of object again."""
        self.call(
            "POST",
            f"/v1/accounts/{self.account}/deployments",
            expect=(201,),
            json={
                "target_model": "reference-target",
                "deployment_id": seeded.deployment,
                "display_name": self.marker,
                "draft_model": "reference-drafter",
                "draft_token_count": 4,
            },
        )
        seeded.ids = {}
        self.seed_objects(seeded)

    def _detector_stored(self, seeded: SeededObjects) -> bool:
        pk = self._deployment_pk(seeded.deployment)
        with unit_of_work(self.database_url) as session:
            state = session.get(DriftMonitorState, pk)
            return state is not None and bool(state.detector_state)

    def _usable(self, seeded: SeededObjects) -> dict[str, list[str]]:
        """For each kind, the values naming objects its state-changing operations accept, best first."""
        from controlplane.canary.phases import UNDECIDED
        from controlplane.drift.states import UNANSWERED

        pk = self._deployment_pk(seeded.deployment)
        known_keys = set(seeded.ids.get("key_id", []))
        with unit_of_work(self.database_url) as session:
            account_id = session.scalar(select(Account.id).where(Account.name == self.account))
            versions = session.scalars(
                select(DrafterVersion)
                .where(DrafterVersion.deployment_id == pk, DrafterVersion.state == DrafterState.candidate)
                .order_by(DrafterVersion.version.desc())
            )
            canaries = session.scalars(
                select(Canary.id)
                .where(Canary.deployment_id == pk, Canary.phase.in_([p.value for p in UNDECIDED]))
                .order_by(Canary.id.desc())
            )
            events = session.scalars(
                select(DriftEvent.id)
                .where(DriftEvent.deployment_id == pk, DriftEvent.state.in_(UNANSWERED))
                .order_by(DriftEvent.id.desc())
            )
            jobs = session.scalars(
                select(Job.id)
                .where(Job.deployment_id == pk, Job.kind == JobKind.realign, Job.state == JobState.queued)
                .order_by(Job.id.desc())
            )
            deliveries = session.scalars(
                select(ActuatorDelivery.id)
                .where(ActuatorDelivery.deployment_id == pk)
                .order_by(ActuatorDelivery.id.desc())
            )
            backends = session.scalars(
                select(ServingBackend.name)
                .where(ServingBackend.deployment_id == pk)
                .order_by(ServingBackend.id)
            )
            targets = session.scalars(
                select(ScrapeTarget.name).where(ScrapeTarget.deployment_id == pk).order_by(ScrapeTarget.id)
            )
            models = session.scalars(
                select(RegisteredModel.name)
                .where(RegisteredModel.account_id == account_id)
                .order_by(RegisteredModel.id)
            )
            keys = session.scalars(
                select(ApiKey.id)
                .where(ApiKey.account_id == account_id, ApiKey.revoked_at.is_(None))
                .order_by(ApiKey.id.desc())
            )
            return {
                "version": [str(v.version) for v in versions],
                "canary_id": [str(i) for i in canaries],
                "event_id": [str(i) for i in events],
                "job_id": [str(i) for i in jobs],
                "delivery_id": [str(i) for i in deliveries],
                "backend": list(backends),
                "name": list(targets),
                "model": list(models),
                "key_id": [str(i) for i in keys if str(i) in known_keys],
            }

    # --- reading state back ---------------------------------------------------------------------

    def object_states(self, deployment: str) -> dict[str, Any]:
        """Every row of the account's objects that an attack could read or change, as plain values
        (two snapshots compare equal only if nothing in the account changed in between)."""
        pk = self._deployment_pk(deployment)
        with unit_of_work(self.database_url) as session:
            row = session.get_one(Deployment, pk)
            account = session.get_one(Account, row.account_id)

            def rows(*columns: Any, where: Any) -> list[tuple[Any, ...]]:
                return sorted(tuple(r) for r in session.execute(select(*columns).where(where)))

            return {
                "account": (account.acceptance_retention_days,),
                "deployment": (
                    row.row_version,
                    row.display_name,
                    row.deleted_at,
                    row.target_model,
                    row.speculation_mode.value,
                    row.draft_token_count,
                    row.auto_realign,
                    str(row.drift_policy),
                    str(row.canary_policy),
                    row.actuator,
                    str(row.actuator_config),
                ),
                "deployments": rows(
                    Deployment.name, Deployment.deleted_at, where=Deployment.account_id == account.id
                ),
                "versions": rows(
                    DrafterVersion.version, DrafterVersion.state, where=DrafterVersion.deployment_id == pk
                ),
                "canaries": rows(Canary.id, Canary.phase, Canary.decision, where=Canary.deployment_id == pk),
                "events": rows(DriftEvent.id, DriftEvent.state, where=DriftEvent.deployment_id == pk),
                "jobs": rows(Job.id, Job.kind, Job.state, where=Job.deployment_id == pk),
                "deliveries": rows(
                    ActuatorDelivery.id,
                    ActuatorDelivery.state,
                    ActuatorDelivery.attempts,
                    ActuatorDelivery.next_attempt_at,
                    where=ActuatorDelivery.deployment_id == pk,
                ),
                "backends": rows(
                    ServingBackend.name, ServingBackend.url, where=ServingBackend.deployment_id == pk
                ),
                "scrape_targets": rows(
                    ScrapeTarget.name,
                    ScrapeTarget.scrapes,
                    ScrapeTarget.enabled,
                    where=ScrapeTarget.deployment_id == pk,
                ),
                "models": rows(
                    RegisteredModel.name,
                    RegisteredModel.default_drafter_id,
                    where=RegisteredModel.account_id == account.id,
                ),
                "keys": rows(ApiKey.id, ApiKey.revoked_at, where=ApiKey.account_id == account.id),
                "records": rows(
                    func.count(AcceptanceRecordRow.id), where=AcceptanceRecordRow.deployment_id == pk
                ),
                "traces": rows(func.count(Trace.id), where=Trace.deployment_id == pk),
                "audit": rows(func.count(AuditEntry.id), where=AuditEntry.account_id == account.id),
            }


def open_states_present(snapshot: dict[str, Any]) -> dict[str, bool]:
    """Whether a snapshot holds each state the seeding promises (for a caller's assertion)."""
    versions = {state for _, state in snapshot["versions"]}
    return {
        "active version": DrafterState.active in versions,
        "canary version": DrafterState.canary in versions,
        "candidate version": DrafterState.candidate in versions,
        "live canary": any(phase == "live" for _, phase, _ in snapshot["canaries"]),
        "open drift event": any(state == DriftState.open for _, state in snapshot["events"]),
        "queued realign job": any(
            kind == JobKind.realign and state == JobState.queued for _, kind, state in snapshot["jobs"]
        ),
        "delivery": bool(snapshot["deliveries"]),
        "backend": bool(snapshot["backends"]),
        "scrape target": bool(snapshot["scrape_targets"]),
        "model": bool(snapshot["models"]),
    }


def _request_record(request_id: str, rng: random.Random, p: float, k: int = 4) -> dict[str, Any]:
    """A request whose draft positions are each accepted with probability p (given the previous)."""
    steps = rng.randint(8, 16)
    per_step = []
    for _ in range(steps):
        accepted = 0
        while accepted < k and rng.random() < p:
            accepted += 1
        per_step.append(accepted)
    return {
        "request_id": request_id,
        "drafted_tokens": steps * k,
        "accepted_tokens": sum(per_step),
        "verify_steps": steps,
        "generated_tokens": sum(per_step) + steps,
        "accepted_per_position": [sum(1 for a in per_step if a > j) for j in range(k)],
        "k": k,
    }


def valid_request(method: str, path: str, seeded: SeededObjects, unique: str) -> tuple[Any, str] | None:
    """A body the API documents as valid for the operation ``method path`` (a template with
    ``{...}``) in ``seeded``'s deployment, and its media type; None when the operation takes no body
    (its generated one is as good) or none is known. ``unique`` keeps names and request ids apart."""
    rng = random.Random(zlib.crc32(unique.encode()))
    tail = path.removeprefix("/v1/accounts/{account}")
    window_start = datetime.fromtimestamp((int(time.time()) // 60 - 5) * 60, UTC)
    bodies: dict[tuple[str, str], Any] = {
        ("POST", "/deployments"): {"target_model": "reference-target", "deployment_id": f"d-{unique}"},
        ("PATCH", "/deployments/{deployment}"): {"draft_token_count": 4},
        ("POST", "/deployments/{deployment}/acceptance"): {
            "records": [_request_record(f"{unique}-{i}", rng, 0.7) for i in range(5)]
        },
        ("POST", "/deployments/{deployment}/acceptance/prometheus"): (
            f'vllm:spec_decode_num_drafts_total{{model_name="{unique}"}} {rng.randint(10, 20)}\n'
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="{unique}"}} 80\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{unique}"}} 40\n'
        ),
        ("POST", "/aggregates"): {
            "edge_id": f"edge-{unique}",
            "window_start": window_start.isoformat(),
            "window_s": 60,
            "aggregates": [
                {
                    "deployment": seeded.deployment,
                    "requests": 2,
                    "drafted_tokens": 16,
                    "accepted_tokens": 9,
                    "verify_steps": 4,
                    "generated_tokens": 13,
                }
            ],
        },
        ("POST", "/deployments/{deployment}/traces"): {
            "traces": [{"prompt": f"fuzzed prompt {unique}", "completion": f"fuzzed completion {unique}"}]
        },
        (
            "POST",
            "/deployments/{deployment}/datasets",
        ): f'{{"input": "p {unique}", "output": "c {unique}"}}\n',
        ("PATCH", "/deployments/{deployment}/drift-policy"): {"min_drop": 0.1},
        ("PATCH", "/deployments/{deployment}/canary-policy"): {"alpha": 0.1},
        ("PUT", "/deployments/{deployment}/adaptation-policy"): {"continuous": False},
        ("PATCH", "/deployments/{deployment}/adaptation-policy"): {"gpu_seconds_per_day": 600},
        ("PATCH", "/settings"): {"acceptance_retention_days": 14},
        ("POST", "/api-keys"): {"name": f"key-{unique}", "role": "viewer"},
        ("POST", "/models"): {
            "name": f"model-{unique}",
            "path": str(REFERENCE_DRAFTER_FOLDER),
            "drafter_for": ["reference-target"],
        },
        ("PATCH", "/models/{name}"): {"default_drafter": None},
        ("POST", "/deployments/{deployment}/backends"): {
            "name": f"backend-{unique}",
            "pool": rng.choice(["baseline", "candidate", "incumbent"]),
            "url": "http://127.0.0.1:9/engine",
        },
        ("POST", "/deployments/{deployment}/scrape-targets"): {
            "name": f"target-{unique}",
            "urls": ["http://127.0.0.1:9/metrics"],
        },
        ("PUT", "/deployments/{deployment}/actuator"): {
            "kind": "webhook",
            "url": "http://127.0.0.1:9/fleet-hook",
            "ready_timeout_s": 3600,
        },
        ("POST", "/deployments/{deployment}:realign"): {},
    }
    body = bodies.get((method, tail))
    if body is None:
        if method == "POST" and (":" in tail.rsplit("/", 1)[-1]):
            return {"reason": f"fuzzed {unique}"}, "application/json"  # promote, reject, dismiss, ...
        return None
    if isinstance(body, str):
        return body, "text/plain"
    return body, "application/json"
