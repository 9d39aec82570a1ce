"""The value pools that generated structured traffic draws from: names, places, companies, products.

Built once per process from Faker, seeded, over several locales, so two machines with the same
Faker release draw the same values and a request rarely repeats another's. The pools are large
(thousands of names and places) but the words a request is made of stay ones a small target that
learned the structured domain's templates can copy: Latin-script locales only, and e-mail
addresses folded to ASCII.
"""

from __future__ import annotations

import random
import unicodedata
from dataclasses import dataclass
from datetime import date, timedelta
from functools import cache

# Latin-script locales: a request copies its values into the SQL or the JSON call, and the bundled
# target's tokenizer splits other scripts into single bytes it never learned to copy.
LOCALES = (
    "en_US",
    "en_GB",
    "en_IN",
    "de_DE",
    "fr_FR",
    "es_ES",
    "es_MX",
    "it_IT",
    "pt_BR",
    "nl_NL",
    "pl_PL",
    "sv_SE",
    "da_DK",
    "cs_CZ",
)
VALUES_SEED = 20_240_611
_PER_LOCALE = 400
# Every real calendar day of 2015-2030 (the fixed corpus drew days 1-28 of 2020-2025).
_EPOCH = date(2015, 1, 1)
_DAYS = (date(2031, 1, 1) - _EPOCH).days

PRODUCTS = (
    "desk lamp",
    "coffee grinder",
    "yoga mat",
    "chess set",
    "water bottle",
    "garden hose",
    "notebook",
    "headphones",
    "rice cooker",
    "tennis racket",
    "backpack",
    "wall clock",
    "teapot",
    "blender",
    "toaster",
    "kettle",
    "umbrella",
    "sleeping bag",
    "camping stove",
    "keyboard",
    "mouse",
    "monitor stand",
    "phone case",
    "charger",
    "bike helmet",
    "running shoes",
    "rain jacket",
    "wool scarf",
    "cutting board",
    "frying pan",
    "knife set",
    "spice rack",
    "bookshelf",
    "office chair",
    "floor rug",
    "throw pillow",
    "candle",
    "picture frame",
    "plant pot",
    "watering can",
    "drill",
    "screwdriver set",
    "toolbox",
    "paint roller",
    "puzzle",
    "board game",
    "drone",
    "speaker",
    "smartwatch",
    "fitness tracker",
    "microphone",
    "webcam",
    "tripod",
    "suitcase",
    "travel pillow",
    "sunglasses",
)
_PRODUCT_QUALIFIERS = (
    "compact",
    "wireless",
    "stainless steel",
    "bamboo",
    "ergonomic",
    "foldable",
    "vintage",
    "deluxe",
    "portable",
    "waterproof",
    "organic",
    "recycled",
    "ceramic",
    "cast iron",
    "leather",
    "cotton",
    "glass",
    "wooden",
    "smart",
    "mini",
    "large",
    "heavy-duty",
    "lightweight",
    "insulated",
    "rechargeable",
    "handmade",
    "classic",
    "premium",
)
AIRLINES = (
    "Lufthansa",
    "Iberia",
    "KLM",
    "Delta",
    "Qantas",
    "Emirates",
    "Finnair",
    "TAP",
    "Ryanair",
    "easyJet",
    "Vueling",
    "Wizz Air",
    "Air France",
    "British Airways",
    "United",
    "American Airlines",
    "Turkish Airlines",
    "Swiss",
    "SAS",
    "Aer Lingus",
    "LOT",
    "Austrian",
    "Brussels Airlines",
    "Norwegian",
    "Icelandair",
    "Air Canada",
    "WestJet",
    "LATAM",
    "Avianca",
    "Aeromexico",
    "Singapore Airlines",
    "Cathay Pacific",
    "Japan Airlines",
    "ANA",
    "Korean Air",
    "Etihad",
    "Qatar Airways",
    "Air India",
    "Ethiopian Airlines",
    "Kenya Airways",
    "South African Airways",
    "Virgin Atlantic",
    "JetBlue",
    "Alaska Airlines",
)
STATUSES = (
    "pending",
    "shipped",
    "delivered",
    "cancelled",
    "returned",
    "processing",
    "refunded",
    "on hold",
    "backordered",
    "in transit",
)
CATEGORIES = (
    "books garden kitchen toys electronics sports music office beauty pets automotive baby grocery "
    "outdoor health jewelry furniture shoes tools crafts games clothing lighting bedding stationery"
).split()
DEPARTMENTS = (
    "sales engineering marketing finance support legal research operations design procurement "
    "security logistics training compliance facilities product analytics recruiting"
).split()
MEETING_TOPICS = (
    "Project sync",
    "Budget review",
    "Lunch",
    "Design review",
    "Interview",
    "Quarterly planning",
    "Onboarding",
    "Retrospective",
    "Sprint demo",
    "Vendor call",
    "One-on-one",
    "Board prep",
    "Roadmap review",
    "Hiring debrief",
    "Offsite planning",
    "Contract review",
)
ERRANDS = (
    "call the bank",
    "water the plants",
    "pay rent",
    "book the dentist",
    "buy milk",
    "renew the passport",
    "pick up the dry cleaning",
    "submit the expense report",
    "back up the laptop",
    "walk the dog",
    "order printer ink",
    "cancel the gym membership",
    "send the invoice",
    "check the tyre pressure",
    "file the taxes",
    "refill the prescription",
)
SUBJECTS = (
    "Invoice",
    "Meeting notes",
    "Travel plans",
    "Quick question",
    "Report",
    "Follow-up",
    "Contract draft",
    "Weekly update",
    "Budget figures",
    "Interview schedule",
    "Welcome aboard",
    "Shipping delay",
)


