"""The CLI commands that hand their arguments to a torch-side module (`controlplane demo`,
`controlplane models build`) show that module's options: `--help` reaches its parser, and every
option the parser declares appears in what the command prints."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each runs a Python process that imports torch to print its help: seconds of CPU apiece.
pytestmark = pytest.mark.slow


def declared_options(module: Path) -> set[str]:
    """The long option names of every ``add_argument`` call in the module, read from its source."""
    options: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            options.update(
                arg.value
                for arg in node.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--")
            )
    return options


@pytest.mark.parametrize(
    ("command", "module"),
    [(["demo"], "workers/demo.py"), (["models", "build"], "workers/training/build_reference.py")],
)
def test_help_shows_every_option_of_the_underlying_parser(command: list[str], module: str) -> None:
    options = declared_options(ROOT / module)
    assert len(options) >= 5, f"{module}: only {sorted(options)} found: the source reading misses them"
    shown = subprocess.run(
        [sys.executable, "-m", "controlplane", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    missing = sorted(option for option in options if option not in shown.stdout.split())
    assert missing == [], f"controlplane {' '.join(command)} --help misses {missing}:\n{shown.stdout}"
