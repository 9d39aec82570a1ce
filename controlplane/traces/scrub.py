"""Personal-data scrubbing of trace text: surrogates of the same shape instead of the personal data.

Owns ``scrub_trace(texts) -> [Scrubbed]`` (a trace's prompt, completion and category together) and
``scrub(text)``, the only gate between caller-supplied text and the ``traces`` table, and this
project's own recognizers (regular expressions compiled once at import). The library recognizers
(Presidio's pattern recognizers, ``phonenumbers``, detect-secrets' plugins) live in
``controlplane.traces.recognizers``; the surrogates in ``controlplane.traces.surrogates``; nothing
here or there does I/O.

Each entity found is replaced by a fake value of the same shape (a fake address for an address,
a card number in the same grouping that passes Luhn, a phone number in the same format), the same
fake value for the same real one everywhere in the trace: a drafter trained on scrubbed traces
learns the form of what the target writes, which a ``<EMAIL>`` placeholder hid, without seeing
the real values. ``Scrubbed.replacements`` says where each entity was in the original text.

What is found, in this order (each stage sees the text with what the earlier ones found masked,
at the same length so that offsets stay those of the original; a mask holds no digits, letters,
``@`` or token characters, so no later stage re-matches it; overlapping finds merge):

1. secrets (ours): PEM private-key blocks; the ``user:password`` of URLs, and a token as a
   URL's user (``https://ghp_...@github.com``: 12+ characters with a letter and a digit); the secret in the
   path of webhook URLs (``hooks.slack.com/services/...``, ``discord.com/api/webhooks/...``,
   ``.../webhookb2/...``, ``.../hooks/catch/...``; the host stays); tokens with a known vendor
   prefix (OpenAI/Anthropic ``sk-``, Stripe, GitHub, GitLab, Slack, AWS, Google, Hugging Face,
   npm, PyPI, SendGrid) and JWTs; the credential after ``Bearer``/``Basic``/``Token``; the value
   of a secret-named assignment (``password=...``, ``"api_key": "..."``, quoted values may hold
   spaces) and of environment variables that glue the word to a prefix (``PGPASSWORD=``,
   ``MYSQL_PWD=``, ``REDISCLI_AUTH=``, ``AWS_SECRET_ACCESS_KEY=``; an unquoted value runs to the
   next space, brackets included); passphrases (``passphrase: a few words``), passwords in
   prose (``the password is Tr0ub4dor&3``, ``password is "two words"``); ``user:password``
   outside URLs after a credential word (``curl -u``, ``login``, ``creds``) or when the password
   mixes a digit and a symbol. Scheme words, key names and hosts stay: the text keeps its shape.
2. secrets (detect-secrets): what its vendor plugins' patterns find that ours did not
   (Twilio, Telegram and Discord bot tokens, Azure storage keys, Square, Mailchimp, ...).
3. e-mail addresses, IBANs, national ids (Presidio): e-mail addresses, internationalised
   domains included; IBANs (checksum-validated, spaced or not); US SSNs, UK NINOs, Spanish
   NIF/NIE, Italian codici fiscali and Finnish henkilötunnus.
4. e-mail addresses (ours): addresses Presidio's suffix check rejects (``ops@corp.internal``).
5. IP addresses (ours): IPv6 (validated by ``ipaddress``) and IPv4 addresses.
6. payment cards (ours): 13-19 digits, optionally grouped by one kind of space (also
   no-break), dash or dot, that pass the Luhn check and start with 2-6 (every major network;
   this keeps epoch-millisecond timestamps, which start with 1, out); groups of 3-6 digits, or
   of four with a shorter last one (``4106 0762 3823 8``).
7. phone numbers (ours): ``+``/``00`` international numbers (8-15 digits); North American
   ``(415) 555-2671``/``415-555-2671``/``1-800-555-0199``; trunk-``0`` national numbers with
   separators (``020 7946 0958``, ``06 12 34 56 78``, ``030 1234567``); and any 7-15 digit number
   right after a phone word (``tel:``, ``phone``, ``call me at``, ``Telefon``, ``téléphone``,
   ``teléfono``, ``celular``, ``kontakt``, ...). Groups may be separated
   by spaces, no-break and thin spaces, hyphens, en dashes or dots.
8. phone numbers (phonenumbers): whole runs of digit groups our rules left that ``phonenumbers``
   validates for a region, chosen by how the number starts (``+``: any; trunk ``0``: GB, DE, FR,
   IN, JP, AU, BR, KR, IT, ES, NL; ``(``: US, BR, AU, GB, DE; else US, IN, BR, IT, ES), such as
   ``(11) 98765-4321`` or ``03-1234-5678``.
9. secrets (ours): any other long token (>= 20 chars) of lower, upper case and digits that
   reads as random rather than as words (class changes between neighbours, distinct characters).

Ours come first where they do better than the libraries: they keep key names and hosts (the
libraries replace whole URLs), handle dotted and no-break-spaced card numbers (Presidio's card
pattern does neither and matches across neighbouring numbers), and reject the near misses below.

Decided near misses, kept verbatim (the unit-test table pins each one):

* hex strings of any length (git SHAs, sha256 digests, ``0x7fffffff``, checksummed Ethereum-style
  addresses) and UUIDs: identifiers and hashes, not credentials; a hex secret is still caught
  with context (``api_key=...``, ``Bearer ...``);
* version numbers, dates, times, decimal numbers, order ids and other bare digit runs; four-part
  versions written after ``version``/``v``/``release``/``build``/``section``;
* loopback, unspecified, broadcast addresses and netmasks (``127.0.0.1``, ``0.0.0.0``, ``::1``,
  ``255.255.255.0``), and the blocks reserved for documentation (``192.0.2.0/24``,
  ``198.51.100.0/24``, ``203.0.113.0/24``, ``2001:db8::/32``): nobody's address, and what
  examples are full of; MAC addresses (not in scope); a dotted quad after a version word
  (``version``, ``build``, ``upgraded ... from``, ``1.2.3 to``) or an image or package name
  (``app:1.2.3.4``); numbers named as product or book ids (``ISBN``, ``EAN``, ``barcode``);
* card-length numbers that fail Luhn (and Luhn-valid ones starting with 0, 1, 7, 8, 9);
* unseparated national numbers without a phone word (``4155552671``: indistinguishable from a
  code constant such as ``2147483647``), also when ``phonenumbers`` calls them valid;
* 9-digit numbers without separators as SSNs (Presidio scores them "very weak" and needs context
  words, which its no-op NLP engine cannot see), and the SSNs published as samples
  (``123-45-6789``) or never issued (``000-``, ``666-``);
* code that *names* a secret without holding one: ``password = get_password()``,
  ``token = self.token``, ``password: str``, ``api_key=None``, ``max_tokens=256``,
  ``connect(password=password)``, ``{"token": " the"}`` (logprobs), placeholders such as
  ``$API_KEY`` or ``<your-key>``; prose about secrets (``the password is required``,
  ``the passphrase is never logged``); ``host:port``, ``image:tag`` and ``key:value`` pairs.

Known misses (heuristics, not a guarantee; the scrubber lowers exposure, retention bounds it):
a plain-word password after ``:`` or a spaced ``=`` (``password: letmein``, read as prose or
code) or in prose (``the password is swordfish``); bare national numbers listed with only spaces
between them (``020 7946 0958 020 ...``, read as one run of digit groups); ~10-20% of random
tokens of 20-24 characters with no name or vendor prefix; obfuscated emails (``jane at example
dot com``); national ids of countries not listed above; national numbers of countries without
a trunk ``0`` (Denmark, Norway, Poland, Mexico, ...) written with no phone word before them
(``21 93 32 75``, ``200 168 1484``): on the generated out-of-sample corpus (``bench/scrub.py``)
these are the misses, 11 of 161 phone numbers, and two four-part versions read as IP addresses
are its false positives.

Speed (CPU time, one core): ~0.7 ms for a typical 1 KB trace (0.3 ms before the libraries),
~2.3 MB/s on large texts (4 before). The libraries are called only when a cheap test passes (see
``controlplane.traces.recognizers``); Presidio is built on the first call (~0.1 s).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import ipaddress
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from controlplane.traces.recognizers import Kind, phone_spans, presidio_spans, secret_spans
from controlplane.traces.surrogates import Surrogates


class Entity(enum.StrEnum):
    """A kind of personal data."""

    email = "email"
    phone = "phone"
    credit_card = "credit_card"
    ip_address = "ip_address"
    secret = "secret"
    iban = "iban"
    national_id = "national_id"


@dataclass(frozen=True, slots=True)
class Replacement:
    """One entity found in a text: its span of the original text, its kind, the real value and
    the surrogate written in its place."""

    start: int
    end: int
    entity: Entity
    value: str
    surrogate: str


@dataclass(frozen=True, slots=True)
class Scrubbed:
    """Scrubbed text, how many entities of each kind were replaced (kinds found only), and each
    replacement with its span in the original text."""

    text: str
    counts: dict[Entity, int]
    replacements: tuple[Replacement, ...] = ()


_A = re.ASCII
_AI = re.ASCII | re.IGNORECASE

# Speed: CPython's regex engine skips ahead quickly only when a pattern starts with a literal or a
# character class; a leading lookbehind or alternation makes it try every position (3-5x
# slower). So most patterns consume their first character and only then look behind it with
# ``X(?<![class].)`` ("X is not preceded by class"), and rare rules run only when a cheap
# substring hint is present. The same lookbehinds keep every scan linear: no pattern may start
# again inside a run it already rejected.

# ---- secrets with an unmistakable shape ------------------------------------------------------

_PEM = re.compile(
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"
    # A block cut off by a length limit is still a key: run to the END line or the base64's end.
    r"(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----|[A-Za-z0-9+/=\s]*)",
    re.DOTALL | _A,
)
# scheme://user:password@host: the credentials pair (the user may be empty: redis://:pw@host).
_URL_CREDENTIALS = re.compile(r"://(?P<value>[^\s/:@]*:[^\s/@]+)@", _A)
# A user name of 12+ characters with a letter and a digit is a token (https://TOKEN@github.com/):
# people's and services' user names (git, deploy, admin) are short or plain words.
_URL_TOKEN_USER = re.compile(r"://(?P<value>(?=[^\s/:@]*\d)(?=[^\s/:@]*[A-Za-z])[^\s/:@]{12,})@", _A)
_VENDOR_TOKEN = re.compile(
    r"[sprwgxAhnSe](?<![A-Za-z0-9_-].)(?:"  # first letter by class (fast scan), then by prefix
    r"(?<=s)k-[A-Za-z0-9_-]{20,}"  # OpenAI (sk-, sk-proj-), Anthropic (sk-ant-)
    r"|(?<=[spr])k_(?:live|test)_[A-Za-z0-9]{10,}"  # Stripe
    r"|(?<=w)hsec_[A-Za-z0-9]{20,}"
    r"|(?<=g)(?:h[pousr]_[A-Za-z0-9]{30,}|ithub_pat_[A-Za-z0-9_]{30,}|lpat-[A-Za-z0-9_-]{20,})"
    r"|(?<=x)ox[abposr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|(?<=A)(?:(?:KIA|SIA|GPA|IDA|ROA|NPA|NVA|IPA)[A-Z0-9]{16}|Iza[A-Za-z0-9_-]{35})"  # AWS, Google
    r"|(?<=h)f_[A-Za-z0-9]{30,}"  # Hugging Face
    r"|(?<=n)pm_[A-Za-z0-9]{36}"
    r"|(?<=p)ypi-[A-Za-z0-9_-]{50,}"
    r"|(?<=S)G\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}"  # SendGrid
    r"|(?<=e)yJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"  # JWT: base64url('{"') first
    r")(?![A-Za-z0-9_-])",
    _A,
)
_VENDOR_HINTS: Final = (
    "sk-", "k_live_", "k_test_", "whsec_", "hp_", "ho_", "hu_", "hs_", "hr_", "github_pat_",
    "glpat-", "xox", "AKIA", "ASIA", "AGPA", "AIDA", "AROA", "ANPA", "ANVA", "AIPA", "AIza", "hf_",
    "npm_", "pypi-", "SG.", "eyJ",
)  # fmt: skip
_AUTH_SCHEME = re.compile(
    r"[BbTt](?<![A-Za-z0-9_].)(?i:(?<=b)(?:earer|asic)|(?<=t)oken)"
    r"\s+(?P<value>[A-Za-z0-9._~+/-]{8,}=*)(?![A-Za-z0-9._~+/=-])",
    _A,
)
_AUTH_HEADER_BEFORE = re.compile(r"Authorization\s*[:=]\s*[\"']?$", _AI)

# ---- secret-named assignments ----------------------------------------------------------------

# The secret word, not preceded by a letter or digit: DB_PASSWORD, x-api-key and "api_key" match,
# mypassword and max_tokens do not. The first letter is consumed by a class (fast scan), the rest
# dispatches on it.
_ASSIGNMENT = re.compile(
    r"[PpSsTtAaCc](?<![A-Za-z0-9].)(?i:"
    r"(?<=p)(?:assword|asswd|assphrase|wd|rivate[_-]?key)|(?<=s)ecret|(?<=t)oken"
    r"|(?<=a)(?:pi[_-]?key|pikey|ccess[_-]?key|uth[_-]?(?:token|key))|(?<=c)redentials?"
    r")(?i:[_-](?:key|token))?"
    r"(?P<sep>[\"']?\s*[:=]\s*)"
    r"(?:(?P<q>[\"'])(?P<quoted>[^\"'\n]{3,200})(?P=q)"
    r"|(?P<bare>[^\s\"'`,;&()\[\]{}<>]{3,200}))",
    _A,
)
_ASSIGNMENT_HINTS: Final = ("pass", "pwd", "secret", "token", "key", "credential")
# Values that say "no secret here": literals of code and config, types, and placeholders.
_NOT_SECRET_VALUES: Final = frozenset(
    {
        "none", "null", "nil", "true", "false", "undefined", "empty", "required", "optional",
        "str", "string", "bytes", "int", "bool", "any", "secretstr", "redacted",
    }
)  # fmt: skip
_PLACEHOLDER_VALUE = re.compile(r"\$[A-Za-z_{(]|%[A-Za-z_(]|[{<]|[*x.\u2022]+$|\.\.\.", _AI)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", _A)
_DOTTED_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+", _A)
_PLAIN_WORD = re.compile(r"[A-Za-z_]+", _A)
_NUMBERS_ONLY = re.compile(r"[\d.:-]+", _A)
_SECRET_WORD = re.compile(r"pass|pwd|secret|token|key|cred", _AI)
# Environment variables glue the secret word to a prefix (PGPASSWORD, MYSQLPWD, REDISCLI_AUTH):
# upper case, the word at the end of the name, then '='.
_ENV_SECRET = re.compile(
    r"[A-Z](?<![A-Za-z0-9_].)[A-Z0-9_]*?"
    r"(?:PASSWORD|PASSWD|PASSPHRASE|PWD|_PASS|SECRET|TOKEN|APIKEY|_AUTH|CREDENTIALS?"
    r"|(?:ACCESS|PRIVATE|SIGNING|ENCRYPTION|MASTER)_KEY)"
    r"(?P<sep>\s*=\s*)"
    # Unquoted values run to the next space: a password may hold brackets (3FHj!dXw(b#8m).
    r"(?:(?P<q>[\"'])(?P<quoted>[^\"'\n]{3,200})(?P=q)|(?P<bare>[^\s\"'`,;&]{3,200}))",
    _A,
)
_CALL = re.compile(r"[\w.]+\(.*\)[)\]}]*", _A)
_OPENING: Final = {")": "(", "]": "[", "}": "{", ">": "<"}
# "the password is X", "passphrase: a few plain words": prose and notes rather than code.
_PASSWORD_IS = re.compile(
    r"[PpSs](?<![A-Za-z0-9].)"  # first letter by class (fast scan), then the word by that letter
    r"(?i:(?:(?<=p)(?:ass\s?words?|asscodes?|ins?|wd)|(?<=s)ecret(?:\s+(?:key|word))?)\s+(?:is|was|=)\s*:?\s*)"
    r"(?:(?P<q>[\"'\u201c])(?P<quoted>[^\"'\u201d\n]{1,200})[\"'\u201d]"
    r"|(?P<bare>[^\s\"'`,;()\[\]{}<>]{3,200}))"
)
_PASSPHRASE = re.compile(
    r"(?i:\b(?:pass[ -]?phrase|seed[ -]phrase|mnemonic|recovery[ -]phrase)s?\s*(?P<sep>is\b|was\b|[:=])\s*)"
    r"(?P<q>[\"'\u201c]?)(?P<value>[^\"'\u201d\n.;,()]{2,160})"
)
# user:password outside URLs (curl -u, .netrc-style notes, "creds admin:S3cret!"). Trusted only
# after a credential word, or when the password part mixes a digit and a symbol: key:value pairs,
# host:port, image:tag and times are far more common than credentials.
# Found from the colon and extended backwards over the user name, as e-mail addresses are from '@'.
_USER_PASSWORD = re.compile(r":(?<=[\w.+-]:)(?P<pw>[^\s:/'\"`<>(){}\[\],;]{4,128})(?![\w:@/])", _A)
_USER_BEFORE = re.compile(r"(?<![\w:/.@$%-])[A-Za-z][\w.+-]{0,63}$", _A)
_CREDENTIAL_WORD_BEFORE = re.compile(
    r"(?:-u|--user|\buser(?:name)?|\blogin|\bcred(?:ential)?s?|\bauth|\baccount|\bbasic|\bhtpasswd"
    r"|\bpassword|\buser/pass(?:word)?)\b[\s:=\"']*$",
    _AI,
)
_PASSWORD_SYMBOL = re.compile(r"[!#$%^&*+=?~]", _A)
_LETTER = re.compile(r"[A-Za-z]", _A)
_EXPRESSION = re.compile(r"[\w.]+(?:\s*[-+*/%]\s*[\w.]+)+", _A)
_NOT_USERS: Final = frozenset(
    {
        "http", "https", "ftp", "file", "mailto", "tel", "urn", "data", "ws", "wss", "git", "ssh",
        "sha1", "sha256", "sha512", "md5", "image", "docker", "localhost", "std", "note", "warning",
        "error", "info", "debug", "todo", "fixme", "type", "arn", "s3", "gs",
    }
)  # fmt: skip
# Webhook URLs carry their secret in the path: everything after the hook segment goes.
_WEBHOOK = re.compile(
    r"https?://[A-Za-z0-9.-]+(?::\d+)?/(?:[^\s?#/]+/)*?"
    r"(?:hooks?|webhooks?|webhookb2|services|triggers?|incoming|catch)/(?P<value>[^\s\"'<>)\]`]+)",
    _A,
)

# ---- emails, IP addresses ----------------------------------------------------------------------

# Found from the '@' (rare) and extended backwards over the local part in code, because a pattern
# that starts with the local part would try every letter of the text.
_EMAIL_DOMAIN = re.compile(
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}(?![A-Za-z0-9-])", _A
)
# Local parts may be non-ASCII (müller@example.de): a partial match would leak the first letters.
_EMAIL_LOCAL_BEFORE = re.compile(r"(?<![\w.%+-])\w[\w.%+-]{0,63}$")
_IPV6_CANDIDATE = re.compile(
    r"[0-9A-Fa-f:](?<![\w:.].)[0-9A-Fa-f]{0,3}(?::[0-9A-Fa-f]{0,4}){1,7}"
    r"(?:(?<=:)(?:\d{1,3}\.){3}\d{1,3})?(?:%[A-Za-z0-9_.]+)?(?![\w:]|\.\d)",
    _A,
)
_IPV4 = re.compile(r"\d(?<![\w.].)\d{0,2}\.\d{1,3}\.\d{1,3}\.\d{1,3}(?!\w)(?!\.\d)", _A)
_IPV4_OCTET = re.compile(r"25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d", _A)
# Address blocks reserved for documentation (RFC 5737, RFC 3849): nobody's address, and what
# examples and docs are full of, like the reserved e-mail domains.
_DOCUMENTATION_V4: Final = frozenset({(192, 0, 2), (198, 51, 100), (203, 0, 113)})
_DOCUMENTATION_V6: Final = ipaddress.IPv6Network("2001:db8::/32")
# A dotted quad right after one of these words is a version or a section number.
_VERSION_BEFORE = re.compile(
    r"(?:\bv|\bversions?|\bver\.?|\brelease|\bbuild|\bsection|\bchapter|\bstep|\u00a7)\s*[:=#]?\s*$"
    # "upgraded the service from 1.2.3.4", "bump to 1.2.3.4", "from 1.2.3 to 1.2.3.4"
    r"|\b(?:upgrad|bump|downgrad)\w*\b[^\n.;]{0,30}?\b(?:from|to)\s+$"
    r"|\d+(?:\.\d+)+\s+(?:to|->|\u2192)\s+$",
    _AI,
)
# name:tag right before a dotted quad is an image tag or a package pin (app:1.2.3.4), unless the
# name says address (ip:10.0.0.5, host:..., from:...).
_TAG_BEFORE = re.compile(r"(?<![\w.-])(?P<name>[A-Za-z][\w.-]*):$", _A)
_ADDRESS_NAMES: Final = frozenset(
    {
        "ip", "ipv4", "addr", "address", "host", "hostname", "server", "client", "remote", "src", "dst",
        "source", "destination", "peer", "gateway", "gw", "dns", "nameserver", "from", "to", "inet", "via",
        "proxy", "origin", "upstream", "endpoint", "node", "target",
    }
)  # fmt: skip

# ---- card and phone numbers: searched only inside runs of 7+ digits ---------------------------

# Between digit groups people write spaces (also no-break and thin ones), hyphens, en dashes, dots.
_SEP = " .\u00a0\u2009\u202f\u2010\u2011\u2013-"
_NUMBER_RUN = re.compile(rf"\d(?:[+(){_SEP}]{{0,2}}\d){{6,}}+", _A)
_CARD = re.compile(rf"[2-6](?<![\w.+-].)\d{{3}}(?:[{_SEP}]?\d){{9,15}}(?![\w-])(?!\.\d)", _A)
_CARD_SEPARATOR = re.compile(rf"[{_SEP}]", _A)
# A number named as a product or book identifier is not a card or a phone number, even when it
# passes Luhn (an EAN-13's own checksum does about one time in ten) or reads as a trunk number.
_PRODUCT_ID_BEFORE = re.compile(
    r"\b(?:ISBN(?:-?1[03])?|ISSN|EAN(?:-?8|-?13)?|GTIN(?:-?\d\d?)?|UPC(?:-?A)?|barcode|ASIN|SKU)"
    r"[\"']?\s*[:=#]?\s*[\"']?$",
    _AI,
)

# Phone rules share their edges: never inside a word, a decimal or a longer run of digit groups
# (a card number with one bad digit must not come out as a phone number). A '+' or '(' marks a
# start by itself, so "+1 415 555 2671 +44 20 7946 0958" is two numbers.
_PHONE_START = rf"(?<![\w.+/-])(?:(?=[+(])|(?<!\d[{_SEP}]))"
_PHONE_END = rf"(?![\w-])(?!\.\d)(?![{_SEP}]\d)"
_PHONE_INTERNATIONAL = re.compile(
    _PHONE_START + rf"(?P<prefix>\+|00(?=[1-9]))\d(?:[(){_SEP}]{{0,2}}\d){{6,16}}" + _PHONE_END, _A
)
_PHONE_NANP = re.compile(
    _PHONE_START
    + rf"(?:\+?1[{_SEP}]?)?(?:\(\s?[2-9]\d{{2}}\s?\)[{_SEP}]?|[2-9]\d{{2}}[{_SEP}])"
    + rf"[2-9]\d{{2}}[{_SEP}]\d{{4}}"
    + _PHONE_END,
    _A,
)
_PHONE_TRUNK = re.compile(
    _PHONE_START + rf"(?:\(0[1-9]\d{{0,3}}\)|0[1-9]\d{{0,3}})(?:[{_SEP}]?\d{{2,4}}){{2,4}}" + _PHONE_END, _A
)
_PHONE_AFTER_WORD = re.compile(_PHONE_START + rf"\+?\d(?:[(){_SEP}]{{0,2}}\d){{6,14}}" + _PHONE_END, _A)
_PHONE_WORD_BEFORE = re.compile(
    r"\b(?:phone|telephone|tel|mobile|cell|fax|whatsapp|sms"
    r"|call(?:\s+me)?(?:\s+(?:at|on))?|text(?:\s+me)?(?:\s+(?:at|on))?"
    # other languages: Telefon, téléphone, teléfono, telefone, tlf, puhelin, Handy, móvil, celular,
    # cellulare, portable, kontakt, contacto, ring (Scandinavian)
    r"|t[e\u00e9]l[e\u00e9](?:fono?|fone|phone)|telefon|tlf|puh(?:elin)?|handy|mobil|m[o\u00f3]vil"
    r"|celular|cellulare|portable|kontakt|contacto?|ring)"
    r"(?:\s*(?:no\.?|number|nr\.?|#|numer|n[u\u00fa]mero|num[e\u00e9]ro|nummer|n[\u00ba\u00b0]))?\s*[:.]?\s*$",
    _AI,
)

# ---- everything else that looks random -------------------------------------------------------

_LONG_TOKEN = re.compile(
    r"[A-Za-z0-9+/_-](?<![A-Za-z0-9+/_-].)[A-Za-z0-9+/_-]{19,}+={0,2}+(?![A-Za-z0-9+/=_-])", _A
)
_HEX_OR_UUID = re.compile(r"(?:0x)?[0-9A-Fa-f-]+", _A)
_MIN_RANDOM_LENGTH: Final = 20
_SEGMENT_SEPARATOR = re.compile(r"[/_-]", _A)
_WORD_OR_NUMBER = re.compile(r"[A-Z]?[a-z]{2,}|\d{1,4}", _A)
_LOWER_RUN = re.compile(r"[a-z]{3,}", _A)
_CAMEL_WORD = re.compile(r"[A-Z]?[a-z]{2,}", _A)

_DIGIT = re.compile(r"\d", _A)
# Found spans are masked with '<' + this + '>' of the same length, so later stages see offsets of
# the original text and no rule matches inside a mask (no digit, letter, '@' or token character).
_MASK_CHAR: Final = "\u2588"
_UPPER = re.compile(r"[A-Z]", _A)
_LOWER = re.compile(r"[a-z]", _A)


def _class_of(char: str) -> int:
    if char.islower():
        return 0
    if char.isupper():
        return 1
    if char.isdigit():
        return 2
    return 3


def looks_random(token: str) -> bool:
    """Whether a long token reads as a generated credential rather than as words, a name or a path.

    Random base64 switches character class (lower/upper/digit/symbol) between neighbours about
    60% of the time, rarely repeats characters and rarely holds a lowercase run of 3+ letters;
    CamelCase names (``Qwen3PreTrainedModel``), paths and model ids (``allenai/OLMoE-1B-7B-0924``)
    fail at least one test. Tuned on the 7,572 mixed-class tokens in CPython and this project's
    dependencies (201 pass, nearly all embedded base64 data) and on random tokens (caught: ~80%
    at 20 chars, ~92% at 40 chars, ~95% at 64 chars).
    """
    body = token.rstrip("=")
    # Cheapest tests first: most long tokens in code are names without a digit or a capital.
    if len(body) < _MIN_RANDOM_LENGTH or not (_DIGIT.search(body) and _UPPER.search(body)):
        return False
    if not _LOWER.search(body) or _HEX_OR_UUID.fullmatch(body):
        return False
    segments = _SEGMENT_SEPARATOR.split(body)
    if len(segments) > 1 and any(_WORD_OR_NUMBER.fullmatch(segment) for segment in segments):
        return False
    if sum(len(run) for run in _LOWER_RUN.findall(body)) >= 0.35 * len(body):
        return False
    if sum(len(word) for word in _CAMEL_WORD.findall(body)) >= 0.6 * len(body):
        return False
    classes = [_class_of(char) for char in body]
    switches = sum(1 for a, b in zip(classes, classes[1:], strict=False) if a != b) / (len(body) - 1)
    counts: dict[str, int] = {}
    for char in body:
        counts[char] = counts.get(char, 0) + 1
    entropy = -sum(n / len(body) * math.log2(n / len(body)) for n in counts.values())
    # A uniform random string of this length reaches close to log2(min(len, 64)) bits per char.
    return switches >= 0.4 and entropy >= 0.82 * math.log2(min(len(body), 64))


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum every payment card number satisfies."""
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = ord(char) - 48
        if position % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


