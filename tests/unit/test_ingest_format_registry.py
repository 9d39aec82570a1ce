"""The ingest formats' registry: one adapter per format, told apart by name, engine and markers,
in the documented detection order, and the one list that the batch body, detection and the
benchmark client read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controlplane.ingest.formats import (
    BATCH_FORMATS,
    FORMAT_ADAPTERS,
    FORMATS,
    PERF_METRICS_IN_RESPONSE,
    BatchValidationError,
    FormatAdapter,
    detect_format,
    parse_batch,
)
from loadbench.runner import ENGINES, NO_PERF_FLAG_ENGINES, PERF_FLAG_ENGINES
from tests.unit.test_ingest_formats import native

ROOT = Path(__file__).resolve().parents[2]
DETECTION_ORDER = ("native", "fireworks", "vllm", "trtllm", "sglang")


def _own_markers(adapter: FormatAdapter) -> frozenset[str]:
    others = frozenset[str]().union(*(a.markers for a in FORMAT_ADAPTERS if a is not adapter))
    return adapter.markers - others


def test_the_registry_is_in_the_documented_detection_order() -> None:
    assert tuple(adapter.name for adapter in FORMAT_ADAPTERS) == DETECTION_ORDER
    assert FORMATS == DETECTION_ORDER
    assert BATCH_FORMATS == ("auto", *DETECTION_ORDER)
    documented = re.search(r"detection order \(today ([^)]*)\)", (ROOT / "docs" / "ingest.md").read_text())
    assert documented is not None
    assert tuple(re.findall(r"`([^`]+)`", documented.group(1))) == DETECTION_ORDER


def test_every_adapter_has_a_distinct_name_engine_and_markers() -> None:
    names = [adapter.name for adapter in FORMAT_ADAPTERS]
    engines = [adapter.engine for adapter in FORMAT_ADAPTERS]
    markers = [adapter.markers for adapter in FORMAT_ADAPTERS]
    assert len(set(names)) == len(names)
    assert len(set(engines)) == len(engines)
    assert all(markers)
    assert len(set(markers)) == len(markers)


@pytest.mark.parametrize("adapter", FORMAT_ADAPTERS, ids=lambda adapter: adapter.name)
def test_each_adapter_has_markers_of_its_own_that_detect_it(adapter: FormatAdapter) -> None:
    own = _own_markers(adapter)
    assert own
    for marker in sorted(own):
        assert detect_format({marker: {}}) == adapter.name


@pytest.mark.parametrize("adapter", FORMAT_ADAPTERS[1:], ids=lambda adapter: adapter.name)
def test_an_engine_marker_takes_a_record_off_the_native_fast_path(adapter: FormatAdapter) -> None:
    # Parsed as native, the marker would only be an unknown field; detected, the record is ambiguous.
    for marker in sorted(_own_markers(adapter)):
        with pytest.raises(BatchValidationError) as refused:
            parse_batch({"records": [{**native(), marker: {}}]})
        (problem,) = refused.value.problems
        assert problem.message.startswith(f"ambiguous record: it matches native, {adapter.name};")


def test_ambiguous_candidates_are_named_in_registry_order() -> None:
    with pytest.raises(ValueError, match="it matches fireworks, vllm, sglang;"):
        detect_format({"meta_info": {}, "metrics": {}, "perf_metrics": {}})


def test_the_benchmark_client_knows_every_registered_engine() -> None:
    assert ENGINES == ("auto", *PERF_FLAG_ENGINES, *NO_PERF_FLAG_ENGINES)
    assert sorted(ENGINES[1:]) == sorted(adapter.engine for adapter in FORMAT_ADAPTERS)
    flagged = {
        adapter.engine for adapter in FORMAT_ADAPTERS if adapter.request_flag == PERF_METRICS_IN_RESPONSE
    }
    assert set(PERF_FLAG_ENGINES) == flagged == {"reference", "fireworks"}
    assert set(NO_PERF_FLAG_ENGINES) == {"vllm", "trtllm", "sglang"}
