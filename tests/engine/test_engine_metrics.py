"""Per-request metrics: counts checked against a brute-force recount, and the export shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from workers.engine.decoder import SpeculativeDecoder, greedy_reference
from workers.engine.metrics import NATIVE_KEYS, RequestMetrics, replay_greedy_rounds
from workers.engine.model import Transformer
from workers.engine.proposers import DraftModelProposer, NgramProposer, Proposals, Proposer
from workers.engine.tokenizer import Tokenizer
from workers.engine.verifier import SamplingParams


class Recording:
    """Wraps a proposer and records (context length, proposed ids) for every call."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.calls: list[tuple[int, list[int]]] = []

    def start_request(self, prompt_ids: Sequence[int]) -> None:
        self.calls.clear()
        self.inner.start_request(prompt_ids)

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> Proposals:
        props = self.inner.propose(context, k, sampling, generator)
        self.calls.append((len(context), props.token_ids.tolist()))
        return props


def recount(
    calls: list[tuple[int, list[int]]], prompt_len: int, full: list[int], k: int, eos: int | None
) -> dict[str, Any]:
    """Recount from first principles: what each proposal shares with the true greedy sequence."""
    drafted = accepted = 0
    per_pos = [0] * k
    eos_was_a_draft = False
    for ctx_len, ids in calls:
        drafted += len(ids)
        n = 0
        while n < len(ids) and ids[n] == full[ctx_len + n]:
            n += 1
            if ids[n - 1] == eos:
                eos_was_a_draft = True
                break
        accepted += n
        for i in range(n):
            per_pos[i] += 1
    generated = len(full) - prompt_len
    return {
        "drafted": drafted,
        "accepted": accepted,
        "per_pos": per_pos,
        "generated": generated,
        "eos_was_a_draft": eos_was_a_draft,
    }


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_counts_match_a_brute_force_recount(
    kind: str, target: Transformer, drafter: Transformer, tokenizer: Tokenizer
) -> None:
    k, n_new = 4, 40
    inner: Proposer = DraftModelProposer(drafter) if kind == "draft" else NgramProposer(2)
    rec = Recording(inner)
    dec = SpeculativeDecoder(target, tokenizer, rec, k=k)
    g = torch.Generator().manual_seed(7)
    eos_draft_endings = 0
    for trial in range(6):
        prompt = torch.randint(1, 320, (12,), generator=g).tolist()
        prompt += prompt[:6]
        ref = greedy_reference(target, prompt, n_new)
        eos = ref[25] if trial % 2 else None  # every other request ends early on an end-of-text token
        tok = Tokenizer(tokenizer.tok, tokenizer.tok.id_to_token(eos)) if eos is not None else tokenizer
        dec.tokenizer = tok
        res = dec.generate(prompt, n_new, stop_at_eos=eos is not None)
        full = prompt + (ref[: ref.index(eos) + 1] if eos is not None else ref)
        want = recount(rec.calls, len(prompt), full, k, eos)
        m = res.metrics
        assert m.drafted_tokens == want["drafted"]
        assert m.accepted_tokens == want["accepted"]
        assert m.accepted_per_position == want["per_pos"]
        assert m.generated_tokens == want["generated"]
        assert m.verify_steps == len(m.per_step_drafted)
        assert m.prompt_tokens == len(prompt)
        # The identity from the metrics docstring, with its one exception.
        assert m.generated_tokens == 1 + m.accepted_tokens + m.verify_steps - int(want["eos_was_a_draft"])
        eos_draft_endings += int(want["eos_was_a_draft"])
        assert sum(m.accepted_per_position) == m.accepted_tokens
        assert m.ttft_ms is not None and m.total_ms is not None and m.total_ms >= m.ttft_ms
    if kind == "draft":
        assert eos_draft_endings > 0  # the exception to the identity was exercised


