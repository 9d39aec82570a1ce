"""Alembic environment: the URL comes from controlplane Settings (or an explicit override)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from controlplane.config import get_settings
from controlplane.db.models import Base
from controlplane.db.session import get_engine
from controlplane.ingest.partitions import is_partition

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _include_object(obj: object, name: str | None, type_: str, reflected: bool, compare_to: object) -> bool:
    """Leave the daily partitions of acceptance_aggregates to the maintenance task: the models do
    not declare them, and autogenerate would otherwise propose dropping them."""
    return not (type_ == "table" and name is not None and is_partition(name))


def _url() -> str:
    return str(config.attributes.get("database_url") or get_settings().database_url)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        with get_engine(_url()).connect() as connection:
            _run(connection)
    else:
        _run(connection)


def _run(connection: object) -> None:
    # Batch mode lets later revisions ALTER tables on SQLite (which cannot drop or alter columns).
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        include_object=_include_object,
    )
    with context.begin_transaction():
        context.run_migrations()
    if hasattr(connection, "commit"):
        connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
