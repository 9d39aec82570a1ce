"""Structured documents generated without bound, for scenario traffic that does not repeat.

The fixed structured corpus (:mod:`workers.corpora.structured`) is what the bundled target learned:
8,000 training documents from small word lists. Traffic drawn from its 400 test documents repeats
within a few hundred requests. Here document ``index`` of stream ``stream`` of a split is generated
from its own ``Random`` seeded by its id ``generated:<split>:<stream>:<index>``, so there is no upper
bound on their number and the train, validation and test streams are disjoint by construction.
Values come from the seeded Faker pools of :mod:`workers.corpora.values` and each task has many
phrasings; the answers keep the fixed corpus's grammar exactly (the same tables, columns, tools
and argument names, a ``SQL:`` line or a ``Call:`` JSON line after each request) so that a target
trained on the fixed corpus still knows what to write.

Every request carries at least one value drawn from a large pool (a name, a place, a date, an
amount), so that a prompt cut after a document's first request is already unlikely to repeat.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from workers.corpora import structured
from workers.corpora._common import Document
from workers.corpora.values import (
    AIRLINES,
    CATEGORIES,
    DEPARTMENTS,
    ERRANDS,
    MEETING_TOPICS,
    STATUSES,
    SUBJECTS,
    Pools,
    pools,
)

_SCHEMA = structured._SCHEMA
_TOOLS = (
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
)

Maker = Callable[[random.Random, Pools], tuple[str, str]]


def _amount(rng: random.Random, low: int, high: int) -> int:
    # Round amounts are what people ask for more often than odd ones.
    value = rng.randint(low, high)
    return value - value % rng.choice((1, 5, 10, 50)) or value


def _filter(rng: random.Random, p: Pools, table: str) -> tuple[str, str]:
    """A (natural-language phrase, SQL predicate) pair for a table."""
    d = p.date(rng)
    if table == "customers":
        c, k, who = rng.choice(p.cities), rng.choice(p.countries), p.person(rng)
        options = [
            (
                f"{rng.choice(('from', 'who live in', 'based in', 'located in', 'living in'))} {c}",
                f"city = '{c}'",
            ),
            (f"who signed up after {d}", f"signup_date > '{d}'"),
            (f"who {rng.choice(('signed up', 'registered', 'joined'))} before {d}", f"signup_date < '{d}'"),
            (f"{rng.choice(('in', 'from', 'located in'))} {k}", f"country = '{k}'"),
            (f"{rng.choice(('named', 'called'))} {who}", f"name = '{who}'"),
            (f"with the email {(e := p.email(rng))}", f"email = '{e}'"),
        ]
    elif table == "orders":
        s, v = rng.choice(STATUSES), _amount(rng, 5, 5000)
        options = [
            (f"{rng.choice(('that are', 'currently', 'marked as'))} {s}", f"status = '{s}'"),
            (f"with status {s}", f"status = '{s}'"),
            (f"{rng.choice(('placed after', 'made after', 'ordered after'))} {d}", f"order_date > '{d}'"),
            (f"placed before {d}", f"order_date < '{d}'"),
            (f"worth more than {v} dollars", f"total > {v}"),
            (f"{rng.choice(('worth less than', 'under', 'below'))} {v} dollars", f"total < {v}"),
            (f"placed by customer {(n := rng.randint(1, 99_999))}", f"customer_id = {n}"),
            (f"with more than {(q := rng.randint(1, 200))} items", f"quantity > {q}"),
        ]
    elif table == "products":
        k, v, n = rng.choice(CATEGORIES), _amount(rng, 1, 2000), rng.randint(1, 1000)
        options = [
            (f"in the {k} category", f"category = '{k}'"),
            (f"{rng.choice(('cheaper than', 'under', 'priced below'))} {v} dollars", f"price < {v}"),
            (f"{rng.choice(('more expensive than', 'over', 'priced above'))} {v} dollars", f"price > {v}"),
            (f"with fewer than {n} items in stock", f"stock < {n}"),
            (f"with more than {n} {rng.choice(('items', 'units'))} in stock", f"stock > {n}"),
            (f"named {(name := p.product(rng))}", f"name = '{name}'"),
        ]
    elif table == "employees":
        dep, v = rng.choice(DEPARTMENTS), _amount(rng, 20_000, 300_000)
        options = [
            (f"in {dep}", f"department = '{dep}'"),
            (f"working in the {dep} {rng.choice(('department', 'team'))}", f"department = '{dep}'"),
            (f"{rng.choice(('earning over', 'paid more than', 'with a salary above'))} {v}", f"salary > {v}"),
            (f"{rng.choice(('earning under', 'paid less than'))} {v}", f"salary < {v}"),
            (f"hired before {d}", f"hire_date < '{d}'"),
            (f"{rng.choice(('hired after', 'who joined after'))} {d}", f"hire_date > '{d}'"),
            (f"named {(who := p.person(rng))}", f"name = '{who}'"),
            (f"reporting to manager {(m := rng.randint(1, 9_999))}", f"manager_id = {m}"),
        ]
    else:
        o, a, v = rng.choice(p.cities), rng.choice(AIRLINES), _amount(rng, 20, 3000)
        options = [
            (f"{rng.choice(('from', 'leaving from', 'departing from'))} {o}", f"origin = '{o}'"),
            (f"{rng.choice(('to', 'going to', 'arriving in'))} {o}", f"destination = '{o}'"),
            (f"{rng.choice(('operated by', 'flown by', 'on'))} {a}", f"airline = '{a}'"),
            (f"{rng.choice(('under', 'cheaper than', 'below'))} {v} dollars", f"price < {v}"),
            (f"departing after {d}", f"departure > '{d}'"),
        ]
    return rng.choice(options)


_SORT = {
    "customers": [
        ("newest first", "signup_date DESC"),
        ("oldest first", "signup_date ASC"),
        ("by name", "name ASC"),
        ("in alphabetical order", "name ASC"),
        ("sorted by city", "city ASC"),
    ],
    "orders": [
        ("most recent first", "order_date DESC"),
        ("oldest first", "order_date ASC"),
        ("largest total first", "total DESC"),
        ("smallest total first", "total ASC"),
        ("by quantity, largest first", "quantity DESC"),
    ],
    "products": [
        ("cheapest first", "price ASC"),
        ("most expensive first", "price DESC"),
        ("by stock, lowest first", "stock ASC"),
        ("sorted by name", "name ASC"),
    ],
    "employees": [
        ("highest paid first", "salary DESC"),
        ("lowest paid first", "salary ASC"),
        ("by hire date", "hire_date ASC"),
        ("newest hires first", "hire_date DESC"),
        ("sorted by name", "name ASC"),
    ],
    "flights": [
        ("cheapest first", "price ASC"),
        ("most expensive first", "price DESC"),
        ("earliest departure first", "departure ASC"),
        ("latest departure first", "departure DESC"),
    ],
}
_NUMERIC = structured._NUMERIC
_GROUP = structured._GROUP
_SELECT_OPENINGS = (
    "Show",
    "List",
    "Give me",
    "Get",
    "Find",
    "Display",
    "Fetch",
    "Return",
    "Pull up",
    "I need",
    "Please list",
    "Can you show",
    "Look up",
    "Retrieve",
)
_LIMITS = ("only the first {n}", "top {n} only", "at most {n} rows", "limit it to {n}", "just {n} of them")


def _sql_select(rng: random.Random, p: Pools) -> tuple[str, str]:
    table = rng.choice(list(_SCHEMA))
    cols = rng.sample(_SCHEMA[table][1:], rng.randint(1, 3))
    phrase, pred = _filter(rng, p, table)
    words = [c.replace("_", " ") for c in cols]
    col_words = " and ".join(words) if rng.random() < 0.6 else ", ".join(words)
    request = f"{rng.choice(_SELECT_OPENINGS)} the {col_words} of {table} {phrase}"
    sql = f"SELECT {', '.join(cols)} FROM {table} WHERE {pred}"
    if rng.random() < 0.5:
        order_words, order = rng.choice(_SORT[table])
        request += f", {order_words}"
        sql += f" ORDER BY {order}"
    if rng.random() < 0.3:
        n = rng.randint(2, 100)
        request += ", " + rng.choice(_LIMITS).format(n=n)
        sql += f" LIMIT {n}"
    return request + ("?" if request.startswith("Can") else "."), sql + ";"


def _sql_count(rng: random.Random, p: Pools) -> tuple[str, str]:
    table = rng.choice(list(_SCHEMA))
    phrase, pred = _filter(rng, p, table)
    request = rng.choice(
        (
            f"How many {table} are there {phrase}?",
            f"Count the {table} {phrase}.",
            f"What is the number of {table} {phrase}?",
            f"How many {table} do we have {phrase}?",
            f"Give me the count of {table} {phrase}.",
            f"Number of {table} {phrase}?",
            f"Tell me how many {table} there are {phrase}.",
        )
    )
    return request, f"SELECT COUNT(*) FROM {table} WHERE {pred};"


def _sql_aggregate(rng: random.Random, p: Pools) -> tuple[str, str]:
    table = rng.choice(list(_NUMERIC))
    col, group = _NUMERIC[table], _GROUP[table]
    fn, word = rng.choice(
        (("AVG", "average"), ("AVG", "mean"), ("SUM", "total"), ("MAX", "highest"), ("MAX", "largest"))
        + (("MIN", "lowest"), ("MIN", "smallest"))
    )
    phrase, pred = _filter(rng, p, table)
    request = rng.choice(
        (
            f"What is the {word} {col} per {group} for {table} {phrase}?",
            f"Show the {word} {col} for each {group}, counting only {table} {phrase}.",
            f"For {table} {phrase}, give me the {word} {col} by {group}.",
            f"Break down the {word} {col} by {group} for {table} {phrase}.",
        )
    )
    return request, f"SELECT {group}, {fn}({col}) FROM {table} WHERE {pred} GROUP BY {group};"


def _sql_join(rng: random.Random, p: Pools) -> tuple[str, str]:
    s, d, c = rng.choice(STATUSES), p.date(rng), rng.choice(p.cities)
    return rng.choice(
        [
            (
                rng.choice(
                    (
                        f"Show each {s} order's total with the customer's name, for orders after {d}.",
                        f"List the customer names and totals of {s} orders placed after {d}.",
                    )
                ),
                "SELECT c.name, o.total FROM orders o JOIN customers c ON o.customer_id = c.id "
                f"WHERE o.status = '{s}' AND o.order_date > '{d}';",
            ),
            (
                rng.choice(
                    (
                        f"List product names and quantities for orders placed after {d}.",
                        f"Which products were ordered after {d}, and in what quantities?",
                    )
                ),
                "SELECT p.name, o.quantity FROM orders o JOIN products p ON o.product_id = p.id "
                f"WHERE o.order_date > '{d}';",
            ),
            (
                rng.choice(
                    (
                        f"Which customers from {c} ordered something on {d}?",
                        f"Find the customers in {c} who placed an order on {d}.",
                    )
                ),
                "SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
                f"WHERE c.city = '{c}' AND o.order_date = '{d}';",
            ),
        ]
    )


def _sql_write(rng: random.Random, p: Pools) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        pid, n = rng.randint(1, 99_999), rng.randint(0, 5000)
        return (
            rng.choice(
                (f"Set the stock of product {pid} to {n}.", f"Update product {pid} so its stock is {n}.")
            ),
            f"UPDATE products SET stock = {n} WHERE id = {pid};",
        )
    if kind == 1:
        s, d = rng.choice(STATUSES), p.date(rng)
        return (
            rng.choice(
                (f"Delete all {s} orders placed before {d}.", f"Remove every {s} order from before {d}.")
            ),
            f"DELETE FROM orders WHERE status = '{s}' AND order_date < '{d}';",
        )
    if kind == 2:
        eid, v = rng.randint(1, 99_999), _amount(rng, 20_000, 300_000)
        return (
            rng.choice(
                (f"Raise the salary of employee {eid} to {v}.", f"Set employee {eid}'s salary to {v}.")
            ),
            f"UPDATE employees SET salary = {v} WHERE id = {eid};",
        )
    name, city = p.person(rng), rng.choice(p.cities)
    email = p.email(rng, name)
    return (
        rng.choice(
            (
                f"Add a customer named {name} from {city} with email {email}.",
                f"Create a new customer: {name}, {city}, {email}.",
                f"Register {name} from {city} as a customer, email {email}.",
            )
        ),
        f"INSERT INTO customers (name, city, email) VALUES ('{name}', '{city}', '{email}');",
    )


_SQL_MAKERS: tuple[Maker, ...] = (_sql_select, _sql_select, _sql_count, _sql_aggregate, _sql_join, _sql_write)


def _call(name: str, **arguments: object) -> str:
    # Values are written as they are (the fixed corpus held only ASCII, so this is its spelling too):
    # a target copies a city's accented letters from the request, not their JSON escapes.
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def _time(rng: random.Random, first: int, last: int) -> str:
    return f"{rng.randint(first, last):02d}:{rng.choice(('00', '15', '30', '45'))}"


def _tool_request(rng: random.Random, p: Pools) -> tuple[str, str, str]:
    """(tool name, request, JSON call) for one of the tools."""
    tool = rng.choice(_TOOLS)
    if tool == "get_weather":
        city, days, unit = rng.choice(p.cities), rng.randint(1, 14), rng.choice(("celsius", "fahrenheit"))
        request = rng.choice(
            (
                f"What's the weather in {city} for the next {days} days, in {unit}?",
                f"Give me a {days}-day forecast for {city} in {unit}.",
                f"Forecast for {city}, {days} days, {unit} please.",
                f"How will the weather be in {city} over the next {days} days? Use {unit}.",
                f"I'm travelling to {city}: weather for {days} days in {unit}?",
            )
        )
        return tool, request, _call(tool, city=city, days=days, unit=unit)
    if tool == "search_flights":
        o, d, date = rng.choice(p.cities), rng.choice(p.cities), p.date(rng)
        n, cabin = rng.randint(1, 9), rng.choice(("economy", "premium economy", "business", "first"))
        party = f"{n} passenger{'s' if n > 1 else ''}"
        request = rng.choice(
            (
                f"Find {cabin} flights from {o} to {d} on {date} for {party}.",
                f"Search {cabin} flights {o} to {d}, {date}, {party}.",
                f"I need to fly from {o} to {d} on {date}, {cabin}, {party}.",
                f"Are there {cabin} seats from {o} to {d} on {date} for {party}?",
            )
        )
        return tool, request, _call(tool, origin=o, destination=d, date=date, passengers=n, cabin=cabin)
    if tool == "create_event":
        who, date, time = p.person(rng), p.date(rng), _time(rng, 7, 19)
        mins = rng.choice((10, 15, 20, 25, 30, 45, 50, 60, 75, 90, 120))
        title = rng.choice(MEETING_TOPICS + tuple(f"{c} call" for c in rng.sample(p.companies, 3)))
        request = rng.choice(
            (
                f"Schedule '{title}' with {who} on {date} at {time} for {mins} minutes.",
                f"Put '{title}' with {who} in my calendar on {date} at {time}, {mins} minutes.",
                f"Book {mins} minutes with {who} on {date} at {time} for '{title}'.",
            )
        )
        return (
            tool,
            request,
            _call(tool, title=title, date=date, time=time, duration_minutes=mins, attendees=[who]),
        )
    if tool == "send_email":
        to = p.email(rng)
        subject, body = (
            rng.choice(SUBJECTS),
            rng.choice(
                (
                    "I will be late.",
                    "Please see the attached file.",
                    "Thanks for your help.",
                    "Can we move our call?",
                )
            ),
        )
        request = rng.choice(
            (
                f"Email {to} with the subject '{subject}' saying {body}",
                f"Send {to} an email titled '{subject}': {body}",
                f"Write to {to}, subject '{subject}', body: {body}",
            )
        )
        return tool, request, _call(tool, to=to, subject=subject, body=body)
    if tool == "convert_currency":
        amount, (a, b) = _amount(rng, 1, 100_000), rng.sample(p.currencies, 2)
        request = rng.choice(
            (
                f"Convert {amount} {a} to {b}.",
                f"How much is {amount} {a} in {b}?",
                f"What are {amount} {a} worth in {b}?",
                f"Change {amount} {a} into {b}.",
            )
        )
        return tool, request, _call(tool, amount=amount, source=a, target=b)
    if tool == "set_reminder":
        what = rng.choice(ERRANDS + (f"call {p.person(rng)}", f"pay the {rng.choice(p.companies)} invoice"))
        when = f"{p.date(rng)} {_time(rng, 6, 22)}"
        request = rng.choice((f"Remind me to {what} on {when}.", f"Set a reminder for {when}: {what}."))
        return tool, request, _call(tool, text=what, time=when)
    if tool == "search_products":
        item, price = p.product(rng), _amount(rng, 5, 3000)
        sort = rng.choice(("price_asc", "rating", "newest"))
        request = rng.choice(
            (
                f"Search for a {item} under {price} dollars, sorted by {sort}.",
                f"Find me a {item} for less than {price} dollars, sort by {sort}.",
                f"Look for {item} options below {price} dollars ({sort} first).",
            )
        )
        return tool, request, _call(tool, query=item, max_price=price, sort=sort)
    if tool == "book_table":
        last = rng.choice(p.last_names)
        place = rng.choice((f"Casa {last}", f"{last} Bistro", f"The {last} Grill", rng.choice(p.companies)))
        city, date, people, time = rng.choice(p.cities), p.date(rng), rng.randint(1, 12), _time(rng, 11, 22)
        request = rng.choice(
            (
                f"Book a table for {people} at {place} in {city} on {date} at {time}.",
                f"Reserve {place} in {city} for {people} on {date}, {time}.",
                f"Get us a table for {people} at {place} ({city}) on {date} at {time}.",
            )
        )
        return tool, request, _call(tool, restaurant=place, city=city, date=date, time=time, people=people)
    if tool == "translate":
        text, (a, b) = rng.choice(p.phrases), rng.sample(p.languages, 2)
        request = rng.choice(
            (
                f"Translate '{text}' from {a} to {b}.",
                f"How do you say '{text}' in {b}? It's {a}.",
                f"Put '{text}' into {b} (from {a}).",
            )
        )
        return tool, request, _call(tool, text=text, source=a, target=b)
    sym = p.ticker(rng)
    request = rng.choice(
        (
            f"What is {sym} trading at?",
            f"Get the latest price of {sym}.",
            f"Stock price for {sym}?",
            f"How is {sym} doing today?",
            f"Quote {sym} for me.",
        )
    )
    return tool, request, _call(tool, symbol=sym)


def _sql_document(rng: random.Random, p: Pools, history: int, answered: int, learned: bool) -> str:
    exchanges = [rng.choice(_SQL_MAKERS)(rng, p) for _ in range(history)]
    if learned:
        exchanges += [rng.choice(structured._SQL_MAKERS)(rng) for _ in range(answered)]
    else:
        exchanges += [rng.choice(_SQL_MAKERS)(rng, p) for _ in range(answered)]
    # As in the fixed corpus: every table the queries use, plus one more (so the header alone does
    # not give the answer away).
    used = {t for _, sql in exchanges for t in _SCHEMA if f" {t} " in f"{sql[:-1]} "}
    tables = used | {rng.choice(list(_SCHEMA))}
    header = "Database tables: " + "; ".join(f"{t}({', '.join(_SCHEMA[t])})" for t in sorted(tables))
    return "\n".join([header, *(f"User: {request}\nSQL: {sql}" for request, sql in exchanges)]) + "\n"


def _json_document(rng: random.Random, p: Pools, history: int, answered: int, learned: bool) -> str:
    exchanges = [_tool_request(rng, p) for _ in range(history)]
    if learned:
        exchanges += [structured._tool_request(rng) for _ in range(answered)]
    else:
        exchanges += [_tool_request(rng, p) for _ in range(answered)]
    names = sorted({name for name, _, _ in exchanges} | set(rng.sample(_TOOLS, 2)))
    lines = ["Available tools: " + ", ".join(names)]
    lines += [f"User: {request}\nCall: {call}" for _, request, call in exchanges]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Generated:
    """A generated document and the number of its leading requests that are history: a prompt is
    cut after one of the others (the answered requests)."""

    document: Document
    history: int


def document(split: str, stream: int, index: int, *, learned_answers: bool = True) -> Generated:
    """Document ``index`` of generated stream ``stream`` of ``split``: the same text on every call,
    for any index; its id names all three, so documents of two streams or splits never share an id.

    With ``learned_answers`` (the default, for the bundled target) the document opens with 1-3
    requests on the wide pools, the conversation so far, and ends with 1-2 requests drawn as the
    fixed corpus draws them, which are the ones a prompt is cut after: the bundled 12M target has
    memorised its corpus's 30 cities, 34 first names and years 2020-2025 and does not copy values it
    never saw (on Faker-valued requests its greedy answer line matched the reference 0 times in 40,
    and 35 in 40 on the fixed corpus's), so a request it answers must come from what it learned,
    while the history makes every prompt as varied as the wide pools. Without it every request is
    on the wide pools and any may be answered: traffic for a target that copies what it is given.
    """
    doc_id = f"generated:{split}:{stream}:{index}"
    rng = random.Random(doc_id)
    history = rng.randint(1, 3) if learned_answers else 0
    answered = rng.randint(1, 2) if learned_answers else rng.randint(1, 4)
    if rng.random() < 0.5:
        kind, text = "sql", _sql_document(rng, pools(), history, answered, learned_answers)
    else:
        kind, text = "json", _json_document(rng, pools(), history, answered, learned_answers)
    return Generated(Document(structured.DOMAIN, doc_id, kind, text, split), history)
