"""The traffic domains are deterministic, split by document, and their prompts are real prefixes;
scenario traffic's prompt streams are endless, rarely repeat, and keep held-out documents apart."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers import corpora
from workers.corpora import generated, structured

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("domain", corpora.DOMAINS)
def test_splits_are_disjoint_and_non_empty(domain: str) -> None:
    ids = {split: {d.doc_id for d in corpora.documents(domain, split)} for split in corpora.SPLITS}
    assert all(ids.values()), ids.keys()
    assert not ids["train"] & ids["validation"]
    assert not ids["train"] & ids["test"]
    assert not ids["validation"] & ids["test"]


def test_a_module_keeps_its_split_across_prose_and_code() -> None:
    # A held-out module's docstrings must not sit inside a training code file (and vice versa).
    for split in corpora.SPLITS:
        code_files = {d.doc_id.removeprefix("file:") for d in corpora.documents("code", split)}
        for doc in corpora.documents("prose", split):
            if doc.kind == "docstring":
                rel = doc.doc_id.removeprefix("docstrings:")
                assert rel in code_files or corpora.split_of(rel) == split


def test_split_rule_is_a_pure_function_of_the_key() -> None:
    assert corpora.split_of("json/decoder.py") == corpora.split_of("json/decoder.py")
    shares = [corpora.split_of(f"k{i}") for i in range(4000)]
    assert 0.85 < shares.count("train") / len(shares) < 0.95


@pytest.mark.parametrize("domain", corpora.DOMAINS)
def test_prompts_are_deterministic_prefixes_of_held_out_documents(domain: str) -> None:
    a = list(corpora.prompts(domain, "test", 6, seed=3))
    b = list(corpora.prompts(domain, "test", 6, seed=3))
    c = list(corpora.prompts(domain, "test", 6, seed=4))
    assert a == b and len(a) == 6
    assert [p.text for p in a] != [p.text for p in c]
    held_out = {d.doc_id: d.text for d in corpora.documents(domain, "test")}
    for p in a:
        assert p.category == corpora.CATEGORY[domain] == domain
        assert (p.text + p.reference) in held_out[p.doc_id]
        assert 0 < len(p.text) <= 800 and p.reference
    if domain == "structured":
        assert all(p.text.endswith(("SQL:", "Call:")) for p in a)


def test_structured_domain_is_reproducible_from_its_seed() -> None:
    first = structured.build(seed=7)
    again = structured.build(seed=7)
    other = structured.build(seed=8)
    assert [d.text for d in first] == [d.text for d in again]
    assert [d.text for d in first] != [d.text for d in other]
    assert {d.kind for d in first} == {"sql", "json"}


def test_tool_is_an_alias_and_unknown_domains_fail_clearly() -> None:
    assert corpora.documents("tool", "validation") == corpora.documents("structured", "validation")
    with pytest.raises(ValueError, match="unknown domain"):
        corpora.documents("poetry", "train")


def test_fingerprint_names_the_interpreter_and_every_split() -> None:
    fp = corpora.fingerprint()
    assert str(fp["python"]).startswith("cpython-") or "python" in fp
    for domain in corpora.DOMAINS:
        for split in corpora.SPLITS:
            entry = fp[f"{domain}/{split}"]
            assert isinstance(entry, dict) and entry["documents"] > 0 and len(entry["sha256"]) == 64


def _stream(
    domain: str, n: int, seed: int = 1, heldout: bool = False, split: str = "test"
) -> list[corpora.Prompt]:
    return list(itertools.islice(corpora.traffic_prompts(domain, "test", seed, heldout=heldout), n))


@pytest.mark.parametrize("domain", corpora.DOMAINS)
def test_traffic_streams_are_fixed_by_their_seed_and_are_real_windows(domain: str) -> None:
    a, b, c = _stream(domain, 40), _stream(domain, 40), _stream(domain, 40, seed=2)
    assert a == b and [p.text for p in a] != [p.text for p in c]
    if domain == "structured":
        for p in a:
            doc = generated.document("test", 1, int(p.doc_id.rsplit(":", 1)[1]))
            assert (p.text + p.reference) in doc.document.text and p.text.endswith(("SQL:", "Call:"))
        return
    texts = {d.doc_id: d.text for d in corpora.documents(domain, "test")}
    for p in a:
        assert p.category == domain and 200 <= len(p.text) <= 800
        assert (p.text + p.reference) in texts[p.doc_id]
        assert not p.text[-1].isspace() and p.reference[:1].isspace()  # cut after a word


@pytest.mark.parametrize("domain", corpora.DOMAINS)
def test_heldout_streams_share_no_document_with_the_others(domain: str) -> None:
    held, rest = _stream(domain, 300, heldout=True), _stream(domain, 300, seed=2)
    held_docs = {corpora.document_key(domain, p.doc_id) for p in held}
    rest_docs = {corpora.document_key(domain, p.doc_id) for p in rest}
    assert held_docs and rest_docs and not held_docs & rest_docs
    assert all(corpora.is_heldout_document(k) for k in held_docs)
    assert not any(corpora.is_heldout_document(k) for k in rest_docs)
    if domain == "structured":
        # The answered request (the prompt's last "User:" line) never crosses the partition either.
        def last_request(p: corpora.Prompt) -> str:
            return p.text.split("\n")[-2]

        assert not {last_request(p) for p in held} & {last_request(p) for p in rest}


def test_prose_traffic_rarely_repeats_though_the_split_is_small() -> None:
    # Deterministic (a fixed seed). 3,000 uniform draws from the 510,000 windows of the open side
    # repeat about 3000**2 / (2 * 510000) = 9 times (0.3%); 2% would need a pool 7 times smaller.
    texts = [p.text for p in _stream("prose", 3000)]
    assert len(corpora.documents("prose", "test")) < 40
    assert len(set(texts)) >= 0.98 * len(texts)


def test_generated_structured_documents_are_unbounded_and_split_apart() -> None:
    far = generated.document("test", 7, 10**12)
    assert far == generated.document("test", 7, 10**12)
    assert far.document.doc_id == f"generated:test:7:{10**12}"
    train = [generated.document("train", 1, i).document.text for i in range(200)]
    test = [generated.document("test", 1, i).document.text for i in range(200)]
    assert not set(train) & set(test) and len(set(test)) == 200
    for i in range(50):
        made = generated.document("test", 3, i)
        text = made.document.text
        assert text.startswith(("Database tables: ", "Available tools: ")) and text.endswith("\n")
        markers = sum(text.count(m) for m in structured.ANSWER_MARKERS)
        assert 1 <= made.history < markers <= made.history + 2


def test_generated_documents_do_not_depend_on_the_processs_hash_seed() -> None:
    """Two processes with different PYTHONHASHSEED build the same documents: the traffic a scenario
    sends, and the held-out split of what it sends, must not change with the interpreter's salt
    (Faker's it_IT cities come from a set)."""
    code = (
        "import hashlib\n"
        "from workers.corpora import generated\n"
        "h = hashlib.sha256()\n"
        "for i in range(200):\n"
        "    for stream in range(3):\n"
        "        h.update(repr(generated.document('test', stream, i)).encode())\n"
        "print(h.hexdigest())\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(digests) == 1, digests