# ---- per-match decisions: the span to replace and its replacement, or None to keep the text ----

_Span = tuple[int, int]
_Decide = Callable[[re.Match[str]], _Span | None]


def _whole(match: re.Match[str]) -> _Span:
    return match.start(), match.end()


def _value_only(match: re.Match[str]) -> _Span:
    return match.start("value"), match.end("value")


def _auth_scheme(match: re.Match[str]) -> _Span | None:
    token = match["value"]
    # Without an Authorization header before it, "Bearer"/"Basic" may be prose: demand a digit.
    if (len(token) < 16 or not _DIGIT.search(token)) and not _AUTH_HEADER_BEFORE.search(
        match.string, max(0, match.start() - 40), match.start()
    ):
        return None
    return _value_only(match)


def _is_secret_value(value: str, *, word: str, spaced_or_colon: bool, quoted: bool) -> bool:
    if value.lower() in _NOT_SECRET_VALUES or _PLACEHOLDER_VALUE.match(value):
        return False
    if word.lower() == "token":
        # "token" is also an NLP word ({"token": "ing"} in logprobs, "token=5"): only random-looking
        # values count, and those need letters and digits.
        return len(value) >= 12 and _DIGIT.search(value) is not None and not _PLAIN_WORD.fullmatch(value)
    if quoted:
        return True
    if value.isdigit() or _DOTTED_IDENTIFIER.fullmatch(value):
        return False  # counters and attribute reads (pwd_len=12, self.password)
    if spaced_or_colon and _IDENTIFIER.fullmatch(value) and _PLAIN_WORD.fullmatch(value):
        return False  # code (password = pw), types (password: str), prose (secret: love)
    return True


