"""The user's documentation, checked against the code it describes: the README stays a short
start, every relative link in it and under docs/ reaches a file (and a heading, where it names
one), every `controlplane` command the pages name exists in the CLI, the configuration page lists
exactly the fields of `Settings`, and the API page gives each route the roles its dependencies
require."""

from __future__ import annotations

import functools
import inspect
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, iter_route_contexts

from controlplane.app import create_app
from controlplane.cli import app as cli_app
from controlplane.config import Settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\s*$")
SHELL_LANGUAGES = frozenset({"sh", "bash", "shell", "console", "zsh"})
# How a command line may start the CLI: the installed script, the venv's copy, or the module.
CLI_PROGRAMS = ("controlplane", ".venv/bin/controlplane", "python -m controlplane")
ROLE_WORDS = ("admin", "viewer", "ingest", "serving")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_and_blocks(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The lines outside fenced blocks, and each fenced block as (language, lines)."""
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    language: str | None = None
    block: list[str] = []
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if fence and language is None:
            language, block = fence.group(1), []
        elif line.strip() == "```" and language is not None:
            blocks.append((language, block))
            language = None
        elif language is not None:
            block.append(line)
        else:
            prose.append(line)
    return prose, blocks


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    prose, _ = prose_and_blocks(path.read_text())
    anchors: set[str] = set()
    for line in prose:
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            anchors.add(slug)
    return anchors


def relative_links(path: Path) -> Iterator[str]:
    prose, _ = prose_and_blocks(path.read_text())
    for line in prose:
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not ours
                yield target


def test_readme_is_a_short_start() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"
    )


def test_every_relative_link_reaches_a_file_and_its_heading() -> None:
    broken = []
    checked = 0
    for page in pages():
        for target in relative_links(page):
            checked += 1
            file_part, _, anchor = target.partition("#")
            destination = (page.parent / file_part).resolve() if file_part else page
            if not destination.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in heading_anchors(destination):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 50, f"only {checked} links found: the link pattern no longer matches the pages"
    assert not broken, "broken links:\n" + "\n".join(broken)


@functools.cache
def cli_tree() -> object:
    """The click command tree typer builds from the CLI (built once: it takes a while)."""
    return typer.main.get_command(cli_app)


def resolve_command(words: list[str]) -> tuple[list[str], str | None]:
    """Walk the CLI's groups along ``words``: the command path found, and the first word a group
    does not know (None when the path ends on a command)."""
    node = cli_tree()
    path: list[str] = []
    for word in words:
        commands = getattr(node, "commands", None)
        if commands is None:
            return path, None  # a leaf command: the rest are its arguments
        if word not in commands:
            return path, word
        node = commands[word]
        path.append(word)
    if getattr(node, "commands", None) is not None:
        return path, "<missing subcommand>"
    return path, None


def shell_commands(lines: list[str]) -> Iterator[list[str]]:
    """Each `controlplane ...` invocation in a shell block, as its words, wherever it starts (a
    line, after a pipe or `&&`, inside `$(...)`)."""
    text = "\n".join(lines)
    text = re.sub(r"\\\n", " ", text)  # join continued lines
    for line in text.splitlines():
        line = line.split(" #", 1)[0]
        if line.lstrip().startswith("#"):
            continue
        for program in CLI_PROGRAMS:
            for match in re.finditer(rf"(?:^|[\s|&;(]){re.escape(program)}(?=\s|$)", line):
                rest = line[match.end() :]
                rest = re.split(r"[|;&)]", rest, maxsplit=1)[0]
                try:
                    words = shlex.split(rest)
                except ValueError:
                    words = rest.split()
                yield [word for word in words if not word.startswith("-")][:3]


def inline_commands(prose: list[str]) -> Iterator[list[str]]:
    """Each inline code span of the prose that runs a CLI command (`controlplane deployment list`;
    a bare `controlplane` names the program)."""
    for line in prose:
        for span in re.findall(r"`([^`]+)`", line):
            yield from (words for words in shell_commands([span]) if words)


def test_every_cli_command_the_pages_name_exists() -> None:
    unknown = []
    found = 0
    for page in pages():
        prose, blocks = prose_and_blocks(page.read_text())
        commands = list(inline_commands(prose))
        for language, lines in blocks:
            if language in SHELL_LANGUAGES:
                commands += shell_commands(lines)
        for words in commands:
            found += 1
            path, missing = resolve_command(words)
            if missing is not None:
                unknown.append(f"{page.relative_to(ROOT)}: controlplane {' '.join(path)} {missing}")
    assert found >= 40, f"only {found} controlplane commands found: the parser no longer sees them"
    assert not unknown, "commands the CLI does not have:\n" + "\n".join(unknown)


def cli_reference_commands() -> Iterator[list[str]]:
    """The command paths of docs/cli.md's table: `scrape add ID NAME` / `list ID` share `scrape`."""
    prose, _ = prose_and_blocks((DOCS / "cli.md").read_text())
    for line in prose:
        if not line.startswith("| `"):
            continue
        first_cell = line.split(" | ")[0]
        group: list[str] = []
        for index, piece in enumerate(re.findall(r"`([^`]+)`", first_cell)):
            words = [word for word in piece.split() if re.fullmatch(r"[a-z][a-z0-9-]*", word)]
            if index == 0:
                group = words[:-1]
                yield words
            else:
                yield group + words


def leaf_commands() -> set[str]:
    leaves: set[str] = set()

    def walk(node: object, path: list[str]) -> None:
        commands = getattr(node, "commands", None)
        if commands is None:
            leaves.add(" ".join(path))
            return
        for name, sub in commands.items():
            walk(sub, [*path, name])

    walk(cli_tree(), [])
    return leaves


def test_the_cli_reference_names_every_command_and_only_those() -> None:
    documented = {" ".join(words) for words in cli_reference_commands()}
    leaves = leaf_commands()
    assert documented - leaves == set(), (
        f"docs/cli.md names commands the CLI lacks: {sorted(documented - leaves)}"
    )
    assert leaves - documented == set(), f"docs/cli.md misses commands: {sorted(leaves - documented)}"


def documented_settings() -> set[str]:
    """The variables in the first column of docs/configuration.md's tables, without the prefix."""
    prose, _ = prose_and_blocks((DOCS / "configuration.md").read_text())
    names: set[str] = set()
    for line in prose:
        if line.startswith("| `"):
            first_cell = line.split(" | ")[0]
            for name in re.findall(r"`([A-Z0-9_]+)`", first_cell):
                names.add(name.removeprefix("CONTROLPLANE_"))
    return names


def test_the_configuration_page_lists_exactly_the_settings() -> None:
    fields = {name.upper() for name in Settings.model_fields}
    documented = documented_settings()
    assert documented - fields == set(), (
        f"docs/configuration.md names no such setting: {sorted(documented - fields)}"
    )
    assert fields - documented == set(), (
        f"docs/configuration.md misses settings: {sorted(fields - documented)}"
    )


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    database = Path(tmp_path_factory.mktemp("docs")) / "unused.db"
    settings = Settings(
        database_url=f"sqlite:///{database}",
        environment="test",
        secret_key="docs-test-secret-not-for-production",
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
    )
    return create_app(settings)


def required_roles(dependant: Dependant) -> frozenset[str] | None:
    """The role set a route's access dependency allows (the `allowed` its closure holds), or None
    for a route that checks no role set through a dependency."""
    for sub in dependant.dependencies:
        call = sub.call
        if call is not None and inspect.isfunction(call) and call.__closure__:
            allowed = inspect.getclosurevars(call).nonlocals.get("allowed")
            if isinstance(allowed, frozenset):
                return frozenset(role.value for role in allowed)
        found = required_roles(sub)
        if found is not None:
            return found
    return None


def shape(path: str) -> str:
    """A path with its parameters unnamed and its query dropped: `{d}` and `{deployment}` agree."""
    return re.sub(r"\{[^}]*\}", "{}", path.split("?", 1)[0])


def documented_routes() -> dict[tuple[str, str], frozenset[str]]:
    """(method, path shape) -> the roles docs/api.md gives it; paths under an account are written
    after `/v1/accounts/{account}`, those in the last table in full."""
    prose, _ = prose_and_blocks((DOCS / "api.md").read_text())
    routes: dict[tuple[str, str], frozenset[str]] = {}
    prefix = "/v1/accounts/{account}"
    for line in prose:
        if line.startswith("**Outside an account**"):
            prefix = ""
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) < 3 or not re.fullmatch(r"[A-Z]+(, [A-Z]+)*", cells[0]):
            continue
        roles = frozenset(word for word in ROLE_WORDS if re.search(rf"\b{word}\b", cells[2]))
        for method in cells[0].split(", "):
            for path in re.findall(r"`([^`]+)`", cells[1]):
                routes[(method, shape(prefix + path))] = roles
    return routes


def test_the_api_page_gives_every_route_the_roles_the_code_requires(api: FastAPI) -> None:
    documented = documented_routes()
    served: dict[tuple[str, str], frozenset[str] | None] = {}
    for context in iter_route_contexts(api.routes):
        route = context.original_route
        if isinstance(route, APIRoute) and str(context.path).startswith("/v1/"):
            for method in route.methods or ():
                served[(method, shape(str(context.path)))] = required_roles(route.dependant)
    assert len(served) > 60, f"only {len(served)} routes found: the walk no longer sees the routers"
    missing = sorted(f"{method} {path}" for method, path in set(served) - set(documented))
    assert not missing, f"docs/api.md misses routes: {missing}"
    stale = sorted(f"{m} {p}" for m, p in set(documented) - set(served) if p.startswith("/v1/"))
    assert not stale, f"docs/api.md names routes the app does not serve: {stale}"
    wrong = []
    for (method, path), roles in sorted(served.items()):
        if roles is not None and documented[(method, path)] != roles:
            wrong.append(
                f"{method} {path}: documented {sorted(documented[(method, path)])}, required {sorted(roles)}"
            )
    assert not wrong, "docs/api.md gives routes other roles than the code:\n" + "\n".join(wrong)
