"""The reference server's torch threads as the local stack starts it: its verify passes stay on its
own share unless asked (it always shares the machine there), and an explicit count is passed on."""

from __future__ import annotations

from pathlib import Path

from controlplane.config import Settings
from controlplane.supervisor import UpOptions, child_specs


def _serve_argv(options: UpOptions, tmp_path: Path) -> list[str]:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'cp.db'}", var_dir=tmp_path)
    specs = child_specs(settings, options, account="default", key_file=tmp_path / "serving.key")
    return next(spec.argv for spec in specs if spec.name == "serve")


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_verify_passes_stay_on_the_servers_own_threads_by_default(tmp_path: Path) -> None:
    argv = _serve_argv(UpOptions(serve_threads=1), tmp_path)
    assert _flag(argv, "--threads") == "1"
    assert "--multi-row-threads" not in argv


def test_an_explicit_verify_thread_count_is_passed_on(tmp_path: Path) -> None:
    argv = _serve_argv(UpOptions(serve_threads=1, serve_multi_row_threads=2), tmp_path)
    assert _flag(argv, "--threads") == "1" and _flag(argv, "--multi-row-threads") == "2"
    # The same count as the server's own is nothing to choose between.
    assert "--multi-row-threads" not in _serve_argv(
        UpOptions(serve_threads=2, serve_multi_row_threads=2), tmp_path
    )