def _assignment(match: re.Match[str]) -> _Span | None:
    sep = match["sep"]
    spaced_or_colon = ":" in sep or sep.strip("\"'") != "="
    word = match.string[match.start() : match.start("sep")]
    if match["quoted"] is not None:
        group = "quoted"
        if not _is_secret_value(match["quoted"], word=word, spaced_or_colon=spaced_or_colon, quoted=True):
            return None
        return match.start(group), match.end(group)
    bare = match["bare"]
    after = match.string[match.end("bare") : match.end("bare") + 1]
    if after in ("(", "["):
        return None  # a call or subscript: password=get_password(...)
    if _IDENTIFIER.fullmatch(bare) and (after in (",", ")") or _SECRET_WORD.search(bare)):
        return None  # a variable passed on: connect(password=password), token=db_token
    value = bare.rstrip(".")  # a sentence's full stop is not part of the value
    if not _is_secret_value(value, word=word, spaced_or_colon=spaced_or_colon, quoted=False):
        return None
    start = match.start("bare")
    return start, start + len(value)


def _env_secret(match: re.Match[str]) -> _Span | None:
    group = "quoted" if match["quoted"] is not None else "bare"
    value = match[group] if group == "quoted" else match[group].rstrip(".")
    if group == "bare":
        if _CALL.fullmatch(value):
            return None  # a call in code: TOKEN=get_token()
        # A bracket the value did not open belongs to the code around it: f(TOKEN=abc123xyz)
        while value and value[-1] in _OPENING and value.count(value[-1]) > value.count(_OPENING[value[-1]]):
            value = value[:-1]
        if len(value) < 3:
            return None
    if _NUMBERS_ONLY.fullmatch(value):
        return None  # versions, OIDs, counts: SERVER_AUTH = "1.3.6.1.5.5.7.3.1"
    if match["sep"].strip() != match["sep"] and _PLAIN_WORD.fullmatch(value):
        return None  # a constant in code: CLIENT_AUTH = "client"
    if not _is_secret_value(value, word="", spaced_or_colon=False, quoted=group == "quoted"):
        return None
    start = match.start(group)
    return start, start + len(value)