def test_native_and_fireworks_shapes() -> None:
    m = RequestMetrics(k=3, prompt_tokens=10)
    m.generated_tokens = 1
    m.record_step(drafted=3, accepted=3, emitted=4)
    m.record_step(drafted=3, accepted=1, emitted=2)
    m.record_step(drafted=0, accepted=0, emitted=1)  # n-gram lookup found nothing
    m.record_step(drafted=2, accepted=0, emitted=1)
    m.ttft_ms, m.inter_token_ms, m.total_ms = 12.0, 3.0, 36.0
    native = m.to_native("req-1", arm="canary:3", drafter_version=3)
    assert tuple(native) == NATIVE_KEYS
    assert native["drafted_tokens"] == 8 and native["accepted_tokens"] == 4
    assert native["verify_steps"] == 4 and native["generated_tokens"] == 9
    assert native["accepted_per_position"] == [2, 1, 1]
    assert native["arm"] == "canary:3" and native["drafter_version"] == 3

    fw = m.to_fireworks()
    # Fireworks' spelling: "position:hits/total" pairs in one string (fw-ai/benchmark parses it so);
    # G = tokens emitted by verify steps = generated - 1 (4 accepted + 4 target tokens).
    assert fw["speculation-acceptance"] == "0:2/3,1:1/3,2:1/2"
    assert fw["speculation-generated-tokens"] == 8 == m.generated_tokens - 1
    assert fw["server-time-to-first-token"] == pytest.approx(0.012)
    assert fw["server-processing-time"] == pytest.approx(0.036)
    assert fw["prompt-tokens"] == 10 and "speculation-prompt-tokens" not in fw

    vllm = m.to_vllm(detailed=True)
    assert vllm["acceptance_histogram"] == [2, 1, 0, 1]
    assert vllm["mean_acceptance_length"] == pytest.approx(2.0)
    assert vllm["per_step_drafted"] == [3, 3, 0, 2]
    assert m.hit_rate == pytest.approx(0.5)


def test_prediction_metrics_in_fireworks_shape() -> None:
    m = RequestMetrics(k=4, prediction_tokens=20, prediction_matched_tokens=0)
    m.record_step(drafted=4, accepted=4, emitted=5, from_prediction=4)
    m.record_step(drafted=4, accepted=2, emitted=3, from_prediction=4)
    m.record_step(drafted=4, accepted=3, emitted=4)  # from the fallback drafter
    fw = m.to_fireworks()
    assert fw["speculation-prompt-tokens"] == 20
    assert fw["speculation-prompt-matched-tokens"] == 6


def test_fireworks_shape_without_speculation_has_no_speculation_fields() -> None:
    m = RequestMetrics(k=0, prompt_tokens=4, generated_tokens=1)
    m.record_step(drafted=0, accepted=0, emitted=1)
    fw = m.to_fireworks()
    assert "speculation-acceptance" not in fw and "speculation-generated-tokens" not in fw


@pytest.mark.parametrize("eos_ending", [False, True])
def test_fireworks_round_trip_through_the_ingest_adapter(eos_ending: bool) -> None:
    """Server metrics -> Fireworks perf_metrics -> ingest adapter: the engine's own counts."""
    from controlplane.ingest.formats import parse_batch

    m = RequestMetrics(k=4, prompt_tokens=7, generated_tokens=1)
    m.record_step(drafted=4, accepted=2, emitted=3)
    m.record_step(drafted=0, accepted=0, emitted=1)  # nothing proposed: only G shows this step
    m.record_step(drafted=4, accepted=3, emitted=4)
    m.record_step(drafted=1, accepted=0, emitted=1)
    if eos_ending:  # an accepted end-of-text draft ends the request: the step emits no own token
        m = RequestMetrics(k=4, prompt_tokens=7, generated_tokens=1)
        m.record_step(drafted=4, accepted=4, emitted=5)
        m.record_step(drafted=4, accepted=1, emitted=2)
        m.record_step(drafted=4, accepted=2, emitted=2)
    m.ttft_ms, m.total_ms = 5.0, 25.0
    usage = {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.generated_tokens}
    for body in (
        {"request_id": "rt-1", "perf_metrics": m.to_fireworks(), "usage": usage},
        {"request_id": "rt-1", "perf_metrics": m.to_fireworks()},  # G alone gives the total
    ):
        (record,) = parse_batch({"format": "fireworks", "records": [body]})
        assert (
            record.drafted_tokens,
            record.accepted_tokens,
            record.verify_steps,
            record.generated_tokens,
            record.accepted_per_position,
            record.k,
            record.prompt_tokens,
        ) == (
            m.drafted_tokens,
            m.accepted_tokens,
            m.verify_steps,
            m.generated_tokens,
            m.accepted_per_position,
            m.k,
            m.prompt_tokens,
        )


