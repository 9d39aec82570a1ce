"""The guard of a service-free run (`make unit`): a test that starts a long-lived process or
connects to PostgreSQL or Redis while not marked `processes` / `postgres` fails, naming what it did,
instead of quietly using the machine's services.

A run is service-free when its marker expression deselects both `processes` and `postgres`. One-shot
commands (`subprocess.run`, `subprocess.call` and what is built on them) stay allowed: they wait for
their command and leave nothing running.
"""

from __future__ import annotations

import itertools
import re
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from _pytest.mark.expression import Expression

SERVICE_PORTS = {5432: "PostgreSQL", 6379: "Redis"}
# Port 9 (discard) has no listener here: a connection is refused at once.
REFUSED_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:9/test"
ONE_SHOT_CALLERS = frozenset({subprocess.run.__code__, subprocess.call.__code__})


class UnmarkedServiceUse(BaseException):
    """Raised where a guarded test reaches a service; a BaseException so no `except Exception` in
    the code under test can swallow it."""


_active: list[str] = []  # the node id of the test being guarded, when one is


def service_free_run(config: pytest.Config) -> bool:
    """Whether the marker expression leaves out every test marked `processes` or `postgres`,
    whatever other markers it carries (`-m slow` does not; `make unit`'s expression does)."""
    expression = config.getoption("markexpr", "")
    if not expression:
        return False
    compiled = Expression.compile(expression)
    names = sorted(set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expression)) - {"and", "or", "not"})
    for service in ("processes", "postgres"):
        others = [name for name in names if name != service]
        for chosen in itertools.product((False, True), repeat=len(others)):
            carried = {service, *(name for name, on in zip(others, chosen, strict=True) if on)}
            if compiled.evaluate(lambda name, carried=carried, **_: name in carried):
                return False
    return True


def _refuse(what: str) -> None:
    raise UnmarkedServiceUse(
        f"{_active[-1]} {what} in a service-free run: tests/markers.py did not see it. Mark the "
        "test with @pytest.mark.processes or @pytest.mark.postgres, or teach tests/markers.py the "
        "call that does it."
    )


def install_service_guard() -> None:
    """Wrap process creation and socket connects for the rest of the run (active per test only)."""
    popen_init = subprocess.Popen.__init__
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded_popen_init(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        import sys

        caller = sys._getframe(1).f_code
        if _active and caller not in ONE_SHOT_CALLERS:
            _refuse(f"started a process ({args[0] if args else kwargs.get('args')!r})")
        popen_init(self, *args, **kwargs)

    def check_address(address: Any) -> None:
        if _active and isinstance(address, tuple) and len(address) >= 2 and address[1] in SERVICE_PORTS:
            _refuse(f"connected to {SERVICE_PORTS[address[1]]} at {address[0]}:{address[1]}")

    def guarded_connect(self: socket.socket, address: Any) -> None:
        check_address(address)
        connect(self, address)

    def guarded_connect_ex(self: socket.socket, address: Any) -> int:
        check_address(address)
        return connect_ex(self, address)

    subprocess.Popen.__init__ = guarded_popen_init  # type: ignore[method-assign]
    socket.socket.connect = guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = guarded_connect_ex  # type: ignore[method-assign]


@contextmanager
def guarded_item(item: pytest.Item) -> Iterator[None]:
    """Guard one test's setup, call and teardown (a no-op unless the guard is installed)."""
    _active.append(item.nodeid)
    try:
        yield
    finally:
        _active.pop()
