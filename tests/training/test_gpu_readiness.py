"""What running workers on a GPU rests on, checked on a CPU: the device setting, the precision
rule, the per-process model cache, the teacher's top-K in memory-bounded chunks, padded
vocabularies shared between target and drafter, a realignment that never changes its target, and
replay KV caches sized to the requests."""

from __future__ import annotations

import threading
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import workers.canary.replay as replay_module
import workers.training.realign as realign_module
from workers.canary.replay import shadow_replay
from workers.devices import autocast_for, resolve_device, weights_dtype
from workers.engine.decoder import SpeculativeDecoder
from workers.engine.model import ModelConfig, Transformer, build_model
from workers.engine.tokenizer import Tokenizer
from workers.model_cache import TARGETS, LoadedModelCache
from workers.training.distill import kl_loss
from workers.training.realign import (
    SCORING_BYTES_PER_LOGIT,
    TOPK_BYTES_PER_ENTRY,
    RealignConfig,
    Rows,
    TraceText,
    completion_logits,
    realign,
    rows_per_chunk,
    run_device,
    teacher_targets,
)

REFERENCE = Path(__file__).resolve().parents[2] / "workers" / "models" / "reference"
VOCAB = 4096  # the reference tokenizer's
LINES = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    total += i\n",
    "if x is None:\n    raise ValueError('x')\n",
    "with open(path) as f:\n    data = f.read()\n",
]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(REFERENCE / "target")


