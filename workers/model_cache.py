"""The models a worker process keeps loaded between jobs, so a target is read from disk once.

Owns :class:`LoadedModelCache` and the process-wide :data:`TARGETS`. A realignment or a shadow
replay of a deployment needs its target model (an 8B target is 16 GB of bf16 weights and tens of
seconds to read); jobs of the same deployment follow each other on the same worker, so the worker
keeps the last target it loaded and hands the same object to the next job.

Entries are keyed by (resolved folder, identity, device, dtype), where identity is a digest of what
is on disk (a manifest's or the weights' sha256): a folder overwritten with other weights is a new
entry, never a stale hit. Least recently used entries are dropped first, and dropping one on a GPU
returns its memory to the driver (``torch.cuda.empty_cache``), so that the next target fits (once
no running job still holds a reference to the dropped model).

A cached model is shared by every later job of the process, so nobody may change it: no training,
no ``.to()`` (a module moves in place), no ``requires_grad_``/``train()`` flag flips, no
``load_state_dict``. ``workers.training.realign.realign`` uses the target only as the frozen teacher
(forward passes under ``torch.no_grad`` on the device it was loaded on, nothing else) and trains a
copy of the drafter, never the target; ``workers.canary.replay`` only runs forward passes. A caller
that wants to change a model must take a copy.

Thread-safe: one lock guards the entries and is held while a model loads, so two threads asking for
the same target load it once (a Celery prefork worker runs one task per process, but a process may
still hold threads).
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

from workers.engine.model import Transformer
from workers.engine.tokenizer import Tokenizer

ModelT = TypeVar("ModelT")
TokenizerT = TypeVar("TokenizerT")


@dataclass(frozen=True, slots=True)
class CacheKey:
    folder: str  # resolved, so two spellings of one folder are one entry
    identity: str
    device: str
    dtype: str


class LoadedModelCache(Generic[ModelT, TokenizerT]):
    """Up to ``capacity`` loaded (model, tokenizer) pairs, least recently used dropped first."""

    def __init__(self, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[CacheKey, tuple[ModelT, TokenizerT]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(folder: Path, *, identity: str, device: torch.device, dtype: torch.dtype) -> CacheKey:
        return CacheKey(str(Path(folder).resolve()), identity, str(torch.device(device)), str(dtype))

    def get(
        self,
        folder: Path,
        *,
        identity: str,
        device: torch.device,
        dtype: torch.dtype,
        loader: Callable[[], tuple[ModelT, TokenizerT]],
    ) -> tuple[ModelT, TokenizerT]:
        """The cached pair for this key, or ``loader()``'s result, kept for the next caller.

        On a miss the least recently used entries are dropped *before* loading, so that an old target
        and a new one never need the GPU's memory at the same time. ``loader`` must load exactly
        ``folder`` at ``identity`` onto ``device`` in ``dtype``; the cache cannot check that.
        """
        key = self.key(folder, identity=identity, device=device, dtype=dtype)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
            while len(self._entries) >= self.capacity:
                self._drop_oldest()
            loaded = loader()
            self._entries[key] = loaded
            return loaded

    def clear(self) -> None:
        """Drop every entry (and give a GPU's memory back)."""
        with self._lock:
            while self._entries:
                self._drop_oldest()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _drop_oldest(self) -> None:
        key, entry = self._entries.popitem(last=False)
        on_gpu = key.device.startswith("cuda")
        del entry
        if on_gpu:
            # Module graphs can hold reference cycles; collect them so their tensors are really
            # unreferenced before the allocator's cached blocks are handed back to the driver.
            gc.collect()
            torch.cuda.empty_cache()


# The worker process's targets: one at a time (the next deployment's target replaces it).
TARGETS: LoadedModelCache[Transformer, Tokenizer] = LoadedModelCache(capacity=1)
