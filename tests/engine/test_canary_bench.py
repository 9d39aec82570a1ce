"""bench/canary.py's pieces: requests replayed at their served length, and the probe's k beside the
k the live canary's tuner settles on, with the reason they differ."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

from controlplane.tuning.draft_length import plan_draft_length
from workers import corpora
from workers.engine.decoder import SpeculativeDecoder
from workers.engine.hf_io import load_hf_folder

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_canary_under_test", ROOT / "bench" / "canary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


canary = _load()
COSTS = {k: 1.0 + 0.03 * k for k in range(1, 9)}


def _probe(rates: list[float], steps: int = 2000, drafted_full: int | None = None) -> SimpleNamespace:
    """A probe replay's candidate arm with these conditional rates at positions 1..8."""
    accepted, reach = [], float(steps)
    for rate in rates:
        reach *= rate
        accepted.append(round(reach))
    drafted = [steps] * 7 + [steps if drafted_full is None else drafted_full]
    arm = SimpleNamespace(accepted_per_position=accepted, verify_steps=steps, drafted_per_position=drafted)
    return SimpleNamespace(arms={"candidate": arm}, costs=SimpleNamespace(cost_ratio=0.05, verify_cost=COSTS))


def test_deep_positions_the_live_canary_never_drafts_explain_a_different_k() -> None:
    # The first position is often missed, the deeper ones almost never: the probe sees that; the
    # live canary drafting 4 tokens extrapolates positions 5..8 from its weakest observed position.
    probe = _probe([0.7] + [0.99] * 7, drafted_full=1500)
    out = canary.compare_k(probe, 4)

    arm = probe.arms["candidate"]
    probe_plan = plan_draft_length(arm.accepted_per_position, 2000, 0.05, verify_cost=COSTS, max_k=8)
    live_plan = plan_draft_length(arm.accepted_per_position[:4], 2000, 0.05, verify_cost=COSTS)
    assert out["probe_k"] == probe_plan.best_k
    assert out["live_tuner_k"] == live_plan.best_k
    assert out["probe_k"] > out["live_tuner_k"]
    assert out["agree"] is False
    assert out["probe_rounds_cut_short"] == 0.25
    assert out["live_tuner_extrapolated_acceptance"] == live_plan.extrapolated_acceptance
    assert live_plan.extrapolated_acceptance is not None and live_plan.extrapolated_acceptance < 0.7
    assert f"accepts at {live_plan.extrapolated_acceptance:.3f}" in out["reason"]
    assert "positions 5..8" in out["reason"] and "25% of the probe's rounds" in out["reason"]


def test_uniform_acceptance_gives_both_tuners_the_same_k() -> None:
    out = canary.compare_k(_probe([0.6] * 8), 4)
    assert out["agree"] is True
    assert out["probe_k"] == out["live_tuner_k"] <= 4
    assert out["reason"] == f"both pick k = {out['probe_k']}"


def test_structured_requests_are_replayed_through_the_token_that_ends_their_answer() -> None:
    target, tokenizer = load_hf_folder(ROOT / "workers" / "models" / "reference" / "target")
    prompts = [tokenizer.encode(p.text)[-256:] for p in corpora.prompts("structured", "test", n=2, seed=7)]
    stops = canary.STOPS["structured"]
    assert stops == ("\n",)

    lengths = canary.served_lengths(target, tokenizer, prompts, 64, stops)

    plain = SpeculativeDecoder(target, tokenizer, None, k=0)
    for ids, length in zip(prompts, lengths, strict=True):
        assert 1 <= length < 64  # every answer ends well before the cap
        tokens = plain.generate(ids, length, stop_at_eos=False).token_ids
        # The last token served completes the first line break, and nothing before it does.
        assert "\n" in tokenizer.decode(tokens) and "\n" not in tokenizer.decode(tokens[:-1])
    assert canary.served_lengths(target, tokenizer, prompts, 64, ()) == [64, 64]