def _password_is(match: re.Match[str]) -> _Span | None:
    if match["quoted"] is not None:
        value, group = match["quoted"], "quoted"
        if value.lower() in _NOT_SECRET_VALUES or _PLACEHOLDER_VALUE.match(value) or not value.strip():
            return None
    else:
        value, group = match["bare"].rstrip(".!?"), "bare"
        # Prose says "the password is required": only values with a digit or a symbol count.
        if _PLAIN_WORD.fullmatch(value) or not (_DIGIT.search(value) or _PASSWORD_SYMBOL.search(value)):
            return None
        if value.lower() in _NOT_SECRET_VALUES or _PLACEHOLDER_VALUE.match(value):
            return None
    start = match.start(group)
    return start, start + len(value)


def _passphrase(match: re.Match[str]) -> _Span | None:
    value = match["value"].rstrip()
    if not match["q"]:
        if match["sep"] in ":=":
            # "passphrase: correct horse battery staple"; one plain word is a type or a name.
            if len(value.split()) < 2 and not (_DIGIT.search(value) or _PASSWORD_SYMBOL.search(value)):
                return None
        else:
            # "the passphrase is never logged" is prose: unquoted, only a token with a digit or
            # a symbol counts.
            value = value.split()[0]
            if not (_DIGIT.search(value) or _PASSWORD_SYMBOL.search(value)):
                return None
    if value.lower() in _NOT_SECRET_VALUES or _PLACEHOLDER_VALUE.match(value) or "(" in value:
        return None
    start = match.start("value")
    return start, start + len(value)


