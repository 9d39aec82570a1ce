"""The layering rules the code base keeps, checked on its source: workers hold no SQL, no module
reaches into another package's private names, the control plane never imports torch or the
workers, and the benchmark client imports no workers."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("controlplane", "workers", "loadbench", "tests", "bench")
# Calls that run SQL or ORM queries when made on a session (or build a statement).
SESSION_CALLS = frozenset(
    {"execute", "scalar", "scalars", "get", "get_one", "add", "add_all", "query", "merge"}
)
STATEMENT_BUILDERS = frozenset({"select", "insert", "update", "delete", "text"})


def _modules(package: str, root: Path = ROOT) -> Iterator[tuple[str, Path, ast.Module]]:
    for path in sorted((root / package).rglob("*.py")):
        if ".venv" in path.parts or "results" in path.parts:
            continue
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        yield name.removesuffix(".__init__"), path, ast.parse(path.read_text(), filename=str(path))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports_across_packages(root: Path = ROOT) -> list[str]:
    """``from a.b import _name`` (or a ``_private`` module) where a.b is not the importer's package."""
    found: list[str] = []
    for package in PROJECT_PACKAGES:
        for module, path, tree in _modules(package, root):
            importer = _package_of(module, path)
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                    continue
                if node.module.split(".")[0] not in PROJECT_PACKAGES:
                    continue
                source_package = node.module.rsplit(".", 1)[0]
                parts = node.module.split(".")
                if any(_is_private(p) for p in parts) and ".".join(parts[:-1]) != importer:
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports module {node.module}")
                for alias in node.names:
                    if _is_private(alias.name) and node.module != module and source_package != importer:
                        found.append(
                            f"{path.relative_to(root)}:{node.lineno} imports {node.module}.{alias.name}"
                        )
    return found


def sql_in_workers(root: Path = ROOT) -> list[str]:
    """SQLAlchemy imports, statement builders and session queries anywhere under workers/."""
    found: list[str] = []
    for _module, path, tree in _modules("workers", root):
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                )
                if any(n == "sqlalchemy" or n.startswith("sqlalchemy.") for n in names):
                    found.append(f"{where}:{node.lineno} imports sqlalchemy")
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in STATEMENT_BUILDERS:
                    found.append(f"{where}:{node.lineno} builds a statement with {func.id}()")
                if (
                    isinstance(func, ast.Attribute)
                    and func.attr in SESSION_CALLS
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "session"
                ):
                    found.append(f"{where}:{node.lineno} calls session.{func.attr}()")
    return found


def imports_of(package: str) -> list[tuple[Path, int, str]]:
    out: list[tuple[Path, int, str]] = []
    for _module, path, tree in _modules(package):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out += [(path, node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.append((path, node.lineno, node.module))
    return out


def test_workers_hold_no_sql() -> None:
    assert sql_in_workers() == []


def test_no_private_name_is_imported_across_packages() -> None:
    assert private_imports_across_packages() == []


@pytest.mark.parametrize(
    ("package", "forbidden"), [("controlplane", ("torch", "workers")), ("loadbench", ("torch", "workers"))]
)
def test_dependencies_point_inward(package: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path, line, name in imports_of(package)
        if name.split(".")[0] in forbidden
    ]
    assert bad == []


def test_the_engine_imports_nothing_from_the_project() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path, line, name in imports_of("workers/engine")
        if name.split(".")[0] in PROJECT_PACKAGES and not name.startswith("workers.engine")
    ]
    assert bad == []


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    # The checks above pass on this tree; on a tree that breaks each rule they must say where.
    (tmp_path / "workers").mkdir()
    (tmp_path / "controlplane" / "canary").mkdir(parents=True)
    (tmp_path / "workers" / "tasks.py").write_text(
        "from sqlalchemy import select\n"
        "from controlplane.canary.service import _lock\n"
        "def f(session):\n    return session.execute(select(1))\n"
    )
    (tmp_path / "controlplane" / "canary" / "evaluate.py").write_text(
        "from controlplane.canary.service import _lock\nfrom controlplane.drift.service import _aware\n"
    )
    assert sql_in_workers(tmp_path) == [
        "workers/tasks.py:1 imports sqlalchemy",
        "workers/tasks.py:4 calls session.execute()",
        "workers/tasks.py:4 builds a statement with select()",
    ]
    assert private_imports_across_packages(tmp_path) == [
        "controlplane/canary/evaluate.py:2 imports controlplane.drift.service._aware",
        "workers/tasks.py:2 imports controlplane.canary.service._lock",
    ]
