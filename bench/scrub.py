"""The trace scrubber on its labelled corpus: recall on personal data and secrets, the share of
clean snippets it changes, and its cost per KB of a typical trace. Writes bench/results/scrub.json.

    python bench/scrub.py

1. pii_recall: over tests/data/scrub_corpus.jsonl's positive cases (email, phone numbers of
   several countries and separators, payment cards, IBANs, national ids, IP addresses, secrets
   and credentials in code, configuration and prose), detected entities / all entities; an
   entity counts as detected when its value no longer appears in the scrubbed text. Also per
   entity type.
2. pii_false_positive_rate: the corpus's negative cases (clean code, SQL, JSON, YAML, shell, logs
   and prose) that come back changed / all negative cases.
3. us_per_kb: CPU microseconds (process time, so other work on a shared machine does not count)
   to scrub a typical 1 KB trace (prose, code, a log line, one e-mail address and one phone
   number), median of repeated runs, and per KB over the whole corpus (short snippets, so the
   per-call cost of the library analyzers weighs more).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controlplane.traces.scrub import scrub  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CORPUS = ROOT / "tests" / "data" / "scrub_corpus.jsonl"

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


def measure_corpus(path: Path = CORPUS) -> dict[str, Any]:
    """Recall, false-positive rate and misses of the scrubber on the labelled corpus."""
    cases = load_corpus(path)
    found: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    missed: list[dict[str, str]] = []
    changed: list[dict[str, str]] = []
    negatives = 0
    for case in cases:
        scrubbed = scrub(case["text"]).text
        if not case["entities"]:
            negatives += 1
            if scrubbed != case["text"]:
                changed.append({"text": case["text"], "scrubbed": scrubbed})
            continue
        for entity in case["entities"]:
            total[entity["type"]] += 1
            if entity["value"] in scrubbed:
                missed.append({"type": entity["type"], "value": entity["value"], "scrubbed": scrubbed})
            else:
                found[entity["type"]] += 1
    positives = sum(total.values())
    return {
        "positive_cases": len(cases) - negatives,
        "positive_entities": positives,
        "negative_cases": negatives,
        "pii_recall": sum(found.values()) / positives if positives else 0.0,
        "pii_false_positive_rate": len(changed) / negatives if negatives else 0.0,
        "recall_by_type": {kind: found[kind] / total[kind] for kind in sorted(total)},
        "entities_by_type": dict(sorted(total.items())),
        "missed": missed,
        "changed_negatives": changed,
    }


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


def main() -> None:
    started = time.process_time()
    scrub("warm up: a@b.io +1 415 555 0132")  # builds the analyzers once, as the first request does
    build_ms = (time.process_time() - started) * 1e3
    figures = measure_corpus()
    speed = measure_speed()
    print(
        f"corpus: {figures['positive_cases']} positive cases ({figures['positive_entities']} entities), "
        f"{figures['negative_cases']} negative cases"
    )
    print(f"{'entity type':<14} {'entities':>8} {'recall':>7}")
    for kind, recall in figures["recall_by_type"].items():
        print(f"{kind:<14} {figures['entities_by_type'][kind]:>8} {recall:>7.3f}")
    print(f"{'all':<14} {figures['positive_entities']:>8} {figures['pii_recall']:>7.3f}")
    print(
        f"pii_false_positive_rate {figures['pii_false_positive_rate']:.4f} "
        f"({len(figures['changed_negatives'])}/{figures['negative_cases']})"
    )
    print(
        f"us per KB: typical trace {speed['us_per_kb_typical_trace']}, corpus {speed['us_per_kb_corpus']}; "
        f"first call (builds analyzers) {build_ms:.0f} ms"
    )
    for miss in figures["missed"]:
        print(f"  missed {miss['type']}: {miss['value']!r}")
    for change in figures["changed_negatives"]:
        print(f"  changed: {change['text']!r} -> {change['scrubbed']!r}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {**figures, **speed, "first_call_ms": round(build_ms, 1)}
    (RESULTS / "scrub.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
