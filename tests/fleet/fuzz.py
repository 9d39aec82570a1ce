"""Schemathesis over every operation of a running control plane's /openapi.json: generated valid
and invalid requests, sent with real keys, their answers checked. Shared by the fuzz test (a few
cases per operation) and the reliability bench (thousands).

Half the cases of an operation name the account and deployment that exist, so requests reach the
code behind the lookup instead of stopping at a 404; the other half are generated whole.
Destructive operations (deleting the deployment, revoking keys) run last, and before each
operation ``prepare`` repairs what an earlier one removed and returns the headers to send.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks

DESTRUCTIVE_METHODS = ("DELETE",)


@dataclass
class ServerError:
    """One 5xx: what to send to see it again, and what came back."""

    operation: str
    status: int
    curl: str
    body: str


@dataclass
class FuzzReport:
    cases: int = 0
    operations: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    per_operation: Counter[str] = field(default_factory=Counter)
    server_errors: list[ServerError] = field(default_factory=list)
    # 2xx replies whose body does not match the documented response model.
    schema_violations: list[str] = field(default_factory=list)
    # Statuses that the operation's documented responses do not list.
    undocumented_statuses: Counter[str] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


def load_schema(base_url: str) -> Any:
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


def operation_order(operation: Any) -> tuple[int, str]:
    return (operation.method.upper() in DESTRUCTIVE_METHODS, operation.label)


def fuzz(
    base_url: str,
    *,
    fixed_path: dict[str, str],
    prepare: Callable[[], dict[str, str]],
    cases_per_operation: int,
    seed: int = 0,
    modes: Iterable[GenerationMode] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
    timeout_s: float = 30.0,
) -> FuzzReport:
    """Send about ``cases_per_operation`` generated requests to every operation of the spec."""
    schema = load_schema(base_url)
    operations = sorted((result.ok() for result in schema.get_all_operations()), key=operation_order)
    report = FuzzReport(operations=len(operations))
    started = time.monotonic()
    http = requests.Session()
    modes = tuple(modes)
    for operation in operations:
        headers = prepare()
        names = {p.name for p in operation.path_parameters}
        pinned = {name: value for name, value in fixed_path.items() if name in names}
        strategies = []
        for mode in modes:
            if pinned:
                strategies.append(operation.as_strategy(generation_mode=mode, path_parameters=pinned))
            strategies.append(operation.as_strategy(generation_mode=mode))
        strategy = st.one_of(strategies).map(_with_headers(headers))
        _run_operation(
            operation, strategy, base_url, headers, http, report, cases_per_operation, seed, timeout_s
        )
    report.seconds = time.monotonic() - started
    return report


def _with_headers(headers: dict[str, str]) -> Callable[[Any], Any]:
    """The generated security headers replaced by the real key: a random ``X-API-Key`` would
    make every case a 401 and test nothing behind authentication."""

    def apply(case: Any) -> Any:
        generated = {
            k: v for k, v in (case.headers or {}).items() if k.lower() not in ("authorization", "x-api-key")
        }
        case.headers = {**generated, **headers}
        return case

    return apply


def _run_operation(
    operation: Any,
    strategy: Any,
    base_url: str,
    headers: dict[str, str],
    http: requests.Session,
    report: FuzzReport,
    cases: int,
    seed: int,
    timeout_s: float,
) -> None:
    label = operation.label

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=False,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(case=strategy)
    def send(case: Any) -> None:
        try:
            response = case.call(base_url=base_url, session=http, headers=headers, timeout=timeout_s)
        except requests.RequestException as exc:
            report.transport_errors[f"{label}: {type(exc).__name__}"] += 1
            return
        report.cases += 1
        report.per_operation[label] += 1
        report.statuses[response.status_code] += 1
        if response.status_code >= 500:
            report.server_errors.append(
                ServerError(
                    label, response.status_code, case.as_curl_command(headers=headers), response.text[:2000]
                )
            )
            return
        _conformance(case, response, label, report)

    # A seed per operation: the run is repeatable, and operations do not share one sequence.
    hypothesis_seed(zlib.crc32(f"{seed}:{label}".encode()))(send)()


def _conformance(case: Any, response: Any, label: str, report: FuzzReport) -> None:
    if 200 <= response.status_code < 300:
        try:
            case.validate_response(response, checks=[checks.response_schema_conformance])
        except (
            Exception,
            BaseExceptionGroup,
        ) as exc:  # schemathesis raises its failure group; any failure is one violation
            report.schema_violations.append(f"{label} {response.status_code}: {str(exc)[:500]}")
    try:
        case.validate_response(response, checks=[checks.status_code_conformance])
    except (
        Exception,
        BaseExceptionGroup,
    ):  # schemathesis raises its failure group; any failure is one undocumented status
        report.undocumented_statuses[f"{label} -> {response.status_code}"] += 1


class FuzzedAccount:
    """The account the fuzzer writes to: ``prepare`` issues a fresh key of ``role`` when a case
    revoked the one in use and re-creates the deployment when a case deleted it."""

    def __init__(
        self,
        base_url: str,
        database_url: str,
        *,
        account_id: int,
        account: str,
        deployment: str,
        role: Any,
        key: str,
    ) -> None:
        self.base_url = base_url
        self.database_url = database_url
        self.account_id = account_id
        self.account = account
        self.deployment = deployment
        self.role = role
        self.key = key
        self.keys_reissued = 0
        self.deployments_recreated = 0

    @property
    def fixed_path(self) -> dict[str, str]:
        return {"account": self.account, "deployment": self.deployment}

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def prepare(self) -> dict[str, str]:
        from controlplane.accounts.service import issue_key
        from controlplane.db.models import Account, Role
        from controlplane.db.session import unit_of_work
        from tests.conftest import TEST_SECRET

        if requests.get(f"{self.base_url}/v1/whoami", headers=self._headers(), timeout=30).status_code == 401:
            with unit_of_work(self.database_url) as session:
                owner = session.get_one(Account, self.account_id)
                self.key = issue_key(
                    session=session, account=owner, name="fuzz", role=self.role, secret=TEST_SECRET
                ).secret
            self.keys_reissued += 1
        path = f"{self.base_url}/v1/accounts/{self.account}/deployments"
        if requests.get(f"{path}/{self.deployment}", headers=self._headers(), timeout=30).status_code == 404:
            admin_key = self.key
            if self.role != Role.admin:
                with unit_of_work(self.database_url) as session:
                    owner = session.get_one(Account, self.account_id)
                    admin_key = issue_key(
                        session=session,
                        account=owner,
                        name="fuzz-repair",
                        role=Role.admin,
                        secret=TEST_SECRET,
                    ).secret
            created = requests.post(
                path,
                json={"target_model": "reference-target", "deployment_id": self.deployment},
                headers={"Authorization": f"Bearer {admin_key}"},
                timeout=30,
            )
            if created.status_code != 201:
                raise AssertionError(f"could not re-create the fuzzed deployment: {created.text}")
            self.deployments_recreated += 1
        return self._headers()
