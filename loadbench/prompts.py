"""Where a benchmark's prompts come from: a file the user gives, or a small built-in set.

Files (``--dataset``): JSONL, one object with ``prompt`` a line (captured traces exported as JSONL
carry ``prompt``, ``completion``, ``category``); one page of ``GET .../traces``
(``{"traces": [...]}``) or a JSON array of such objects; or, for a ``.txt`` file, plain text with
one prompt a non-blank line (prompts that span lines need JSONL).

The built-in set is a short, fixed list per domain written for this client, in the shape of the
reference drafters' traffic domains: ``prose`` (technical English), ``code`` (Python source cut
inside a function) and ``structured`` (a request answered by SQL or a JSON tool call, cut right
after ``SQL:`` / ``Call:``). Being written here, the prompts are in no drafter's training corpus,
and they are the same on every machine and interpreter. They are few: a run with more requests
than prompts cycles through them (as it does through a short file); a larger or more realistic set
is a ``--dataset`` file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final


@dataclass(frozen=True)
class PromptItem:
    text: str
    category: str | None = None
    max_tokens: int | None = None  # this prompt's own output length (a dataset may give one)


class DatasetError(ValueError):
    """A dataset file that cannot be read as prompts."""


# Suffixes read as plain text (one prompt a line) rather than JSON / JSONL.
TEXT_SUFFIXES: Final = frozenset({".txt", ".text"})


def _prompt_of(obj: Mapping[str, Any], where: str) -> PromptItem:
    text: object = obj.get("prompt", obj.get("input"))
    if text is None and isinstance(obj.get("messages"), list):
        # The trace-dataset convention: one "role: content" line per message.
        lines = [f"{m.get('role')}: {m.get('content')}" for m in obj["messages"] if isinstance(m, dict)]
        text = "\n".join(lines)
    if not isinstance(text, str) or not text:
        raise DatasetError(f"{where}: needs a non-empty string 'prompt' (or 'input', or 'messages')")
    category = obj.get("category")
    max_tokens = obj.get("max_tokens", obj.get("output_tokens"))
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise DatasetError(f"{where}: max_tokens must be a positive integer")
    return PromptItem(text, category if isinstance(category, str) else None, max_tokens)


def _not_object(path: Path, index: int) -> PromptItem:
    raise DatasetError(f"{path}[{index}]: must be a JSON object")


def load_dataset(path: Path) -> list[PromptItem]:
    """Prompts from a file: plain text for ``.txt``, else JSON (an array or a traces page) or JSONL."""
    raw = path.read_text(encoding="utf-8-sig")
    if path.suffix.lower() in TEXT_SUFFIXES:
        items = [PromptItem(line) for line in raw.splitlines() if line.strip()]
        if not items:
            raise DatasetError(f"{path}: holds no prompts")
        return items
    try:
        whole: object = json.loads(raw)
    except json.JSONDecodeError:
        whole = None  # JSONL: several values, one a line
    if isinstance(whole, dict) and isinstance(whole.get("traces"), list):
        whole = whole["traces"]
    if isinstance(whole, list):
        if not whole:
            raise DatasetError(f"{path}: holds no prompts")
        return [
            _prompt_of(obj, f"{path}[{i}]") if isinstance(obj, dict) else _not_object(path, i)
            for i, obj in enumerate(whole)
        ]
    items = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not valid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}:{number}: each line must be a JSON object")
        items.append(_prompt_of(obj, f"{path}:{number}"))
    if not items:
        raise DatasetError(f"{path}: holds no prompts")
    return items


# --------------------------------------------------------------------------------------------
# The built-in set
# --------------------------------------------------------------------------------------------

_PROSE: Final = (
    "Caching\n\nA cache keeps the results of expensive operations so that a later request for the same\n"
    "input can be answered without repeating the work. The first question to ask of any cache is\n"
    "what happens when the underlying data changes. A cache that is never invalidated returns stale\n"
    "answers; one that is invalidated too eagerly does no better than no cache at all.\n",
    "Retrying a failed request\n\nA client that retries immediately after a failure tends to make an\n"
    "overloaded server worse: every client retries at once, and the load that caused the failure\n"
    "arrives again, multiplied. The usual remedy is exponential backoff with jitter. After the first\n"
    "failure the client waits a short, random interval; after each further failure the upper bound\n"
    "of that interval doubles, up to a limit.\n",
    "Text and bytes\n\nA string is a sequence of Unicode code points; a bytes object is a sequence of\n"
    "integers between 0 and 255. Converting one into the other always involves an encoding, and most\n"
    "errors in programs that handle text come from an encoding chosen implicitly. Reading a file\n"
    "without naming the encoding, for example, uses a default that depends on the platform, so the\n"
    "same program may\n",
    "Logging levels\n\nEach log record carries a level that says how serious the event is. DEBUG records\n"
    "describe the inner workings of a program and are normally switched off in production. INFO\n"
    "records confirm that things are working as expected. WARNING records report something\n"
    "unexpected that the program recovered from, or a problem that may soon matter, such as a disk\n"
    "that is nearly full.\n",
    "Floating-point arithmetic\n\nMost decimal fractions cannot be represented exactly as binary\n"
    "fractions. The decimal value 0.1, for instance, is stored as the binary fraction closest to it,\n"
    "which is slightly larger than one tenth. The difference is tiny and is hidden when the number is\n"
    "printed, but it accumulates: adding 0.1 ten times does not give exactly 1.0. Programs that\n"
    "compare computed values for equality\n",
    "Dates, times and time zones\n\nA timestamp without a time zone is ambiguous: 09:30 in Lisbon and\n"
    "09:30 in Tokyo are nine hours apart. Store times in UTC and convert to local time only when\n"
    "showing them to a person. Daylight saving time makes local time worse than merely offset: once\n"
    "a year an hour repeats, and once a year an hour is skipped, so some local times occur twice and\n"
    "others never occur at all.\n",
    "Iterators and generators\n\nAn iterator is an object that produces the items of a sequence one\n"
    "at a time, on demand. It remembers where it is, and each call to next() returns the following\n"
    "item until the sequence is exhausted, at which point StopIteration is raised. Because items are\n"
    "produced only when asked for, an iterator can describe a sequence that is too large to hold in\n"
    "memory, or even one that\n",
    "How a dictionary finds a key\n\nA dictionary stores its entries in a table indexed by the hash of\n"
    "each key. To look a key up, the dictionary computes its hash, reduces it to a slot in the table,\n"
    "and compares the key stored there with the one it was given. If the slot holds a different key,\n"
    "another slot is probed, following a sequence that depends on the hash, until the key or an\n"
    "empty slot is found.\n",
    "Writing a commit message\n\nThe first line of a commit message summarises the change in about\n"
    'fifty characters, in the imperative: "Fix the parser\'s handling of empty lines", not "Fixed"\n'
    'or "Fixes". It is followed by a blank line and a body that explains what changed and why. The\n'
    "diff already shows how the change was made; what a reader cannot recover from the diff is the\n"
    "reason for it.\n",
    "Unit tests\n\nA unit test checks one small piece of a program in isolation: a function, a class,\n"
    "a module. It should be fast, so that it can run after every change, and deterministic, so that\n"
    "a failure always means the same thing. Tests that depend on the network, on the current time or\n"
    "on the order in which they run fail now and then for reasons that have nothing to do with the\n"
    "code, and\n",
    "Queues and back-pressure\n\nA queue between a producer and a consumer absorbs short bursts: when\n"
    "items arrive faster than they can be handled, they wait in line instead of being dropped. But a\n"
    "queue cannot absorb a sustained difference in rates. If the producer is faster on average, the\n"
    "queue grows without bound, and every item waits longer than the one before it. The remedy is\n"
    "back-pressure: when the\n",
    "Regular expressions\n\nA regular expression describes a set of strings. Most characters match\n"
    "themselves; a few, the metacharacters, have special meanings. The dot matches any character\n"
    "except a newline. The star repeats the preceding item zero or more times, the plus one or more\n"
    "times, and the question mark makes it optional. By default these repetitions are greedy: they\n"
    "match as much text as they can,\n",
)

_CODE: Final = (
    "import hashlib\nfrom pathlib import Path\n\n\n"
    "def file_digest(path: Path, chunk_size: int = 1 << 16) -> str:\n"
    '    """Return the SHA-256 hex digest of a file, read in chunks."""\n'
    "    h = hashlib.sha256()\n"
    '    with path.open("rb") as fh:\n',
    "class LRUCache:\n"
    '    """A mapping that keeps at most ``capacity`` entries, evicting the least recently used."""\n\n'
    "    def __init__(self, capacity: int) -> None:\n"
    "        if capacity < 1:\n"
    '            raise ValueError("capacity must be at least 1")\n'
    "        self.capacity = capacity\n"
    "        self._data: dict[object, object] = {}\n\n"
    "    def get(self, key, default=None):\n",
    "def binary_search(items, target):\n"
    '    """Return the index of target in the sorted list items, or -1 if it is absent."""\n'
    "    lo, hi = 0, len(items) - 1\n"
    "    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n",
    "import csv\nfrom collections import defaultdict\n\n\n"
    "def totals_by_category(path):\n"
    '    """Sum the \'amount\' column of a CSV file per \'category\'."""\n'
    "    totals = defaultdict(float)\n"
    '    with open(path, newline="", encoding="utf-8") as fh:\n'
    "        for row in csv.DictReader(fh):\n",
    "import time\n\n\n"
    "def retry(func, attempts=5, base_delay=0.1, exceptions=(OSError,)):\n"
    '    """Call func until it succeeds, sleeping base_delay * 2**i after failed attempt i."""\n'
    "    for attempt in range(attempts):\n"
    "        try:\n"
    "            return func()\n"
    "        except exceptions:\n"
    "            if attempt == attempts - 1:\n"
    "                raise\n",
    "from dataclasses import dataclass, field\n\n\n"
    "@dataclass\nclass Inventory:\n"
    "    items: dict[str, int] = field(default_factory=dict)\n\n"
    "    def add(self, name: str, count: int = 1) -> None:\n"
    "        if count < 0:\n"
    '            raise ValueError("count must not be negative")\n'
    "        self.items[name] = self.items.get(name, 0) + count\n\n"
    "    def remove(self, name: str, count: int = 1) -> None:\n",
    "def parse_duration(text):\n"
    "    \"\"\"Parse '1h30m', '45s' or '2m5s' into a number of seconds.\"\"\"\n"
    '    units = {"h": 3600, "m": 60, "s": 1}\n'
    "    total = 0\n"
    '    number = ""\n'
    "    for ch in text.strip():\n"
    "        if ch.isdigit():\n"
    "            number += ch\n"
    "        elif ch in units and number:\n",
    "import argparse\n\n\n"
    "def build_parser():\n"
    '    parser = argparse.ArgumentParser(description="Count lines, words and characters in files.")\n'
    '    parser.add_argument("files", nargs="+", help="the files to count")\n'
    '    parser.add_argument("-l", "--lines", action="store_true", help="print only the line counts")\n',
    "import asyncio\n\n\n"
    "async def fetch_all(urls, fetch, limit=8):\n"
    '    """Run fetch(url) for every url, at most `limit` at a time; the results in order."""\n'
    "    semaphore = asyncio.Semaphore(limit)\n\n"
    "    async def one(url):\n",
    "def flatten(nested):\n"
    '    """Yield the leaves of arbitrarily nested lists and tuples, depth first."""\n'
    "    for item in nested:\n"
    "        if isinstance(item, (list, tuple)):\n",
    "import json\nimport logging\n\nlogger = logging.getLogger(__name__)\n\n\n"
    "def load_settings(path, defaults):\n"
    '    """Read a JSON settings file over the defaults; a missing file gives the defaults."""\n'
    "    settings = dict(defaults)\n"
    "    try:\n"
    '        with open(path, encoding="utf-8") as fh:\n'
    "            settings.update(json.load(fh))\n"
    "    except FileNotFoundError:\n",
    "class Matrix:\n"
    "    def __init__(self, rows):\n"
    "        self.rows = [list(r) for r in rows]\n"
    "        if len({len(r) for r in self.rows}) > 1:\n"
    '            raise ValueError("rows must all have the same length")\n\n'
    "    @property\n"
    "    def shape(self):\n"
    "        return len(self.rows), (len(self.rows[0]) if self.rows else 0)\n\n"
    "    def __matmul__(self, other):\n",
)

