"""Counterfactual draft-stop counts: what a round would have drafted and had accepted under each
confidence threshold equals what a real run with that threshold drafts and accepts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from controlplane.ingest.formats import parse_record
from workers.engine.decoder import SpeculativeDecoder
from workers.engine.hf_io import save_hf_folder
from workers.engine.metrics import DRAFT_STOP_GRID, RequestMetrics, counterfactual_round
from workers.engine.model import Transformer
from workers.engine.proposers import DraftModelProposer, NgramProposer
from workers.engine.tokenizer import Tokenizer
from workers.serve.server import ServerConfig, create_app

PromptFactory = Callable[..., list[list[int]]]
K = 6
N_NEW = 24
FIRST_ROUND = K + 2  # the prefill's token, then one round that may draft all K


def _decoder(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, threshold: float
) -> SpeculativeDecoder:
    return SpeculativeDecoder(
        target, tokenizer, DraftModelProposer(drafter, confidence_threshold=threshold), k=K
    )


def test_counterfactual_first_round_matches_a_real_run_at_each_threshold(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    """Greedy: the first round starts from the same context whatever the threshold, so the
    counterfactual counts of a threshold-0 run are exactly what a threshold-t run drafts and
    accepts there."""
    off = _decoder(target, drafter, tokenizer, 0.0)
    runs = {t: _decoder(target, drafter, tokenizer, t) for t in DRAFT_STOP_GRID}
    shortened = rejected = 0
    for prompt in make_prompts(12):
        counted = off.generate(prompt, FIRST_ROUND, stop_at_eos=False).metrics
        assert counted.draft_stop is not None
        for i, t in enumerate(DRAFT_STOP_GRID):
            real = runs[t].generate(prompt, FIRST_ROUND, stop_at_eos=False).metrics
            assert counted.per_step_stop_drafted[0][i] == real.per_step_drafted[0], (prompt, t)
            assert counted.per_step_stop_accepted[0][i] == real.per_step_accepted[0], (prompt, t)
            shortened += real.per_step_drafted[0] < K
            rejected += real.per_step_accepted[0] < real.per_step_drafted[0]
    # Meaningful only if thresholds did stop rounds early and drafts were rejected.
    assert shortened > 0 and rejected > 0


def test_sampled_drafts_stop_where_the_counterfactual_says(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    """With a seeded generator the drafter samples the same first-round tokens under every
    threshold until it stops: the counterfactual drafted count is the real one."""
    off = _decoder(target, drafter, tokenizer, 0.0)
    stopped = 0
    for seed, prompt in enumerate(make_prompts(6)):
        counted = off.generate(
            prompt,
            FIRST_ROUND,
            temperature=1.0,
            generator=torch.Generator().manual_seed(seed),
            stop_at_eos=False,
        ).metrics
        for i, t in enumerate((0.3, 0.6, 0.9)):
            column = DRAFT_STOP_GRID.index(t)
            real = (
                _decoder(target, drafter, tokenizer, t)
                .generate(
                    prompt,
                    FIRST_ROUND,
                    temperature=1.0,
                    generator=torch.Generator().manual_seed(seed),
                    stop_at_eos=False,
                )
                .metrics
            )
            assert counted.per_step_stop_drafted[0][column] == real.per_step_drafted[0], (seed, i)
            stopped += real.per_step_drafted[0] < K
    assert stopped > 0


def test_an_active_threshold_reports_the_thresholds_at_or_above_it_and_its_own_counts(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    """A round stopped at t0 shows nothing about lower thresholds; at t0 itself the counts are
    the request's own, over every round it drafted in."""
    dec = _decoder(target, drafter, tokenizer, 0.5)
    for prompt in make_prompts(4):
        m = dec.generate(prompt, N_NEW, stop_at_eos=False).metrics
        stop = m.draft_stop
        assert stop is not None
        assert stop.thresholds == (0.5, 0.6, 0.7, 0.8, 0.9)
        assert stop.rounds == sum(1 for d in m.per_step_drafted if d)
        assert (stop.drafted[0], stop.accepted[0]) == (m.drafted_tokens, m.accepted_tokens)
        # Stopping earlier drafts and keeps no more.
        assert stop.drafted == sorted(stop.drafted, reverse=True)
        assert stop.accepted == sorted(stop.accepted, reverse=True)
        native = m.to_native("r")["draft_stop_counts"]
        assert native == {
            "thresholds": [0.5, 0.6, 0.7, 0.8, 0.9],
            "rounds": stop.rounds,
            "drafted": stop.drafted,
            "accepted": stop.accepted,
        }


