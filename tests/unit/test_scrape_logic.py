"""The pure parts of pull scraping: a target's validation and its deterministic scrape ids."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.errors import ValidationProblem
from controlplane.ingest.prometheus import parse_exposition
from controlplane.ingest.scrape import MAX_URLS, TargetSpec, scrape_id_for, validate_target

URL = "http://10.0.0.7:8000/metrics"


def _fields(**kwargs: Any) -> list[str]:
    with pytest.raises(ValidationProblem) as caught:
        validate_target(**kwargs)
    assert caught.value.status_code == 422
    return [d["field"] for d in caught.value.details]


def test_a_valid_target_is_normalised() -> None:
    assert validate_target(name="engine-0", urls=[URL, "https://api.example.com/metrics"]) == TargetSpec(
        "engine-0", (URL, "https://api.example.com/metrics")
    )
    canary = validate_target(name="c", urls=[URL], arm="canary:007")
    assert (canary.arm, canary.drafter_version) == ("canary:7", 7)
    assert validate_target(name="b", urls=[URL], arm="baseline", enabled=False).enabled is False
    assert validate_target(name="x" * 100, urls=[URL], drafter_version=3).drafter_version == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "", "urls": [URL]}, "name"),
        ({"name": "x" * 101, "urls": [URL]}, "name"),
        ({"name": "Engine", "urls": [URL]}, "name"),
        ({"name": "e", "urls": []}, "urls"),
        ({"name": "e", "urls": URL}, "urls"),
        ({"name": "e", "urls": [URL] * 2}, "urls.1"),
        ({"name": "e", "urls": [f"http://h{i}/metrics" for i in range(MAX_URLS + 1)]}, "urls"),
        ({"name": "e", "urls": ["file:///etc/passwd"]}, "urls.0"),
        ({"name": "e", "urls": [URL, "10.0.0.7:8000/metrics"]}, "urls.1"),
        ({"name": "e", "urls": ["http:///metrics"]}, "urls.0"),
        ({"name": "e", "urls": ["http://host:99999/metrics"]}, "urls.0"),
        ({"name": "e", "urls": ["https://admin:pw@host/metrics"]}, "urls.0"),
        ({"name": "e", "urls": [7]}, "urls.0"),
        ({"name": "e", "urls": [URL], "arm": "canary:x"}, "arm"),
        ({"name": "e", "urls": [URL], "arm": "shadow"}, "arm"),
        ({"name": "e", "urls": [URL], "arm": "canary:2", "drafter_version": 3}, "drafter_version"),
        ({"name": "e", "urls": [URL], "arm": "baseline", "drafter_version": 3}, "drafter_version"),
        ({"name": "e", "urls": [URL], "drafter_version": 0}, "drafter_version"),
        ({"name": "e", "urls": [URL], "drafter_version": True}, "drafter_version"),
        ({"name": "e", "urls": [URL], "enabled": "yes"}, "enabled"),
    ],
)
def test_an_invalid_target_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    assert field in _fields(**kwargs)


def test_every_problem_is_listed_at_once() -> None:
    assert _fields(name="Bad Name", urls=["ftp://x/metrics"], arm="nope") == ["name", "urls.0", "arm"]


def _snapshot(drafts: int) -> Any:
    return parse_exposition(
        f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}\n'
        f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {drafts * 4}\n'
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {drafts * 2}\n'
    )


def test_scrape_ids_are_deterministic_and_tell_transitions_apart() -> None:
    before, after = _snapshot(10), _snapshot(15)
    same = scrape_id_for(1, 4, before, after)
    assert same == scrape_id_for(1, 4, _snapshot(10), _snapshot(15))  # a repeat: the same id
    others = {
        scrape_id_for(2, 4, before, after),  # another target of the deployment
        scrape_id_for(1, 5, before, after),  # the same counters met again later (after a restart)
        scrape_id_for(1, 4, None, after),  # a first scrape
        scrape_id_for(1, 4, before, _snapshot(16)),
    }
    assert same not in others and len(others) == 4
