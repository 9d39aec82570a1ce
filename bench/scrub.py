"""The trace scrubber on two labelled corpora: recall on personal data and secrets, how much clean
text it changes, whether its surrogates keep the shape, and its cost per KB of a typical trace.
Writes bench/results/scrub.json (``bench/scrub_cost.py`` adds the hit-rate cost of scrubbing).

    python bench/scrub.py          # both corpora, speed
    python bench/scrub.py --dev    # the development split only (another seed): what to tune on

Corpora:

* in sample: tests/data/scrub_corpus.jsonl, written beside the scrubber's rules
  (tests/data/make_scrub_corpus.py): values located in their text by search;
* out of sample: tests/data/scrub_out_of_sample.jsonl, generated apart from the rules by
  tests/data/make_scrub_out_of_sample.py (Faker in twelve locales, phonenumbers' metadata for 30
  regions, other templates and languages), with labelled spans; the held-out seed is never tuned
  on (``--dev`` builds the development split from another seed).

Figures (``_in_sample`` figures keep their old names, ``pii_recall`` and ``pii_false_positive_rate``):

1. recall: caught entities / all labelled entities, per type too. An entity counts as caught only
   if *every* character of its span lies inside spans the scrubber replaced (a partial redaction
   that leaves a digit or a letter of it is a miss, counted apart as ``partial``); a value that
   occurs several times must be caught at every occurrence.
2. ``pii_false_positive_rate_out_of_sample``: look-alike spans touched / all look-alike spans of
   the negative texts (versions, dates, order numbers, ISBNs, EANs, hashes, UUIDs, MAC addresses,
   coordinates, prices, ports, timestamps, user agents, code identifiers); a look-alike counts as
   touched if any one of its characters was replaced.
   ``pii_false_positive_rate_tokens_out_of_sample``: over every text of the corpus, the tokens
   (maximal runs of non-space characters) that overlap no labelled entity and of which at least
   one character was replaced / all such tokens (ordinary words included, so it is the smaller).
   In sample, ``pii_false_positive_rate`` stays the share of negative cases changed at all.
3. surrogates: the share of replaced entities whose surrogate the scrubber finds again as the same
   kind of entity when it scrubs its own output (a fake address is still an address), and of card
   and IBAN surrogates that pass their checksums.
4. us_per_kb: CPU microseconds (process time, so other work on a shared machine does not count)
   to scrub a typical 1 KB trace, median of repeated runs, and per KB over the in-sample corpus.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controlplane.traces.scrub import Entity, Scrubbed, luhn_ok, scrub  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DATA = ROOT / "tests" / "data"
CORPUS = DATA / "scrub_corpus.jsonl"
OUT_OF_SAMPLE = DATA / "scrub_out_of_sample.jsonl"
# Surrogates do not change what is found: a fixed key makes the bench's output reproducible.
BENCH_KEY = b"bench/scrub.py"

TYPICAL_TRACE = (
    "User: my order 123456 from 2024-01-15 has not arrived; email me at jane.doe@mailbox.org.\n"
    "Assistant: Sorry to hear that! Order #123456 shipped on 2024-01-16 (tracking 00340434161094012345).\n"
    "```python\ndef fetch(order_id: int) -> dict:\n"
    "    resp = requests.get(f'https://api.example.com/v1/orders/{order_id}', timeout=30)\n"
    "    return resp.json()\n```\n"
    "Logs: 2024-01-16T10:30:45Z INFO worker-3 processed 42 items in 1.25s (version 2.3.1).\n"
    'Call +44 20 7946 0958 if needed. The API returned {"status": "ok", "count": 17}.\n'
    "Thanks, that helps a lot. Could you also check the second order placed yesterday afternoon?\n"
)


def load_corpus(path: Path = CORPUS) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _located(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The case's entities with spans: as labelled, or every occurrence of each value."""
    spans = []
    for entity in case["entities"]:
        if "start" in entity:
            spans.append(entity)
            continue
        at = case["text"].find(entity["value"])
        assert at >= 0, entity
        while at >= 0:
            spans.append({**entity, "start": at, "end": at + len(entity["value"])})
            at = case["text"].find(entity["value"], at + 1)
    return spans


def _replaced_mask(text: str, result: Scrubbed) -> list[bool]:
    mask = [False] * len(text)
    for replacement in result.replacements:
        for index in range(replacement.start, replacement.end):
            mask[index] = True
    return mask