def _model(vocab: int, seed: int, scale: float = 1.0, dim: int = 32) -> Transformer:
    cfg = ModelConfig(
        vocab_size=vocab, dim=dim, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=2 * dim, max_seq_len=256
    )
    model = build_model(cfg, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(scale)  # random 0.02-std weights give a near-uniform distribution
    return model


def _traces(n: int, prefix: str = "r") -> list[TraceText]:
    return [
        TraceText(f"{prefix}{i}", LINES[i % 4] + f"# {i}\n", LINES[(i + 1) % 4] + LINES[(i + 2) % 4])
        for i in range(n)
    ]


def _rows(seed: int, lengths: tuple[int, ...] = (40, 23, 31), vocab: int = VOCAB) -> Rows:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    return Rows(ids, [n // 3 for n in lengths], [f"k{i}" for i in range(len(lengths))])


QUICK = RealignConfig(
    seed=1, time_budget_s=120, batch_rows=8, max_epochs=2, evals=2, patience=10, lr=3e-3, teacher="topk"
)


# ------------------------------------------------------------------------------------------ devices


def test_cpu_and_auto_without_a_gpu_resolve_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto") == CPU


def test_auto_picks_the_first_gpu_and_cuda_n_picks_that_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="CONTROLPLANE_WORKER_DEVICE.*GPU 2.*sees 2"):
        resolve_device("cuda:2")


def test_asking_for_a_gpu_that_is_not_there_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for setting in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(RuntimeError, match="CONTROLPLANE_WORKER_DEVICE"):
            resolve_device(setting)
    with pytest.raises(ValueError, match="CONTROLPLANE_WORKER_DEVICE"):
        resolve_device("gpu")


def test_precision_is_bf16_on_a_gpu_and_float32_on_a_cpu() -> None:
    assert weights_dtype(CPU) == torch.float32
    assert weights_dtype(torch.device("cuda", 0)) == torch.bfloat16
    a = torch.randn(4, 8)
    with autocast_for(CPU):
        assert not torch.is_autocast_enabled("cpu")
        assert (a @ a.T).dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # building a CUDA autocast on a CPU-only torch warns
        gpu = autocast_for(torch.device("cuda", 0))
    assert isinstance(gpu, torch.autocast) and gpu.fast_dtype == torch.bfloat16


# -------------------------------------------------------------------------------------- model cache


class _CountingLoader:
    """Fake loaders that record each load and how many entries the cache held while it ran."""

    def __init__(self, cache: LoadedModelCache[object, str] | None = None) -> None:
        self.cache = cache
        self.calls: list[str] = []
        self.sizes: list[int] = []

    def __call__(self, name: str) -> Any:
        def load() -> tuple[object, str]:
            self.calls.append(name)
            if self.cache is not None:
                self.sizes.append(len(self.cache))
            return object(), f"tok-{name}"

        return load


def test_cache_hits_misses_and_keys(tmp_path: Path) -> None:
    cache: LoadedModelCache[object, str] = LoadedModelCache(capacity=2)
    loads = _CountingLoader()
    a = tmp_path / "a"
    first = cache.get(a, identity="sha1", device=CPU, dtype=torch.float32, loader=loads("a"))
    again = cache.get(
        tmp_path / "x" / ".." / "a", identity="sha1", device=CPU, dtype=torch.float32, loader=loads("a")
    )
    assert again is first and loads.calls == ["a"]  # one folder, however it is spelled
    assert (cache.hits, cache.misses) == (1, 1)
    # New weights in the same folder, or another dtype or device, are other entries.
    cache.get(a, identity="sha2", device=CPU, dtype=torch.float32, loader=loads("a2"))
    cache.get(a, identity="sha2", device=CPU, dtype=torch.bfloat16, loader=loads("a2-bf16"))
    assert loads.calls == ["a", "a2", "a2-bf16"] and len(cache) == 2


def test_cache_drops_the_least_recently_used_before_loading(tmp_path: Path) -> None:
    cache: LoadedModelCache[object, str] = LoadedModelCache(capacity=2)
    loads = _CountingLoader(cache)

    def get(name: str) -> tuple[object, str]:
        return cache.get(tmp_path / name, identity=name, device=CPU, dtype=torch.float32, loader=loads(name))

    a, b = get("a"), get("b")
    assert get("a") is a  # a is now the most recently used
    get("c")  # evicts b, not a
    assert get("a") is a and get("b") is not b
    assert loads.calls == ["a", "b", "c", "b"]
    assert loads.sizes == [0, 1, 1, 1]  # a full cache made room before each load, not after
    cache.clear()
    assert len(cache) == 0


def test_dropping_a_gpu_entry_gives_its_memory_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    cache: LoadedModelCache[object, str] = LoadedModelCache()
    loads = _CountingLoader()
    gpu = torch.device("cuda", 0)
    cache.get(tmp_path / "a", identity="1", device=gpu, dtype=torch.bfloat16, loader=loads("a"))
    cache.get(tmp_path / "b", identity="1", device=gpu, dtype=torch.bfloat16, loader=loads("b"))
    assert emptied == [True]
    cache.get(tmp_path / "c", identity="1", device=CPU, dtype=torch.float32, loader=loads("c"))
    cache.get(tmp_path / "d", identity="1", device=CPU, dtype=torch.float32, loader=loads("d"))
    assert emptied == [True, True]  # b (a GPU entry) went; c (a CPU one) needs no allocator call


def test_cache_loads_once_when_threads_ask_together(tmp_path: Path) -> None:
    cache: LoadedModelCache[object, str] = LoadedModelCache()
    calls: list[int] = []
    start = threading.Barrier(8)

    def slow_load() -> tuple[object, str]:
        calls.append(1)
        threading.Event().wait(0.05)
        return object(), "tok"

    got: list[object] = []

    def worker() -> None:
        start.wait()
        got.append(cache.get(tmp_path, identity="x", device=CPU, dtype=torch.float32, loader=slow_load)[0])

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(m) for m in got}) == 1


def test_the_process_cache_holds_one_target() -> None:
    assert TARGETS.capacity == 1
    with pytest.raises(ValueError):
        LoadedModelCache(capacity=0)


# ----------------------------------------------------------------------------- chunked teacher top-K