def _user_password(match: re.Match[str]) -> _Span | None:
    colon = match.start()
    found = _USER_BEFORE.search(match.string, max(0, colon - 64), colon)
    if found is None:
        return None
    user, password = found.group(), match["pw"]
    if user.lower() in _NOT_USERS or password.isdigit() or _HEX_OR_UUID.fullmatch(password):
        return None
    start = found.start()
    if _CREDENTIAL_WORD_BEFORE.search(match.string, max(0, start - 24), start):
        return start, match.end()
    if match.string[start - 1 : start] in ("[", "("):
        return None  # a slice or a call: a[index:index+2]
    if _EXPRESSION.fullmatch(password):
        return None  # arithmetic: start:start+20
    # Without a credential word: a letter, a digit and a symbol, not leading (#e0e0e0 is a CSS
    # colour) and no '=' (x:int=3 is an annotation with a default).
    if (
        _PASSWORD_SYMBOL.search(password)
        and _DIGIT.search(password)
        and _LETTER.search(password)
        and not _PASSWORD_SYMBOL.match(password)
        and "=" not in password
    ):
        return start, match.end()
    return None


def _webhook(match: re.Match[str]) -> _Span | None:
    value = match["value"].rstrip(".,")
    if len(value) < 12 or not _DIGIT.search(value):
        return None  # documentation paths such as /webhooks/creating-webhooks
    start = match.start("value")
    return start, start + len(value)


