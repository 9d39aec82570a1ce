"""An API process over a fresh PostgreSQL database that already holds the test's tenants: what
the fuzzing and cross-tenant tests aim their requests at. Ingestion does not nudge the drift
monitor (no broker), and the process keeps its files under the test's folder.
"""

from __future__ import annotations

from pathlib import Path

from controlplane.db.session import get_sessionmaker
from tests.conftest import TEST_SECRET, Tenant, make_tenant, prepare_database, recreate_pg_database
from tests.fleet.processes import ControlPlaneProcess


def api_on_fresh_postgres(
    tmp_path: Path, database: str, tenant_names: tuple[str, ...], **env: str
) -> tuple[str, list[Tenant], ControlPlaneProcess]:
    """(database URL, the tenants in ``tenant_names``' order, the started API); ``env`` adds to or
    replaces the process's environment."""
    url = recreate_pg_database(database)
    prepare_database(url)
    with get_sessionmaker(url)() as session:
        tenants = [make_tenant(session, name) for name in tenant_names]
        session.commit()
    api = ControlPlaneProcess(
        tmp_path,
        **{
            "CONTROLPLANE_DATABASE_URL": url,
            "CONTROLPLANE_ENVIRONMENT": "test",
            "CONTROLPLANE_SECRET_KEY": TEST_SECRET,
            "CONTROLPLANE_DRIFT_ENQUEUE_ON_INGEST": "false",
            "CONTROLPLANE_VAR_DIR": str(tmp_path / "var"),
            **env,
        },
    ).start()
    return url, tenants, api