@pytest.mark.parametrize("k", [1, 3, 4])
def test_greedy_rounds_replayed_from_agreement_equal_the_decoder(
    k: int, target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: Any
) -> None:
    n_new = 33
    dec = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=k)
    hits = 0
    for prompt in make_prompts(6, seed=3):
        res = dec.generate(prompt, n_new, stop_at_eos=False)
        full = torch.tensor([prompt + res.token_ids])
        with torch.inference_mode():
            guesses = drafter(full)[0, len(prompt) - 1 : -1].argmax(-1)  # [n_new]
        agreement = (guesses == full[0, len(prompt) :]).tolist()
        replay = replay_greedy_rounds(agreement, k)
        m = res.metrics
        assert (replay.drafted_tokens, replay.accepted_tokens) == (m.drafted_tokens, m.accepted_tokens)
        assert replay.per_step_accepted == m.per_step_accepted
        assert replay.accepted_per_position == m.accepted_per_position
        assert replay.generated_tokens == m.generated_tokens == n_new
        hits += m.accepted_tokens
    assert hits > 0  # the drafter agrees sometimes, so accepted runs of several lengths were compared


def test_replayed_rounds_of_a_perfect_and_a_useless_drafter() -> None:
    # After the prefill's token, two full rounds (4 drafts + the target's own token) emit the other 10.
    perfect = replay_greedy_rounds([True] * 11, k=4)
    assert (perfect.verify_steps, perfect.drafted_tokens, perfect.accepted_tokens) == (2, 8, 8)
    assert perfect.generated_tokens == 11
    useless = replay_greedy_rounds([False] * 6, k=4)
    assert useless.accepted_tokens == 0 and useless.verify_steps == 5 and useless.generated_tokens == 6
    assert useless.drafted_per_position == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="k must be"):
        replay_greedy_rounds([True], k=0)


def test_replayed_rounds_of_stop_ended_requests_equal_the_decoder(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: Any
) -> None:
    n_new, k = 33, 4
    dec = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=k)
    compared = exact = 0
    for n, prompt in enumerate(make_prompts(16, seed=5)):
        full = dec.generate(prompt, n_new, stop_at_eos=False)
        text = full.text
        stop = text[len(text) // 3 + n : len(text) // 3 + n + 2]
        if not stop.strip() or "\ufffd" in stop:
            continue
        res = dec.generate(prompt, n_new, stop_at_eos=False, stop=[stop])
        assert res.finish_reason == "stop"
        # The request ends with the first token whose text completes the stop string.
        ends = next(j for j in range(1, n_new + 1) if stop in tokenizer.decode(full.token_ids[:j]))
        rows = torch.tensor([prompt + full.token_ids])
        with torch.inference_mode():
            guesses = drafter(rows)[0, len(prompt) - 1 : -1].argmax(-1)
        agreement = (guesses == rows[0, len(prompt) :]).tolist()
        out, guessed = full.token_ids, guesses.tolist()
        guess_ends = [j < ends and stop in tokenizer.decode([*out[:j], guessed[j]]) for j in range(n_new)]
        replay = replay_greedy_rounds(agreement, k, stop_after=ends, guess_ends=guess_ends)
        m = res.metrics
        assert replay.per_step_accepted == m.per_step_accepted
        assert replay.generated_tokens == m.generated_tokens >= ends
        # Upper bound: the decoder also drops drafts after a wrong guess that completes the stop.
        assert all(r >= d for r, d in zip(replay.per_step_drafted, m.per_step_drafted, strict=True))
        exact += int(replay.per_step_drafted == m.per_step_drafted)
        compared += 1
    assert compared >= 4 and exact >= compared // 2