def _email(match: re.Match[str]) -> _Span | None:
    at = match.start()
    local = _EMAIL_LOCAL_BEFORE.search(match.string, max(0, at - 64), at)
    if local is None:
        return None
    return local.start(), match.end()


def _ipv6(match: re.Match[str]) -> _Span | None:
    candidate = match.group()
    if candidate.count(":") < 2 or not _DIGIT.search(candidate):
        return None  # hex words around '::' (C++ scopes such as Face::add) are not addresses
    groups = [g for g in candidate.split("%", 1)[0].split(":") if g]
    if len(groups) < 3 and not any(len(g) == 4 for g in groups):
        return None  # Python slices a[1::2], a[10::20]
    try:
        address = ipaddress.IPv6Address(candidate)
    except ValueError:
        return None  # times 12:30:45, MAC addresses
    if address.is_loopback or address.is_unspecified or address in _DOCUMENTATION_V6:
        return None
    return match.start(), match.end()


def _ipv4(match: re.Match[str]) -> _Span | None:
    parts = match.group().split(".")
    if not all(_IPV4_OCTET.fullmatch(part) for part in parts):
        return None  # an octet over 255 or with a leading zero: not an address
    octets = [int(part) for part in parts]
    if octets[0] == 127 or octets == [0, 0, 0, 0] or tuple(octets[:3]) in _DOCUMENTATION_V4:
        return None
    inverted = ~int(ipaddress.IPv4Address(match.group())) & 0xFFFFFFFF
    if octets[0] == 255 and inverted & (inverted + 1) == 0:
        return None  # a netmask (255.255.255.0) or the broadcast address
    start = match.start()
    if _VERSION_BEFORE.search(match.string, max(0, start - 48), start):
        return None
    tag = _TAG_BEFORE.search(match.string, max(0, start - 32), start)
    if tag is not None and tag["name"].lower().rstrip("_-") not in _ADDRESS_NAMES:
        return None
    return start, match.end()


