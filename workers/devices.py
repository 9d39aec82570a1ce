"""Where a worker runs its models and in which precision: the one reading of the device setting.

Owns :func:`resolve_device` (the ``CONTROLPLANE_WORKER_DEVICE`` value, "auto" | "cpu" | "cuda" |
"cuda:N", to a ``torch.device``, refusing a GPU that is not there), :func:`weights_dtype` (how
weights are held on that device) and :func:`autocast_for` (the mixed-precision context forward
passes run under there).

On a GPU: bfloat16 weights for frozen models and bf16 autocast, which keeps float32 master weights
of a model being trained while its matrix products run in bf16 (bf16 has float32's exponent range,
so no loss scaling is needed). On a CPU: float32 throughout, because CPU half-precision matrix
products are slower than float32 ones and less exact, and because CPU results then stay
bit-for-bit what they were before any of this existed.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch

SETTING_NAME = "CONTROLPLANE_WORKER_DEVICE"
_CUDA_SETTING = re.compile(r"^cuda(?::(\d+))?$")


def resolve_device(setting: str) -> torch.device:
    """The device a worker runs models on, from its setting.

    "auto": the first GPU when torch sees one, else the CPU. "cpu": the CPU. "cuda" / "cuda:N": that
    GPU ("cuda" is GPU 0); a RuntimeError naming the setting when torch sees no GPU or fewer than
    N + 1 of them, because silently training on a CPU instead would take hours, not minutes.
    """
    value = setting.strip().lower()
    if value == "cpu":
        return torch.device("cpu")
    if value == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    match = _CUDA_SETTING.match(value)
    if match is None:
        raise ValueError(f"{SETTING_NAME}={setting!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    index = int(match.group(1) or 0)
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{SETTING_NAME}={setting!r} asks for a GPU, but torch sees no CUDA device "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); "
            "set it to 'auto' or 'cpu' to run on the CPU"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(
            f"{SETTING_NAME}={setting!r} asks for GPU {index}, but torch sees {count} "
            f"(cuda:0..cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def weights_dtype(device: torch.device) -> torch.dtype:
    """How a frozen model's weights are held: bfloat16 on a GPU, float32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on a GPU; on a CPU a context that does nothing (float32 stays float32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
