"""Writes tests/data/scrub_out_of_sample.jsonl: a labelled corpus generated apart from the scrubber.

    python tests/data/make_scrub_out_of_sample.py            # the held-out file (seed 20261207)
    python tests/data/make_scrub_out_of_sample.py --dev OUT  # a development split (another seed)

The in-sample corpus (tests/data/make_scrub_corpus.py) was written beside the scrubber's rules,
so its recall says little about text nobody tuned for. This one is built from other sources,
never from the rules or their tables: values come from Faker (twelve locales: names, e-mail
addresses of free and company domains, payment card numbers of every network Faker knows,
IBANs, IP addresses, national ids of the countries the scrubber claims) and from phonenumbers'
metadata (valid numbers of 30 regions, written in national, international and E.164 formats
with the separators people use); credentials are drawn at random behind vendor prefixes; the
surrounding text is support chats, CRM notes, tool-call arguments, CSV rows, logs, e-mail
signatures and forms in several languages, with names and street addresses beside the labelled
values (the scrubber does not claim those: they are neither labelled nor counted).

Negative texts hold look-alikes and no personal data: versions, dates, order and invoice
numbers, ISBNs and EAN barcodes, hashes, UUIDs, MAC addresses, coordinates, prices, ports,
timestamps, user agents and code. Each look-alike is a labelled ``decoy`` span.

One JSON object a line: ``{"text", "entities": [{"type", "start", "end", "value"}], "decoys":
[{"kind", "start", "end", "value"}]}``. The held-out file is committed; tune only on a
development split (``--dev``), which uses another seed.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import phonenumbers
from faker import Faker

OUT = Path(__file__).resolve().parent / "scrub_out_of_sample.jsonl"
HELD_OUT_SEED = 20261207
DEV_SEED = 7
POSITIVE_CASES = 420
NEGATIVE_CASES = 300

LOCALES = (
    "en_US", "en_GB", "de_DE", "fr_FR", "es_ES", "it_IT", "pt_BR", "nl_NL", "pl_PL", "sv_SE",
    "en_IN", "ja_JP",
)  # fmt: skip
PHONE_REGIONS = (
    "US", "CA", "GB", "IE", "DE", "AT", "CH", "FR", "BE", "NL", "ES", "PT", "IT", "PL", "SE", "NO",
    "DK", "FI", "IN", "JP", "KR", "CN", "SG", "AU", "NZ", "BR", "MX", "AR", "ZA", "AE",
)  # fmt: skip
PHONE_TYPES = (phonenumbers.PhoneNumberType.MOBILE, phonenumbers.PhoneNumberType.FIXED_LINE)
CARD_TYPES = ("visa", "visa13", "visa19", "mastercard", "amex", "discover", "jcb", "diners")

Span = dict[str, Any]


class Builder:
    """Text assembled piece by piece, recording where each labelled value lands."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.entities: list[Span] = []
        self.decoys: list[Span] = []

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.length += len(text)

    def entity(self, kind: str, value: str) -> None:
        self.entities.append(
            {"type": kind, "start": self.length, "end": self.length + len(value), "value": value}
        )
        self.add(value)

    def decoy(self, kind: str, value: str) -> None:
        self.decoys.append(
            {"kind": kind, "start": self.length, "end": self.length + len(value), "value": value}
        )
        self.add(value)

    def case(self) -> dict[str, Any]:
        text = "".join(self.parts)
        for span in self.entities + self.decoys:
            assert text[span["start"] : span["end"]] == span["value"]
        return {"text": text, "entities": self.entities, "decoys": self.decoys}


# ---- values -----------------------------------------------------------------------------------