def _ascii(text: str) -> str:
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()


@dataclass(frozen=True)
class Pools:
    """Seeded value pools; every draw goes through a caller's ``random.Random``."""

    first_names: tuple[str, ...]
    last_names: tuple[str, ...]
    cities: tuple[str, ...]
    countries: tuple[str, ...]
    companies: tuple[str, ...]
    mail_domains: tuple[str, ...]
    currencies: tuple[str, ...]
    languages: tuple[str, ...]
    phrases: tuple[str, ...]

    def person(self, rng: random.Random) -> str:
        return f"{rng.choice(self.first_names)} {rng.choice(self.last_names)}"

    def email(self, rng: random.Random, person: str | None = None) -> str:
        name = _ascii(person or self.person(rng)).lower().replace("'", "").split()
        first, last = name[0], name[-1]
        local = rng.choice((".".join(name), "".join(name), f"{first[:1]}{last}", f"{first}_{last}"))
        if rng.random() < 0.3:
            local += str(rng.randint(1, 99))
        return f"{local}@{rng.choice(self.mail_domains)}"

    def product(self, rng: random.Random) -> str:
        noun = rng.choice(PRODUCTS)
        return noun if rng.random() < 0.3 else f"{rng.choice(_PRODUCT_QUALIFIERS)} {noun}"

    def ticker(self, rng: random.Random) -> str:
        return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.randint(2, 5)))

    def date(self, rng: random.Random) -> str:
        return (_EPOCH + timedelta(days=rng.randrange(_DAYS))).isoformat()


def _unique(values: list[str]) -> tuple[str, ...]:
    return tuple(sorted({v.strip() for v in values if v.strip() and "'" not in v and '"' not in v}))


def _stable_city_order(fake: object) -> None:
    """Sort any city list a Faker provider builds from a set (it_IT's does), so a seeded draw
    picks the same cities in every process whatever PYTHONHASHSEED is."""
    for provider in getattr(fake, "providers", []):
        cities = getattr(provider, "cities", None)
        if isinstance(cities, list):
            provider.cities = sorted(cities)


@cache
def pools() -> Pools:
    """The pools, built on first use (about a second: Faker loads each locale's providers)."""
    from faker import Faker

    first: list[str] = []
    last: list[str] = []
    cities: list[str] = []
    companies: list[str] = []
    domains: list[str] = []
    for number, locale in enumerate(LOCALES):
        fake = Faker(locale)
        _stable_city_order(fake)
        fake.seed_instance(VALUES_SEED + number)
        first += [fake.first_name() for _ in range(_PER_LOCALE)]
        last += [fake.last_name() for _ in range(_PER_LOCALE)]
        cities += [fake.city() for _ in range(_PER_LOCALE)]
        companies += [fake.company() for _ in range(_PER_LOCALE // 2)]
        domains += [fake.free_email_domain() for _ in range(20)]
        domains += [_ascii(fake.domain_name()) for _ in range(_PER_LOCALE // 4)]
    english = Faker("en_US")
    english.seed_instance(VALUES_SEED - 1)
    return Pools(
        first_names=_unique(first),
        last_names=_unique(last),
        cities=_unique(cities),
        countries=_unique([english.country() for _ in range(3000)]),
        companies=_unique(companies),
        mail_domains=_unique(domains),
        currencies=_unique([english.currency_code() for _ in range(3000)]),
        languages=_unique([english.language_name() for _ in range(3000)]),
        phrases=_unique([english.catch_phrase() for _ in range(4000)]),
    )
