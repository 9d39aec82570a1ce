"""The layering rules the code base keeps, checked on its source: workers hold no SQL, no module
reaches into another package's private names, the control plane never imports torch or the
workers, the benchmark client imports no workers, and the control plane's packages import each
other in one direction only: no import cycle between them, each importing only layers below its
own (``LAYERS``).

The package graph counts every ``import`` and ``from`` statement anywhere in a module, those
inside functions included: an import deferred to call time still ties the two packages, and a
cycle hidden behind it is still a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
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


# The control plane's top-level packages (and single-module packages such as config.py), bottom
# layer first; a package may import only packages of lower layers. The lifecycles stand in the
# order in which one acts on the other's state: the drafters' serving config names the fleet's
# backends, a drift event is answered by a realign job (its end ends the event), a job's trained
# version is judged by a canary (a promotion resolves the events); the continuous triggers
# (adaptation, the check that speculation pays) request realignments and canaries; ``loop`` carries
# one lifecycle into the next where a lower package would otherwise have to call up (see
# controlplane/loop/__init__.py).
LAYERS: tuple[tuple[str, ...], ...] = (
    # Leaves: nothing of the project below them.
    (
        "errors",
        "timestamps",
        "lifecycle",
        "messaging",
        "speculation_math",
        "canary_policy",
        "adaptation_policy",
        "artifacts",
    ),
    # The draft tuner's arithmetic, on speculation_math's figures.
    ("tuning",),
    ("config", "db"),
    ("audit",),
    # Acceptance records, rollups and window aggregates: data every lifecycle reads.
    ("ingest",),
    ("accounts", "stats"),
    ("models",),
    # Sampled traces (a chat trace is rendered with its target model's template).
    ("traces",),
    ("deployments", "router"),
    ("fleet",),
    ("drafters",),
    ("drift",),
    ("jobs",),
    ("canary",),
    ("adaptation",),
    ("speculation_check",),
    ("loop",),
    ("api",),
    ("dashboard", "observability"),
    ("bootstrap",),
    ("app", "supervisor"),
    # The CLI's HTTP client and output, then the verb modules the main CLI module registers.
    ("cli_client",),
    ("cli_canary", "cli_models", "cli_scrape"),
    ("cli",),
    ("__main__",),
)


def _imported_modules(module: str, path: Path, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Every module an import statement anywhere in ``tree`` names (relative imports resolved;
    ``from package import name`` also yields ``package.name``, which may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def _top_package(module: str, root_package: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == root_package else None


def package_imports(root: Path = ROOT, root_package: str = "controlplane") -> dict[str, dict[str, list[str]]]:
    """importer package -> imported package -> where (file:line), over the root package's
    top-level packages; a module directly under it (config.py) is a package of its own."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path, tree in _modules(root_package, root):
        importer = _top_package(module, root_package)
        if importer is None:
            continue
        edges = graph.setdefault(importer, {})
        for line, name in _imported_modules(module, path, tree):
            imported = _top_package(name, root_package)
            if imported is not None and imported != importer:
                where = f"{path.relative_to(root)}:{line}"
                if where not in edges.setdefault(imported, []):
                    edges[imported].append(where)
    return graph


def import_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of two or more packages (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def imports_against_layers(
    graph: Mapping[str, Mapping[str, list[str]]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[str]:
    """Each import of a package in the importer's own layer or above, with where it stands."""
    rank = {package: i for i, layer in enumerate(layers) for package in layer}
    return [
        f"{importer} -> {imported} ({', '.join(where)})"
        for importer, edges in sorted(graph.items())
        for imported, where in sorted(edges.items())
        if rank.get(imported, len(layers)) >= rank.get(importer, -1)
    ]


def test_the_control_planes_packages_form_no_import_cycle() -> None:
    assert import_cycles(package_imports()) == []


def test_every_control_plane_package_has_a_layer() -> None:
    packages = {
        _top_package(module, "controlplane")
        for module, _path, _tree in _modules("controlplane")
        if _top_package(module, "controlplane") is not None
    }
    layered = [package for layer in LAYERS for package in layer]
    assert len(layered) == len(set(layered))
    assert sorted(packages - set(layered)) == []


def test_packages_import_only_lower_layers() -> None:
    assert imports_against_layers(package_imports()) == []


def realign_jobs_built_outside_the_one_validated_function(root: Path = ROOT) -> list[str]:
    """``Job(kind=JobKind.realign, ...)`` anywhere but in ``jobs.service.queue_realign_job``, the one
    function that checks a realignment's trigger and validates its params, whatever asked for it."""
    found: list[str] = []
    for module, path, tree in _modules("controlplane", root):
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if module == "controlplane.jobs.service" and function.name == "queue_realign_job":
                continue
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "Job"
                    and any(
                        k.arg == "kind" and isinstance(k.value, ast.Attribute) and k.value.attr == "realign"
                        for k in node.keywords
                    )
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno} in {function.name}")
    return found


def test_every_realignment_is_created_by_the_one_validated_function() -> None:
    assert realign_jobs_built_outside_the_one_validated_function() == []


def test_the_realign_check_finds_a_job_built_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "controlplane" / "jobs").mkdir(parents=True)
    (tmp_path / "controlplane" / "jobs" / "service.py").write_text(
        "def queue_realign_job():\n    return Job(kind=JobKind.realign)\n"
        "def schedule():\n    return Job(kind=JobKind.realign, params={})\n"
        "def replay():\n    return Job(kind=JobKind.replay)\n"
    )
    assert realign_jobs_built_outside_the_one_validated_function(tmp_path) == [
        "controlplane/jobs/service.py:4 in schedule"
    ]


def test_the_graph_checks_find_what_they_look_for(tmp_path: Path) -> None:
    # A cycle through a deferred import, a relative import and a module imported by name.
    pkg = tmp_path / "cp"
    for sub in ("low", "high", "other"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "leaf.py").write_text("X = 1\n")
    (pkg / "low" / "service.py").write_text("def f():\n    from cp.high.service import g\n    return g\n")
    (pkg / "high" / "service.py").write_text("from ..low import service\nfrom cp import leaf\ndef g(): ...\n")
    (pkg / "other" / "a.py").write_text("import cp.leaf\n")
    graph = package_imports(tmp_path, "cp")
    assert graph["low"] == {"high": ["cp/low/service.py:2"]}
    assert graph["high"] == {"low": ["cp/high/service.py:1"], "leaf": ["cp/high/service.py:2"]}
    assert graph["other"] == {"leaf": ["cp/other/a.py:1"]}
    assert import_cycles(graph) == [["high", "low"]]
    assert import_cycles({"a": ["b"], "b": ["c"], "c": []}) == []
    layers = (("leaf",), ("low",), ("high", "other"))
    assert imports_against_layers(graph, layers) == ["low -> high (cp/low/service.py:2)"]