class Values:
    """Personal data and look-alikes drawn from Faker and phonenumbers with one seed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.fakers = {locale: Faker(locale) for locale in LOCALES}
        for index, faker in enumerate(self.fakers.values()):
            faker.seed_instance(seed * 100 + index)
        self.extra = {locale: Faker(locale) for locale in ("es_ES", "it_IT", "fi_FI", "en_US")}
        for index, faker in enumerate(self.extra.values()):
            faker.seed_instance(seed * 100 + 50 + index)

    def faker(self) -> Faker:
        return self.fakers[self.rng.choice(LOCALES)]

    def name(self) -> str:
        return str(self.faker().name())

    def address(self) -> str:
        return str(self.faker().address()).replace("\n", ", ")

    def email(self) -> str:
        faker = self.faker()
        choice = self.rng.random()
        if choice < 0.35:
            return str(faker.free_email())
        if choice < 0.7:
            return str(faker.company_email())
        if choice < 0.85:
            first, last = faker.first_name().lower(), faker.last_name().lower()
            separator = self.rng.choice([".", "_", "", "-"])
            tag = self.rng.choice(["", "", f"+{faker.word()}", str(self.rng.randint(1, 99))])
            local = "".join(c for c in f"{first}{separator}{last}{tag}" if not c.isspace())
            return f"{local}@{faker.free_email_domain()}"
        return str(faker.email())  # Faker's safe domains (example.org): a shape that still teaches

    def phone(self) -> str:
        while True:
            region = self.rng.choice(PHONE_REGIONS)
            example = phonenumbers.example_number_for_type(region, self.rng.choice(PHONE_TYPES))
            if example is None:
                continue
            national = str(example.national_number)
            keep = max(1, len(national) - 6)
            digits = national[:keep] + "".join(self.rng.choice(string.digits) for _ in national[keep:])
            number = phonenumbers.PhoneNumber(country_code=example.country_code, national_number=int(digits))
            if not phonenumbers.is_valid_number(number):
                continue
            style = self.rng.random()
            if style < 0.4:
                text = phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.INTERNATIONAL)
            elif style < 0.75:
                text = phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.NATIONAL)
            else:
                text = phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
            if " " in text and self.rng.random() < 0.25:
                text = text.replace(" ", self.rng.choice(["-", ".", "\u00a0"]))
            return text

    def card(self) -> str:
        number = str(self.faker().credit_card_number(self.rng.choice(CARD_TYPES)))
        style = self.rng.random()
        if style < 0.35:
            return number
        separator = self.rng.choice([" ", " ", "-"])
        if len(number) == 15:  # American Express: 4-6-5
            return separator.join([number[:4], number[4:10], number[10:]])
        if len(number) == 14:  # Diners: 4-6-4
            return separator.join([number[:4], number[4:10], number[10:]])
        return separator.join(number[i : i + 4] for i in range(0, len(number), 4))

    def iban(self) -> str:
        locale = self.rng.choice(("de_DE", "fr_FR", "es_ES", "it_IT", "nl_NL", "en_GB", "pl_PL", "pt_BR"))
        number = str(self.fakers[locale].iban())
        if self.rng.random() < 0.5:
            return " ".join(number[i : i + 4] for i in range(0, len(number), 4))
        return number

    def ip(self) -> str:
        faker = self.faker()
        choice = self.rng.random()
        if choice < 0.45:
            return str(faker.ipv4_public())
        if choice < 0.7:
            return str(faker.ipv4_private())
        return str(faker.ipv6())

    def national_id(self) -> str:
        choice = self.rng.randrange(6)
        if choice == 0:
            return str(self.extra["en_US"].ssn())
        if choice == 1:
            return str(self.extra["es_ES"].nif())
        if choice == 2:
            return str(self.extra["es_ES"].nie())
        if choice == 3:
            return str(self.extra["it_IT"].ssn())
        if choice == 4:
            return str(self.extra["fi_FI"].ssn())
        # A UK National Insurance number: two prefix letters HMRC issues, six digits, A-D.
        first = self.rng.choice("ABCEGHJKLMNOPRSTWXYZ")
        second = self.rng.choice("ABCEGHJKLMNPRSTWXYZ")
        digits = "".join(self.rng.choice(string.digits) for _ in range(6))
        suffix = self.rng.choice("ABCD")
        if self.rng.random() < 0.5:
            return f"{first}{second} {digits[:2]} {digits[2:4]} {digits[4:]} {suffix}"
        return f"{first}{second}{digits}{suffix}"

    def _random(self, alphabet: str, length: int) -> str:
        return "".join(self.rng.choice(alphabet) for _ in range(length))

    def secret(self) -> str:
        alnum = string.ascii_letters + string.digits
        choice = self.rng.randrange(9)
        if choice == 0:
            return "sk-" + self.rng.choice(["", "proj-", "svcacct-"]) + self._random(alnum + "_-", 48)
        if choice == 1:
            return self.rng.choice(["ghp_", "gho_", "github_pat_11"]) + self._random(alnum, 36)
        if choice == 2:
            return "AKIA" + self._random(string.ascii_uppercase + string.digits, 16)
        if choice == 3:
            return "xoxb-" + "-".join([self._random(string.digits, 12), self._random(string.digits, 13),
                                       self._random(alnum, 24)])  # fmt: skip
        if choice == 4:
            header = base64.urlsafe_b64encode(b'{"alg":"HS256","typ":"JWT"}').rstrip(b"=").decode()
            claims = json.dumps(
                {"sub": self._random(string.digits, 8), "name": self.name(), "iat": 1700000000}
            )
            payload = base64.urlsafe_b64encode(claims.encode()).rstrip(b"=").decode()
            return f"{header}.{payload}.{self._random(alnum + '_-', 43)}"
        if choice == 5:
            return "glpat-" + self._random(alnum + "_-", 20)
        if choice == 6:
            return str(self.faker().password(length=self.rng.randint(10, 18)))
        if choice == 7:
            return self._random(alnum, self.rng.choice([32, 40, 48]))
        return "hf_" + self._random(alnum, 34)


# ---- positive templates -------------------------------------------------------------------------

# A template is a list of literal pieces and slots: ("email",) is a labelled value, ("name",) and
# ("address",) are unlabelled context, ("secret_line",) a secret in a config line.
Template = list[str | tuple[str]]

POSITIVE_TEMPLATES: list[Template] = [
    ["Hi team, customer ", ("name",), " wrote in about a refund. Reach her at ", ("email",),
     " or on ", ("phone",), ". She is at ", ("address",), "."],
    ["[crm] contact updated: name=", ("name",), "; email=", ("email",), "; mobile=", ("phone",)],
    ['{"tool": "create_contact", "arguments": {"full_name": "', ("name",), '", "email": "', ("email",),
     '", "phone": "', ("phone",), '"}}'],
    ['{"name": "lookup_customer", "arguments": {"email": "', ("email",), '"}}'],
    ["id,name,email,phone\n", ("int",), ",", ("name",), ",", ("email",), ",", ("phone",), "\n"],
    ["Best regards,\n", ("name",), "\nSales Manager\nDirect: ", ("phone",), "\n", ("email",)],
    ["Mit freundlichen Grüßen\n", ("name",), "\nTelefon: ", ("phone",), "\nE-Mail: ", ("email",)],
    ["Bonjour, je suis ", ("name",), ". Vous pouvez me joindre au ", ("phone",), " ou par courriel à ",
     ("email",), "."],
    ["Hola, mi correo es ", ("email",), " y mi número es ", ("phone",), ". Gracias."],
    ["Olá! Meu telefone é ", ("phone",), " e meu e-mail ", ("email",), "."],
    ["Ciao, il mio IBAN è ", ("iban",), ", intestato a ", ("name",), "."],
    ["Please wire the deposit to IBAN ", ("iban",), " (account holder: ", ("name",), ")."],
    ["Betaling graag naar ", ("iban",), " t.n.v. ", ("name",), "."],
    ['payout = {"beneficiary": "', ("name",), '", "iban": "', ("iban",), '", "amount": 1250}'],
    ["I paid with my card ", ("card",), " but the order never arrived."],
    ["Card on file: ", ("card",), ", expires ", ("expiry",), ", holder ", ("name",), "."],
    ['charge(amount=4999, currency="eur", card_number="', ("card",), '", cvc="', ("cvc",), '")'],
    ["Can you check why ", ("card",), " was declined twice today?"],
    ["SSN/ID for the application: ", ("national_id",), ". Applicant: ", ("name",), "."],
    ["Mi DNI es ", ("national_id",), " y vivo en ", ("address",), "."],
    ["Employee record: ", ("name",), " | ID ", ("national_id",), " | ", ("email",)],
    ["2026-03-04T10:12:55Z WARN auth failed for user ", ("email",), " from ", ("ip",), " (attempt 3)"],
    ['{"event": "login", "ip": "', ("ip",), '", "user": "', ("email",), '"}'],
    ["Our office VPN gateway is ", ("ip",), "; my laptop shows ", ("ip",), " when connected."],
    ["nginx: ", ("ip",), ' - - [04/Mar/2026:10:12:55 +0000] "GET /account HTTP/1.1" 200 512'],
    ["Here is my .env, why doesn't it connect?\n", ("secret_line",), "\nDEBUG=true\n"],
    ["export ", ("secret_env",), "\npython deploy.py --region eu-west-1"],
    ["client = OpenAI(api_key=\"", ("secret",), "\")\nresp = client.models.list()"],
    ["My token is ", ("secret",), ", is it still valid?"],
    ["git remote set-url origin https://", ("secret",), "@github.com/acme/tools.git"],
    ["Shipping to ", ("name",), ", ", ("address",), ". Contact: ", ("phone",), "."],
    ["Reminder: call ", ("name",), " back at ", ("phone",), " before 5pm."],
    ["電話番号は ", ("phone",), " です。メールは ", ("email",), " までお願いします。"],
    ["Proszę o kontakt: ", ("phone",), ", ", ("email",), "."],
    ["Kund: ", ("name",), ", tel ", ("phone",), ", e-post ", ("email",)],
    ["| ", ("name",), " | ", ("email",), " | ", ("phone",), " | ", ("ip",), " |"],
]  # fmt: skip

ENTITY_TYPES = {"card": "credit_card", "ip": "ip_address"}  # slot name -> the scrubber's entity name
SECRET_ENV_NAMES = ("OPENAI_API_KEY", "GITHUB_TOKEN", "STRIPE_SECRET", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                    "HF_TOKEN", "SLACK_BOT_TOKEN", "SENDGRID_API_KEY")  # fmt: skip


def _fill_positive(builder: Builder, template: Template, values: Values) -> None:
    rng = values.rng
    for piece in template:
        if isinstance(piece, str):
            builder.add(piece)
            continue
        slot = piece[0]
        if slot == "name":
            builder.add(values.name())
        elif slot == "address":
            builder.add(values.address())
        elif slot == "int":
            builder.add(str(rng.randint(1, 99999)))
        elif slot == "expiry":
            builder.add(f"{rng.randint(1, 12):02d}/{rng.randint(26, 32)}")
        elif slot == "cvc":
            builder.add(str(rng.randint(100, 999)))
        elif slot == "secret_line":
            name = rng.choice(SECRET_ENV_NAMES)
            builder.add(f"{name}=")
            builder.entity("secret", values.secret())
        elif slot == "secret_env":
            builder.add(f"{rng.choice(SECRET_ENV_NAMES)}=")
            builder.entity("secret", values.secret())
        else:
            maker: Callable[[], str] = getattr(values, slot)
            builder.entity(ENTITY_TYPES.get(slot, slot), maker())


# ---- negative templates -------------------------------------------------------------------------


class Decoys:
    """Look-alikes of personal data that hold none."""

    def __init__(self, values: Values) -> None:
        self.values = values
        self.rng = values.rng

    def version(self) -> str:
        parts = [str(self.rng.randint(0, 30)) for _ in range(self.rng.choice([2, 3, 3, 4]))]
        return ".".join(parts)

    def date(self) -> str:
        faker = self.values.faker()
        return str(faker.date(pattern=self.rng.choice(["%Y-%m-%d", "%d.%m.%Y", "%m/%d/%Y", "%d/%m/%Y"])))

    def timestamp(self) -> str:
        return str(self.values.faker().iso8601())

    def unix_time(self) -> str:
        return str(self.rng.randint(1_500_000_000, 1_800_000_000) * self.rng.choice([1, 1000]))

    def order_number(self) -> str:
        faker = self.values.faker()
        return str(
            faker.bothify(self.rng.choice(["ORD-########", "INV-####-######", "#########", "PO ######"]))
        )

    def isbn(self) -> str:
        faker = self.values.faker()
        return str(faker.isbn13() if self.rng.random() < 0.5 else faker.isbn10())

    def ean(self) -> str:
        return str(self.values.faker().ean13())

    def sha(self) -> str:
        faker = self.values.faker()
        return str(self.rng.choice([faker.sha1, faker.sha256, faker.md5])())

    def uuid(self) -> str:
        return str(self.values.faker().uuid4())

    def mac(self) -> str:
        return str(self.values.faker().mac_address())

    def coordinates(self) -> str:
        faker = self.values.faker()
        return f"{faker.latitude()}, {faker.longitude()}"

    def price(self) -> str:
        return f"{self.rng.randint(1, 99999)}.{self.rng.randint(0, 99):02d}"

    def port(self) -> str:
        host = self.rng.choice(["localhost", "127.0.0.1", "0.0.0.0", "db", "cache"])
        return f"{host}:{self.rng.randint(1024, 65535)}"

    def user_agent(self) -> str:
        return str(self.values.faker().user_agent())

    def hex_colour(self) -> str:
        return str(self.values.faker().hex_color())

    def count(self) -> str:
        return f"{self.rng.randint(1000, 9_999_999):,}"

    def duration(self) -> str:
        return f"{self.rng.randint(0, 23):02d}:{self.rng.randint(0, 59):02d}:{self.rng.randint(0, 59):02d}"

    def tracking(self) -> str:
        return str(self.values.faker().bothify("1Z###?##########").upper())

    def identifier(self) -> str:
        faker = self.values.faker()
        return f"{faker.word()}_{faker.word()}_{self.rng.randint(1, 99)}"


NEGATIVE_TEMPLATES: list[Template] = [
    ["Upgraded the service from ", ("version",), " to ", ("version",), " on ", ("date",), "."],
    ["Your order ", ("order_number",), " shipped on ", ("date",), " (tracking ", ("tracking",), ")."],
    ["Invoice ", ("order_number",), " for ", ("price",), " EUR is due ", ("date",), "."],
    ['{"isbn": "', ("isbn",), '", "ean": "', ("ean",), '", "price": ', ("price",), "}"],
    ["commit ", ("sha",), "\nAuthor: build bot\nDate: ", ("timestamp",), "\n\n    bump to ", ("version",)],
    ["request_id=", ("uuid",), " status=200 duration_ms=", ("int",), " ts=", ("unix_time",)],
    ["docker run -p ", ("port",), " app:", ("version",), " # digest sha256:", ("sha",)],
    ["Interface eth0 HWaddr ", ("mac",), " up since ", ("duration",)],
    ["The store is at ", ("coordinates",), " and opens at 09:00."],
    ["User-Agent: ", ("user_agent",)],
    ["button { color: ", ("hex_colour",), "; } /* theme ", ("version",), " */"],
    ["We served ", ("count",), " requests last month, up from ", ("count",), "."],
    ["SELECT * FROM orders WHERE id = ", ("int",), " AND created_at > '", ("date",), "';"],
    ["def ", ("identifier",), "(x):\n    return x * ", ("int",), "  # see issue ", ("int",)],
    ["Build ", ("version",), " finished in ", ("duration",), " (", ("count",), " tests)."],
    ["Book: ISBN ", ("isbn",), ", barcode ", ("ean",), "."],
    ["cache key ", ("sha",), " expires at ", ("unix_time",)],
    ["Die Bestellung ", ("order_number",), " wurde am ", ("date",), " versandt."],
    ["La version ", ("version",), " corrige le bug du ", ("date",), "."],
    ["Connecting to ", ("port",), " ... ok (", ("duration",), ")"],
    ["trace ", ("uuid",), " span ", ("sha",)],
    ["Tracking number ", ("tracking",), " for order ", ("order_number",), "."],
]  # fmt: skip


def _fill_negative(builder: Builder, template: Template, decoys: Decoys) -> None:
    for piece in template:
        if isinstance(piece, str):
            builder.add(piece)
        elif piece[0] == "int":
            builder.decoy("int", str(decoys.rng.randint(10, 999_999)))
        else:
            builder.decoy(piece[0], getattr(decoys, piece[0])())


def build(seed: int) -> list[dict[str, Any]]:
    """The corpus for one seed: positive cases first, then negative ones."""
    values = Values(seed)
    decoys = Decoys(values)
    cases = []
    for _ in range(POSITIVE_CASES):
        builder = Builder()
        _fill_positive(builder, values.rng.choice(POSITIVE_TEMPLATES), values)
        cases.append(builder.case())
    for _ in range(NEGATIVE_CASES):
        builder = Builder()
        _fill_negative(builder, values.rng.choice(NEGATIVE_TEMPLATES), decoys)
        cases.append(builder.case())
    return cases


def write(cases: list[dict[str, Any]], path: Path) -> None:
    path.write_text("".join(json.dumps(case, ensure_ascii=False) + "\n" for case in cases), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dev", type=Path, help="write a development split (another seed) here instead")
    args = parser.parse_args()
    seed, path = (DEV_SEED, args.dev) if args.dev else (HELD_OUT_SEED, OUT)
    cases = build(seed)
    write(cases, path)
    entities = sum(len(case["entities"]) for case in cases)
    decoys = sum(len(case["decoys"]) for case in cases)
    print(f"wrote {path}: {len(cases)} cases, {entities} entities, {decoys} look-alikes (seed {seed})")


if __name__ == "__main__":
    main()
