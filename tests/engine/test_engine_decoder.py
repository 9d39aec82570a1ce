"""SpeculativeDecoder: greedy speculation is token-identical to plain greedy for every proposer;
sampling is reproducible from an explicit generator; limits and end-of-text behave."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from workers.engine.decoder import (
    ContextLengthError,
    MultiRowThreads,
    SpeculativeDecoder,
    StopStrings,
    generate_batch,
    greedy_reference,
)
from workers.engine.model import NUMPY_STEP_ROWS, Transformer
from workers.engine.proposers import (
    DraftModelProposer,
    NgramProposer,
    PredictedOutputProposer,
    Proposals,
    Proposer,
)
from workers.engine.tokenizer import Tokenizer

PromptFactory = Callable[..., list[list[int]]]
N_NEW = 32


@pytest.fixture(scope="module")
def references(target: Transformer, make_prompts: PromptFactory) -> list[tuple[list[int], list[int]]]:
    return [(p, greedy_reference(target, p, N_NEW)) for p in make_prompts(16)]


def _edit(ids: list[int]) -> list[int]:
    """A prediction that is the true output with an insertion and a deletion (a code edit)."""
    return ids[:8] + [7, 7, 7] + ids[8:18] + ids[21:]


@pytest.mark.parametrize(
    "kind,k",
    [
        ("none", 4),
        ("draft", 1),
        ("draft", 4),
        ("draft", 6),
        ("draft-confident", 6),
        ("ngram1", 4),
        ("ngram3", 3),
        ("predicted", 4),
        ("predicted+draft", 4),
    ],
)
def test_greedy_speculation_is_token_identical(
    kind: str,
    k: int,
    target: Transformer,
    drafter: Transformer,
    tokenizer: Tokenizer,
    references: list[tuple[list[int], list[int]]],
) -> None:
    proposer: Proposer | None = {
        "none": None,
        "draft": DraftModelProposer(drafter),
        "draft-confident": DraftModelProposer(drafter, confidence_threshold=0.5),
        "ngram1": NgramProposer(1),
        "ngram3": NgramProposer(3),
        "predicted": None,
        "predicted+draft": DraftModelProposer(drafter),
    }[kind]
    dec = SpeculativeDecoder(target, tokenizer, proposer, k=k)
    drafted = accepted = 0
    for prompt, ref in references:
        prediction = _edit(ref) if kind.startswith("predicted") else None
        res = dec.generate(prompt, N_NEW, stop_at_eos=False, prediction=prediction)
        assert res.token_ids == ref
        assert res.finish_reason == "length"
        drafted += res.metrics.drafted_tokens
        accepted += res.metrics.accepted_tokens
    if kind == "none":
        assert drafted == 0
    else:
        # The check is only meaningful if drafts were both accepted and rejected along the way.
        assert 0 < accepted < drafted


def test_a_confidence_threshold_shortens_doubtful_drafts(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    """Rounds stop where the drafter doubts its token: fewer drafted tokens per round, and those
    drafted are accepted at least as often (what stops was mostly going to be rejected)."""
    figures = {}
    for threshold in (0.0, 0.5):
        dec = SpeculativeDecoder(
            target, tokenizer, DraftModelProposer(drafter, confidence_threshold=threshold), k=6
        )
        drafted = accepted = steps = 0
        for prompt in make_prompts(8):
            m = dec.generate(prompt, N_NEW, stop_at_eos=False).metrics
            drafted, accepted, steps = (
                drafted + m.drafted_tokens,
                accepted + m.accepted_tokens,
                steps + m.verify_steps,
            )
        figures[threshold] = (drafted / steps, accepted / drafted)
    # Without a threshold a round drafts k, short of the requested length's end.
    # Deterministic: greedy decoding with seeded models and prompts; fails only if the code changes.
    assert figures[0.5][0] < 0.8 * figures[0.0][0]
    assert figures[0.5][1] >= figures[0.0][1]
    with pytest.raises(ValueError, match="confidence_threshold"):
        DraftModelProposer(drafter, confidence_threshold=1.0)


def test_predicted_output_realigns_after_an_edit(
    target: Transformer, tokenizer: Tokenizer, references: list[tuple[list[int], list[int]]]
) -> None:
    prompt, ref = references[0]
    res = SpeculativeDecoder(target, tokenizer, None, k=4).generate(
        prompt, N_NEW, stop_at_eos=False, prediction=_edit(ref)
    )
    m = res.metrics
    assert m.prediction_tokens == len(_edit(ref))
    # 8 tokens before the insertion and >= 8 of the 10 after it re-align (3 output tokens to re-anchor).
    assert m.prediction_matched_tokens is not None and m.prediction_matched_tokens >= 15
    assert m.prediction_matched_tokens == m.accepted_tokens  # no fallback: every draft came from it


def test_proposer_without_match_proposes_nothing() -> None:
    ngram = NgramProposer(2)
    ngram.start_request([1, 2, 3])
    assert len(ngram.propose([1, 2, 3, 4], 4)) == 0
    assert ngram.propose([1, 2, 3, 4, 1, 2], 4).token_ids.tolist() == [3, 4, 1, 2]
    # The most recent earlier occurrence wins.
    assert ngram.propose([1, 2, 3, 4, 1, 2, 9, 1, 2], 2).token_ids.tolist() == [9, 1]
    predicted = PredictedOutputProposer([5, 6, 7])
    predicted.start_request([1])
    assert predicted.propose([1], 2).token_ids.tolist() == [5, 6]
    assert len(predicted.propose([1, 9], 2)) == 0  # diverged, no fallback


def test_sampling_is_reproducible_with_a_generator(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    dec = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=4)
    prompt = make_prompts(1, seed=5)[0]

    def run(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return dec.generate(prompt, 40, temperature=0.9, top_p=0.95, generator=g, stop_at_eos=False).token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)
    plain = SpeculativeDecoder(target, tokenizer, None)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert (
        plain.generate(prompt, 20, 1.0, generator=g1).token_ids
        == plain.generate(prompt, 20, 1.0, generator=g2).token_ids
    )


def test_stops_at_eos_and_limits(
    target: Transformer,
    drafter: Transformer,
    tokenizer: Tokenizer,
    references: list[tuple[list[int], list[int]]],
) -> None:
    prompt, ref = references[1]
    stop_tok = ref[10]
    first = ref.index(stop_tok)
    eos_tokenizer = Tokenizer(tokenizer.tok, eos_token=tokenizer.tok.id_to_token(stop_tok))
    dec = SpeculativeDecoder(target, eos_tokenizer, DraftModelProposer(drafter), k=4)
    res = dec.generate(prompt, N_NEW)
    assert res.token_ids == ref[:first] and res.finish_reason == "stop"
    assert res.metrics.generated_tokens == first + 1  # the end-of-text token counts as generated

    one = dec.generate(prompt, 1, stop_at_eos=False)
    assert one.token_ids == ref[:1] and one.metrics.verify_steps == 0
    with pytest.raises(ContextLengthError, match="context window"):
        dec.generate(prompt, target.config.max_seq_len)
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], 4)


def test_text_prompt_and_batch_helper(
    target: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    dec = SpeculativeDecoder(target, tokenizer, NgramProposer(2), k=4)
    res = dec.generate("def add(a, b):", 12, stop_at_eos=False)
    assert res.prompt_ids == tokenizer.encode("def add(a, b):")
    assert res.text == tokenizer.decode(res.token_ids)

    batch = torch.tensor([p[:4] for p in make_prompts(5, seed=9)])
    out = generate_batch(target, batch, 10)
    assert out.shape == (5, 10)
    for row, prompt in zip(out.tolist(), batch.tolist(), strict=True):
        assert row == greedy_reference(target, prompt, 10)


def test_multi_row_threads_keep_output_identical_and_restore_the_thread_count(
    target: Transformer,
    drafter: Transformer,
    tokenizer: Tokenizer,
    references: list[tuple[list[int], list[int]]],
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # Verify passes of k+1 rows in NumPy (on one thread) leave the chooser nothing to pick.
        target.numpy_step_rows = 5
        dec = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=4, multi_row_threads=2)
        assert dec.generate(references[0][0], N_NEW, stop_at_eos=False).token_ids == references[0][1]
        assert dec._thread_choice is None
        target.numpy_step_rows = NUMPY_STEP_ROWS  # torch verify passes: the chooser times 1 against 2 threads
        for prompt, want in references[:6]:
            assert dec.generate(prompt, N_NEW, stop_at_eos=False).token_ids == want
            assert torch.get_num_threads() == 1  # verify passes hand the count back
        chooser = dec._thread_choice
        assert chooser is not None and chooser.options == (1, 2)
    finally:
        target.numpy_step_rows = 0
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="multi_row_threads"):
        SpeculativeDecoder(target, tokenizer, None, multi_row_threads=0)


def _run_chooser(chooser: MultiRowThreads, seconds: Callable[[int], float], rounds: int) -> list[int]:
    picks = []
    for _ in range(rounds):
        option = chooser.choose()
        chooser.record(option, seconds(option))
        picks.append(option)
    return picks


def test_multi_row_threads_follow_a_busy_neighbour_coming_and_going() -> None:
    chooser = MultiRowThreads(1, 2)
    idle = {1: 0.015, 2: 0.011}  # two threads faster on an idle machine
    busy = {1: 0.015, 2: 0.060}  # and far slower while another process holds a core
    picks = _run_chooser(chooser, idle.__getitem__, 200)
    trial, check = MultiRowThreads.TRIAL, MultiRowThreads.TRIAL
    assert picks[: trial + check] == [2] * trial + [1] * check  # compared back to back first
    assert (
        picks[trial + check : trial + check + MultiRowThreads.FIRST_RETRY]
        == [2] * MultiRowThreads.FIRST_RETRY
    )
    picks = _run_chooser(chooser, busy.__getitem__, 400)
    assert picks[1:trial] == [1] * (trial - 1)  # one slow pass starts a comparison at once
    # Deterministic: the timings are a fixed table, not measured.
    assert picks[-300:].count(2) <= 2 * MultiRowThreads.EARLY  # slow retries stop early, and rarely
    picks = _run_chooser(chooser, idle.__getitem__, 600)
    assert picks[-100:] == [2] * 100  # the neighbour left: back to two threads


def test_multi_row_threads_do_not_flap_on_noise() -> None:
    chooser = MultiRowThreads(1, 2)
    rng = random.Random(7)
    # Two counts within 3% of each other, each pass jittering by +-15%.
    picks = _run_chooser(
        chooser, lambda option: (0.0150 if option == 1 else 0.0146) * rng.uniform(0.85, 1.15), 2000
    )
    adopted = [b for a, b in zip(picks, picks[1:], strict=False) if a != b]
    assert len(adopted) <= 20  # comparisons only, ever rarer; noise alone rarely adopts a count


@pytest.mark.parametrize("kind", ["none", "draft", "ngram"])
def test_stop_strings_end_the_output_before_them(
    kind: str,
    target: Transformer,
    drafter: Transformer,
    tokenizer: Tokenizer,
    references: list[tuple[list[int], list[int]]],
) -> None:
    proposer = {"none": None, "draft": DraftModelProposer(drafter), "ngram": NgramProposer(2)}[kind]
    dec = SpeculativeDecoder(target, tokenizer, proposer, k=4)
    cut_early = 0
    for n, (prompt, ref) in enumerate(references[:8]):
        full = tokenizer.decode(ref)
        # A stop string taken from the output itself, at a different place per prompt; a second,
        # absent one must not matter.
        at = (n * 7) % max(1, len(full) - 4) + 1
        stop = full[at : at + 3]
        if not stop.strip() or "\ufffd" in stop:
            continue
        where = full.find(stop)
        res = dec.generate(prompt, N_NEW, stop_at_eos=False, stop=[stop, "\x00never\x00"])
        assert res.text == full[:where]
        assert res.finish_reason == "stop" and res.stop_string == stop
        assert res.token_ids == ref[: len(res.token_ids)]  # a prefix of the unstopped output
        assert tokenizer.decode(res.token_ids).startswith(res.text)
        assert len(tokenizer.decode(res.token_ids[:-1])) < where or not res.token_ids  # the shortest one
        cut_early += int(res.metrics.generated_tokens < N_NEW)
    assert cut_early >= 4  # the decoder stopped working once the stop string appeared

    untouched = dec.generate(references[0][0], N_NEW, stop_at_eos=False, stop=["\x00never\x00"])
    assert untouched.token_ids == references[0][1] and untouched.finish_reason == "length"
    with pytest.raises(ValueError, match="at most 4"):
        dec.generate(references[0][0], 4, stop=["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError, match="non-empty"):
        dec.generate(references[0][0], 4, stop=[""])


def test_drafts_after_a_stop_string_are_not_verified(tokenizer: Tokenizer) -> None:
    stopper = StopStrings(tokenizer, ["\n"])
    output = tokenizer.encode("SELECT name")
    line_end = tokenizer.encode(" FROM t;\n")
    drafts = line_end + tokenizer.encode("User: next")
    props = Proposals(torch.tensor(drafts), torch.rand(len(drafts), 8), from_prediction=len(drafts))
    kept = stopper.drafts_through_stop(output, props)
    assert kept.token_ids.tolist() == line_end  # through the draft that completes the stop, no further
    assert kept.probs is not None and kept.probs.shape[0] == len(line_end)
    assert kept.from_prediction == len(line_end)
    no_stop = Proposals(torch.tensor(tokenizer.encode(" FROM t")))
    assert stopper.drafts_through_stop(output, no_stop) is no_stop
