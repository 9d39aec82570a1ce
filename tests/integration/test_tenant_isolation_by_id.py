"""Another account's objects addressed by id, against a running API process on PostgreSQL: both
accounts hold real objects of every kind (tests/fleet/seed_objects.py), and every operation that
names an object is sent with the attacker's key of each role, from the attacker's own account and
deployment with the victim's ids, and from the victim's path. None may answer 2xx, and the
victim's objects must be exactly as they were; the victim's own key reads the same ids (so the
probes named real objects). The reliability bench (bench/reliability.py, tenants) runs the same
attack with generated bodies as well."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.db.models import Role
from controlplane.db.session import get_engine
from tests.conftest import TEST_SECRET, Tenant
from tests.fleet.api_on_postgres import api_on_fresh_postgres
from tests.fleet.fuzz import load_schema
from tests.fleet.processes import ControlPlaneProcess
from tests.fleet.seed_objects import (
    PATH_PARAMETERS,
    AccountSeeder,
    SeededObjects,
    open_states_present,
    valid_request,
)

ROLES = (Role.admin, Role.ingest, Role.viewer, Role.serving)
ROOT = Path(__file__).resolve().parents[2]
PLANTED_IDOR = ROOT / "tests" / "fleet" / "planted_idor"
OBJECT_PARAMETERS = set(PATH_PARAMETERS) - {"account", "deployment"}


class Accounts:
    def __init__(
        self,
        api: ControlPlaneProcess,
        victim: Tenant,
        attacker: Tenant,
        seeder: AccountSeeder,
        victim_objects: SeededObjects,
        attacker_objects: SeededObjects,
    ) -> None:
        self.api = api
        self.victim = victim
        self.attacker = attacker
        self.seeder = seeder
        self.victim_objects = victim_objects
        self.attacker_objects = attacker_objects


@pytest.fixture
def accounts(tmp_path: Path) -> Iterator[Accounts]:
    yield from _seeded_accounts(tmp_path)


@pytest.fixture
def accounts_on_a_broken_api(tmp_path: Path) -> Iterator[Accounts]:
    yield from _seeded_accounts(tmp_path, PYTHONPATH=f"{PLANTED_IDOR}{os.pathsep}{ROOT}")


def _seeded_accounts(tmp_path: Path, **env: str) -> Iterator[Accounts]:
    url, (victim, attacker), api = api_on_fresh_postgres(
        tmp_path, "controlplane_idor", ("victim", "attacker"), **env
    )
    try:
        seeder = AccountSeeder(
            api.url,
            url,
            account="victim",
            admin_key=victim.keys[Role.admin],
            secret_key=TEST_SECRET,
            marker="victim-marker-5d2e",
        )
        victim_objects = seeder.seed("vsvc")
        for _ in range(3):  # version numbers the attacker's deployment does not have
            seeder.fresh_candidate(victim_objects)
        attacker_objects = AccountSeeder(
            api.url,
            url,
            account="attacker",
            admin_key=attacker.keys[Role.admin],
            secret_key=TEST_SECRET,
            marker="attacker-marker-8a41",
        ).seed("asvc")
        yield Accounts(api, victim, attacker, seeder, victim_objects, attacker_objects)
    finally:
        api.stop()
        get_engine(url).dispose()


def _victim_only(accounts: Accounts) -> dict[str, list[str]]:
    """Each kind's victim values that name no object of the attacker (ids are global, names and
    version numbers count per account or deployment)."""
    theirs, ours = accounts.victim_objects.ids, accounts.attacker_objects.ids
    return {kind: [v for v in values if v not in ours.get(kind, [])] for kind, values in theirs.items()}


def _addressed(accounts: Accounts, operation: Any, ids: dict[str, list[str]], own: bool) -> list[str]:
    """The operation's path naming each victim object, from the attacker's path or the victim's."""
    names = {p.name for p in operation.path_parameters}
    objects = sorted(names & OBJECT_PARAMETERS)
    if not objects:
        return []
    (name,) = objects
    kind = "model" if name == "name" and "/models/" in operation.path else name
    base = accounts.attacker_objects if own else accounts.victim_objects
    return [
        operation.path.format(account=base.account, deployment=base.deployment, **{name: value})
        for value in ids.get(kind, [])
    ]


