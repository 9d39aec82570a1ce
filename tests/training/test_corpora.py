"""The traffic domains are deterministic, split by document, and their prompts are real prefixes."""

from __future__ import annotations

import pytest

from workers import corpora
from workers.corpora import structured


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
