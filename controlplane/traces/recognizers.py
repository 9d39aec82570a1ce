"""Scrubbing recognizers built on libraries: Presidio's pattern recognizers, phonenumbers, detect-secrets.

Owns building those libraries' detectors once (lazily, on first use) and turning what they find
into spans ``(start, end, kind)`` over the text; ``controlplane.traces.scrub`` decides the order
and does the replacing. Nothing here touches the network or the disk at run time:

* Presidio's ``AnalyzerEngine`` runs with its no-op NLP engine (no spaCy model) and pattern
  recognizers only; its e-mail recognizer validates domains with ``tldextract``, which would
  fetch the public suffix list, so ours validates against tldextract's bundled snapshot with no
  cache directory and no suffix-list URLs.
* ``phonenumbers`` carries its metadata in the package.
* detect-secrets' plugins are used for their regular expressions only (never ``verify``).

Speed: each library is called only when a cheap test says it could find something (an ``@``, an
IBAN- or id-shaped group of digits, a separated run of 7-15 digits the scrubber's own phone rules
left, a vendor's literal prefix), and Presidio reads only the words around those places: its
analyzer costs ~0.1 ms a call and its e-mail pattern ~1 ms per KB of code-like text, and
phonenumbers ~0.05 ms per region tried.
"""

from __future__ import annotations

import bisect
import enum
import re
from collections.abc import Iterator
from typing import Any, Final

import phonenumbers
from detect_secrets.plugins import (
    artifactory,
    aws,
    azure_storage_key,
    discord,
    github_token,
    gitlab_token,
    jwt,
    mailchimp,
    npm,
    openai,
    pypi_token,
    sendgrid,
    slack,
    square_oauth,
    stripe,
    telegram_token,
    twilio,
)


class Kind(enum.StrEnum):
    """What a library recognizer found; the scrubber maps it to its own entity."""

    email = "email"
    phone = "phone"
    iban = "iban"
    national_id = "national_id"
    secret = "secret"


Span = tuple[int, int, Kind]

# ---- Presidio ----------------------------------------------------------------------------------


_PRESIDIO_KINDS: Final = {
    "EMAIL_ADDRESS": Kind.email,
    "IBAN_CODE": Kind.iban,
    "US_SSN": Kind.national_id,
    "UK_NINO": Kind.national_id,
    "ES_NIF": Kind.national_id,
    "ES_NIE": Kind.national_id,
    "IT_FISCAL_CODE": Kind.national_id,
    "FI_PERSONAL_IDENTITY_CODE": Kind.national_id,
}
# Presidio reads only the words around a place where the rough shape of an IBAN or a national id
# occurs, found in one scan that starts at digits only (a class the regex engine skips to quickly);
# shapes that start with letters are found from their first digit, looking back.
_ID_HINT = re.compile(
    r"\d(?:"
    r"(?<=[A-Z]{2}\d)\d"  # IBAN: country code, check digits
    r"|(?<=[X-Z]\d)\d{6}-?[A-Z]"  # Spanish NIE
    r"|\d{2}[- .]\d{2}[- .]\d{4}"  # US SSN
    r"|\d ?\d{2} ?\d{2} ?[A-Da-d]\b"  # UK NINO
    r"|\d{6}-?[A-Z]"  # Spanish NIF
    r"|\d[A-Za-z]\d{2}[A-Za-z]\d{3}[A-Za-z]"  # Italian codice fiscale
    r"|\d{5}[-+A-FU-Y]\d{3}"  # Finnish henkilötunnus
    r")",
    re.ASCII,
)
_ID_ENTITIES: Final = tuple(name for name in _PRESIDIO_KINDS if name != "EMAIL_ADDRESS")
_TWO_DIGITS: Final = re.compile(r"\d\d", re.ASCII)
_NUMBER_BEFORE: Final = re.compile(r"\d[.,]$|[.]$", re.ASCII)
_NUMBER_AFTER: Final = re.compile(r"[+-]\d|[.,]\d", re.ASCII)
# How far from a hint Presidio looks: an address's local part (64) and domain (255); an id's
# groups and separators.
_EMAIL_REACH: Final = 255
_ID_LEAD: Final = 8  # letters before an id's first digit: "GB82", "RSSMRA85", "AB 12"
_ID_REACH: Final = 48  # an IBAN with its spaces runs to 42 characters