def test_rows_per_chunk_stays_within_the_budget() -> None:
    # 152,064 columns (Llama-3.1-8B's 128,256 or a Qwen2.5-7B's 152,064 rows), 1 GiB, top-32.
    per_row = 152_064 * SCORING_BYTES_PER_LOGIT + 32 * TOPK_BYTES_PER_ENTRY
    rows = rows_per_chunk(152_064, 1024, SCORING_BYTES_PER_LOGIT, 32)
    assert rows * per_row <= 1024 * 2**20 < (rows + 1) * per_row
    assert rows == 882
    assert rows_per_chunk(4096, 1024, 8) == 2**30 // (4096 * 8)
    assert rows_per_chunk(152_064, 0.01, 8, 32) == 1  # one position at least, whatever the budget
    assert rows_per_chunk(1000, 1, 4) == 2**20 // 4000
    with pytest.raises(ValueError):
        rows_per_chunk(0, 1024, 8)


def test_chunked_top_k_equals_the_unchunked_one(monkeypatch: pytest.MonkeyPatch) -> None:
    target = _model(VOCAB, seed=5, scale=20.0)
    rows = _rows(7)
    k = 16
    # The top-K of the full [N, V] distribution, as it was computed before chunking existed.
    p = torch.softmax(completion_logits(target, rows, [0, 1, 2], CPU).detach(), dim=-1)
    want_p, want_i = p.topk(k, dim=-1)
    seen: list[int] = []
    real = realign_module._chunk_logits

    def recording(model: Transformer, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append(hidden.shape[0])
        return real(model, hidden, *args)

    monkeypatch.setattr(realign_module, "_chunk_logits", recording)
    budget_mb = 7 * (VOCAB * SCORING_BYTES_PER_LOGIT + k * TOPK_BYTES_PER_ENTRY) / 2**20  # 7 rows
    for memory_mb, batch_rows in ((1024.0, 16), (budget_mb, 2)):
        seen.clear()
        got = teacher_targets(target, rows, k, CPU, batch_rows, memory_mb=memory_mb)
        got_p, got_i = torch.cat(got.probs), torch.cat(got.index).long()
        assert torch.equal(got_i, want_i)
        torch.testing.assert_close(got_p, want_p, rtol=1e-6, atol=1e-7)
        assert got.index[0].dtype == torch.int32
        assert sum(seen) == len(want_p)
        if memory_mb == budget_mb:
            assert max(seen) == 7 and len(seen) > 2  # never more positions at once than the budget holds
        else:
            assert torch.equal(got_p, want_p)  # one chunk per batch: bit-for-bit the old computation


# ------------------------------------------------------------------------------- padded vocabularies


def _padded_target(rows: int, seed: int) -> Transformer:
    """A target with ``rows`` embedding rows whose rows past the tokenizer's 4096 would win every
    argmax if they were looked at: padding a teacher must never hand to a smaller drafter."""
    target = _model(rows, seed=seed, scale=20.0)
    with torch.no_grad():
        target.lm_head.weight[VOCAB:] = 5.0  # tied: the embedding rows no token id reaches
    return target


def test_teacher_ids_stay_in_the_shared_range() -> None:
    target = _padded_target(VOCAB + 128, seed=3)
    rows = _rows(2)
    everything = teacher_targets(target, rows, 8, CPU)
    assert int(torch.cat(everything.index).max()) >= VOCAB  # the padding rows do win when looked at
    shared = teacher_targets(target, rows, 8, CPU, columns=VOCAB)
    assert int(torch.cat(shared.index).max()) < VOCAB


def test_realign_with_a_target_of_more_rows_than_the_drafter(tokenizer: Tokenizer) -> None:
    target = _padded_target(VOCAB + 128, seed=3).eval()
    drafter = _model(VOCAB, seed=4, scale=2.0).eval()
    m = realign(target, drafter, tokenizer, _traces(32), (), QUICK).metrics
    assert m["shared_vocab_size"] == VOCAB and m["teacher"] == "topk"
    assert m["held_out_after"]["expected_acceptance"] >= m["held_out_before"]["expected_acceptance"]
    assert m["steps_run"] >= 2


def test_realign_with_a_drafter_of_more_rows_than_the_target(tokenizer: Tokenizer) -> None:
    target = _model(VOCAB, seed=3, scale=20.0).eval()
    drafter = _model(VOCAB + 64, seed=4, scale=2.0).eval()
    result = realign(target, drafter, tokenizer, _traces(32), (), QUICK)
    assert result.metrics["shared_vocab_size"] == VOCAB
    assert result.model.config.vocab_size == VOCAB + 64  # the drafter keeps its own shape


# --------------------------------------------------------------------------- the target is read-only


def test_realign_never_changes_the_target(tokenizer: Tokenizer) -> None:
    # A fresh model: training mode, gradients on. A cached target must come back exactly as lent.
    target = _model(VOCAB, seed=3, scale=20.0)
    drafter = _model(VOCAB, seed=4, scale=2.0)
    params = dict(target.named_parameters())
    before = {name: (p, p.detach().clone(), p._version, p.requires_grad) for name, p in params.items()}
    mode, device = target.training, target.device
    realign(target, drafter, tokenizer, _traces(32), _traces(8, "old"), QUICK)
    assert target.training == mode and target.device == device
    for name, p in target.named_parameters():
        obj, value, version, grad = before[name]
        assert p is obj and p._version == version and p.requires_grad == grad, name
        assert torch.equal(p.detach(), value), name
        assert p.grad is None, name


def test_the_run_goes_where_the_target_is() -> None:
    target = _model(VOCAB, seed=3)
    assert run_device(None, target) == CPU
    assert run_device("cpu", target) == CPU
    with torch.device("meta"):
        elsewhere = Transformer(target.config)
    with pytest.raises(ValueError, match="never moves the target"):
        run_device("cpu", elsewhere)


def test_the_teacher_budget_is_part_of_the_config(tokenizer: Tokenizer) -> None:
    cfg = replace(QUICK, teacher_memory_mb=0.5, max_epochs=1)
    target = _model(VOCAB, seed=3, scale=20.0).eval()
    drafter = _model(VOCAB, seed=4, scale=2.0).eval()
    m = realign(target, drafter, tokenizer, _traces(24), (), cfg).metrics
    assert m["config"]["teacher_memory_mb"] == 0.5 and RealignConfig().teacher_memory_mb == 1024
    assert m["teacher_tokens"] > 0 and m["teacher_tokens_per_s"] > 0


def test_distillation_compares_only_the_shared_rows() -> None:
    g = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    padded_teacher = torch.cat([teacher, torch.full((6, 8), 50.0)], dim=-1)  # padding that would win
    torch.testing.assert_close(kl_loss(padded_teacher, student), kl_loss(teacher, student))
    # A drafter's own padding rows: mass there is its loss (nothing it drafts there is accepted).
    padded_student = torch.cat([student, torch.full((6, 8), 50.0)], dim=-1)
    assert float(kl_loss(teacher, padded_student)) > float(kl_loss(teacher, student)) + 1.0


# ------------------------------------------------------------------------------------- shadow replay


def test_replay_caches_are_sized_to_the_longest_request(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int | None] = []

    class Recording(SpeculativeDecoder):
        def __init__(self, *args: Any, max_len: int | None = None, **kwargs: Any) -> None:
            sizes.append(max_len)
            super().__init__(*args, max_len=max_len, **kwargs)

    monkeypatch.setattr(replay_module, "SpeculativeDecoder", Recording)
    target = _model(VOCAB, seed=3, scale=20.0).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    r = shadow_replay(
        target, tokenizer, {"baseline": None, "candidate": target}, prompts, 2, [6, 9], measure_cost=False
    )
    assert r.broken_arms == []
    assert sizes == [3 + 9 + 2 + 1] * 2  # the longest request (prompt + new tokens) + a round of k drafts
