"""Schemathesis over every operation of a running control plane's /openapi.json: generated valid
and invalid requests, sent with real keys, their answers checked. Shared by the fuzz test (a few
cases per operation) and the reliability bench (thousands).

Three cases in four of an operation have their path pinned to real objects of the fuzzed account
(tests/fleet/seed_objects.py seeds one of every kind: drafter versions, a live canary, an open
drift event, a queued job, deliveries, keys, backends, scrape targets, models), so requests reach
the code behind the lookup and state-changing operations run; two of those three carry a body the
API documents as valid where one is known, the third its generated body; the fourth case is
generated whole.
Objects a reply names (a created key, backend, job, canary, ...) become the ones later cases
address, and a case that consumed its object (a promoted candidate, a dismissed event, a deleted
backend) has a fresh one made before the next case. Destructive operations (deleting the
deployment, revoking keys) run last. A request that gets no answer (a refused connection, a
timeout: a crashed or hung server) is a transport error, counted apart from 5xx answers.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks

from tests.fleet.seed_objects import AccountSeeder, SeededObjects, valid_request

DESTRUCTIVE_METHODS = ("DELETE",)
STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Of every four cases of an operation, three have their path pinned to real objects.
PINNED_SHARE = 3


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
    # "<operation> -> <status>": where each status came from.
    operation_statuses: Counter[str] = field(default_factory=Counter)
    server_errors: list[ServerError] = field(default_factory=list)
    # 2xx replies whose body does not match the documented response model.
    schema_violations: list[str] = field(default_factory=list)
    # Statuses that the operation's documented responses do not list.
    undocumented_statuses: Counter[str] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)
    # 2xx answers of POST/PUT/PATCH/DELETE, by operation: state changes the API accepted.
    state_changing_2xx: Counter[str] = field(default_factory=Counter)
    # Cases whose path named real objects of the fuzzed account, and those of them sent with a
    # body the API documents as valid instead of a generated one.
    pinned_cases: int = 0
    valid_body_cases: int = 0
    # Objects made between cases because an earlier case consumed the one there was.
    repairs: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def transport_error_count(self) -> int:
        return sum(self.transport_errors.values())


class FuzzTarget(Protocol):
    """The account a fuzz run writes to: headers to send, real values for a path's parameters,
    and what to learn from each answer."""

    def prepare(self) -> dict[str, str]: ...

    def path_values(self, operation: Any) -> dict[str, str]: ...

    def observe(self, operation: Any, case: Any, response: Any) -> None: ...

    def valid_request(self, operation: Any, unique: str) -> tuple[Any, str] | None: ...


@dataclass
class _FixedTarget:
    """A target of fixed path values, with ``prepare`` as given (no seeded objects)."""

    fixed_path: dict[str, str]
    prepare_headers: Callable[[], dict[str, str]]

    def prepare(self) -> dict[str, str]:
        return self.prepare_headers()

    def path_values(self, operation: Any) -> dict[str, str]:
        names = {p.name for p in operation.path_parameters}
        return {name: value for name, value in self.fixed_path.items() if name in names}

    def observe(self, operation: Any, case: Any, response: Any) -> None:
        return None

    def valid_request(self, operation: Any, unique: str) -> tuple[Any, str] | None:
        return None


def load_schema(base_url: str) -> Any:
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


def operation_order(operation: Any) -> tuple[int, str]:
    return (operation.method.upper() in DESTRUCTIVE_METHODS, operation.label)


def fuzz(
    base_url: str,
    *,
    cases_per_operation: int,
    target: FuzzTarget | None = None,
    fixed_path: dict[str, str] | None = None,
    prepare: Callable[[], dict[str, str]] | None = None,
    seed: int = 0,
    modes: Iterable[GenerationMode] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
    timeout_s: float = 30.0,
) -> FuzzReport:
    """Send about ``cases_per_operation`` generated requests to every operation of the spec, to
    ``target`` (or to the fixed path values ``fixed_path`` with headers from ``prepare``)."""
    if target is None:
        if fixed_path is None or prepare is None:
            raise TypeError("fuzz needs a target, or fixed_path and prepare")
        target = _FixedTarget(fixed_path, prepare)
    schema = load_schema(base_url)
    operations = sorted((result.ok() for result in schema.get_all_operations()), key=operation_order)
    report = FuzzReport(operations=len(operations))
    started = time.monotonic()
    http = requests.Session()
    modes = tuple(modes)
    for operation in operations:
        headers = target.prepare()
        strategy = st.one_of([operation.as_strategy(generation_mode=mode) for mode in modes])
        _run_operation(
            operation,
            strategy.map(_with_headers(headers)),
            base_url,
            headers,
            http,
            report,
            _Pins(target, operation, seed),
            cases_per_operation,
            seed,
            timeout_s,
        )
    report.seconds = time.monotonic() - started
    return report


@dataclass
class _Pins:
    """Points three cases in four of an operation at the target's real objects, with the values
    usable when the case is sent (an earlier case may have consumed the object). Chosen here, not
    by the strategy: Hypothesis avoids repeating an example, so a pinned strategy with few
    parameters would mostly yield to a generated one."""

    target: FuzzTarget
    operation: Any
    seed: int
    sent: int = 0

    def apply(self, case: Any) -> str:
        """Of each four cases of the operation: the first and the fourth pinned and sent with a
        body the API documents as valid (where the target knows one) and no query, the second left
        as generated, the third pinned with its generated body (so three cases already see each
        kind); which of ``valid``, ``generated`` or ``pinned`` the case became."""
        self.sent += 1
        sent = self.sent
        turn = sent % (PINNED_SHARE + 1)
        current = self.target.path_values(self.operation)
        if turn == 2 or not current:
            return "generated"
        case.path_parameters = {**(case.path_parameters or {}), **current}
        valid = self.target.valid_request(self.operation, f"{self.seed}-{sent}") if turn in (0, 1) else None
        if valid is None:
            return "pinned"
        # Generated query parameters (a dataset's name, say) could refuse the valid body: left out.
        case.body, case.media_type = valid
        case.query = None
        return "valid"


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
    pins: _Pins,
    cases: int,
    seed: int,
    timeout_s: float,
) -> None:
    label = operation.label
    state_changing = operation.method.upper() in STATE_CHANGING_METHODS

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
        kind = pins.apply(case)
        report.pinned_cases += kind != "generated"
        report.valid_body_cases += kind == "valid"
        try:
            response = case.call(base_url=base_url, session=http, headers=headers, timeout=timeout_s)
        except requests.RequestException as exc:
            report.transport_errors[f"{label}: {type(exc).__name__}"] += 1
            return
        report.cases += 1
        report.per_operation[label] += 1
        report.statuses[response.status_code] += 1
        report.operation_statuses[f"{label} -> {response.status_code}"] += 1
        if response.status_code >= 500:
            report.server_errors.append(
                ServerError(
                    label, response.status_code, case.as_curl_command(headers=headers), response.text[:2000]
                )
            )
            return
        if state_changing and 200 <= response.status_code < 300:
            report.state_changing_2xx[label] += 1
        pins.target.observe(operation, case, response)
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


# Replies that name an object a later case can address: (method, path suffix) -> (kind, field).
CREATED_OBJECTS: dict[tuple[str, str], tuple[str, str]] = {
    ("POST", "/api-keys"): ("key_id", "id"),
    ("POST", "/backends"): ("backend", "name"),
    ("POST", "/scrape-targets"): ("name", "name"),
    ("POST", "/models"): ("model", "name"),
    ("POST", ":realign"): ("job_id", "id"),
    ("POST", ":canary"): ("canary_id", "canary_id"),
}


class FuzzedAccount:
    """The account the fuzzer writes to: ``prepare`` issues a fresh key of ``role`` when a case
    revoked the one in use and re-creates the deployment when a case deleted it.

    Given a ``seeder`` and the objects it ``seeded``, the account also pins paths to those real
    objects, learns the objects replies name, and has a fresh object made whenever a case may have
    consumed one (any state-changing 2xx, and a pinned case's 404 or 409)."""

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
        seeder: AccountSeeder | None = None,
        seeded: SeededObjects | None = None,
    ) -> None:
        self.base_url = base_url
        self.database_url = database_url
        self.account_id = account_id
        self.account = account
        self.deployment = deployment
        self.role = role
        self.key = key
        self.seeder = seeder
        self.seeded = seeded
        self.keys_reissued = 0
        self.deployments_recreated = 0
        self.repairs: Counter[str] = Counter()
        self.repair_failures: list[str] = []
        # Objects a reply named that later cases then addressed, by kind.
        self.followed: Counter[str] = Counter()

    @property
    def fixed_path(self) -> dict[str, str]:
        return {"account": self.account, "deployment": self.deployment}

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def path_values(self, operation: Any) -> dict[str, str]:
        names = {p.name for p in operation.path_parameters}
        values = self.seeded.path_values(operation.path) if self.seeded is not None else self.fixed_path
        return {name: value for name, value in values.items() if name in names}

    def valid_request(self, operation: Any, unique: str) -> tuple[Any, str] | None:
        if self.seeded is None:
            return None
        return valid_request(operation.method.upper(), operation.path, self.seeded, f"{self.role}-{unique}")

    def observe(self, operation: Any, case: Any, response: Any) -> None:
        if self.seeded is None or self.seeder is None:
            return
        method = operation.method.upper()
        status = response.status_code
        if 200 <= status < 300:
            self._learn(method, operation.path, response)
        pinned = (case.path_parameters or {}).get("account") == self.account
        consumed = method in STATE_CHANGING_METHODS and (
            200 <= status < 300 or (pinned and status in (404, 409))
        )
        if consumed:
            self._repair()

    def _learn(self, method: str, path: str, response: Any) -> None:
        assert self.seeded is not None
        for (created_by, suffix), (kind, field_name) in CREATED_OBJECTS.items():
            if method != created_by or not path.endswith(suffix):
                continue
            try:
                value = response.json()[field_name]
            except (ValueError, KeyError, TypeError):
                return
            self.seeded.add(kind, str(value))
            self.followed[kind] += 1

    def _repair(self) -> None:
        assert self.seeded is not None and self.seeder is not None
        try:
            made = self.seeder.ensure_usable(self.seeded)
        except (RuntimeError, requests.RequestException) as exc:
            self.repair_failures.append(str(exc)[:300])
            return
        self.repairs.update(made)
        self.deployments_recreated += made.count("deployment")

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
        if self.seeder is not None:
            self._repair()
            return self._headers()
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
