"""Surrogates for scrubbed personal data: fake values of the same shape, consistent within a trace.

Owns ``Surrogates``, the map from each real value the scrubber found in one trace (prompt,
completion and category together) to the fake value written in its place. A drafter trained on
scrubbed traces should learn the *form* of what the target writes (an address, a card number in
groups of four, a phone number in its country's format), which a typed placeholder such as
``<EMAIL>`` hides, without ever seeing the real values. So each surrogate keeps the shape:

* e-mail: the local part's words become names (a first name, then last names; a one- or
  two-letter word stays an initial), digits other digits, punctuation stays; the domain stays
  when it is a public mailbox provider or a documentation domain (it names nobody), otherwise
  its labels become pronounceable words of the same length and its public suffix
  (``.co.uk``) stays. A local-part word the trace also writes as a name (``Sara Cohen`` beside
  ``sara.cohen@...``) stays, since names are not scrubbed and the link between a person and
  their address is what a target follows; such an address always gets another domain;
* phone: the ``+``/``00`` and country calling code, a trunk ``0`` and every separator stay; the
  other digits are drawn anew;
* card: the same length and grouping, the same first digit (the network), fresh digits and a
  check digit that passes Luhn;
* IBAN: the same country, length and spacing, fresh account characters and valid check digits;
* IP address: an IPv4 address in the same kind of block (private stays private), an IPv6 address
  with the same groups and zone;
* national id: the same format (US SSN, UK NINO, Spanish NIF/NIE, Italian codice fiscale,
  Finnish henkilötunnus) with a valid check character where the format has one;
* secret: every letter another of the same case, every digit another digit; vendor prefixes
  (``sk-proj-``, ``ghp_``, ``AKIA``, ``eyJ``) and PEM armour lines stay.

Each surrogate is drawn from a generator seeded by HMAC-SHA256 of the value under the trace's
key, so the same value always gets the same surrogate within a trace and the value cannot be
recovered from the surrogate without the key. The service gives every trace a fresh random key
that is never stored: surrogates are unlinkable across traces, and nobody (the operator
included) can test a guessed value against a stored surrogate. A surrogate is re-drawn until it
is none of the trace's real values, none of the words of the trace's original text and not
already another value's surrogate, each compared without separators or case.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import random
import re
import secrets
from collections.abc import Callable, Iterable
from typing import Final

import phonenumbers

_VOWELS: Final = "aeiou"
_CONSONANTS: Final = "bcdfghjklmnprstvwz"
_HEX: Final = "0123456789abcdef"
_UPPER: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_LOWER: Final = "abcdefghijklmnopqrstuvwxyz"
_DIGITS: Final = "0123456789"

# Mailbox providers and documentation domains: the domain alone names nobody, and keeping it keeps
# what a drafter can learn to predict (``@gmail.com``).
_SHARED_MAIL_DOMAINS: Final = frozenset(
    {
        "gmail.com", "googlemail.com", "outlook.com", "hotmail.com", "live.com", "msn.com",
        "yahoo.com", "yahoo.co.uk", "yahoo.co.jp", "yahoo.fr", "yahoo.de", "yahoo.com.br",
        "icloud.com", "me.com", "mac.com", "aol.com", "proton.me", "protonmail.com", "pm.me",
        "gmx.de", "gmx.net", "gmx.com", "web.de", "t-online.de", "mail.ru", "yandex.ru", "ya.ru",
        "qq.com", "163.com", "126.com", "naver.com", "daum.net", "orange.fr", "free.fr",
        "laposte.net", "libero.it", "virgilio.it", "wp.pl", "o2.pl", "seznam.cz", "zoho.com",
        "fastmail.com", "tutanota.com", "mail.com", "example.com", "example.org", "example.net",
    }
)  # fmt: skip
_RESERVED_SUFFIXES: Final = (".example", ".test", ".invalid", ".localhost")
_VENDOR_PREFIX = re.compile(
    r"(?:sk-(?:proj-|ant-(?:api\d\d-)?)?|[rsp]k_(?:live|test)_|whsec_|gh[pousr]_|github_pat_|glpat-"
    r"|xox[abposr]-|AKIA|ASIA|AIza|hf_|npm_|pypi-|SG\.|eyJ|SK|AC)",
)
_LETTER_RUN = re.compile(r"[^\W\d_]+")
_NAME_WORD = re.compile(r"\b[A-Z][a-z]{2,}\b")
_LOCAL_PIECES = re.compile(r"[^\W\d_]+|\d+|[^\w]|_")
# Common first and last names of many countries, ASCII: what a fake address's local part is made
# of, so that it tokenises like the names people's addresses are made of.
_FIRST_NAMES: Final = tuple(
    """anna maria james olivia noah emma liam sofia lucas mia ethan chloe mateo aisha yuki omar lena ivan
    priya chen fatima diego hannah kofi elena tomas sara jonas amara leo nina rafael ines hugo zara
    david laura daniel julia michael sarah thomas lisa peter karen paul nora simon alice martin clara
    marco giulia luca francesca pierre camille louis manon carlos lucia pablo carmen jan eva piotr
    kasia lars ingrid erik astrid mehmet elif ali leila arjun ananya rahul kenji haruto sakura minjun
    jiwoo wei ming amina tunde chidi zainab joao beatriz felipe ana pedro rosa emil freja oscar""".split()
)
_LAST_NAMES: Final = tuple(
    """silva smith garcia muller rossi kim nguyen patel cohen okafor larsen novak tanaka costa dubois
    weber khan moreau jensen santos ivanova haddad fischer rahman lopez berg mensah ortiz sato varga
    johnson brown jones miller davis wilson taylor anderson thomas martin schmidt schneider meyer
    wagner becker bianchi romano colombo ricci bernard petit durand leroy fernandez gonzalez martinez
    sanchez perez kowalski nowak wojcik andersson johansson nielsen hansen yilmaz kaya demir sharma
    singh gupta suzuki takahashi watanabe park lee choi wang zhang liu chen yang adeyemi okeke bello
    oliveira souza pereira lima ferreira virtanen korhonen murphy kelly walsh""".split()
)
_IPV4_TAIL = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}$", re.ASCII)


def _word(rng: random.Random, length: int) -> str:
    """A pronounceable lower-case pseudo-word: consonants and vowels alternating."""
    vowel = rng.random() < 0.3
    letters = []
    for _ in range(length):
        letters.append(rng.choice(_VOWELS if vowel else _CONSONANTS))
        vowel = not vowel
    return "".join(letters)


def _like(text: str, rng: random.Random) -> str:
    """Every letter another of the same case, every digit another digit; the rest stays."""
    out = []
    for char in text:
        if char.isdigit():
            out.append(rng.choice(_DIGITS))
        elif char.isupper():
            out.append(rng.choice(_UPPER))
        elif char.isalpha():
            out.append(rng.choice(_LOWER))
        else:
            out.append(char)
    return "".join(out)


def _words_like(text: str, rng: random.Random) -> str:
    """Runs of letters become pseudo-words of the same length (capitalised where they were)."""

    def word(match: re.Match[str]) -> str:
        run = match.group()
        made = _word(rng, len(run))
        if run.isupper() and len(run) > 1:
            return made.upper()
        return made.capitalize() if run[0].isupper() else made

    return _LETTER_RUN.sub(word, "".join(rng.choice(_DIGITS) if c.isdigit() else c for c in text))


@functools.cache
def _suffixes() -> object:
    # The public suffix list from tldextract's bundled snapshot (never fetched), as Presidio uses it.
    from controlplane.traces.presidio_engine import offline_suffixes

    return offline_suffixes()


def _email(value: str, rng: random.Random, names: frozenset[str] = frozenset()) -> str:
    local, _, domain = value.rpartition("@")
    folded = domain.lower()
    local_surrogate = _local_part(local, rng, names)
    # A local part that keeps a name the trace writes anyway must change domain to be no real value.
    keeps_name = any(piece.lower() in names for piece in _LOCAL_PIECES.findall(local))
    if keeps_name or (folded not in _SHARED_MAIL_DOMAINS and not folded.endswith(_RESERVED_SUFFIXES)):
        suffix = getattr(_suffixes()(domain), "suffix", "")  # type: ignore[operator]
        if suffix and folded.endswith("." + suffix.lower()):
            head = domain[: -len(suffix) - 1]
            domain = _words_like(head, rng) + domain[-len(suffix) - 1 :]
        else:
            domain = _words_like(domain, rng)
    return f"{local_surrogate}@{domain}"


def _local_part(local: str, rng: random.Random, names: frozenset[str] = frozenset()) -> str:
    """Names for names: ``jane.doe`` becomes another first and last name, ``j.doe`` an initial and
    a last name; other words and digits are drawn like the rest (``_words_like``). A word the
    trace also writes as a name (``Jane``, in ``names``) stays: the address still belongs to the
    person the text names, and the name is in the stored text anyway."""
    out = []
    words = 0
    for piece in _LOCAL_PIECES.findall(local):
        if piece.lower() in names:
            out.append(piece)
            words += 1
            continue
        if not _LETTER_RUN.fullmatch(piece) or len(piece) < 3:
            out.append(_words_like(piece, rng) if piece[0].isalnum() else piece)
            if piece[0].isalpha():
                words += 1
            continue
        name = rng.choice(_FIRST_NAMES if words == 0 else _LAST_NAMES)
        words += 1
        out.append(name.upper() if piece.isupper() else name.capitalize() if piece[0].isupper() else name)
    return "".join(out)


def _kept_phone_digits(value: str) -> int:
    """How many leading digits of a phone number stay: its country calling code or trunk 0."""
    digits = "".join(char for char in value if char.isdigit())
    if value.startswith("+") or value.startswith("00"):
        international = digits[2:] if value.startswith("00") else digits
        # Calling codes are prefix-free: the first 1-3 digits that name one are the code.
        code = next(
            (n for n in (1, 2, 3) if int(international[:n] or 0) in phonenumbers.COUNTRY_CODE_TO_REGION_CODE),
            1,
        )
        return code + (2 if value.startswith("00") else 0)
    if digits.startswith("0"):
        return 1
    if digits.startswith("1") and len(digits) == 11:
        return 1  # North American 1-800-...
    return 0


def _phone(value: str, rng: random.Random) -> str:
    keep = _kept_phone_digits(value)
    out, seen = [], 0
    for char in value:
        if not char.isdigit():
            out.append(char)
            continue
        if seen < keep:
            out.append(char)
        elif seen == keep:
            out.append(rng.choice("23456789"))  # never a second trunk or service prefix
        else:
            out.append(rng.choice(_DIGITS))
        seen += 1
    return "".join(out)


def luhn_check_digit(payload: str) -> str:
    """The digit that makes ``payload + digit`` pass the Luhn checksum."""
    total = 0
    for position, char in enumerate(reversed(payload)):
        value = ord(char) - 48
        if position % 2 == 0:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return str((10 - total % 10) % 10)


def _card(value: str, rng: random.Random) -> str:
    digits = [char for char in value if char.isdigit()]
    payload = digits[0] + "".join(rng.choice(_DIGITS) for _ in digits[1:-1])
    fresh = iter(payload + luhn_check_digit(payload))
    return "".join(next(fresh) if char.isdigit() else char for char in value)


def iban_check_digits(country: str, bban: str) -> str:
    """ISO 13616 check digits: the IBAN read as a number is 1 modulo 97."""
    number = "".join(str(int(char, 36)) for char in bban + country + "00")
    return f"{98 - int(number) % 97:02d}"


def _iban(value: str, rng: random.Random) -> str:
    compact = [char for char in value if not char.isspace()]
    country = "".join(compact[:2]).upper()
    bban = _like("".join(compact[4:]), rng).upper()
    fresh = iter(country + iban_check_digits(country, bban) + bban)
    return "".join(char if char.isspace() else next(fresh) for char in value)


_PRIVATE_V4: Final = (
    ipaddress.IPv4Network("10.0.0.0/8"),
    ipaddress.IPv4Network("172.16.0.0/12"),
    ipaddress.IPv4Network("192.168.0.0/16"),
    ipaddress.IPv4Network("100.64.0.0/10"),
)


def _ipv4(value: str, rng: random.Random) -> str:
    address = ipaddress.IPv4Address(value)
    for network in _PRIVATE_V4:
        if address in network:
            host = rng.randrange(1, network.num_addresses - 1)
            return str(network.network_address + host)
    while True:  # a public unicast address
        candidate = ipaddress.IPv4Address(rng.randrange(1 << 24, 224 << 24))
        if candidate.is_global:
            return str(candidate)


def _ip(value: str, rng: random.Random) -> str:
    if ":" not in value:
        return _ipv4(value, rng)
    address, zone, zone_id = value.partition("%")
    tail = _IPV4_TAIL.search(address)
    head = address[: tail.start()] if tail else address
    groups = head.split(":")
    # Link-local and unique-local prefixes say what kind of address it is, not whose.
    keep_first = groups[0].lower().startswith(("fe8", "fc", "fd")) or groups[0].lower() == ""
    rewritten = [
        group if (index == 0 and keep_first) or not group else "".join(rng.choice(_HEX) for _ in group)
        for index, group in enumerate(groups)
    ]
    if rewritten and rewritten[0] and rewritten[0][0] == "0" and len(rewritten[0]) > 1:
        rewritten[0] = rng.choice("23") + rewritten[0][1:]
    out = ":".join(rewritten) + (_ipv4(tail.group(), rng) if tail else "")
    return out + (zone + zone_id if zone else "")


def _secret(value: str, rng: random.Random) -> str:
    if value.startswith("-----BEGIN"):
        lines = value.split("\n")
        return "\n".join(line if line.startswith("-----") else _like(line, rng) for line in lines)
    prefix = _VENDOR_PREFIX.match(value)
    kept = prefix.group() if prefix else ""
    return kept + _like(value[len(kept) :], rng)


# Keyed by the scrubber's entity names (``controlplane.traces.scrub.Entity`` values).
# ---- national ids: the same format with a valid check character where the format has one --------

_SSN = re.compile(r"\d{3}([- ]?)\d{2}\1\d{4}", re.ASCII)
_NINO = re.compile(r"[A-Z]{2}( ?)\d{2}\1\d{2}\1\d{2}\1[A-D]", re.ASCII)
_NIF = re.compile(r"\d{8}-?[A-Z]", re.ASCII)
_NIE = re.compile(r"[XYZ]-?\d{7}-?[A-Z]", re.ASCII)
_CODICE_FISCALE = re.compile(r"[A-Z]{6}\d{2}[A-EHLMPR-T]\d{2}[A-Z]\d{3}[A-Z]", re.ASCII)
_HETU = re.compile(r"\d{6}[-+A-FU-Y]\d{3}[0-9A-Y]", re.ASCII)
_DNI_LETTERS: Final = "TRWAGMYFPDXBNJZSQVHLCKE"
_HETU_CHECKS: Final = "0123456789ABCDEFHJKLMNPRSTUVWXY"
_NINO_FIRST: Final = "ABCEGHJKLMNOPRSTWXYZ"
_NINO_SECOND: Final = "ABCEGHJKLMNPRSTWXYZ"
# Italian codice fiscale check character: odd positions (1st, 3rd, ...) and even ones weigh
# characters differently; digits weigh as the letter of the same index.
_CF_ODD: Final = (
    1,
    0,
    5,
    7,
    9,
    13,
    15,
    17,
    19,
    21,
    2,
    4,
    18,
    20,
    11,
    3,
    6,
    8,
    12,
    14,
    16,
    10,
    22,
    25,
    24,
    23,
)


def _digits(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(_DIGITS) for _ in range(count))


def _ssn(value: str, rng: random.Random) -> str:
    shape = _SSN.fullmatch(value)
    separator = shape[1] if shape else "-"
    area = rng.choice([n for n in range(1, 900) if n != 666])
    return f"{area:03d}{separator}{rng.randint(1, 99):02d}{separator}{rng.randint(1, 9999):04d}"


def _nino(value: str, rng: random.Random) -> str:
    shape = _NINO.fullmatch(value)
    space = shape[1] if shape else ""
    digits = _digits(rng, 6)
    prefix = rng.choice(_NINO_FIRST) + rng.choice(_NINO_SECOND)
    return space.join([prefix, digits[:2], digits[2:4], digits[4:], rng.choice("ABCD")])


def _nif(value: str, rng: random.Random) -> str:
    number = _digits(rng, 8)
    return number + ("-" if "-" in value else "") + _DNI_LETTERS[int(number) % 23]


def _nie(value: str, rng: random.Random) -> str:
    first, number = rng.choice("XYZ"), _digits(rng, 7)
    letter = _DNI_LETTERS[int(str("XYZ".index(first)) + number) % 23]
    dash = "-" if "-" in value else ""
    return f"{first}{dash}{number}{dash}{letter}"


def _codice_fiscale(value: str, rng: random.Random) -> str:
    consonants = _CONSONANTS.upper()
    # Surname and name are coded as consonants first; the place as a cadastral letter and number.
    body = (
        "".join(rng.choice(consonants) + rng.choice(consonants) + rng.choice(_UPPER) for _ in range(2))
        + _digits(rng, 2)
        + rng.choice("ABCDEHLMPRST")
        + f"{rng.randint(1, 28) + rng.choice((0, 40)):02d}"
        + rng.choice("ABCDEFGHILM")
        + str(rng.randint(1, 9))
        + _digits(rng, 2)
    )
    total = 0
    for position, char in enumerate(body):
        index = int(char) if char.isdigit() else ord(char) - 65
        total += _CF_ODD[index] if position % 2 == 0 else index
    return body + chr(65 + total % 26)


def _hetu(value: str, rng: random.Random) -> str:
    date = f"{rng.randint(1, 28):02d}{rng.randint(1, 12):02d}{_digits(rng, 2)}"
    serial = f"{rng.randint(2, 899):03d}"
    return date + value[6] + serial + _HETU_CHECKS[int(date + serial) % 31]


_NATIONAL_IDS: Final = (
    (_SSN, _ssn),
    (_NINO, _nino),
    (_NIF, _nif),
    (_NIE, _nie),
    (_CODICE_FISCALE, _codice_fiscale),
    (_HETU, _hetu),
)


def _national_id(value: str, rng: random.Random) -> str:
    for shape, make in _NATIONAL_IDS:
        if shape.fullmatch(value):
            return make(value, rng)
    return _like(value, rng)


_MAKERS: Final[dict[str, Callable[[str, random.Random], str]]] = {
    "email": _email,
    "phone": _phone,
    "credit_card": _card,
    "iban": _iban,
    "ip_address": _ip,
    "secret": _secret,
    "national_id": _national_id,
}
_MAX_DRAWS: Final = 64


class Surrogates:
    """The surrogates of one trace: the same real value always gets the same fake one.

    ``texts`` are the trace's original texts, and ``real_values`` every value found in them: no
    surrogate equals a real value or a word of those texts.
    """

    def __init__(self, *, texts: Iterable[str], real_values: Iterable[str], key: bytes | None = None):
        self._key = key if key is not None else secrets.token_bytes(32)
        # Whole words of the texts, not every substring: a search of the text per surrogate would
        # make a text of many entities quadratic.
        # Capitalised words of the texts: the names an address's local part may spell.
        self._names = frozenset(word.lower() for text in texts for word in _NAME_WORD.findall(text))
        self._words = frozenset(_normal(word) for text in texts for word in text.split())
        self._real = frozenset(_normal(value) for value in real_values)
        self._given: dict[tuple[str, str], str] = {}
        self._used: set[str] = set()

    def surrogate(self, kind: str, value: str) -> str:
        """The fake value written in place of ``value`` (an entity of ``kind``), drawn once per trace."""
        given = self._given.get((kind, value))
        if given is not None:
            return given
        make = _MAKERS[kind]
        if kind == "email":
            make = functools.partial(_email, names=self._names)
        candidate = value
        for draw in range(_MAX_DRAWS):
            message = f"{kind}\0{value}\0{draw}".encode()
            seed = hmac.new(self._key, message, hashlib.sha256).digest()
            candidate = make(value, random.Random(seed))
            if self._acceptable(candidate):
                break
        else:
            # Only a value too short to have 64 shapes gets here ("a@b.io" has thousands): its
            # last draw is kept if it is at least not a real value, else every character goes.
            if _normal(candidate) in self._real or candidate == value:
                candidate = "x" * len(value)
        self._given[(kind, value)] = candidate
        self._used.add(_normal(candidate))
        return candidate

    def _acceptable(self, candidate: str) -> bool:
        normal = _normal(candidate)
        return not (normal in self._real or normal in self._used or normal in self._words)


def _normal(value: str) -> str:
    """A value without its separators and case: 4111 1111 1111 1111 is 4111-1111-1111-1111."""
    return "".join(char for char in value.casefold() if char.isalnum())