def _probe(accounts: Accounts, operations: list[Any]) -> list[tuple[str, str, Role, int]]:
    """Every object-addressing operation, with the attacker's key of each role, naming each victim
    object from the attacker's own path and from the victim's: (method, path, role, status)."""
    exclusive = _victim_only(accounts)
    probes: list[tuple[str, str, Role, int]] = []
    with httpx.Client(base_url=accounts.api.url, timeout=30) as http:
        for operation in operations:
            method = operation.method.upper()
            valid = valid_request(method, operation.path, accounts.victim_objects, "probe")
            body: dict[str, Any] = {}
            if valid is not None:
                content, media_type = valid
                body = (
                    {"json": content}
                    if media_type == "application/json"
                    else {"content": content, "headers": {"Content-Type": media_type}}
                )
            own = _addressed(accounts, operation, exclusive, own=True)
            theirs = _addressed(accounts, operation, accounts.victim_objects.ids, own=False)
            for path in own + theirs:
                for role in ROLES:
                    headers = {"Authorization": f"Bearer {accounts.attacker.keys[role]}"}
                    headers.update(body.get("headers", {}))
                    sent = {k: v for k, v in body.items() if k != "headers"}
                    reply = http.request(method, path, headers=headers, **sent)
                    probes.append((method, path, role, reply.status_code))
    return probes


def test_no_key_of_another_account_reads_or_changes_an_object_by_its_id(accounts: Accounts) -> None:
    present = open_states_present(accounts.seeder.object_states("vsvc"))
    assert all(present.values()), present  # the victim holds every kind, in every state promised
    exclusive = _victim_only(accounts)
    assert all(exclusive[kind] for kind in ("version", "canary_id", "event_id", "job_id", "delivery_id")), (
        exclusive
    )
    before = accounts.seeder.object_states("vsvc")
    operations = [result.ok() for result in load_schema(accounts.api.url).get_all_operations()]
    # Every {...} of the spec names a kind the seeding makes (a model route's {name} a model).
    assert {p.name for operation in operations for p in operation.path_parameters} == set(PATH_PARAMETERS)
    unseeded = [kind for kind in [*OBJECT_PARAMETERS, "model"] if not accounts.victim_objects.ids.get(kind)]
    assert not unseeded, unseeded
    probes = _probe(accounts, operations)
    leaks = [p for p in probes if 200 <= p[3] < 300]
    assert not leaks, leaks
    # From the victim's path the answer never depends on the object: another account is not there.
    refused_otherwise = [p for p in probes if "/accounts/victim/" in p[1] and p[3] != 404]
    assert not refused_otherwise, refused_otherwise
    # Every role is checked before any lookup or a lookup scoped to the caller's own account: the
    # attacker's admin gets 404 (no such object in its deployment), weaker roles 404 or 403.
    assert {p[3] for p in probes if p[2] == Role.admin} == {404}
    assert len(probes) > 200
    assert accounts.seeder.object_states("vsvc") == before
    # The control: the victim reads the same objects by the same ids.
    victim_headers = {"Authorization": f"Bearer {accounts.victim.keys[Role.admin]}"}
    reads = [
        path
        for operation in operations
        if operation.method.upper() == "GET"
        for path in _addressed(accounts, operation, accounts.victim_objects.ids, own=False)
    ]
    assert reads
    answers = {
        path: httpx.get(accounts.api.url + path, headers=victim_headers, timeout=30).status_code
        for path in reads
    }
    assert set(answers.values()) == {200}, answers


def test_the_probes_catch_a_lookup_that_ignores_the_account(accounts_on_a_broken_api: Accounts) -> None:
    """The same probes against an API whose canary lookup ignores account and deployment: the
    victim's canary answers 2xx from the attacker's own path, and a promotion through it changes
    the victim's objects."""
    accounts = accounts_on_a_broken_api
    before = accounts.seeder.object_states("vsvc")
    operations = [
        result.ok()
        for result in load_schema(accounts.api.url).get_all_operations()
        if "{canary_id}" in result.ok().path
    ]
    probes = _probe(accounts, operations)
    leaked = {(p[0], p[1].rsplit("/", 1)[-1], p[2]) for p in probes if 200 <= p[3] < 300}
    canary = accounts.victim_objects.ids["canary_id"][0]
    assert ("GET", canary, Role.viewer) in leaked
    assert ("POST", f"{canary}:promote", Role.admin) in leaked
    assert accounts.seeder.object_states("vsvc")["canaries"] != before["canaries"]