_CUSTOMERS: Final = "customers(id, name, email, city, country, signup_date)"
_ORDERS: Final = "orders(id, customer_id, product_id, quantity, total, status, order_date)"
_PRODUCTS: Final = "products(id, name, category, price, stock)"
_EMPLOYEES: Final = "employees(id, name, department, salary, hire_date, manager_id)"
_FLIGHTS: Final = "flights(id, origin, destination, departure, price, airline)"

_STRUCTURED: Final = (
    f"Database tables: {_CUSTOMERS}; {_ORDERS}\n"
    "User: List the name and email of customers from Porto, by name.\nSQL:",
    "Available tools: book_table, get_weather, translate\n"
    "User: What's the weather in Valencia for the next 3 days, in celsius?\nCall:",
    f"Database tables: {_EMPLOYEES}; {_FLIGHTS}\n"
    "User: How many employees are there in engineering?\n"
    "SQL: SELECT COUNT(*) FROM employees WHERE department = 'engineering';\n"
    "User: Show the name and salary of employees hired before 2021-03-15, highest paid first.\nSQL:",
    "Available tools: convert_currency, search_flights, set_reminder\n"
    "User: Convert 250 EUR to JPY.\n"
    'Call: {"name": "convert_currency", "arguments": {"amount": 250, "source": "EUR", "target": "JPY"}}\n'
    "User: Find economy flights from Porto to Krakow on 2025-06-14 for 2 passengers.\nCall:",
    f"Database tables: {_ORDERS}; {_PRODUCTS}\nUser: What is the average price per category?\nSQL:",
    "Available tools: create_event, get_stock_price, send_email\n"
    "User: Schedule 'Budget review' with Ana Novak on 2024-11-05 at 10:30 for 45 minutes.\nCall:",
    f"Database tables: {_CUSTOMERS}; {_ORDERS}; {_PRODUCTS}\n"
    "User: Show each shipped order's total with the customer's name.\nSQL:",
    "Available tools: search_products, send_email, translate\n"
    "User: Email jonas.berg@example.com with the subject 'Travel plans' saying I will be late.\nCall:",
    f"Database tables: {_EMPLOYEES}; {_PRODUCTS}\nUser: Set the stock of product 412 to 75.\nSQL:",
    "Available tools: book_table, get_stock_price, set_reminder\n"
    "User: Remind me to pay rent on 2025-02-01 09:00.\nCall:",
    f"Database tables: {_CUSTOMERS}; {_FLIGHTS}\n"
    "User: Find the destination and price of flights from Oslo operated by Finnair, cheapest first, "
    "only the first 5.\nSQL:",
    "Available tools: get_weather, search_products, translate\n"
    "User: Search for a teapot under 40 dollars, sorted by rating.\nCall:",
)

BUILTIN: Final[Mapping[str, tuple[str, ...]]] = {
    "prose": _PROSE,
    "code": _CODE,
    "structured": _STRUCTURED,
}
DOMAINS: Final = tuple(BUILTIN)
# "tool" is the name the design notes use for the structured domain.
ALIASES: Final[Mapping[str, str]] = {"tool": "structured"}


def builtin_prompts(domain: str, n: int | None = None) -> list[PromptItem]:
    """The first ``n`` (default: all) built-in prompts of a domain, each labelled with the domain."""
    name = ALIASES.get(domain, domain)
    if name not in BUILTIN:
        raise DatasetError(f"unknown domain {domain!r}; expected one of {', '.join(DOMAINS)}")
    if n is not None and n < 1:
        raise DatasetError("the number of prompts must be at least 1")
    return [PromptItem(text, name) for text in BUILTIN[name][:n]]