def _window(text: str, start: int, end: int, reach: int, limit: int) -> tuple[int, int]:
    """``start:end`` widened by ``reach`` characters each way, then on to the whitespace around
    it (at most ``limit`` characters each way in all), so no word is cut in two."""
    start, end = max(0, start), min(len(text), end)
    low, high = max(0, start - limit), min(len(text), end + limit)
    inner_start, inner_end = max(low, start - reach), min(high, end + reach)
    before = max(text.rfind(" ", low, inner_start), text.rfind("\n", low, inner_start))
    after = [i for i in (text.find(" ", inner_end, high), text.find("\n", inner_end, high)) if i >= 0]
    return (before + 1 if before >= 0 else low), (min(after) if after else high)


def presidio_spans(text: str) -> list[Span]:
    """E-mail addresses, IBANs and national ids Presidio's pattern recognizers find in ``text``.

    Presidio reads only the words around each place a rough shape occurs, joined by newlines,
    not the whole text: its e-mail pattern alone costs ~1 ms per KB of code-like text.
    """
    entities: set[str] = set()
    windows: list[tuple[int, int]] = []
    at = text.find("@")
    while at >= 0:
        entities.add("EMAIL_ADDRESS")
        windows.append(_window(text, at, at + 1, 0, _EMAIL_REACH))
        at = text.find("@", windows[-1][1])
    if _TWO_DIGITS.search(text) is not None:
        for match in _ID_HINT.finditer(text):
            entities.update(_ID_ENTITIES)
            windows.append(_window(text, match.start() - _ID_LEAD, match.end(), _ID_REACH, 2 * _ID_REACH))
    if not entities:
        return []
    windows.sort()
    merged: list[list[int]] = []
    for start, end in windows:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    pieces, offsets = [], []  # offsets: (start in the analysed text, start in ``text``)
    position = 0
    for start, end in merged:
        offsets.append((position, start))
        pieces.append(text[start:end])
        position += end - start + 1
    analysed = "\n".join(pieces)
    # Imported on first use: Presidio pulls in spaCy (~1.5 s), which a process that never scrubs
    # (a worker, the CLI) should not pay for at start.
    from controlplane.traces.presidio_engine import PRESIDIO_MIN_SCORE, presidio_engine

    results = presidio_engine().analyze(
        analysed, language="en", entities=sorted(entities), score_threshold=PRESIDIO_MIN_SCORE
    )
    spans: list[Span] = []
    for result in results:
        index = bisect.bisect_right(offsets, result.start, key=lambda offset: offset[0]) - 1
        shift = offsets[index][1] - offsets[index][0]
        start, end = result.start + shift, result.end + shift
        kind = _PRESIDIO_KINDS[result.entity_type]
        if kind is Kind.national_id and _inside_a_number(text, start, end):
            continue
        spans.append((start, end, kind))
    return spans


def _inside_a_number(text: str, start: int, end: int) -> bool:
    """Whether an id-shaped match is part of a decimal or a float: ``1.38435736E+8``."""
    before = text[max(0, start - 2) : start]
    after = text[end : end + 2]
    return bool(_NUMBER_BEFORE.search(before) or _NUMBER_AFTER.match(after))


# ---- phonenumbers ------------------------------------------------------------------------------

# Regions tried for numbers written in national format, by how the number starts: with the trunk
# prefix 0, with an area code in parentheses, or with neither (North American and Indian mobiles).
_TRUNK_ZERO_REGIONS: Final = ("GB", "DE", "FR", "IN", "JP", "AU", "BR", "KR", "IT", "ES", "NL")
_PARENTHESES_REGIONS: Final = ("US", "BR", "AU", "GB", "DE")
_NO_PREFIX_REGIONS: Final = ("US", "IN", "BR", "IT", "ES")

# The characters people put between digit groups: spaces (incl. no-break and thin), hyphens and
# dashes (incl. non-breaking hyphen, en dash), dots, slashes, parentheses.
SEPARATORS: Final = " \u00a0\u2009\u202f.\u2010\u2011\u2012\u2013\u2014/()-"
_SEPARATOR_CLASS: Final = re.escape(SEPARATORS)
# A candidate is a whole run of digit groups (not a window into a longer run: a list of numbers
# or a hex dump is not a phone number), 7-15 digits counted afterwards.
_CANDIDATE = re.compile(
    rf"[+(\d](?<![\w.+/].)(?<!\w-.)(?<!\d[{_SEPARATOR_CLASS}].)(?:(?<=[+(])\d|(?<=\d))\d{{0,14}}\)?"
    rf"(?:(?:[{_SEPARATOR_CLASS}]|(?<=\)))\(?\d{{1,5}}\)?){{0,6}}(?!\w)(?![{_SEPARATOR_CLASS}]?\d)",
    re.ASCII,
)
_HAS_SEPARATOR = re.compile(rf"\d[{_SEPARATOR_CLASS}]+\d", re.ASCII)
# Dates and times are the commonest separated digit runs in logs and code.
_DATE_LIKE = re.compile(
    r"\d{4}[-/.]\d{1,2}[-/.]\d{1,2}|\d{1,2}[-/.]\d{1,2}[-/.]\d{2,4}(?!\d)|\d{1,2}\.\d{1,2}\.\d{1,2}", re.ASCII
)