def _card(match: re.Match[str]) -> _Span | None:
    text = match.group()
    digits = _CARD_SEPARATOR.sub("", text)
    if not 13 <= len(digits) <= 19 or not luhn_ok(digits):
        return None
    separators = set(_CARD_SEPARATOR.findall(text))
    if separators:
        groups = _CARD_SEPARATOR.split(text)
        # Cards are grouped 4-4-4-4(-3), 4-6-5 or 4-6-4, with one kind of separator.
        # ... or chunked by four with a shorter last group, as people type them (4106 0762 3823 8).
        chunked_by_four = all(len(g) == 4 for g in groups[:-1])
        if len(separators) > 1 or len(groups[0]) != 4:
            return None
        if any(not 3 <= len(g) <= 6 for g in groups) and not chunked_by_four:
            return None
    return match.start(), match.end()


def _digit_count(text: str) -> int:
    return len(_DIGIT.findall(text))


def _phone_international(match: re.Match[str]) -> _Span | None:
    text = match.group()
    digits = _digit_count(text) - (2 if match["prefix"] == "00" else 0)
    if "(0)" in text:
        digits -= 1  # the national trunk zero written as +44 (0)20 ...
    if not 8 <= digits <= 15:
        return None
    if match["prefix"] == "00" and not _CARD_SEPARATOR.search(text) and "(" not in text:
        return None  # 0044207946... without any grouping reads as a constant, not a number
    return match.start(), match.end()


def _phone_trunk(match: re.Match[str]) -> _Span | None:
    text = match.group()
    if not 9 <= _digit_count(text) <= 12 or text.isdigit():
        return None
    return match.start(), match.end()


def _phone_after_word(match: re.Match[str]) -> _Span | None:
    start = match.start()
    if not 7 <= _digit_count(match.group()) <= 15:
        return None
    if not _PHONE_WORD_BEFORE.search(match.string, max(0, start - 40), start):
        return None
    return start, match.end()


def _long_token(match: re.Match[str]) -> _Span | None:
    if not looks_random(match.group()):
        return None
    return match.start(), match.end()


@dataclass(frozen=True, slots=True)
class _Rule:
    entity: Entity
    pattern: re.Pattern[str]
    decide: _Decide
    # The rule runs only if one of these occurs in the text (lower-cased when ``fold``): plain
    # substring tests beat a regex alternation of the same literals several times over.
    hints: tuple[str, ...] = ()
    fold: bool = False
    needs_digit: bool = False


_SECRET_RULES: Final = (
    _Rule(Entity.secret, _PEM, _whole, hints=("PRIVATE KEY",)),
    _Rule(Entity.secret, _URL_CREDENTIALS, _value_only, hints=("://",)),
    _Rule(Entity.secret, _URL_TOKEN_USER, _value_only, hints=("://",)),
    _Rule(Entity.secret, _WEBHOOK, _webhook, hints=("hook", "services/", "trigger", "incoming", "catch/")),
    _Rule(Entity.secret, _VENDOR_TOKEN, _whole, hints=_VENDOR_HINTS),
    _Rule(Entity.secret, _AUTH_SCHEME, _auth_scheme, hints=("bearer", "basic", "token"), fold=True),
    _Rule(Entity.secret, _ASSIGNMENT, _assignment, hints=_ASSIGNMENT_HINTS, fold=True),
    _Rule(
        Entity.secret,
        _ENV_SECRET,
        _env_secret,
        hints=("PASS", "PWD", "SECRET", "TOKEN", "KEY", "AUTH", "CRED"),
    ),
    _Rule(Entity.secret, _PASSPHRASE, _passphrase, hints=("phrase", "mnemonic"), fold=True),
    _Rule(Entity.secret, _PASSWORD_IS, _password_is, hints=("pass", "pin", "pwd", "secret"), fold=True),
    _Rule(Entity.secret, _USER_PASSWORD, _user_password, hints=(":",)),
)
_TEXT_RULES: Final = (
    _Rule(Entity.email, _EMAIL_DOMAIN, _email, hints=("@",)),
    _Rule(Entity.ip_address, _IPV6_CANDIDATE, _ipv6, hints=(":",), needs_digit=True),
    _Rule(Entity.ip_address, _IPV4, _ipv4, hints=(".",), needs_digit=True),
)
_LONG_TOKEN_RULE: Final = _Rule(Entity.secret, _LONG_TOKEN, _long_token, needs_digit=True)


@dataclass(frozen=True, slots=True)
class _NumberRule:
    entity: Entity
    pattern: re.Pattern[str]
    decide: _Decide
    # Fewest digits a match needs: most runs (dates, ids) are too short for most rules.
    min_digits: int
    # What must be right before the run (or at its start) for the rule to have a chance.
    lead: re.Pattern[str] | None = None


_PHONE_WORD_NEAR = re.compile(
    r"phone|t[e\u00e9]l|mobil|cell|fax|whatsapp|sms|call|text|fono|fone|tlf|puh|handy|m[o\u00f3]vil|celular"
    r"|portable|kontakt|contact|ring",
    _AI,
)
# Searched inside each run of 7+ digits, in priority order: a span taken by an earlier rule is
# not available to a later one.
_NUMBER_RULES: Final = (
    _NumberRule(Entity.credit_card, _CARD, _card, min_digits=13),
    _NumberRule(
        Entity.phone, _PHONE_INTERNATIONAL, _phone_international, min_digits=8, lead=re.compile(r"\+|00", _A)
    ),
    _NumberRule(Entity.phone, _PHONE_AFTER_WORD, _phone_after_word, min_digits=7, lead=_PHONE_WORD_NEAR),
    _NumberRule(Entity.phone, _PHONE_NANP, _whole, min_digits=10),
    _NumberRule(Entity.phone, _PHONE_TRUNK, _phone_trunk, min_digits=9),
)
_LEAD_WINDOW: Final = 42  # "Telephone number: " plus a little


_Found = list[tuple[int, int, Entity]]


def _mask(length: int) -> str:
    return "<" + _MASK_CHAR * (length - 2) + ">" if length >= 2 else _MASK_CHAR


