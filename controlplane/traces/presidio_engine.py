"""Presidio's analyzer, built offline with pattern recognizers only (imported on first use).

Owns the Presidio side of scrubbing: the analyzer with its no-op NLP engine (no spaCy model is
loaded or downloaded), an e-mail recognizer that validates domains against tldextract's bundled
public suffix snapshot (never its URLs), and a context enhancer that leaves scores alone.
``controlplane.traces.recognizers`` imports this module only when a text could hold something
Presidio finds, so processes that never scrub do not pay spaCy's import.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any, Final

import tldextract

# Presidio imports its optional transformers NLP engine whenever transformers is installed (as it
# is beside the workers), and with it torch: seconds of import and hundreds of MB in the API
# process, for an engine this module never uses. Both are hidden while Presidio is imported, so
# its optional imports fail as they would where the packages are missing.
_ML_FRAMEWORKS: Final = ("torch", "transformers")


@contextlib.contextmanager
def _without_ml_frameworks() -> Iterator[None]:
    hidden = [name for name in _ML_FRAMEWORKS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # makes "import name" raise ImportError
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name) is None:
                del sys.modules[name]


with _without_ml_frameworks():
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry, RecognizerResult
    from presidio_analyzer.context_aware_enhancers import ContextAwareEnhancer
    from presidio_analyzer.nlp_engine import NoOpNlpEngine
    from presidio_analyzer.predefined_recognizers import (
        EmailRecognizer,
        EsNieRecognizer,
        EsNifRecognizer,
        FiPersonalIdentityCodeRecognizer,
        IbanRecognizer,
        ItFiscalCodeRecognizer,
        UkNinoRecognizer,
        UsSsnRecognizer,
    )


@functools.cache
def offline_suffixes() -> tldextract.TLDExtract:
    """tldextract reading the public suffix list from its bundled snapshot: no URL, no cache dir."""
    return tldextract.TLDExtract(cache_dir=None, suffix_list_urls=(), fallback_to_snapshot=True)


class OfflineEmailRecognizer(EmailRecognizer):
    """Presidio's e-mail recognizer with the public suffix list read from tldextract's snapshot."""

    def validate_result(self, pattern_text: str) -> bool:
        return bool(offline_suffixes()(pattern_text).fqdn)


class NoContextEnhancer(ContextAwareEnhancer):
    """Leaves scores as the recognizers gave them: with no NLP tokens there are no context words
    to find, and the default enhancer's copying of every result is most of Presidio's cost."""

    def __init__(self) -> None:
        super().__init__(
            context_similarity_factor=0,
            min_score_with_context_similarity=0,
            context_prefix_count=0,
            context_suffix_count=0,
        )

    def enhance_using_context(
        self, text: str, raw_results: list[RecognizerResult], *args: Any, **kwargs: Any
    ) -> list[RecognizerResult]:
        return raw_results


# Patterns Presidio scores "very weak" (any 9-digit number for an SSN) need context words, which
# the no-op NLP engine cannot see; validated patterns (checksums) score 1.0.
PRESIDIO_MIN_SCORE: Final = 0.5


@functools.cache
def presidio_engine() -> AnalyzerEngine:
    """Presidio's analyzer with pattern recognizers only, built once."""
    recognizers = [
        OfflineEmailRecognizer(),
        IbanRecognizer(),
        UsSsnRecognizer(),
        UkNinoRecognizer(),
        # Country recognizers default to their country's language; the text is analysed as one.
        EsNifRecognizer(supported_language="en"),
        EsNieRecognizer(supported_language="en"),
        ItFiscalCodeRecognizer(supported_language="en"),
        FiPersonalIdentityCodeRecognizer(supported_language="en"),
    ]
    registry = RecognizerRegistry(recognizers=recognizers, supported_languages=["en"])
    nlp_engine = NoOpNlpEngine(models=[{"lang_code": "en", "model_name": "none"}])
    return AnalyzerEngine(
        registry=registry,
        nlp_engine=nlp_engine,
        supported_languages=["en"],
        context_aware_enhancer=NoContextEnhancer(),
    )
