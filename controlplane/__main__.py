"""`python -m controlplane` runs the CLI."""

from controlplane.cli import app

app()