def _splice(text: str, spans: _Found, found: _Found) -> str:
    """Mask non-overlapping spans (sorted by start) and record them in ``found``; a span
    overlapping an earlier one is dropped."""
    pieces: list[str] = []
    last = 0
    for start, end, entity in spans:
        if start < last:
            continue
        pieces.append(text[last:start])
        pieces.append(_mask(end - start))
        last = end
        found.append((start, end, entity))
    if not pieces:
        return text
    pieces.append(text[last:])
    return "".join(pieces)


def _apply(rule: _Rule, text: str, found: _Found) -> str:
    spans = []
    for match in rule.pattern.finditer(text):
        hit = rule.decide(match)
        if hit is not None:
            spans.append((*hit, rule.entity))
    return _splice(text, spans, found) if spans else text


def _apply_numbers(text: str, found: _Found) -> str:
    spans: _Found = []
    floor = 0
    for run in _NUMBER_RUN.finditer(text):
        # Two characters either side: a leading '+' or '(' and what the end lookaheads inspect.
        low, high = max(floor, run.start() - 2), min(len(text), run.end() + 2)
        floor = run.end()
        if _product_id_before(text, run.start()):
            continue
        digits = _digit_count(run.group())
        # Kept sorted by start, so the overlap test is two neighbours, not the whole list: a run
        # can hold thousands of matches ("4111111111111111 " * 4000).
        taken: _Found = []
        for rule in _NUMBER_RULES:
            if digits < rule.min_digits:
                continue
            if rule.lead is not None and not rule.lead.search(
                text, max(0, run.start() - _LEAD_WINDOW), run.start() + 2
            ):
                continue
            for match in rule.pattern.finditer(text, low, high):
                hit = rule.decide(match)
                if hit is None:
                    continue
                at = bisect.bisect_left(taken, hit[0], key=lambda span: span[0])
                if (at > 0 and taken[at - 1][1] > hit[0]) or (at < len(taken) and taken[at][0] < hit[1]):
                    continue
                taken.insert(at, (*hit, rule.entity))
        spans.extend(taken)
    return _splice(text, spans, found) if spans else text


_LIBRARY_KINDS: Final = {
    Kind.email: Entity.email,
    Kind.phone: Entity.phone,
    Kind.iban: Entity.iban,
    Kind.national_id: Entity.national_id,
    Kind.secret: Entity.secret,
}


def _apply_library(spans: list[tuple[int, int, Kind]], text: str, found: _Found) -> str:
    kept = [(start, end, _LIBRARY_KINDS[kind]) for start, end, kind in spans]
    # Longest first among spans starting together; a span overlapping an earlier one is dropped.
    kept.sort(key=lambda span: (span[0], -span[1]))
    return _splice(text, kept, found) if kept else text


def _product_id_before(text: str, start: int) -> bool:
    return _PRODUCT_ID_BEFORE.search(text, max(0, start - 16), start) is not None


def _phone_word_before(text: str, start: int) -> bool:
    return _PHONE_WORD_BEFORE.search(text, max(0, start - 40), start) is not None


def _run(
    rules: tuple[_Rule, ...],
    text: str,
    original: str,
    folded: str,
    has_digit: bool,
    found: _Found,
) -> str:
    for rule in rules:
        if rule.needs_digit and not has_digit:
            continue
        haystack = folded if rule.fold else original
        if rule.hints and not any(hint in haystack for hint in rule.hints):
            continue
        text = _apply(rule, text, found)
    return text


def find_entities(text: str) -> list[Replacement]:
    """The personal data in ``text``: disjoint spans of the original text, in order, each with
    its entity (the ``surrogate`` field is left empty)."""
    found: _Found = []
    has_digit = _DIGIT.search(text) is not None
    # Hints are looked up in the original text: masking only ever removes candidates.
    original, folded = text, text.lower()
    text = _run(_SECRET_RULES, text, original, folded, has_digit, found)
    text = _apply_library(secret_spans(text), text, found)
    text = _apply_library(presidio_spans(text), text, found)
    text = _run(_TEXT_RULES, text, original, folded, has_digit, found)
    if has_digit:
        text = _apply_numbers(text, found)
        phones = phone_spans(text, phone_word_before=_phone_word_before)
        phones = [span for span in phones if not _product_id_before(text, span[0])]
        text = _apply_library(phones, text, found)
        text = _apply(_LONG_TOKEN_RULE, text, found)
    # A later rule's negated character class can run over an earlier mask (a passphrase holding
    # an address): overlapping spans merge, keeping the earlier rule's entity.
    merged: list[list[Any]] = []
    for order, (start, end, entity) in sorted(enumerate(found), key=lambda item: (item[1][0], item[0])):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
            if order < merged[-1][3]:
                merged[-1][2], merged[-1][3] = entity, order
        else:
            merged.append([start, end, entity, order])
    return [Replacement(start, end, entity, original[start:end], "") for start, end, entity, _ in merged]


def scrub_trace(texts: Sequence[str], *, key: bytes | None = None) -> list[Scrubbed]:
    """Replace the personal data in the texts of one trace (prompt, completion, ...) with
    surrogates of the same shape: the same value gets the same surrogate in every text.

    ``key`` seeds the surrogates (``controlplane.traces.surrogates``); a fresh random key is
    drawn when none is given, so that surrogates are unlinkable across traces.
    """
    found = [find_entities(text) for text in texts]
    surrogates = Surrogates(
        texts=texts, real_values={entity.value for spans in found for entity in spans}, key=key
    )
    results = []
    for text, spans in zip(texts, found, strict=True):
        pieces: list[str] = []
        replaced: list[Replacement] = []
        counts: dict[Entity, int] = {}
        last = 0
        for span in spans:
            surrogate = surrogates.surrogate(span.entity.value, span.value)
            pieces += [text[last : span.start], surrogate]
            replaced.append(dataclasses.replace(span, surrogate=surrogate))
            counts[span.entity] = counts.get(span.entity, 0) + 1
            last = span.end
        pieces.append(text[last:])
        results.append(Scrubbed("".join(pieces) if spans else text, counts, tuple(replaced)))
    return results


def scrub(text: str, *, key: bytes | None = None) -> Scrubbed:
    """Replace personal data in one text with surrogates of the same shape; count what was replaced."""
    return scrub_trace([text], key=key)[0]
