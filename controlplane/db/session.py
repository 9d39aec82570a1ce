"""Engine and session factory, the unit of work that is the one transaction boundary, and the
driver-level cursor that hot write paths use inside a session's transaction."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import orjson
import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

# The database was briefly unreachable or refused a connection: worth retrying the same work
# (Celery tasks map these to a retry), unlike a bug or bad data.
TRANSIENT_DATABASE_ERRORS: tuple[type[Exception], ...] = (OperationalError,)
# The same, as a request may meet them: wrapped by SQLAlchemy, or raw from psycopg where the ingest
# path uses the driver's own cursor (COPY).
UNREACHABLE_DATABASE_ERRORS: tuple[type[Exception], ...] = (OperationalError, psycopg.OperationalError)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # SQLite ignores foreign keys unless asked per connection; WAL lets readers run beside
    # the ingest writer, and busy_timeout makes concurrent writers wait instead of failing.
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def json_loads(text: str | bytes) -> Any:
    """Decode a JSON column: orjson (several times faster than the stdlib on rollup histograms),
    falling back to the stdlib for what orjson refuses (NaN, integers beyond 64 bits) so that
    any value the stdlib encoder once wrote still reads back."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def json_dumps(value: Any) -> str:
    """Encode a JSON column with orjson (the ingest COPY path writes one per record)."""
    return orjson.dumps(value).decode()


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """One pooled engine per database URL for the whole process."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, json_deserializer=json_loads
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    # On psycopg the dialect registers these as each new connection's JSON loader and dumper, so
    # the raw COPY path in controlplane.ingest.service uses them too, at no per-call cost.
    return create_engine(
        url,
        pool_size=10,
        max_overflow=20,
        pool_pre_ping=True,
        json_deserializer=json_loads,
        json_serializer=json_dumps,
    )


@contextmanager
def driver_cursor(session: Session) -> Iterator[Any]:
    """A psycopg cursor on the session's own connection, so inside its transaction; rows read
    by attribute, like SQLAlchemy's. PostgreSQL only.

    For the per-request ingest statements, where SQLAlchemy's execution machinery (parameter
    processing, result wrapping) cost about as much CPU as the database's own work. The
    driver's errors leave as SQLAlchemy's (IntegrityError, OperationalError, ...), so callers
    handle them the same whichever path raised them.
    """
    driver_connection: Any = session.connection().connection.driver_connection
    cursor = driver_connection.cursor(row_factory=namedtuple_row)
    try:
        yield cursor
    except psycopg.Error as exc:
        raise DBAPIError.instance(None, None, exc, psycopg.Error) from exc
    finally:
        cursor.close()


@lru_cache(maxsize=8)
def get_sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(url), expire_on_commit=False)


@contextmanager
def unit_of_work(url: str) -> Iterator[Session]:
    """A session that commits only when the block ends cleanly, and rolls back otherwise."""
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
