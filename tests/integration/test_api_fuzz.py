"""Schemathesis against a running API process on PostgreSQL: a few generated requests, valid and
invalid, to every operation of /openapi.json with an admin key of an account that has a
deployment; no answer may be a 5xx, and every 2xx must match its documented response model.
The bench (bench/reliability.py) runs the same fuzzer for thousands of cases and every role."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.db.models import Role
from controlplane.db.session import get_engine
from tests.fleet.api_on_postgres import api_on_fresh_postgres
from tests.fleet.fuzz import FuzzedAccount, fuzz
from tests.fleet.processes import ControlPlaneProcess

CASES_PER_OPERATION = 2


@pytest.fixture
def fuzzed(tmp_path: Path) -> Iterator[tuple[ControlPlaneProcess, FuzzedAccount]]:
    url, (tenant,), api = api_on_fresh_postgres(tmp_path, "controlplane_fuzz", ("acme",))
    account = FuzzedAccount(
        api.url,
        url,
        account_id=tenant.account_id,
        account="acme",
        deployment="svc",
        role=Role.admin,
        key=tenant.keys[Role.admin],
    )
    try:
        yield api, account
    finally:
        api.stop()
        get_engine(url).dispose()


def test_no_operation_answers_a_generated_request_with_a_server_error(
    fuzzed: tuple[ControlPlaneProcess, FuzzedAccount],
) -> None:
    api, account = fuzzed
    report = fuzz(
        api.url,
        fixed_path=account.fixed_path,
        prepare=account.prepare,
        cases_per_operation=CASES_PER_OPERATION,
    )
    assert report.operations > 50
    assert set(report.per_operation) == set(_labels(api.url)), "an operation got no case"
    assert not report.transport_errors, report.transport_errors
    assert not report.server_errors, "\n\n".join(
        [*(f"{e.curl}\n{e.status} {e.body}" for e in report.server_errors), api.log_tail(8000)]
    )
    assert not report.schema_violations, "\n\n".join(report.schema_violations)
    # Cases reached past authentication and the lookup: some were accepted, some refused as invalid.
    assert sum(n for status, n in report.statuses.items() if status < 300) > report.operations // 2
    assert report.statuses[422] > 0
    assert "Traceback" not in api.log_tail(1_000_000)


def _labels(base_url: str) -> list[str]:
    from tests.fleet.fuzz import load_schema

    return [result.ok().label for result in load_schema(base_url).get_all_operations()]
