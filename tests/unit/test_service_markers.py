"""The markers read from code (tests/markers.py): what starts a process or reaches PostgreSQL is
seen through helpers and classes; one-shot commands are not services."""

from __future__ import annotations

import subprocess
import sys

from tests.fleet.processes import ControlPlaneProcess
from tests.markers import ServiceReader


def _runs_a_server() -> None:
    subprocess.Popen([sys.executable, "-c", "pass"])


def _through_a_helper() -> None:
    _runs_a_server()


def _through_a_class() -> None:
    ControlPlaneProcess  # noqa: B018  (referenced, as a fixture that builds one would)


def _one_shot() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _makes_a_database() -> None:
    from tests.conftest import recreate_pg_database

    recreate_pg_database("x")


def _plain() -> int:
    return sum(range(3))


# Reached through a dict, which the reader does not follow: these tests only read the examples, and
# naming the functions directly would mark the tests themselves as starting processes.
EXAMPLES = {
    f.__name__: f
    for f in (_runs_a_server, _through_a_helper, _through_a_class, _one_shot, _makes_a_database, _plain)
}


def test_process_starts_are_seen_through_helpers_and_classes() -> None:
    reader = ServiceReader()
    assert reader.needs_of(EXAMPLES["_runs_a_server"]) == {"processes"}
    assert reader.needs_of(EXAMPLES["_through_a_helper"]) == {"processes"}
    assert reader.needs_of(EXAMPLES["_through_a_class"]) == {"processes"}


def test_one_shot_commands_and_plain_code_need_nothing() -> None:
    reader = ServiceReader()
    assert reader.needs_of(EXAMPLES["_one_shot"]) == frozenset()
    assert reader.needs_of(EXAMPLES["_plain"]) == frozenset()


def test_the_test_database_helpers_mean_postgres() -> None:
    assert ServiceReader().needs_of(EXAMPLES["_makes_a_database"]) == {"postgres"}