_OTHER_SEPARATOR = re.compile(r"[^\d.]", re.ASCII)
_DOTTED_QUAD = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}", re.ASCII)  # addresses, netmasks, versions


def _is_dotted_quad(candidate: str) -> bool:
    """An address, a netmask or a version: four dotted groups of at most 255 (12.367.99.58 is a
    phone number written with dots)."""
    return _DOTTED_QUAD.fullmatch(candidate) is not None and all(int(g) <= 255 for g in candidate.split("."))


_VALIDATIONS_BASE: Final = 64
_CHARACTERS_PER_VALIDATION: Final = 256


def _regions_for(candidate: str) -> tuple[str | None, ...]:
    if candidate.startswith("+"):
        return (None,)
    if candidate.startswith("00"):
        return ("DE",)  # 00 is the international prefix across Europe and most of the world
    if candidate.startswith("("):
        return _PARENTHESES_REGIONS
    if candidate.startswith("0"):
        return _TRUNK_ZERO_REGIONS
    return _NO_PREFIX_REGIONS


def phone_spans(text: str, *, phone_word_before: Any = None) -> list[Span]:
    """Phone numbers ``phonenumbers`` validates for one of several regions.

    Numbers in national format must be written with separators (a bare run of digits is as likely
    an id or a constant) unless ``phone_word_before(text, start)`` says a phone word precedes it.

    Validating costs ~0.1-0.3 ms a candidate, so a text gets a budget of validations in
    proportion to its length; past it, phone-shaped candidates are replaced unvalidated (only
    text built to be slow gets there, and replacing too much is the safe side).
    """
    spans: list[Span] = []
    budget = _VALIDATIONS_BASE + len(text) // _CHARACTERS_PER_VALIDATION
    seen: dict[str, bool] = {}  # a number repeated in the text is validated once
    for match in _CANDIDATE.finditer(text):
        candidate = match.group()
        if not 7 <= sum(char.isdigit() for char in candidate) <= 15:
            continue
        international = candidate.startswith(("+", "00"))
        if not international and (_DATE_LIKE.search(candidate) or _is_dotted_quad(candidate)):
            continue
        if candidate.count(".") == 1 and not _OTHER_SEPARATOR.search(candidate):
            continue  # a decimal number: 86087.7578
        separated = _HAS_SEPARATOR.search(candidate) is not None
        if (
            not international
            and not separated
            and not (phone_word_before is not None and phone_word_before(text, match.start()))
        ):
            continue
        valid = seen.get(candidate)
        if valid is None:
            budget -= 1
            valid = seen[candidate] = budget < 0 or _valid_somewhere(candidate)
        if valid:
            spans.append((match.start(), match.end(), Kind.phone))
    return spans


def _valid_somewhere(candidate: str) -> bool:
    # Not cached across calls: a process-wide cache would keep callers' phone numbers in memory.
    for region in _regions_for(candidate):
        try:
            number = phonenumbers.parse(candidate, region)
        except phonenumbers.NumberParseException:
            continue
        if phonenumbers.is_valid_number(number):
            return True
    return False


# ---- detect-secrets ----------------------------------------------------------------------------

_SECRET_PLUGINS: Final = (
    artifactory.ArtifactoryDetector(),
    aws.AWSKeyDetector(),
    azure_storage_key.AzureStorageKeyDetector(),
    discord.DiscordBotTokenDetector(),
    github_token.GitHubTokenDetector(),
    gitlab_token.GitLabTokenDetector(),
    jwt.JwtTokenDetector(),
    mailchimp.MailchimpDetector(),
    npm.NpmDetector(),
    openai.OpenAIDetector(),
    pypi_token.PypiTokenDetector(),
    sendgrid.SendGridDetector(),
    slack.SlackDetector(),
    square_oauth.SquareOAuthDetector(),
    stripe.StripeDetector(),
    telegram_token.TelegramBotTokenDetector(),
    twilio.TwilioKeyDetector(),
)
# Some plugins' patterns take the delimiter around the token too (``(?:\s|=|:|"|^)AKC...``).
_DELIMITERS: Final = " \t\r\n=:\"'"
# Plugins whose first group is the credential (elsewhere groups only pick a prefix such as ghp).
_VALUE_IN_GROUP_PLUGINS: Final = (aws.AWSKeyDetector, npm.NpmDetector)
_TOKEN_CHARACTERS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=_-")
_JWT_CHARACTERS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.+/=")


