"""Shared fixtures: real databases (SQLite file and the machine's PostgreSQL), accounts, clients.

PostgreSQL tests run in one outer transaction per test, with every service commit turned into a
SAVEPOINT release, so each test sees a clean database without re-migrating. SQLite tests get a
fresh copy of a migrated template file.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from controlplane.accounts.service import create_account, issue_key
from controlplane.api.deps import get_session, get_work_queue
from controlplane.app import create_app
from controlplane.config import Settings
from controlplane.db.migrate import downgrade_to_base, upgrade_to_head
from controlplane.db.models import Account, Deployment, Role, SpeculationMode
from controlplane.db.session import get_engine, get_sessionmaker, unit_of_work
from controlplane.ingest.batcher import IngestBatcher
from controlplane.models.service import REFERENCE_TARGET, register_reference_models
from tests.markers import ServiceReader, item_needs
from tests.service_guard import REFUSED_PG_URL, guarded_item, install_service_guard, service_free_run

# pytest loads this file as `conftest`; tests import it as `tests.conftest`. One module for both, so
# the databases a test creates through either name are dropped at the end, and a service-free
# run's refused URL holds for both.
sys.modules.setdefault("tests.conftest", sys.modules[__name__])

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
# Per test session, so two test runs on one machine never drop each other's databases.
SESSION_SUFFIX = f"_{os.getpid()}"
PG_TEST_DB = "controlplane_test"
_created_databases: list[str] = []
TEST_SECRET = "test-secret-not-for-production"


def pg_url(database: str = PG_TEST_DB) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + database


def recreate_pg_database(name: str) -> str:
    """A fresh, empty database named ``name`` plus this session's suffix; dropped at session end."""
    name += SESSION_SUFFIX
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    if name not in _created_databases:
        _created_databases.append(name)
    return pg_url(name)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Drop the databases this session created; a session that created none never connects."""
    if not _created_databases:
        return
    for url_name in _created_databases:
        get_engine(pg_url(url_name)).dispose()
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for name in _created_databases:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def pytest_configure(config: pytest.Config) -> None:
    if service_free_run(config):
        install_service_guard()
        # libpq's sockets are out of the guard's reach: a PostgreSQL test that slipped through
        # unmarked meets a refused port instead of the machine's server.
        global PG_ADMIN_URL
        PG_ADMIN_URL = REFUSED_PG_URL


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test by what it needs: `e2e` and `integration` by directory, `processes` and
    `postgres` read from the code of the test, its fixtures and what they call (tests/markers.py)."""
    reader = ServiceReader()
    here = Path(__file__).parent
    rings = {here / "e2e": pytest.mark.e2e, here / "integration": pytest.mark.integration}
    for item in items:
        for directory, ring in rings.items():
            if directory in item.path.parents:
                item.add_marker(ring)
        for need in sorted(item_needs(item, reader)):
            item.add_marker(getattr(pytest.mark, need))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    with guarded_item(item):
        return (yield)


def prepare_database(url: str) -> None:
    """Migrate to head and register the bundled reference pair, as ``controlplane init`` does."""
    upgrade_to_head(url)
    with unit_of_work(url) as session:
        register_reference_models(
            session=session, settings=Settings(database_url=url, environment="test", secret_key=TEST_SECRET)
        )


@pytest.fixture(scope="session")
def migrated_pg_url() -> str:
    url = recreate_pg_database(PG_TEST_DB)
    prepare_database(url)
    return url


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    prepare_database(f"sqlite:///{path}")
    get_engine(f"sqlite:///{path}").dispose()
    return path


@dataclass
class Database:
    """A database for one test: its URL, dialect and a session factory in the test's scope."""

    url: str
    dialect: str
    new_session: Callable[[], Session]


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        path = tmp_path / "controlplane.db"
        shutil.copy(template, path)
        url = f"sqlite:///{path}"
        yield Database(url, "sqlite", get_sessionmaker(url))
        get_engine(url).dispose()
        return
    url = request.getfixturevalue("migrated_pg_url")
    connection = get_engine(url).connect()
    outer = connection.begin()

    def new_session() -> Session:
        return Session(bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False)

    yield Database(url, "postgresql", new_session)
    outer.rollback()
    connection.close()


@dataclass
class Tenant:
    """An account with one key of each role."""

    name: str
    account_id: int
    keys: dict[Role, str]

    def headers(self, role: Role) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}


def add_deployment(session: Session, account_name: str, name: str = "d") -> Deployment:
    """A bare account with one default-speculation deployment, flushed (for write-path tests)."""
    account = Account(name=account_name)
    session.add(account)
    session.flush()
    return add_deployment_to(session, account.id, name)


def add_deployment_to(session: Session, account_id: int, name: str = "d") -> Deployment:
    """A default-speculation deployment in an existing account, flushed."""
    deployment = Deployment(
        account_id=account_id,
        name=name,
        target_model=REFERENCE_TARGET,
        speculation_mode=SpeculationMode.default,
        drift_policy={},
        canary_policy={},
    )
    session.add(deployment)
    session.flush()
    return deployment


def make_tenant(session: Session, name: str) -> Tenant:
    account, admin = create_account(session=session, name=name, secret=TEST_SECRET)
    keys = {Role.admin: admin.secret}
    owner = session.get_one(Account, account.id)
    for role in (Role.ingest, Role.viewer, Role.serving):
        keys[role] = issue_key(
            session=session, account=owner, name=role.value, role=role, secret=TEST_SECRET
        ).secret
    return Tenant(name, account.id, keys)


@pytest.fixture
def tenants(db: Database) -> tuple[Tenant, Tenant]:
    session = db.new_session()
    first, second = make_tenant(session, "acme"), make_tenant(session, "globex")
    session.commit()
    session.close()
    return first, second


@pytest.fixture
def settings(db: Database) -> Settings:
    return Settings(
        database_url=db.url,
        environment="test",
        secret_key=TEST_SECRET,
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
    )


@pytest.fixture
def client(db: Database, settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings)

    def session_override() -> Iterator[Session]:
        session = db.new_session()
        try:
            yield session
        finally:
            session.rollback()
            session.close()

    app.dependency_overrides[get_session] = session_override
    # Routes on the hot path read these from app state, not through dependencies: every session
    # they open, and the shared ingest writer, must work inside the test's transaction too.
    app.state.session_factory = db.new_session
    app.state.ingest_batcher = IngestBatcher(db.new_session)
    with TestClient(app) as test_client:
        yield test_client


__all__ = ["Database", "Tenant", "downgrade_to_base", "recreate_pg_database"]


class RecordingWorkQueue:
    """Stands in for the Celery work queue: records the job ids the API hands to the gpu workers."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def enqueue_realign(self, job_id: int) -> None:
        self.sent.append(job_id)

    def enqueue_shadow_replay(self, job_id: int) -> None:
        self.sent.append(job_id)


@pytest.fixture
def queue(client: TestClient) -> RecordingWorkQueue:
    recording = RecordingWorkQueue()
    client.app.dependency_overrides[get_work_queue] = lambda: recording  # type: ignore[attr-defined]
    return recording
