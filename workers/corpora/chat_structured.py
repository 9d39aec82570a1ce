"""Structured work for an instruction-tuned target, generated: JSON extraction from a text, JSON tool
calls against tool schemas in the system message, and SQL for a table schema and a question.

Every request is made by one maker from a caller's seeded ``Random`` and is well specified, the way
a client that wants a parseable answer writes it: the system message says what to return and in
what shape, every field asked for is in the text, and two or three worked turns of the same task
(on other generated values) come before the real request, since a small target copies a shown
format far more reliably than it follows a described one: SmolLM2-135M-Instruct with no worked turn
answered extractions with prose or nested objects, and invented tool names. Each request's expected
answer is known and kept as its ``reference``: a one-line JSON object or one SQL statement.

Tool calls and SQL reuse the requests of :mod:`workers.corpora.generated` (Faker-valued, many
phrasings per task); extraction texts are built here from the same pools.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from workers.corpora import generated
from workers.corpora.chat_general import Message, jobs
from workers.corpora.values import AIRLINES, MEETING_TOPICS, Pools, pools

# (task kind, messages, expected answer)
Made = tuple[str, list[Message], str]
Maker = Callable[[random.Random], Made]

TOOL_SCHEMAS: dict[str, dict[str, object]] = {
    "get_weather": {
        "description": "Weather forecast for a city",
        "parameters": {"city": "string", "days": "integer", "unit": "celsius | fahrenheit"},
    },
    "search_flights": {
        "description": "Find flights",
        "parameters": {
            "origin": "string",
            "destination": "string",
            "date": "YYYY-MM-DD",
            "passengers": "integer",
            "cabin": "economy | premium economy | business | first",
        },
    },
    "create_event": {
        "description": "Add a calendar event",
        "parameters": {
            "title": "string",
            "date": "YYYY-MM-DD",
            "time": "HH:MM",
            "duration_minutes": "integer",
            "attendees": "list of names",
        },
    },
    "send_email": {
        "description": "Send an email",
        "parameters": {"to": "email address", "subject": "string", "body": "string"},
    },
    "convert_currency": {
        "description": "Convert an amount between currencies",
        "parameters": {"amount": "number", "source": "currency code", "target": "currency code"},
    },
    "set_reminder": {
        "description": "Set a reminder",
        "parameters": {"text": "string", "time": "YYYY-MM-DD HH:MM"},
    },
    "search_products": {
        "description": "Search the shop",
        "parameters": {"query": "string", "max_price": "number", "sort": "price_asc | rating | newest"},
    },
    "book_table": {
        "description": "Reserve a restaurant table",
        "parameters": {
            "restaurant": "string",
            "city": "string",
            "date": "YYYY-MM-DD",
            "time": "HH:MM",
            "people": "integer",
        },
    },
    "translate": {
        "description": "Translate a text",
        "parameters": {"text": "string", "source": "language", "target": "language"},
    },
    "get_stock_price": {
        "description": "Latest price of a stock",
        "parameters": {"symbol": "ticker symbol"},
    },
}
_TOOL_SYSTEMS = (
    "You can call these tools:\n{tools}\nAnswer with one JSON object "
    '{{"name": ..., "arguments": {{...}}}} and nothing else.',
    "Tools available:\n{tools}\nTo use a tool, reply with a single line of JSON: "
    '{{"name": "<tool>", "arguments": {{...}}}}. No other text.',
    "You are a function-calling assistant. Functions:\n{tools}\n"
    "Reply only with the JSON call for the user's request.",
    "You have access to the following tools.\n{tools}\nRespond with exactly one tool call as JSON.",
)
_SQL_SYSTEMS = (
    "Write one SQLite query that answers the question. Tables:\n{tables}\nReply with the SQL only.",
    "You translate questions into SQL. Schema:\n{tables}\n"
    "Answer with a single SQL statement and nothing else.",
    "Database schema:\n{tables}\nReturn only the SQL query for each request.",
    "You are a SQL assistant for this database:\n{tables}\nReply with one SQL statement, no explanation.",
)
_EXTRACT_SYSTEMS = (
    "Extract the requested fields from the text as one line of JSON. Reply with the JSON only.",
    "You extract data. Return a single JSON object with exactly the requested keys and nothing else.",
    "Read the text and answer with one line of JSON holding the fields asked for. No explanation.",
    "Return the requested fields as a compact JSON object. Numbers as numbers, no other text.",
)
_EXTRACT_USERS = (
    "Text: {text}\nFields: {fields}",
    "Extract {fields} from this text:\n{text}",
    "{text}\n\nReturn JSON with the keys {fields}.",
    "Fields: {fields}\nText: {text}",
)


def _tool_line(name: str) -> str:
    return json.dumps({"name": name, **TOOL_SCHEMAS[name]})


def _turns(shots: list[tuple[str, str]]) -> list[Message]:
    return [
        {"role": role, "content": text}
        for question, answer in shots
        for role, text in (("user", question), ("assistant", answer))
    ]


def _tool_call(rng: random.Random) -> Made:
    p = pools()
    tool, request, call = generated._tool_request(rng, p)
    # Two or three worked calls of different tools, the last one of the requested tool: with a
    # single worked call the 135M target copied its values, not the request's; with the requested
    # tool's call anywhere among several it often called another tool (1 exact call in 6), with it
    # last 3 in 6 on the same requests.
    wanted = 2 + (rng.random() < 0.5)
    shots: dict[str, tuple[str, str]] = {}
    while len(shots) < wanted:
        name, shot_request, shot_call = generated._tool_request(rng, p)
        if name not in shots and (name == tool or tool in shots or len(shots) < wanted - 1):
            shots[name] = (shot_request, shot_call)
    order = [*rng.sample([n for n in shots if n != tool], len(shots) - 1), tool]
    others = [t for t in TOOL_SCHEMAS if t not in shots]
    names = order + rng.sample(others, rng.randint(0, 2))  # the schemas shown, in a random order
    rng.shuffle(names)
    system = rng.choice(_TOOL_SYSTEMS).format(tools="\n".join(_tool_line(n) for n in names))
    messages = [{"role": "system", "content": system}, *_turns([shots[n] for n in order])]
    messages.append({"role": "user", "content": request})
    return "tool_call", messages, call


def _tables(sql: str) -> set[str]:
    return {t for t in generated._SCHEMA if f" {t} " in f"{sql.rstrip(';')} "}


def _sql(rng: random.Random) -> Made:
    p = pools()
    maker = rng.choice(generated._SQL_MAKERS)
    question, sql = maker(rng, p)
    tables = _tables(sql)
    # Two worked questions: one of another shape, then one of the same shape on the same tables
    # (the first of up to 64 draws), last, where the target looks hardest.
    same = next(
        (made for made in (maker(rng, p) for _ in range(64)) if _tables(made[1]) == tables),
        maker(rng, p),
    )
    other = rng.choice([m for m in generated._SQL_MAKERS if m is not maker])(rng, p)
    shots = [other, same]
    listed = sorted(tables.union(*(_tables(answer) for _, answer in shots)))
    schema = "\n".join(f"{t}({', '.join(generated._SCHEMA[t])})" for t in listed)
    messages: list[Message] = [
        {"role": "system", "content": rng.choice(_SQL_SYSTEMS).format(tables=schema)},
        *_turns(shots),
        {"role": "user", "content": question},
    ]
    return "sql", messages, sql


def _person(rng: random.Random, p: Pools) -> tuple[dict[str, object], tuple[str, ...]]:
    name = p.person(rng)
    v: dict[str, object] = {
        "name": name,
        "age": rng.randint(19, 79),
        "city": rng.choice(p.cities),
        "job": rng.choice(jobs()),
        "email": p.email(rng, name),
    }
    texts = (
        "{name}, {age}, works as a {job} in {city}. Reach them at {email}.",
        "{name} is a {age}-year-old {job} who lives in {city} (email: {email}).",
        "Meet {name}: {age} years old, based in {city}, working as a {job}. Contact: {email}.",
        "Our new {job}, {name} ({age}), joins us from {city}; write to {email}.",
        "Contact card - {name}, {job}, age {age}, {city}, {email}",
        "I spoke with {name} today. They are {age}, live in {city} and work as a {job}. Email is {email}.",
    )
    return v, texts


def _order(rng: random.Random, p: Pools) -> tuple[dict[str, object], tuple[str, ...]]:
    quantity = rng.randint(1, 12)
    v: dict[str, object] = {
        "order_id": rng.randint(10_000, 9_999_999),
        "customer": p.person(rng),
        "product": p.product(rng),
        "quantity": quantity,
        "total": round(quantity * rng.randint(3, 900) + rng.choice((0, 0.5, 0.99, 0.25)), 2),
        "date": p.date(rng),
    }
    texts = (
        "Order #{order_id} was placed by {customer} on {date}: {quantity} x {product}, total {total}.",
        "On {date}, {customer} bought {quantity} {product} (order {order_id}) for {total} dollars.",
        "Receipt {order_id} | {date} | customer: {customer} | item: {product} | qty {quantity} | {total}",
        "{customer} ordered {quantity} units of {product} on {date}. Order {order_id}, amount {total}.",
    )
    return v, texts


def _event(rng: random.Random, p: Pools) -> tuple[dict[str, object], tuple[str, ...]]:
    v: dict[str, object] = {
        "title": rng.choice(MEETING_TOPICS),
        "date": p.date(rng),
        "time": f"{rng.randint(7, 20):02d}:{rng.choice(('00', '15', '30', '45'))}",
        "city": rng.choice(p.cities),
        "organizer": p.person(rng),
    }
    texts = (
        "{organizer} invites you to the {title} on {date} at {time} in {city}.",
        "Reminder: {title}, {date}, {time}, {city}. Organised by {organizer}.",
        "The {title} will take place in {city} on {date}, starting at {time}; {organizer} is hosting.",
        "Hi all, {organizer} here. Our {title} is set for {date} at {time} in {city}.",
    )
    return v, texts


def _company(rng: random.Random, p: Pools) -> tuple[dict[str, object], tuple[str, ...]]:
    v: dict[str, object] = {
        "company": rng.choice(p.companies),
        "founded": rng.randint(1890, 2024),
        "employees": rng.choice((rng.randint(3, 99), rng.randint(10, 999) * 10)),
        "city": rng.choice(p.cities),
        "ceo": p.person(rng),
    }
    texts = (
        "{company} was founded in {founded} and is based in {city}. It has {employees} employees; CEO {ceo}.",
        "Headquartered in {city}, {company} (founded {founded}) employs {employees} people; CEO: {ceo}.",
        "{ceo} runs {company}, a firm from {city} with {employees} staff, founded in {founded}.",
        "Company profile: {company}. Founded: {founded}. Staff: {employees}. HQ: {city}. Head: {ceo}.",
    )
    return v, texts


def _flight(rng: random.Random, p: Pools) -> tuple[dict[str, object], tuple[str, ...]]:
    origin, destination = rng.sample(p.cities, 2)
    airline = rng.choice(AIRLINES)
    v: dict[str, object] = {
        "passenger": p.person(rng),
        "origin": origin,
        "destination": destination,
        "date": p.date(rng),
        "flight": f"{airline[:2].upper()}{rng.randint(10, 9999)}",
        "airline": airline,
    }
    texts = (
        "{passenger} is booked on {airline} flight {flight} from {origin} to {destination} on {date}.",
        "Booking confirmed for {passenger}: {flight} ({airline}), {origin} to {destination}, {date}.",
        "Passenger {passenger} flies {origin} - {destination} on {date} with {airline}, flight {flight}.",
        "Your trip on {date}: {airline} {flight} departs {origin} for {destination}. Traveller: {passenger}.",
    )
    return v, texts


_RECORDS = (_person, _order, _event, _company, _flight)


Record = Callable[[random.Random, Pools], tuple[dict[str, object], tuple[str, ...]]]


def _extraction(rng: random.Random, p: Pools, record: Record, count: int, template: str) -> tuple[str, str]:
    """(user turn, expected JSON): ``count`` fields of a new record, asked for in the order the text
    gives them (a small model reads the text front to back as it writes the object)."""
    values, texts = record(rng, p)
    text = rng.choice(texts).format(**values)
    fields = sorted(rng.sample(list(values), count), key=lambda f: text.find(str(values[f])))
    user = template.format(text=text, fields=", ".join(fields))
    return user, json.dumps({f: values[f] for f in fields}, ensure_ascii=False)


def _extract(rng: random.Random) -> Made:
    p = pools()
    # Two worked extractions from records of other kinds (other keys), then the request: with a
    # worked one of the same kind the 135M target copied its values instead of reading the text.
    record, *others = rng.sample(_RECORDS, 3)
    template = rng.choice(_EXTRACT_USERS)
    shots = [_extraction(rng, p, kind, rng.randint(2, 4), template) for kind in others]
    user, answer = _extraction(rng, p, record, rng.randint(2, 4), template)
    messages: list[Message] = [
        {"role": "system", "content": rng.choice(_EXTRACT_SYSTEMS)},
        *_turns(shots),
        {"role": "user", "content": user},
    ]
    return "extract_json", messages, answer


MAKERS: tuple[Maker, ...] = (_extract, _tool_call, _sql)


def prepare() -> None:
    """Build the pools the makers draw from (Faker's, about a second), before any clock starts."""
    pools()
    jobs()