# Each plugin's patterns run only when the text holds one of its literal parts (a substring test
# is far cheaper than a pattern, and most patterns start with a class or an alternation, which
# makes the regex engine try every position), or, where no literal is long enough, a prefilter
# pattern that starts with a literal.
_SECRET_PREFILTERS: Final[dict[type, tuple[str, ...] | re.Pattern[str]]] = {
    artifactory.ArtifactoryDetector: re.compile(r"A(?:KC[a-zA-Z0-9]{10}|P[0-9A-F][a-zA-Z0-9]{8})", re.ASCII),
    aws.AWSKeyDetector: ("A3T", "ABIA", "ACCA", "AKIA", "ASIA", "aws"),
    azure_storage_key.AzureStorageKeyDetector: ("AccountKey=",),
    discord.DiscordBotTokenDetector: re.compile(r"\.[a-zA-Z0-9_-]{6}\.[a-zA-Z0-9_-]{27}", re.ASCII),
    github_token.GitHubTokenDetector: ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
    gitlab_token.GitLabTokenDetector: ("glpat-", "gldt-", "glft-", "glsoat-", "glrt-", "GR1348941", "glcbt-",
                                       "glimt-", "glptt-", "glagent-", "gloas-"),
    jwt.JwtTokenDetector: ("eyJ",),
    mailchimp.MailchimpDetector: ("-us",),
    npm.NpmDetector: ("_authToken",),
    openai.OpenAIDetector: ("T3BlbkFJ",),
    pypi_token.PypiTokenDetector: ("pypi-",),
    sendgrid.SendGridDetector: ("SG.",),
    slack.SlackDetector: ("xox", "hooks.slack.com"),
    square_oauth.SquareOAuthDetector: ("sq0csp-",),
    stripe.StripeDetector: ("k_live_",),
    telegram_token.TelegramBotTokenDetector: re.compile(r":[0-9A-Za-z_-]{35}", re.ASCII),
    twilio.TwilioKeyDetector: ("AC", "SK"),
}  # fmt: skip


def _secret_matches() -> Iterator[tuple[Any, re.Pattern[str]]]:
    for plugin in _SECRET_PLUGINS:
        for pattern in plugin.denylist:
            yield plugin, pattern


_SECRET_PATTERNS: Final = tuple(_secret_matches())


def _may_match(plugin: Any, text: str) -> bool:
    prefilter = _SECRET_PREFILTERS[type(plugin)]
    if isinstance(prefilter, re.Pattern):
        return prefilter.search(text) is not None
    return any(hint in text for hint in prefilter)


def secret_spans(text: str) -> list[Span]:
    """Credentials detect-secrets' vendor plugins recognise by shape (their regular expressions)."""
    spans: list[Span] = []
    possible = [plugin for plugin in _SECRET_PLUGINS if _may_match(plugin, text)]
    for plugin, pattern in _SECRET_PATTERNS:
        if plugin not in possible:
            continue
        value_group = 1 if isinstance(plugin, _VALUE_IN_GROUP_PLUGINS) and pattern.groups else 0
        for match in pattern.finditer(text):
            start, end = match.span(value_group)
            if start < 0:
                continue
            if isinstance(plugin, jwt.JwtTokenDetector):
                if not plugin.is_formally_valid(match.group()):
                    continue
                while end < len(text) and text[end] in _JWT_CHARACTERS:
                    end += 1  # the plugin's pattern stops lazily before the signature
            while start < end and text[start] in _DELIMITERS:
                start += 1
            while end > start and text[end - 1] in _DELIMITERS:
                end -= 1
            # Fixed-length patterns (Azure's 88 characters) stop inside a longer token: the token
            # goes whole (base64 padding included), or its tail would be left in the text.
            while end > start and end < len(text) and text[end] in _TOKEN_CHARACTERS:
                end += 1
            if end > start:
                spans.append((start, end, Kind.secret))
    return spans
