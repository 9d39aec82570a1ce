"""Structured domain: natural-language requests answered by a SQL query or a JSON tool call.

Made from templates with a seeded RNG, so it needs no data on disk and is new to any drafter that
saw only prose or code, yet fully predictable for a target that learned the templates: the domain
with the cleanest contrast between a generic drafter and a tuned one. Document ``i`` of a split is
generated from ``Random(f"{seed}:{split}:{i}")``, so each split is fixed by the seed and documents
never move between splits.

This fixed corpus is what the bundled target was trained on, and what the benches measure on.
Scenario traffic draws from :mod:`workers.corpora.generated` instead: documents without bound,
whose answered requests are drawn by this module's makers.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from workers.corpora._common import Document

DOMAIN = "structured"
DOCS_PER_SPLIT = {"train": 8000, "validation": 400, "test": 400}
DEFAULT_SEED = 1234
# Markers that open an answer; prompts of this domain end right after one of them.
ANSWER_MARKERS = ("\nSQL:", "\nCall:")

_FIRST = (
    "Ana Maria James Olivia Noah Emma Liam Sofia Lucas Mia Ethan Chloe Mateo Aisha Yuki Omar Lena Ivan "
    "Priya Chen Fatima Diego Hannah Kofi Elena Tomas Sara Jonas Amara Leo Nina Rafael Ines Hugo Zara"
).split()
_LAST = (
    "Silva Smith Garcia Muller Rossi Kim Nguyen Patel Cohen Okafor Larsen Novak Tanaka Costa Dubois "
    "Weber Khan Moreau Jensen Santos Ivanova Haddad Fischer Rahman Lopez Berg Mensah Ortiz Sato Varga"
).split()
_CITIES = (
    "Berlin Paris Lisbon Madrid Rome Vienna Oslo Dublin Prague Warsaw Athens Tokyo Seoul Lima Cairo Nairobi "
    "Toronto Chicago Boston Denver Austin Seattle Sydney Auckland Mumbai Istanbul Zurich Helsinki Lagos Quito"
).split()
_COUNTRIES = (
    "Germany France Portugal Spain Italy Austria Norway Ireland Japan Brazil Canada Kenya India".split()
)
_STATUSES = ("pending", "shipped", "delivered", "cancelled", "returned")
_CATEGORIES = ("books", "garden", "kitchen", "toys", "electronics", "sports", "music", "office")
_DEPARTMENTS = ("sales", "engineering", "marketing", "finance", "support", "legal", "research")
_AIRLINES = ("Lufthansa", "Iberia", "KLM", "Delta", "Qantas", "Emirates", "Finnair", "TAP")
_PRODUCTS = (
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
    "guitar strings",
    "teapot",
)
_CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "BRL", "INR", "NOK")
_LANGUAGES = ("English", "French", "German", "Spanish", "Italian", "Japanese", "Portuguese", "Dutch")
_SYMBOLS = ("AAPL", "MSFT", "NVDA", "AMZN", "GOOG", "TSLA", "SAP", "ASML", "SONY", "SHOP")
_RESTAURANTS = ("Casa Lena", "The Blue Door", "Sakura House", "Trattoria Roma", "Le Petit Four", "Green Leaf")

_SCHEMA = {
    "customers": ("id", "name", "email", "city", "country", "signup_date"),
    "orders": ("id", "customer_id", "product_id", "quantity", "total", "status", "order_date"),
    "products": ("id", "name", "category", "price", "stock"),
    "employees": ("id", "name", "department", "salary", "hire_date", "manager_id"),
    "flights": ("id", "origin", "destination", "departure", "price", "airline"),
}
# Plural nouns and the column a request may filter or sort on, per table.
_NOUN = {
    "customers": "customers",
    "orders": "orders",
    "products": "products",
    "employees": "employees",
    "flights": "flights",
}


def _date(rng: random.Random) -> str:
    return f"{rng.randint(2020, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _pick(rng: random.Random, *options: str) -> str:
    return rng.choice(options)


def _filter(rng: random.Random, table: str) -> tuple[str, str]:
    """A (natural-language phrase, SQL predicate) pair for a table."""
    if table == "customers":
        c = rng.choice(_CITIES)
        return rng.choice(
            [
                (f"from {c}", f"city = '{c}'"),
                (f"who live in {c}", f"city = '{c}'"),
                (f"who signed up after {(d := _date(rng))}", f"signup_date > '{d}'"),
                (f"in {(k := rng.choice(_COUNTRIES))}", f"country = '{k}'"),
            ]
        )
    if table == "orders":
        s = rng.choice(_STATUSES)
        return rng.choice(
            [
                (f"that are {s}", f"status = '{s}'"),
                (f"with status {s}", f"status = '{s}'"),
                (f"placed after {(d := _date(rng))}", f"order_date > '{d}'"),
                (f"worth more than {(v := rng.randint(2, 60) * 10)} dollars", f"total > {v}"),
            ]
        )
    if table == "products":
        k = rng.choice(_CATEGORIES)
        return rng.choice(
            [
                (f"in the {k} category", f"category = '{k}'"),
                (f"cheaper than {(v := rng.randint(1, 30) * 5)} dollars", f"price < {v}"),
                (f"with fewer than {(n := rng.randint(1, 50))} items in stock", f"stock < {n}"),
            ]
        )
    if table == "employees":
        d = rng.choice(_DEPARTMENTS)
        return rng.choice(
            [
                (f"in {d}", f"department = '{d}'"),
                (f"working in the {d} department", f"department = '{d}'"),
                (f"earning over {(v := rng.randint(30, 150) * 1000)}", f"salary > {v}"),
                (f"hired before {(h := _date(rng))}", f"hire_date < '{h}'"),
            ]
        )
    o, a = rng.choice(_CITIES), rng.choice(_AIRLINES)
    return rng.choice(
        [
            (f"from {o}", f"origin = '{o}'"),
            (f"to {o}", f"destination = '{o}'"),
            (f"operated by {a}", f"airline = '{a}'"),
            (f"under {(v := rng.randint(5, 80) * 10)} dollars", f"price < {v}"),
        ]
    )


_SORT = {
    "customers": [("newest first", "signup_date DESC"), ("by name", "name ASC")],
    "orders": [("most recent first", "order_date DESC"), ("largest total first", "total DESC")],
    "products": [("cheapest first", "price ASC"), ("most expensive first", "price DESC")],
    "employees": [("highest paid first", "salary DESC"), ("by hire date", "hire_date ASC")],
    "flights": [("cheapest first", "price ASC"), ("earliest departure first", "departure ASC")],
}
_NUMERIC = {"orders": "total", "products": "price", "employees": "salary", "flights": "price"}
_GROUP = {
    "orders": "status",
    "products": "category",
    "employees": "department",
    "flights": "airline",
    "customers": "city",
}


def _sql_select(rng: random.Random) -> tuple[str, str]:
    table = rng.choice(list(_SCHEMA))
    cols = rng.sample(_SCHEMA[table][1:], rng.randint(1, 3))
    phrase, pred = _filter(rng, table)
    col_words = " and ".join(c.replace("_", " ") for c in cols)
    verb = _pick(rng, "Show", "List", "Give me", "Get", "Find")
    request = f"{verb} the {col_words} of {_NOUN[table]} {phrase}"
    sql = f"SELECT {', '.join(cols)} FROM {table} WHERE {pred}"
    if rng.random() < 0.5:
        words, order = rng.choice(_SORT[table])
        request += f", {words}"
        sql += f" ORDER BY {order}"
    if rng.random() < 0.3:
        n = rng.choice((3, 5, 10, 20, 50))
        request += f", only the first {n}"
        sql += f" LIMIT {n}"
    return request + ".", sql + ";"


def _sql_count(rng: random.Random) -> tuple[str, str]:
    table = rng.choice(list(_SCHEMA))
    phrase, pred = _filter(rng, table)
    request = _pick(
        rng, f"How many {_NOUN[table]} are there {phrase}?", f"Count the {_NOUN[table]} {phrase}."
    )
    return request, f"SELECT COUNT(*) FROM {table} WHERE {pred};"


def _sql_aggregate(rng: random.Random) -> tuple[str, str]:
    table = rng.choice(list(_NUMERIC))
    col, group = _NUMERIC[table], _GROUP[table]
    fn, word = rng.choice((("AVG", "average"), ("SUM", "total"), ("MAX", "highest"), ("MIN", "lowest")))
    request = _pick(rng, f"What is the {word} {col} per {group}?", f"Show the {word} {col} for each {group}.")
    return request, f"SELECT {group}, {fn}({col}) FROM {table} GROUP BY {group};"


def _sql_join(rng: random.Random) -> tuple[str, str]:
    s, d = rng.choice(_STATUSES), _date(rng)
    return rng.choice(
        [
            (
                f"Show each {s} order's total with the customer's name.",
                "SELECT c.name, o.total FROM orders o JOIN customers c ON o.customer_id = c.id "
                f"WHERE o.status = '{s}';",
            ),
            (
                f"List product names and quantities for orders placed after {d}.",
                "SELECT p.name, o.quantity FROM orders o JOIN products p ON o.product_id = p.id "
                f"WHERE o.order_date > '{d}';",
            ),
            (
                f"Which customers from {(c := rng.choice(_CITIES))} ordered something on {d}?",
                "SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
                f"WHERE c.city = '{c}' AND o.order_date = '{d}';",
            ),
        ]
    )


def _sql_write(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        pid, n = rng.randint(1, 999), rng.randint(0, 500)
        return f"Set the stock of product {pid} to {n}.", f"UPDATE products SET stock = {n} WHERE id = {pid};"
    if kind == 1:
        s, d = rng.choice(_STATUSES), _date(rng)
        return (
            f"Delete all {s} orders placed before {d}.",
            f"DELETE FROM orders WHERE status = '{s}' AND order_date < '{d}';",
        )
    name, city = _person(rng), rng.choice(_CITIES)
    email = name.lower().replace(" ", ".") + "@example.com"
    return (
        f"Add a customer named {name} from {city} with email {email}.",
        f"INSERT INTO customers (name, city, email) VALUES ('{name}', '{city}', '{email}');",
    )


_SQL_MAKERS: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _sql_select,
    _sql_select,
    _sql_count,
    _sql_aggregate,
    _sql_join,
    _sql_write,
)


def _call(name: str, **arguments: object) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def _tool_request(rng: random.Random) -> tuple[str, str, str]:
    """(tool name, request, JSON call) for one of the tools."""
    kind = rng.randrange(10)
    if kind == 0:
        city, days = rng.choice(_CITIES), rng.randint(1, 7)
        unit = rng.choice(("celsius", "fahrenheit"))
        return (
            "get_weather",
            _pick(
                rng,
                f"What's the weather in {city} for the next {days} days, in {unit}?",
                f"Give me a {days}-day forecast for {city} in {unit}.",
            ),
            _call("get_weather", city=city, days=days, unit=unit),
        )
    if kind == 1:
        o, d, date = *rng.sample(_CITIES, 2), _date(rng)
        p, cabin = rng.randint(1, 4), rng.choice(("economy", "business"))
        return (
            "search_flights",
            (f"Find {cabin} flights from {o} to {d} on {date} for {p} passenger{'s' if p > 1 else ''}."),
            _call("search_flights", origin=o, destination=d, date=date, passengers=p, cabin=cabin),
        )
    if kind == 2:
        who, date = _person(rng), _date(rng)
        time, mins = f"{rng.randint(8, 18):02d}:{rng.choice(('00', '30'))}", rng.choice((15, 30, 45, 60, 90))
        title = rng.choice(("Project sync", "Budget review", "Lunch", "Design review", "Interview"))
        return (
            "create_event",
            (f"Schedule '{title}' with {who} on {date} at {time} for {mins} minutes."),
            _call("create_event", title=title, date=date, time=time, duration_minutes=mins, attendees=[who]),
        )
    if kind == 3:
        who = _person(rng)
        to = who.lower().replace(" ", ".") + "@example.com"
        subject = rng.choice(("Invoice", "Meeting notes", "Travel plans", "Quick question", "Report"))
        return (
            "send_email",
            f"Email {to} with the subject '{subject}' saying I will be late.",
            _call("send_email", to=to, subject=subject, body="I will be late."),
        )
    if kind == 4:
        amount, (a, b) = rng.randint(1, 5000), rng.sample(_CURRENCIES, 2)
        return (
            "convert_currency",
            _pick(rng, f"Convert {amount} {a} to {b}.", f"How much is {amount} {a} in {b}?"),
            _call("convert_currency", amount=amount, source=a, target=b),
        )
    if kind == 5:
        what = rng.choice(("call the bank", "water the plants", "pay rent", "book the dentist", "buy milk"))
        when = f"{_date(rng)} {rng.randint(6, 21):02d}:00"
        return "set_reminder", f"Remind me to {what} on {when}.", _call("set_reminder", text=what, time=when)
    if kind == 6:
        item, price = rng.choice(_PRODUCTS), rng.randint(1, 40) * 5
        sort = rng.choice(("price_asc", "rating", "newest"))
        return (
            "search_products",
            f"Search for a {item} under {price} dollars, sorted by {sort}.",
            _call("search_products", query=item, max_price=price, sort=sort),
        )
    if kind == 7:
        place, city, date = rng.choice(_RESTAURANTS), rng.choice(_CITIES), _date(rng)
        people, time = rng.randint(1, 8), f"{rng.randint(17, 22)}:{rng.choice(('00', '30'))}"
        return (
            "book_table",
            f"Book a table for {people} at {place} in {city} on {date} at {time}.",
            _call("book_table", restaurant=place, city=city, date=date, time=time, people=people),
        )
    if kind == 8:
        text = rng.choice(
            ("Where is the station?", "Thank you very much", "The meeting is at noon", "Good night")
        )
        a, b = rng.sample(_LANGUAGES, 2)
        return (
            "translate",
            f"Translate '{text}' from {a} to {b}.",
            _call("translate", text=text, source=a, target=b),
        )
    sym = rng.choice(_SYMBOLS)
    return (
        "get_stock_price",
        _pick(rng, f"What is {sym} trading at?", f"Get the latest price of {sym}."),
        _call("get_stock_price", symbol=sym),
    )


def _sql_document(rng: random.Random) -> str:
    exchanges = [rng.choice(_SQL_MAKERS)(rng) for _ in range(rng.randint(1, 4))]
    # The header lists every table the queries use (a request never names a table it cannot see),
    # plus one unused table so the header alone does not give the answer away.
    used = {t for _, sql in exchanges for t in _SCHEMA if f" {t} " in f"{sql[:-1]} "}
    tables = used | {rng.choice(list(_SCHEMA))}
    header = "Database tables: " + "; ".join(f"{t}({', '.join(_SCHEMA[t])})" for t in sorted(tables))
    lines = [header]
    for request, sql in exchanges:
        lines.append(f"User: {request}\nSQL: {sql}")
    return "\n".join(lines) + "\n"


def _json_document(rng: random.Random) -> str:
    exchanges = [_tool_request(rng) for _ in range(rng.randint(1, 4))]
    names = sorted(
        {name for name, _, _ in exchanges}
        | set(
            rng.sample(
                [
                    "get_weather",
                    "search_flights",
                    "create_event",
                    "send_email",
                    "convert_currency",
                    "set_reminder",
                    "search_products",
                    "book_table",
                    "translate",
                    "get_stock_price",
                ],
                2,
            )
        )
    )
    lines = ["Available tools: " + ", ".join(names)]
    for _, request, call in exchanges:
        lines.append(f"User: {request}\nCall: {call}")
    return "\n".join(lines) + "\n"


def build(seed: int = DEFAULT_SEED) -> list[Document]:
    """All structured documents, split by construction (see module docstring)."""
    docs = []
    for split, count in DOCS_PER_SPLIT.items():
        for i in range(count):
            rng = random.Random(f"{seed}:{split}:{i}")
            if rng.random() < 0.5:
                kind, text = "sql", _sql_document(rng)
            else:
                kind, text = "json", _json_document(rng)
            docs.append(Document(DOMAIN, f"{split}:{i}", kind, text, split))
    return docs
