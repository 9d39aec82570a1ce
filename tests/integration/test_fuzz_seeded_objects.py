"""The fuzzer on an account seeded with real objects of every kind (tests/fleet/seed_objects.py),
against a running API process on PostgreSQL, with an admin key: every state-changing operation
that addresses an object by id (promote, reject, ready, dismiss, cancel, retry, scrape, delete,
...) must get a 2xx at least once, so that the fuzzing reaches the code behind the lookup; and no
request may get a 5xx or no answer at all. The bench (bench/reliability.py, fuzz) runs it with
more cases and every role."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.db.models import Role
from controlplane.db.session import get_engine
from tests.conftest import TEST_SECRET
from tests.fleet.api_on_postgres import api_on_fresh_postgres
from tests.fleet.fuzz import STATE_CHANGING_METHODS, FuzzedAccount, fuzz, load_schema
from tests.fleet.processes import ControlPlaneProcess
from tests.fleet.seed_objects import PATH_PARAMETERS, AccountSeeder, open_states_present

CASES_PER_OPERATION = 3
OBJECT_PARAMETERS = set(PATH_PARAMETERS) - {"account", "deployment"}


@pytest.fixture
def seeded_account(tmp_path: Path) -> Iterator[tuple[ControlPlaneProcess, FuzzedAccount]]:
    url, (tenant,), api = api_on_fresh_postgres(tmp_path, "controlplane_fuzz_seeded", ("acme",))
    try:
        seeder = AccountSeeder(
            api.url,
            url,
            account="acme",
            admin_key=tenant.keys[Role.admin],
            secret_key=TEST_SECRET,
            marker="fuzzed-account",
        )
        seeded = seeder.seed("svc")
        present = open_states_present(seeder.object_states("svc"))
        assert all(present.values()), present
        yield (
            api,
            FuzzedAccount(
                api.url,
                url,
                account_id=tenant.account_id,
                account="acme",
                deployment="svc",
                role=Role.admin,
                key=tenant.keys[Role.admin],
                seeder=seeder,
                seeded=seeded,
            ),
        )
    finally:
        api.stop()
        get_engine(url).dispose()


def test_every_state_changing_operation_on_an_object_runs_and_none_fails(
    seeded_account: tuple[ControlPlaneProcess, FuzzedAccount],
) -> None:
    api, account = seeded_account
    report = fuzz(api.url, target=account, cases_per_operation=CASES_PER_OPERATION)
    assert not report.transport_errors, report.transport_errors
    assert not report.server_errors, "\n\n".join(
        [*(f"{e.curl}\n{e.status} {e.body}" for e in report.server_errors), api.log_tail(8000)]
    )
    assert not report.schema_violations, "\n\n".join(report.schema_violations)
    assert not account.repair_failures, account.repair_failures
    object_writes = {
        operation.label
        for operation in (result.ok() for result in load_schema(api.url).get_all_operations())
        if operation.method.upper() in STATE_CHANGING_METHODS
        and {p.name for p in operation.path_parameters} & OBJECT_PARAMETERS
    }
    assert len(object_writes) >= 14  # promote, canary, reject, ready, dismiss, cancel, retry, ...
    never_ran = sorted(object_writes - set(report.state_changing_2xx))
    assert not never_ran, [
        (label, {s: n for s, n in report.operation_statuses.items() if s.startswith(label)})
        for label in never_ran
    ]
    # Consumed objects were made again: promotions and dismissals ran more than once.
    assert sum(account.repairs.values()) > 0
    assert "Traceback" not in api.log_tail(1_000_000)


def test_a_server_that_stops_answering_counts_as_transport_errors(tmp_path: Path) -> None:
    """The figure can fail: once the API process is gone, every case is a transport error (none is
    skipped, and none is mistaken for an answer)."""
    url, (tenant,), api = api_on_fresh_postgres(tmp_path, "controlplane_fuzz_crash", ("acme",))
    prepared = 0

    def prepare() -> dict[str, str]:
        nonlocal prepared
        prepared += 1
        if prepared == 3:
            api.stop(kill=True)  # the server crashes before the third operation
        return tenant.headers(Role.admin)

    try:
        report = fuzz(
            api.url, fixed_path={"account": "acme"}, prepare=prepare, cases_per_operation=CASES_PER_OPERATION
        )
    finally:
        api.stop()
        get_engine(url).dispose()
    answered_before_the_crash = sum(report.per_operation.values())
    assert 0 < answered_before_the_crash <= 2 * CASES_PER_OPERATION
    assert report.transport_error_count >= report.operations - 2  # at least one per later operation
    assert not report.server_errors
