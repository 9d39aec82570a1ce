"""Realignment on tiny models: dataset building, the loop lowers held-out TVD in seconds, seeds
reproduce, cancellation, the artifact; and the ``realign.run`` task against a real database
(redelivery registers one version, a cancel stops the run)."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sqlalchemy import func, select

from controlplane.artifacts.store import VerifiedArtifactCache
from controlplane.db.models import (
    Deployment,
    DrafterState,
    DrafterVersion,
    Job,
    JobState,
    SpeculationMode,
    Trace,
    TraceSource,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.jobs.realign import realign_inputs
from controlplane.jobs.service import cancel_job, request_realign
from controlplane.models.service import ModelSource, register_model
from controlplane.timestamps import utcnow
from controlplane.traces.holdout import (
    TrainedContent,
    content_key,
    content_of,
    is_held_out,
    overlap_count,
    prompt_hash,
)
from tests.conftest import Database, add_deployment, make_tenant
from tests.in_process import in_process_settings
from workers.engine.hf_io import load_hf_folder, save_hf_folder
from workers.engine.model import ModelConfig, Transformer, build_model
from workers.engine.tokenizer import Tokenizer
from workers.training.realign import (
    MANIFEST_NAME,
    PROTECTED_LR,
    SPEC_CONFIG_NAME,
    RealignCancelledError,
    RealignConfig,
    Rows,
    RowScores,
    TraceText,
    TrainVocab,
    anchor_targets,
    build_dataset,
    choose_lr,
    completion_logits,
    distill_loss,
    floors_of,
    judge,
    pad_rows,
    realign,
    save_drafter,
    steady_categories,
    teacher_targets,
    token_targets,
    verify_artifact,
)

REFERENCE = Path(__file__).resolve().parents[2] / "workers" / "models" / "reference"
LINES = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    total += i\n",
    "if x is None:\n    raise ValueError('x')\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "with open(path) as f:\n    data = f.read()\n",
    "import os\nprint(os.getcwd())\n",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    # Tiny models: one thread is fastest, and it leaves the other core to the jobs beside us.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(REFERENCE / "target")


def _peaked(model: Transformer, scale: float) -> Transformer:
    # Random 0.02-std weights give a near-uniform target, which any drafter matches already.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(scale)
    return model.eval()


def _config(dim: int, layers: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=4096, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=4, ffn_dim=2 * dim, max_seq_len=256
    )


@pytest.fixture(scope="module")
def models() -> tuple[Transformer, Transformer]:
    target = _peaked(build_model(_config(64, 2), seed=1), 25.0)
    # The incumbent: the target with its weights perturbed, a drafter that is close but off.
    drafter = build_model(_config(64, 2), seed=1)
    drafter.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.6)
    return target, drafter.eval()


def traces(n: int, prefix: str = "r") -> list[TraceText]:
    out = []
    for i in range(n):
        a, b = LINES[i % len(LINES)], LINES[(i * 5 + 1) % len(LINES)]
        # The prefix is in the prompt too: older traffic that repeated a recent prompt verbatim
        # would (rightly) keep that prompt out of the held-out rows.
        out.append(TraceText(f"{prefix}{i}", a + f"# {prefix}{i}\n", b + LINES[(i + 2) % len(LINES)]))
    return out


# The budget does not bind (the step count follows from max_epochs), so the run is reproducible
# however busy the machine is; teacher="topk" keeps the target-distribution path under test.
FAST = RealignConfig(
    seed=3,
    time_budget_s=120,
    batch_rows=8,
    max_epochs=6,
    evals=4,
    patience=10,
    lr=3e-3,
    device="cpu",
    teacher="topk",
    replay_share=0.25,  # fixed: the planned replay has its own tests
)


def test_dataset_holds_out_by_request_and_replays_a_share(tokenizer: Tokenizer) -> None:
    recent, older = traces(80), traces(100, prefix="old")
    cfg = RealignConfig(seed=0, holdout_share=0.2, replay_share=0.25)
    data = build_dataset(recent, older, tokenizer, cfg, max_len=256)
    assert not set(data.train.keys) & set(data.held_out.keys)
    assert all(k.startswith("r") for k in data.held_out.keys)  # evaluation is on recent traffic only
    assert 8 <= len(data.held_out) <= 28
    assert data.replay_rows == round(data.recent_rows * 0.25 / 0.75)
    assert all(s >= 1 and len(t) > s for t, s in zip(data.train.ids, data.train.starts, strict=True))
    again = build_dataset(recent, older, tokenizer, cfg, max_len=256)
    assert again.train.keys == data.train.keys  # the split and the replay choice follow the seed


def _variant(text: str, j: int) -> str:
    """The ``j``-th spelling of ``text`` that normalises to the same prompt: cases and spacing."""
    cased = (text.upper(), text.lower(), text.title())[j % 3]
    return " " * (j // 3) + cased.replace(" ", " " + "\t" * (j % 2) + " " * (j // 6)) + "\n" * (j % 4)


def _content_traffic(n: int, seed: int, prefix: str) -> list[TraceText]:
    """Traffic that repeats: prompts drawn from a pool of 100 (each repeat spelled differently),
    each cut from its own one of 40 documents, except that one request in eight names another
    document or none."""
    rng = random.Random(seed)
    spelled: Counter[str] = Counter()
    out = []
    for i in range(n):
        question = rng.randrange(100)
        base = f"{prefix} question {question} about the report"
        document: str | None = f"{prefix}:doc-{question % 40}"
        if rng.random() < 1 / 8:
            document = rng.choice([None, f"{prefix}:doc-{rng.randrange(40)}"])
        prompt = _variant(base, spelled[base])
        spelled[base] += 1
        completion = LINES[i % len(LINES)] + LINES[(i + 3) % len(LINES)]
        out.append(TraceText(content_key(prompt, document), prompt, completion, None, document))
    return out


def _sides(data: Any, traffic: list[TraceText], tokenizer: Tokenizer) -> dict[str, list[TraceText]]:
    """The traces behind each side's rows, found by decoding each row's prompt tokens."""
    by_prompt = {t.prompt: t for t in traffic}
    assert len(by_prompt) == len(traffic)  # every spelling is unique, so decoding finds its trace
    return {
        side: [
            by_prompt[tokenizer.decode(ids[:start].tolist())]
            for ids, start in zip(rows.ids, rows.starts, strict=True)
        ]
        for side, rows in (
            ("train", data.train),
            ("held_out", data.held_out),
            ("held_out_old", data.held_out_old),
        )
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_prompt_or_document_is_on_both_sides_of_the_split(tokenizer: Tokenizer, seed: int) -> None:
    recent, older = _content_traffic(300, seed, "new"), _content_traffic(200, seed + 10, "old")
    # Older traffic that repeats recent prompts and documents (traffic that drifted only partly).
    older += [replace(t, prompt=t.prompt + " ", completion=t.completion[::-1]) for t in recent[:60:3]]
    cfg = RealignConfig(seed=seed, holdout_share=0.2, replay_share=0.5, max_holdout_rows=1000)
    data = build_dataset(recent, older, tokenizer, cfg, max_len=256)
    sides = _sides(data, recent + older, tokenizer)
    trained = {prompt_hash(t.prompt) for t in sides["train"]}, {t.document for t in sides["train"]} - {None}
    held = sides["held_out"] + sides["held_out_old"]
    assert sides["held_out"] and sides["held_out_old"]
    assert not {prompt_hash(t.prompt) for t in held} & trained[0]
    assert not {t.document for t in held} & trained[1]
    # Repeats of one prompt under several spellings, documents and none really were on both sides
    # of the key's hash (so the check above had something to catch), and were dropped.
    assert data.split["held_out_dropped_as_trained"] > 0
    assert data.split["heldout_prompt_overlap"] == 0
    assert data.split["train_rows"] == len(data.train) and data.split["held_out_rows"] == len(data.held_out)
    # Every prompt the replay pool holds counts as trained (the replay selection reckons so too),
    # even the ones this seed's replay did not pick.
    pool = [t for t in older if not is_held_out(t.key, cfg.seed, cfg.holdout_share)]
    assert not {prompt_hash(t.prompt) for t in held} & {prompt_hash(t.prompt) for t in pool}


def _few_documents(seed: int) -> tuple[list[TraceText], list[TraceText]]:
    """(recent, older) like a partial shift: category "old" cut from 6 recurring documents (20
    requests each, a few of them before the shift), category "new" each from its own document."""
    rng = random.Random(seed)
    recent, older = [], []
    for i in range(240):
        if i % 2:
            doc, category = f"old:doc-{rng.randrange(6)}", "old"
        else:
            doc, category = f"new:doc-{i}", "new"
        prompt = f"{category} request {i} from {doc}\n"
        trace = TraceText(content_key(prompt, doc), prompt, LINES[i % len(LINES)], category, doc)
        (older if category == "old" and i < 40 else recent).append(trace)
    return recent, older


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_category_is_held_out_on_documents_never_trained(tokenizer: Tokenizer, seed: int) -> None:
    recent, older = _few_documents(seed)
    cfg = RealignConfig(seed=seed, replay_share=0.25, holdout_rows_per_category=8)
    data = build_dataset(recent, older, tokenizer, cfg, max_len=256)
    held = [*data.held_out.keys, *data.held_out_old.keys]
    categories = Counter(k.split(":")[1] for k in held)  # keys are "document:<category>:doc-<n>"
    assert categories["old"] >= 8 and categories["new"] >= 1
    assert not set(held) & set(data.train.keys) and data.split["heldout_prompt_overlap"] == 0
    # The hash alone holds out none of the "old" documents at some of these seeds: the split
    # reserved some, never more than max_reserved_share of the category's traces.
    old_keys = Counter(t.key for t in (*recent, *older) if t.category == "old")
    by_hash = sum(n for k, n in old_keys.items() if is_held_out(k, seed, cfg.holdout_share))
    reserved = sum(
        n for k, n in old_keys.items() if k in held and not is_held_out(k, seed, cfg.holdout_share)
    )
    assert (reserved > 0) == (by_hash < 8)
    assert reserved == 0 or by_hash + reserved <= max(8, int(cfg.max_reserved_share * sum(old_keys.values())))
    assert data.split["held_out_reserved_keys"] == len({k for k in held if not is_held_out(k, seed, 0.1)})
    # Without the reservation, seeds whose hash holds out no "old" document score none of it.
    bare = build_dataset(recent, older, tokenizer, replace(cfg, holdout_rows_per_category=0), max_len=256)
    bare_old = [k for k in (*bare.held_out.keys, *bare.held_out_old.keys) if k.startswith("document:old")]
    assert (len(bare_old) == 0) == (by_hash == 0)


def test_training_rows_are_capped_per_document(tokenizer: Tokenizer) -> None:
    recent, older = _few_documents(0)
    cfg = RealignConfig(seed=0, replay_share=0.25, max_rows_per_key=5)
    data = build_dataset(recent, older, tokenizer, cfg, max_len=256)
    per_key = Counter(data.train.keys)
    assert max(per_key.values()) == 5 and data.split["dropped_over_key_cap"] > 0
    uncapped = build_dataset(recent, older, tokenizer, replace(cfg, max_rows_per_key=None), max_len=256)
    assert max(Counter(uncapped.train.keys).values()) > 5


def _scores(figures: dict[str, tuple[float, int]]) -> RowScores:
    """One row per category: (greedy agreement, positions)."""
    out = RowScores()
    for category, (agreement, n) in figures.items():
        out.agree.append(agreement * n)
        out.accept.append(agreement * n)
        out.positions.append(n)
        out.categories.append(category)
    return out


def test_weights_that_lose_a_category_are_refused_whatever_the_aggregate_gains() -> None:
    key = "greedy_agreement"
    incumbent = _scores({"structured": (0.10, 400), "prose": (0.60, 200), "rare": (0.5, 10)})
    floors = floors_of(incumbent, key=key, tolerance=0.02, min_positions=128)
    assert floors == {"structured": pytest.approx(0.08), "prose": pytest.approx(0.58)}  # "rare": too few
    start = judge(incumbent, None, key=key, old_weight=0.0, floors=floors)
    # Structured gains 70 points, prose loses 10: the aggregate rises from 0.27 to 0.70.
    forgot = judge(
        _scores({"structured": (0.80, 400), "prose": (0.50, 200), "rare": (0.0, 10)}),
        None,
        key=key,
        old_weight=0.0,
        floors=floors,
    )
    assert forgot.value > start.value + 0.4 and forgot.below == ["prose"]
    assert not forgot.beats(start.value)
    # The same prose loss on the old window's held-out rows counts as much (rows are pooled).
    split = judge(
        _scores({"structured": (0.80, 400)}),
        _scores({"prose": (0.50, 200)}),
        key=key,
        old_weight=0.1,
        floors=floors,
    )
    assert split.below == ["prose"] and not split.beats(start.value)
    # Within the tolerance, and with no floors at all, the gain is kept.
    close = _scores({"structured": (0.80, 400), "prose": (0.59, 200)})
    kept = judge(close, None, key=key, old_weight=0.0, floors=floors)
    assert kept.below == [] and kept.beats(start.value)
    unguarded = _scores({"structured": (0.80, 400), "prose": (0.50, 200)})
    assert judge(unguarded, None, key=key, old_weight=0.0, floors={}).beats(start.value)
    assert unguarded.by_category()["prose"] == (200, {"expected_acceptance": 0.5, "greedy_agreement": 0.5})


def test_only_named_categories_the_incumbent_still_serves_as_before_count_as_steady() -> None:
    key = "greedy_agreement"
    old = _scores({"prose": (0.60, 300), "": (0.5, 300), "code": (0.7, 300)})
    recent = _scores({"prose": (0.59, 300), "structured": (0.1, 300), "": (0.5, 300), "code": (0.4, 300)})
    # prose: within the tolerance; structured: not in the old window; uncategorized: unmatched;
    # code: the incumbent fell 30 points there, so that part drifted and is relearnt.
    assert steady_categories(recent, old, key=key, tolerance=0.02, min_positions=128) == ["prose"]
    assert steady_categories(recent, old, key=key, tolerance=0.02, min_positions=400) == []
    assert steady_categories(recent, None, key=key, tolerance=0.02, min_positions=1) == []
    # A category the incumbent was as poor at before did not drift, but holds nothing to keep.
    poor_old = _scores({"prose": (0.60, 300), "structured": (0.14, 300)})
    poor_recent = _scores({"prose": (0.59, 300), "structured": (0.13, 300)})
    assert steady_categories(poor_recent, poor_old, key=key, tolerance=0.02, min_positions=128) == ["prose"]
    assert steady_categories(
        poor_recent, poor_old, key=key, tolerance=0.02, min_positions=128, worth_keeping=0.1
    ) == ["prose", "structured"]


def test_realign_keeps_the_incumbent_when_every_gain_costs_a_category(
    tokenizer: Tokenizer, models: tuple[Transformer, Transformer]
) -> None:
    target, drafter = models
    recent = [replace(t, category=("a", "b")[i % 2]) for i, t in enumerate(traces(48))]
    older = [replace(t, category="b") for t in traces(24, "old")]
    cfg = replace(FAST, min_category_positions=1, category_tolerance=None)
    free = realign(target, drafter, tokenizer, recent, older, cfg).metrics
    assert free["best_step"] > 0  # training gains on these rows when nothing guards a category
    assert set(free["held_out_by_category"]) == {"a", "b"}
    # A floor above the incumbent on every category (a negative tolerance: each must gain 1.0,
    # which no weights can): every gain is refused and the incumbent's weights come back.
    strict = realign(target, drafter, tokenizer, recent, older, replace(cfg, category_tolerance=-1.0))
    m = strict.metrics
    assert m["best_step"] == 0 and m["selection"]["refused"]
    assert m["selection"]["guarded_categories"] == ["a", "b"]
    assert m["held_out_after"] == m["held_out_before"]
    for k, v in drafter.state_dict().items():
        assert torch.equal(strict.model.state_dict()[k], v.float()), k


def test_the_overlap_is_counted_from_the_rows_not_assumed() -> None:
    a, b = content_of("Report  one", "doc-1"), content_of("report one")
    seen = TrainedContent.of([content_of("REPORT ONE", "doc-2"), content_of("two", "doc-1")])
    assert overlap_count([a, b, content_of("three", "doc-3")], seen) == 2


def test_replayed_rows_are_fitted_to_the_incumbent_and_recent_ones_to_the_target(
    tokenizer: Tokenizer, models: tuple[Transformer, Transformer]
) -> None:
    target, drafter = models
    cfg = RealignConfig(seed=0, holdout_share=0.2, replay_share=0.25, teacher_top_k=8)
    data = build_dataset(traces(40), traces(40, prefix="old"), tokenizer, cfg, max_len=256)
    first_replay = len(data.train) - data.replay_rows
    assert data.replay_rows >= 2 and all(k.startswith("old") for k in data.train.keys[first_replay:])
    teacher = teacher_targets(target, data.train, 8, torch.device("cpu"))
    recent_before = [t.clone() for t in teacher.index[:first_replay]]
    anchor_targets(drafter, data, teacher, 8, torch.device("cpu"), cfg)
    assert all(torch.equal(a, b) for a, b in zip(recent_before, teacher.index[:first_replay], strict=True))
    for i in range(first_replay, len(data.train)):
        ids, start = data.train.ids[i], data.train.starts[i]
        with torch.no_grad():
            own = torch.softmax(drafter(ids[None, :-1]).float()[0, start - 1 :], dim=-1)  # [N, V]
        assert torch.equal(teacher.index[i][:, 0].long(), own.argmax(-1))
        assert torch.allclose(teacher.probs[i], own.topk(8, dim=-1).values, atol=1e-4)
    # The two models disagree somewhere on these rows: the replay's targets really changed hands.
    target_argmax = teacher_targets(target, data.train, 1, torch.device("cpu")).index
    assert any(
        not torch.equal(target_argmax[i][:, 0], teacher.index[i][:, 0])
        for i in range(first_replay, len(data.train))
    )
    # As point masses (the token-targets mode), each replayed position is the incumbent's argmax.
    points = token_targets(data.train)
    anchor_targets(drafter, data, points, 1, torch.device("cpu"), cfg)
    assert all(p.shape[1] == 1 and bool((p == 1).all()) for p in points.probs)
    assert torch.equal(points.index[-1][:, 0].long(), teacher.index[-1][:, 0].long())


def test_picked_recent_rows_are_fitted_to_the_incumbent_and_the_others_kept(
    tokenizer: Tokenizer, models: tuple[Transformer, Transformer]
) -> None:
    target, drafter = models
    cfg = RealignConfig(seed=0, holdout_share=0.2, replay_share=0.25, teacher_top_k=8)
    data = build_dataset(traces(40), traces(40, prefix="old"), tokenizer, cfg, max_len=256)
    teacher = teacher_targets(target, data.train, 8, torch.device("cpu"))
    own = teacher_targets(drafter, data.train, 8, torch.device("cpu"))
    before = [t.clone() for t in teacher.index]
    anchor_targets(drafter, data, teacher, 8, torch.device("cpu"), cfg, picks=[0, 3])
    for i in range(len(data.train)):
        want = own.index[i] if i in (0, 3) else before[i]
        assert torch.equal(teacher.index[i], want), i


def test_the_learning_rate_is_capped_while_old_traffic_is_kept() -> None:
    novel = choose_lr(50_000, start_agreement=0.05)
    assert novel > PROTECTED_LR  # traffic the incumbent does not know: a large step
    assert choose_lr(50_000, start_agreement=0.05, protects_old=True) == PROTECTED_LR
    # The cap holds while the incumbent knows the old traffic, and lifts as it knows less of it.
    assert choose_lr(50_000, start_agreement=0.05, protects_old=True, old_agreement=0.6) == PROTECTED_LR
    assert choose_lr(50_000, start_agreement=0.05, protects_old=True, old_agreement=0.2) == novel
    assert (
        PROTECTED_LR < choose_lr(50_000, start_agreement=0.05, protects_old=True, old_agreement=0.4) < novel
    )
    known = choose_lr(50_000, start_agreement=0.9)
    assert known < PROTECTED_LR and choose_lr(50_000, start_agreement=0.9, protects_old=True) == known
    with pytest.raises(ValueError, match="replay_teacher"):
        realign(None, None, None, [], cfg=RealignConfig(replay_teacher="draft"))  # type: ignore[arg-type]


def test_planned_replay_follows_the_categories_and_the_incumbents_old_agreement(tokenizer: Tokenizer) -> None:
    recent = [replace(t, category="code") for t in traces(80)]
    prose = [replace(t, category="prose") for t in traces(100, prefix="old")]
    cfg = RealignConfig(seed=0, holdout_share=0.2, replay_share=None)
    scored: list[list[str]] = []

    def agreement(value: float) -> Any:
        def score(rows: Rows) -> float:
            scored.append(list(rows.keys))
            return value

        return score

    data = build_dataset(recent, prose, tokenizer, cfg, max_len=256, old_agreement=agreement(0.9))
    # The incumbent was scored on the held-out old rows, which are never replayed.
    assert scored == [data.held_out_old.keys] and len(data.held_out_old) >= 8
    assert all(k.startswith("old") for k in data.held_out_old.keys)
    assert not set(data.held_out_old.keys) & set(data.train.keys)
    # The old traffic is wholly gone and well known: the largest share, half the training rows.
    assert data.replay_plan is not None and data.replay_plan.absent_share == 1.0
    assert data.replay_rows == data.recent_rows
    # An incumbent that barely agrees there has little to lose: a smaller replay.
    little = build_dataset(recent, prose, tokenizer, cfg, max_len=256, old_agreement=agreement(0.14))
    assert 0 < little.replay_rows < data.replay_rows / 3
    # Half the recent window is still prose: only the other half of the old traffic is missing.
    mixed = [replace(t, category="prose") if i % 2 else t for i, t in enumerate(recent)]
    half = build_dataset(mixed, prose, tokenizer, cfg, max_len=256, old_agreement=agreement(0.9))
    assert half.replay_plan is not None and half.replay_plan.absent_share == pytest.approx(0.5, abs=0.05)
    assert half.replay_rows < data.replay_rows
    # A fixed share overrides the plan (and is what a job's replay_share parameter sets).
    fixed = build_dataset(recent, prose, tokenizer, replace(cfg, replay_share=0.2), max_len=256)
    assert fixed.replay_plan is None and fixed.replay_rows == round(fixed.recent_rows * 0.2 / 0.8)


def test_realign_lowers_held_out_tvd_and_reproduces(
    tokenizer: Tokenizer, models: tuple[Transformer, Transformer]
) -> None:
    target, drafter = models
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    first = realign(target, drafter, tokenizer, traces(48), traces(24, "old"), FAST)
    m = first.metrics
    assert m["held_out_after"]["expected_acceptance"] > m["held_out_before"]["expected_acceptance"] + 0.05
    # Both windows are scored for both drafters; the new one's figures are the selection's.
    assert (
        m["held_out_new"]["rows"] == m["held_out_rows"]
        and m["held_out_new"]["realigned"] == m["held_out_after"]
    )
    old = m["held_out_old"]
    assert old["rows"] >= 1 and set(old["incumbent"]) == set(old["realigned"]) == {
        "expected_acceptance",
        "greedy_agreement",
    }
    assert m["replay_plan"] is None and m["replay_rows"] == round(m["recent_rows"] * 0.25 / 0.75)
    assert m["steps_run"] >= 2 and m["train_tokens_per_s"] > 0
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in before.items())  # incumbent untouched
    second = realign(target, drafter, tokenizer, traces(48), traces(24, "old"), FAST)
    if second.metrics["steps_run"] == m["steps_run"]:  # a loaded machine may fit fewer steps in the budget
        for k, v in first.model.state_dict().items():
            assert torch.equal(v, second.model.state_dict()[k]), k


def test_token_targets_need_no_target_pass_and_still_train(
    tokenizer: Tokenizer, models: tuple[Transformer, Transformer]
) -> None:
    target, drafter = models
    # "auto" with no budget for a target pass over the training rows falls back to the tokens.
    cfg = replace(
        FAST,
        teacher="auto",
        teacher_budget_share=0.0,
        ce_weight=0.5,
        select_on="greedy_agreement",
        replay_share=None,
    )
    m = realign(target, drafter, tokenizer, traces(48), traces(24, "old"), cfg).metrics
    assert m["teacher"] == "tokens" and m["select_on"] == "greedy_agreement"
    # The replay was planned from the incumbent's agreement on the held-out old rows.
    assert m["replay_plan"]["old_agreement"] == m["held_out_old"]["incumbent"]["greedy_agreement"]
    assert m["replay_plan"]["rows"] == m["replay_rows"]
    # Weights were judged on both windows, the old one at the replay's share of the training rows.
    assert m["select_old_weight"] == round(m["replay_rows"] / m["train_rows"], 4)
    # The old window's held-out rows are scored at every evaluation when old rows are replayed
    # (or the category guard, off here, reads them).
    assert all("old_greedy_agreement" in h for h in m["history"]) == (m["replay_rows"] > 0)
    losses = [h["loss"] for h in m["history"] if "loss" in h]
    assert losses[-1] < losses[0]  # it fits the completion tokens
    # The best held-out weights are kept, so the result is never worse than the incumbent.
    assert m["held_out_after"]["greedy_agreement"] >= m["held_out_before"]["greedy_agreement"]


def test_wide_token_targets_leave_the_loss_unchanged() -> None:
    g = torch.Generator().manual_seed(0)
    rows = Rows([torch.randint(1, 4096, (n,), generator=g) for n in (20, 13)], [5, 9], ["a", "b"])
    logits = torch.randn(19, 4096, generator=g)  # [N, V]: 15 + 4 completion positions
    narrow, wide = token_targets(rows), token_targets(rows, 32, 4096)
    assert wide.index[0].shape == (15, 32) and torch.equal(wide.index[0][:, 0], narrow.index[0][:, 0])
    assert all(len(set(r.tolist())) == 32 for r in wide.index[1])  # distinct ids, the token first
    for a, b in zip(
        distill_loss(logits, torch.cat(narrow.probs), torch.cat(narrow.index), 0.5, 1.0, 0.3),
        distill_loss(logits, torch.cat(wide.probs), torch.cat(wide.index), 0.5, 1.0, 0.3),
        strict=True,
    ):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="vocabulary"):
        token_targets(rows, 32)


def test_a_sampled_training_vocabulary_keeps_the_loss_of_its_columns() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 4096
    rows = Rows([torch.randint(1, 300, (n,), generator=g) for n in (20, 13)], [5, 9], ["a", "b"])
    logits = torch.randn(19, vocab, generator=g)  # [N, V]
    wide = token_targets(rows, 32, vocab)  # the padding ids (probability 0) are mostly not named
    top_p, top_i = torch.cat(wide.probs), torch.cat(wide.index)
    cpu = torch.device("cpu")
    # The named rows are exactly the completion tokens; "auto" keeps a 4,096-row vocabulary whole.
    sampled = TrainVocab.choose(
        RealignConfig(train_vocab="sampled", train_vocab_negatives=64), wide, vocab, cpu
    )
    assert sampled is not None and set(sampled.named.tolist()) == set(top_i[:, 0].tolist())
    assert TrainVocab.choose(RealignConfig(), wide, vocab, cpu) is None
    rng = np.random.default_rng(0)
    columns, column_of = sampled.draw(rng)
    assert len(set(columns.tolist())) == len(columns) and torch.equal(
        column_of[columns], torch.arange(len(columns))
    )
    local = column_of[top_i]
    assert bool((top_p[local < 0] == 0).all())  # only zero-probability padding falls outside
    # Each drawn row stands in for its share of the unnamed ones; the named rows are themselves.
    named, drawn = len(sampled.named), len(columns) - len(sampled.named)
    stand_in = sampled.stand_in(columns)
    assert bool((stand_in[:named] == 0).all())
    torch.testing.assert_close(
        stand_in[named:], torch.full((drawn,), np.log((vocab - named) / drawn)).float()
    )
    got = distill_loss(logits[:, columns], top_p, local.clamp_min(0), 0.5, 1.0, 0.3, local >= 0)
    # The same loss as the unpadded targets over those columns: a restricted softmax, nothing else.
    narrow_local = column_of[top_i[:, :1]]
    want = distill_loss(logits[:, columns], top_p[:, :1], narrow_local, 0.5, 1.0, 0.3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    # With every row a column, the sampled loss is the full one.
    every = replace(sampled, negatives=200 * vocab)
    columns, column_of = every.draw(rng)
    assert len(columns) == vocab
    local = column_of[top_i]
    full = distill_loss(logits, top_p, top_i, 0.5, 1.0, 0.3)
    for a, b in zip(
        distill_loss(logits[:, columns], top_p, local, 0.5, 1.0, 0.3, local >= 0), full, strict=True
    ):
        torch.testing.assert_close(a, b)


def test_completion_logits_match_the_full_forward(models: tuple[Transformer, Transformer]) -> None:
    _, drafter = models
    g = torch.Generator().manual_seed(0)
    rows = Rows([torch.randint(1, 4096, (n,), generator=g) for n in (20, 13)], [5, 9], ["a", "b"])
    got = completion_logits(drafter, rows, [0, 1], torch.device("cpu"))  # [N, V]
    with torch.no_grad():
        full = drafter(pad_rows(rows.ids, 0)[:, :-1])  # [2, 19, V]
    want = torch.cat([full[0, 4:19], full[1, 8:12]])
    torch.testing.assert_close(got.detach(), want)
    tokens = token_targets(rows)
    assert [len(p) for p in tokens.probs] == [15, 4] and torch.equal(tokens.index[1][:, 0], rows.ids[1][9:])


def test_cancel_stops_at_a_checkpoint(tokenizer: Tokenizer, models: tuple[Transformer, Transformer]) -> None:
    target, drafter = models
    seen: list[str] = []

    def progress(fraction: float, message: str) -> bool:
        seen.append(message)
        return len(seen) < 3

    with pytest.raises(RealignCancelledError):
        realign(target, drafter, tokenizer, traces(48), (), FAST, progress=progress)
    assert len(seen) == 3


def test_artifact_loads_with_its_checksum(
    tmp_path: Path, tokenizer: Tokenizer, models: tuple[Transformer, Transformer]
) -> None:
    _, drafter = models
    artifact = save_drafter(
        drafter, tokenizer, tmp_path / "v1", num_speculative_tokens=4, metadata={"job_id": 7}
    )
    loaded, _ = load_hf_folder(artifact.path, expected_sha256=artifact.sha256)
    assert loaded.config.dim == drafter.config.dim
    assert verify_artifact(artifact.path)
    spec = json.loads((artifact.path / SPEC_CONFIG_NAME).read_text())
    # The serving side points "model" at its own verified copy: the config names the folder only.
    assert spec["num_speculative_tokens"] == 4 and spec["model"] == artifact.path.name
    manifest = json.loads((artifact.path / MANIFEST_NAME).read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json", SPEC_CONFIG_NAME} <= set(manifest["files"])
    assert verify_artifact(artifact.path, artifact.manifest_sha256)
    (artifact.path / "config.json").write_text("{}")
    assert not verify_artifact(artifact.path)


# ------------------------------------------------------------------------------- the realign.run task


@pytest.fixture
def task_db(
    sqlite_template: Path,
    tmp_path: Path,
    tokenizer: Tokenizer,
    models: tuple[Transformer, Transformer],
    monkeypatch: Any,
) -> tuple[str, int]:
    import workers.tasks

    settings = in_process_settings(
        sqlite_template,
        tmp_path,
        "tasks.db",
        model_roots=[tmp_path / "models"],
    )
    url = settings.database_url
    monkeypatch.setattr(workers.tasks, "get_settings", lambda: settings)
    monkeypatch.setattr(workers.tasks, "DEFAULT_TIME_BUDGET_S", 8.0)
    target, drafter = models
    save_hf_folder(target, tokenizer, tmp_path / "models" / "target")
    save_hf_folder(drafter, tokenizer, tmp_path / "models" / "drafter")
    with get_sessionmaker(url)() as session:
        tenant = make_tenant(session, "acme")
        for name, folder, drafts_for in (("tiny", "target", []), ("tiny-drafter", "drafter", ["tiny"])):
            register_model(
                session=session,
                account_id=tenant.account_id,
                name=name,
                source=ModelSource(path=folder),
                settings=settings,
                drafter_for=drafts_for,
            )
        deployment = Deployment(
            account_id=tenant.account_id,
            name="svc",
            target_model="tiny",
            speculation_mode=SpeculationMode.draft_model,
            draft_model="tiny-drafter",
            drift_policy={},
            canary_policy={},
        )
        session.add(deployment)
        session.flush()
        for t in traces(40):
            session.add(
                Trace(
                    deployment_id=deployment.id,
                    source=TraceSource.sampled,
                    prompt=t.prompt,
                    completion=t.completion,
                )
            )
        job = request_realign(session=session, deployment=deployment).job
        session.commit()
        job_id = job.id
    yield url, job_id
    get_engine(url).dispose()


def test_task_registers_one_candidate_even_when_redelivered(task_db: tuple[str, int]) -> None:
    from workers.tasks import run_realign

    url, job_id = task_db
    out = run_realign(job_id)
    assert out["drafter_version"] == 1, out
    again = run_realign(job_id)  # the broker redelivers after a lost ack
    assert again["drafter_version"] == 1
    with get_sessionmaker(url)() as session:
        versions = list(session.scalars(select(DrafterVersion)))
        job = session.get_one(Job, job_id)
    assert len(versions) == 1 and job.state == JobState.succeeded and job.attempts == 1
    v = versions[0]
    assert (
        v.state == DrafterState.canary and v.training_job_id == job_id and v.parent_version_id is None
    )  # auto_realign: handed to its canary
    assert v.traffic_window_start is not None and v.training_metrics["steps_run"] >= 1
    assert v.artifact_path.startswith("file://") and v.manifest_sha256 is not None
    local = VerifiedArtifactCache(Path(url.removeprefix("sqlite:///")).parent / "c").local_folder(
        v.artifact_path, v.manifest_sha256
    )
    loaded, _ = load_hf_folder(local, expected_sha256=v.artifact_sha256)
    assert verify_artifact(local, v.manifest_sha256)
    assert job.result["drafter_version"] == 1 and job.progress == 1.0


def test_task_stops_when_the_job_is_cancelled(task_db: tuple[str, int], monkeypatch: Any) -> None:
    import workers.tasks
    from controlplane.jobs import service

    url, job_id = task_db
    real = service.report_progress
    calls = {"n": 0}

    def cancel_midway(*, session: Any, job_id: int, fraction: float, message: str, **attempt: Any) -> bool:
        calls["n"] += 1
        if calls["n"] == 2:
            with get_sessionmaker(url)() as other:
                job = other.get_one(Job, job_id)
                cancel_job(
                    session=other,
                    deployment=other.get_one(Deployment, job.deployment_id),
                    job_id=job_id,
                    actor="t",
                )
                other.commit()
        return real(session=session, job_id=job_id, fraction=fraction, message=message, **attempt)

    monkeypatch.setattr(workers.tasks, "report_progress", cancel_midway)
    out = workers.tasks.run_realign(job_id)
    assert "stopped" in out
    with get_sessionmaker(url)() as session:
        assert session.scalar(select(func.count()).select_from(DrafterVersion)) == 0
        assert session.get_one(Job, job_id).state == JobState.cancelled


def test_realign_inputs_carry_each_traces_category(db: Database) -> None:
    since = utcnow() - timedelta(minutes=5)
    with db.new_session() as session:
        deployment = add_deployment(session, "cats")
        for i, (category, at) in enumerate(
            [
                ("prose", since - timedelta(hours=1)),
                (None, since - timedelta(minutes=30)),
                ("structured", since),
            ]
        ):
            session.add(
                Trace(
                    deployment_id=deployment.id,
                    source=TraceSource.sampled,
                    category=category,
                    prompt=f"prompt {i}",
                    completion="completion",
                    created_at=at + timedelta(seconds=1),
                )
            )
        job = request_realign(session=session, deployment=deployment, params={"since": since.isoformat()}).job
        session.flush()
        inputs = realign_inputs(session=session, job_id=job.id)
    # Before the window: replayed (or held out) by category; in it: what the plan compares them with.
    assert [(t.prompt, t.category) for t in inputs.older] == [("prompt 0", "prose"), ("prompt 1", None)]
    assert [(t.prompt, t.category) for t in inputs.recent] == [("prompt 2", "structured")]