def test_counts_sum_the_rounds_and_only_draft_models_report_them(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    prompt = make_prompts(1)[0]
    m = _decoder(target, drafter, tokenizer, 0.0).generate(prompt, N_NEW, stop_at_eos=False).metrics
    assert m.draft_stop is not None
    assert m.draft_stop.drafted == [sum(col) for col in zip(*m.per_step_stop_drafted, strict=True)]
    assert m.draft_stop.accepted == [sum(col) for col in zip(*m.per_step_stop_accepted, strict=True)]
    assert all(d <= m.drafted_tokens for d in m.draft_stop.drafted)
    with_prediction = (
        _decoder(target, drafter, tokenizer, 0.0)
        .generate(prompt, N_NEW, stop_at_eos=False, prediction=prompt)
        .metrics
    )
    assert with_prediction.to_native("r")["draft_stop_counts"] is None
    ngram = SpeculativeDecoder(target, tokenizer, NgramProposer(2), k=K).generate(prompt, N_NEW).metrics
    assert ngram.to_native("r")["draft_stop_counts"] is None
    grid_off = SpeculativeDecoder(
        target, tokenizer, DraftModelProposer(drafter), k=K, draft_stop_grid=None
    ).generate(prompt, N_NEW)
    assert grid_off.metrics.draft_stop is None


@pytest.mark.parametrize(
    "confidences,drafted,accepted,expected",
    [
        # The first doubtful draft is still proposed; the cap is what the round drafted.
        ([0.9, 0.4, 0.8, 0.2], 4, 3, ([4, 2, 2], [3, 2, 2])),
        ([0.9, 0.9, 0.9], 2, 0, ([2, 2, 2], [0, 0, 0])),
        ([0.1, 0.9], 2, 2, ([1, 1, 1], [1, 1, 1])),
    ],
)
def test_counterfactual_round_follows_the_proposer_rule(
    confidences: list[float], drafted: int, accepted: int, expected: tuple[list[int], list[int]]
) -> None:
    assert counterfactual_round(confidences, drafted, accepted, (0.3, 0.5, 0.85)) == expected
    metrics = RequestMetrics(k=4)
    metrics.record_draft_stop(confidences, drafted, accepted)  # no counts asked for: ignored
    assert metrics.per_step_stop_drafted == []


def test_the_server_applies_each_arms_threshold_and_its_records_pass_ingest(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The live arm serves the tuned threshold, the canary arm none (so it counts every one), an
    arm without the key the server's own; what each reports is a valid native ingest record."""
    save_hf_folder(target, tokenizer, tmp_path / "target")
    save_hf_folder(drafter, tokenizer, tmp_path / "drafter")
    arm = {"speculation": "draft_model", "drafter_path": str(tmp_path / "drafter"), "k": 4}
    config = {
        "target_path": str(tmp_path / "target"),
        "arms": [
            {**arm, "arm": "live", "draft_confidence_threshold": 0.7, "drafter_version": 1},
            {**arm, "arm": "canary:2", "draft_confidence_threshold": None, "drafter_version": 2},
            {**arm, "arm": "canary:3", "drafter_version": 3},
        ],
    }
    records: dict[str, dict[str, Any]] = {}
    app = create_app(
        ServerConfig(
            serving_config={"svc": config},
            on_record=lambda _, r: records.__setitem__(r["arm"], r),
            draft_confidence_threshold=0.4,
        )
    )
    with TestClient(app) as client:
        for name in ("live", "canary:2", "canary:3"):
            reply = client.post(
                "/v1/completions",
                json={"model": "svc", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0},
                headers={"x-speculation-arm": name},
            )
            assert reply.status_code == 200, reply.text
    shown = {name: records[name]["draft_stop_counts"]["thresholds"] for name in records}
    assert shown == {
        "live": [0.7, 0.8, 0.9],
        "canary:2": list(DRAFT_STOP_GRID),
        "canary:3": list(DRAFT_STOP_GRID[3:]),
    }
    for record in records.values():
        parsed = parse_record(record, "native")
        assert parsed.draft_stop_counts == record["draft_stop_counts"]
    bad = {**config, "arms": [{**config["arms"][0], "draft_confidence_threshold": 1.5}]}
    with TestClient(create_app(ServerConfig(serving_config={"svc": bad}))) as client:
        reply = client.post("/v1/completions", json={"model": "svc", "prompt": "x", "max_tokens": 2})
        assert reply.status_code == 500 and "confidence_threshold" in reply.text
