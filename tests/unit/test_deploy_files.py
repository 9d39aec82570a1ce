"""The deployment files' first start and their pointers into the docs: docker-compose.yml has a
one-shot service that creates the first account and its admin key, and every comment in the
compose and deploy/ files that sends the reader to a page names a page and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.unit.test_docs import heading_anchors

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMMENTED_FILES = (
    COMPOSE,
    ROOT / "deploy" / "prometheus" / "prometheus.yml",
    ROOT / "deploy" / "router.toml",
)
# `(docs/operations.md, "Dashboard and observability")`, a comment possibly wrapping the heading.
POINTER = re.compile(r"\(\s*(?:see\s+)?([\w./-]+\.md),\s*\"([^\"]+)\"\s*\)")


def comments(path: Path) -> str:
    """The file's comment text, its lines joined so that a wrapped heading reads whole."""
    return " ".join(line.split("#", 1)[1].strip() for line in path.read_text().splitlines() if "#" in line)


def test_a_one_shot_service_creates_the_first_account_and_its_admin_key() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    init = services["init"]
    # A profile keeps it out of `docker compose up`: it runs once, by `docker compose run --rm init`.
    assert init["profiles"] == ["init"]
    assert init["command"][:3] == ["controlplane", "init", "--account"]
    assert init["command"][3].startswith("${CONTROLPLANE_ACCOUNT:?")
    assert init["depends_on"]["postgres"]["condition"] == "service_healthy"
    # The same database, secret key and artifact store as the API it prepares.
    assert init["environment"] == services["api"]["environment"]
    assert "docker compose run --rm init" in COMPOSE.read_text()


def test_every_pointer_in_the_deploy_files_reaches_a_page_and_its_heading() -> None:
    found = []
    for path in COMMENTED_FILES:
        text = comments(path)
        assert "README," not in text, f"{path.name} points at a README section (the README is a short start)"
        for page, heading in POINTER.findall(text):
            slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
            assert (ROOT / page).exists(), f"{path.name}: no page {page}"
            assert slug in heading_anchors(ROOT / page), f"{path.name}: {page} has no heading {heading!r}"
            found.append((path.name, page))
    assert {name for name, _ in found} == {path.name for path in COMMENTED_FILES}