def _tokens(text: str) -> Iterable[tuple[int, int]]:
    start = None
    for index, char in enumerate(text + " "):
        if char.isspace():
            if start is not None:
                yield start, index
                start = None
        elif start is None:
            start = index


def _surrogate_checks(result: Scrubbed) -> dict[str, int]:
    """Whether each surrogate is found again as its own kind, and passes its checksum."""
    counts = {"surrogates": 0, "same_kind": 0, "checksummed": 0, "checksum_ok": 0}
    if not result.replacements:
        return counts
    again = scrub(result.text, key=BENCH_KEY)
    shift = 0
    for replacement in result.replacements:
        start = replacement.start + shift
        end = start + len(replacement.surrogate)
        shift += len(replacement.surrogate) - (replacement.end - replacement.start)
        counts["surrogates"] += 1
        if any(
            r.entity is replacement.entity and r.start <= start and end <= r.end for r in again.replacements
        ):
            counts["same_kind"] += 1
        if replacement.entity is Entity.credit_card:
            counts["checksummed"] += 1
            counts["checksum_ok"] += luhn_ok("".join(c for c in replacement.surrogate if c.isdigit()))
        elif replacement.entity is Entity.iban:
            compact = replacement.surrogate.replace(" ", "")
            number = "".join(str(int(char, 36)) for char in compact[4:] + compact[:4])
            counts["checksummed"] += 1
            counts["checksum_ok"] += int(number) % 97 == 1
    return counts


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def measure(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Strict recall, false-positive rates and surrogate shape on one labelled corpus."""
    caught: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    partial = 0
    missed: list[dict[str, str]] = []
    decoys = decoys_touched = tokens = tokens_changed = negatives = negatives_changed = 0
    touched: list[dict[str, str]] = []
    shape: dict[str, int] = defaultdict(int)
    for case in cases:
        text = case["text"]
        result = scrub(text, key=BENCH_KEY)
        mask = _replaced_mask(text, result)
        entities = _located(case)
        labelled = [False] * len(text)
        for entity in entities:
            total[entity["type"]] += 1
            covered = [mask[i] for i in range(entity["start"], entity["end"])]
            for index in range(entity["start"], entity["end"]):
                labelled[index] = True
            if all(covered):
                caught[entity["type"]] += 1
            else:
                partial += any(covered)
                missed.append({"type": entity["type"], "value": entity["value"], "scrubbed": result.text})
        for decoy in case.get("decoys", []):
            decoys += 1
            if any(mask[decoy["start"] : decoy["end"]]):
                decoys_touched += 1
                touched.append({"kind": decoy["kind"], "value": decoy["value"], "scrubbed": result.text})
        for start, end in _tokens(text):
            if any(labelled[start:end]):
                continue
            tokens += 1
            tokens_changed += any(mask[start:end])
        if not entities:
            negatives += 1
            if result.text != text:
                negatives_changed += 1
                if not case.get("decoys"):
                    touched.append({"kind": "text", "value": text, "scrubbed": result.text})
        for name, count in _surrogate_checks(result).items():
            shape[name] += count
    positives = sum(total.values())
    return {
        "entities": positives,
        "negative_cases": negatives,
        "look_alikes": decoys,
        "recall": sum(caught.values()) / positives if positives else 0.0,
        "partial_redactions": partial,
        "false_positive_rate_look_alikes": decoys_touched / decoys if decoys else None,
        "false_positive_rate_tokens": tokens_changed / tokens if tokens else 0.0,
        "false_positive_rate_cases": negatives_changed / negatives if negatives else 0.0,
        "recall_by_type": {kind: caught[kind] / total[kind] for kind in sorted(total)},
        "entities_by_type": dict(sorted(total.items())),
        "surrogate_same_kind_share": _share(shape["same_kind"], shape["surrogates"]),
        "surrogate_checksum_share": _share(shape["checksum_ok"], shape["checksummed"]),
        "missed": missed,
        "touched": touched,
    }


def measure_corpus(path: Path = CORPUS, out_of_sample: Path = OUT_OF_SAMPLE) -> dict[str, Any]:
    """Both corpora's figures under the names the reliability bench and the README use."""
    inside = measure(load_corpus(path))
    outside = measure(load_corpus(out_of_sample))
    return {
        "pii_recall": inside["recall"],
        "pii_false_positive_rate": inside["false_positive_rate_cases"],
        "pii_false_positive_rate_tokens": inside["false_positive_rate_tokens"],
        "pii_recall_out_of_sample": outside["recall"],
        "pii_false_positive_rate_out_of_sample": outside["false_positive_rate_look_alikes"],
        "pii_false_positive_rate_tokens_out_of_sample": outside["false_positive_rate_tokens"],
        "surrogate_same_kind_share": outside["surrogate_same_kind_share"],
        "surrogate_checksum_share": outside["surrogate_checksum_share"],
        "in_sample": inside,
        "out_of_sample": outside,
    }


def _micros_per_call(text: str, repeats: int = 200) -> float:
    for _ in range(5):
        scrub(text)
    samples = []
    for _ in range(5):
        started = time.process_time()
        for _ in range(repeats // 5):
            scrub(text)
        samples.append((time.process_time() - started) / (repeats // 5) * 1e6)
    return statistics.median(samples)


def measure_speed(path: Path = CORPUS) -> dict[str, float]:
    trace = (TYPICAL_TRACE * 3)[:1024]
    corpus_text = [case["text"] for case in load_corpus(path)]
    started = time.process_time()
    for _ in range(5):
        for text in corpus_text:
            scrub(text)
    corpus_kb = 5 * sum(len(text.encode()) for text in corpus_text) / 1024
    return {
        "us_per_kb_typical_trace": round(_micros_per_call(trace), 1),
        "us_per_kb_corpus": round((time.process_time() - started) * 1e6 / corpus_kb, 1),
    }


def show(name: str, figures: dict[str, Any], misses: bool) -> None:
    look_alikes = figures["false_positive_rate_look_alikes"]
    print(
        f"{name}: {figures['entities']} entities, {figures['negative_cases']} negative cases, "
        f"{figures['look_alikes']} look-alikes"
    )
    print(f"  {'entity type':<14} {'entities':>8} {'recall':>7}")
    for kind, recall in figures["recall_by_type"].items():
        print(f"  {kind:<14} {figures['entities_by_type'][kind]:>8} {recall:>7.3f}")
    partial = figures["partial_redactions"]
    print(f"  {'all':<14} {figures['entities']:>8} {figures['recall']:>7.3f}  ({partial} partial)")
    print(
        f"  false positives: look-alikes {'-' if look_alikes is None else f'{look_alikes:.4f}'}, "
        f"tokens {figures['false_positive_rate_tokens']:.5f}, "
        f"negative cases {figures['false_positive_rate_cases']:.4f}"
    )
    same, checksum = figures["surrogate_same_kind_share"], figures["surrogate_checksum_share"]
    print(f"  surrogates found again as their kind {same:.3f}, checksums valid {checksum:.3f}")
    if misses:
        for miss in figures["missed"]:
            print(f"    missed {miss['type']}: {miss['value']!r} -> {miss['scrubbed']!r}")
        for touch in figures["touched"]:
            print(f"    touched {touch['kind']}: {touch['value']!r} -> {touch['scrubbed']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dev", action="store_true", help="measure the development split only, with its misses"
    )
    args = parser.parse_args()
    if args.dev:
        sys.path.insert(0, str(DATA))
        from make_scrub_out_of_sample import DEV_SEED, build  # type: ignore[import-not-found]

        show(f"development split (seed {DEV_SEED})", measure(build(DEV_SEED)), misses=True)
        return
    started = time.process_time()
    scrub("warm up: a@b.io +1 415 555 0132")  # builds the analyzers once, as the first request does
    build_ms = (time.process_time() - started) * 1e3
    figures = measure_corpus()
    speed = measure_speed()
    show("in sample (tests/data/scrub_corpus.jsonl)", figures["in_sample"], misses=True)
    show("out of sample (tests/data/scrub_out_of_sample.jsonl)", figures["out_of_sample"], misses=False)
    print(
        f"pii_recall_out_of_sample {figures['pii_recall_out_of_sample']:.4f}, "
        f"pii_false_positive_rate_out_of_sample {figures['pii_false_positive_rate_out_of_sample']:.4f}"
    )
    print(
        f"us per KB: typical trace {speed['us_per_kb_typical_trace']}, corpus {speed['us_per_kb_corpus']}; "
        f"first call (builds analyzers) {build_ms:.0f} ms"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "scrub.json"
    # bench/scrub_cost.py writes its figures into the same file: keep them.
    kept = json.loads(path.read_text()) if path.exists() else {}
    kept = {
        key: value
        for key, value in kept.items()
        if key.startswith("scrub_hit_rate") or key == "hit_rate_cost"
    }
    out = {**figures, **speed, "first_call_ms": round(build_ms, 1), **kept}
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
