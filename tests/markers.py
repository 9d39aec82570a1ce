"""Which services a test needs, read from its code, so the markers `processes` and `postgres` are
applied at collection and nobody has to remember them.

A test needs what its own function, the fixtures it uses and every project function or class they
reference (followed transitively through `controlplane`, `workers`, `bench`, `loadbench` and
`tests`) need:

- `processes`: something starts a long-lived process: `subprocess.Popen` (a server, a worker, a
  supervisor's children), `os.fork`, `multiprocessing`, or an asyncio subprocess. A one-shot
  `subprocess.run` that waits for its command is not a service and does not count.
- `postgres`: something reaches the machine's PostgreSQL through the test configuration
  (`recreate_pg_database`, `pg_url`, `PG_ADMIN_URL`, the `migrated_pg_url` fixture, a parameter
  whose value is "postgres") or starts a private cluster (`PrivatePostgres`).

Reading code cannot see a call made through a value the test never names, so `make unit` also runs
with a guard (see `tests/conftest.py`) that fails any test starting a process or reaching
PostgreSQL or Redis without its marker.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("controlplane", "workers", "bench", "loadbench", "tests")
# The reader and the guard name process starts themselves; a test that uses them starts nothing.
READER_FILES = frozenset({Path(__file__).resolve(), ROOT / "tests" / "service_guard.py"})
POSTGRES_NAMES = frozenset({"recreate_pg_database", "pg_url", "PrivatePostgres", "migrated_pg_url"})
POSTGRES_FIXTURES = frozenset({"migrated_pg_url"})
# Attribute names that start a long-lived process, by the module they are read from.
PROCESS_ATTRIBUTES = {
    "subprocess": frozenset({"Popen"}),
    "os": frozenset({"fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnv", "spawnve"}),
    "multiprocessing": frozenset({"Process", "Pool", "get_context"}),
    "asyncio": frozenset({"create_subprocess_exec", "create_subprocess_shell"}),
}


def _process_objects() -> tuple[Any, ...]:
    import os
    import subprocess

    return (subprocess.Popen, os.fork)


def _is_project(obj: Any) -> bool:
    """Defined in this repository (pytest imports test files under their bare names)."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return isinstance(name, str) and _is_project_module(name)


@functools.cache
def _is_project_module(name: str) -> bool:
    path = getattr(sys.modules.get(name), "__file__", None)
    if path is None:
        return False
    resolved = Path(path).resolve()
    if resolved in READER_FILES:
        return False
    return any(resolved.is_relative_to(ROOT / package) for package in PROJECT_PACKAGES)


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _functions_of(obj: Any) -> Iterable[Callable[..., Any]]:
    """The plain functions behind a function, method, property, class or partial."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        return [f for f in (obj.fget, obj.fset, obj.fdel) if f is not None]
    if isinstance(obj, type):
        return [f for value in vars(obj).values() for f in _functions_of(value)]
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    return [obj] if isinstance(obj, types.FunctionType) else []


class ServiceReader:
    """Memoised reading of what a function reaches: `needs(f)` is a subset of {processes, postgres}."""

    def __init__(self) -> None:
        self._needs: dict[Any, frozenset[str]] = {}
        self._process_objects = _process_objects()

    def needs_of(self, obj: Any) -> frozenset[str]:
        found: set[str] = set()
        for function in _functions_of(obj):
            found |= self._function_needs(function)
        return frozenset(found)

    def _function_needs(self, function: types.FunctionType) -> frozenset[str]:
        if function in self._needs:
            return self._needs[function]
        self._needs[function] = frozenset()  # a recursive reference adds nothing new
        found: set[str] = set()
        names: set[str] = set()
        for code in _code_objects(function.__code__):
            names.update(code.co_names)
        if names & POSTGRES_NAMES or "PG_ADMIN_URL" in names:
            found.add("postgres")
        referenced: list[Any] = []
        modules: list[types.ModuleType] = []
        for name in names:
            if name in function.__globals__:
                referenced.append(function.__globals__[name])
            elif name in sys.modules:  # `import x.y` inside the function
                referenced.append(sys.modules[name])
        for value in referenced:
            if isinstance(value, types.ModuleType):
                modules.append(value)
            elif any(value is starter for starter in self._process_objects):
                found.add("processes")
        for module in modules:
            base = module.__name__.split(".")[0]
            if names & PROCESS_ATTRIBUTES.get(base, frozenset()):
                found.add("processes")
            if _is_project(module):
                referenced.extend(getattr(module, name) for name in names if hasattr(module, name))
        for value in referenced:
            if not isinstance(value, types.ModuleType) and _is_project(value):
                for inner in _functions_of(value):
                    if inner is not function:
                        found |= self._function_needs(inner)
        self._needs[function] = frozenset(found)
        return self._needs[function]


def item_needs(item: Any, reader: ServiceReader) -> frozenset[str]:
    """What one collected test needs: its function and every fixture in its closure."""
    found: set[str] = set(reader.needs_of(getattr(item, "function", None)))
    fixture_info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        if name in POSTGRES_FIXTURES:
            found.add("postgres")
        definitions = fixture_info.name2fixturedefs.get(name, ()) if fixture_info is not None else ()
        for definition in definitions:
            found |= reader.needs_of(definition.func)
    # A dialect parameter (`db`, `dialect`, a fixture's own params) picks PostgreSQL by value.
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(
        value == "postgres" for value in callspec.params.values() if isinstance(value, str)
    ):
        found.add("postgres")
    return frozenset(found)
