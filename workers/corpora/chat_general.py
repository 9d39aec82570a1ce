"""General assistant chat, generated: explanations, how-to questions, advice, rewrites, summaries
and short messages, each a list of chat messages for an instruction-tuned target.

Every request is made by one maker from a caller's seeded ``Random``: a task template picked from
several phrasings, filled from large pools (a concept list crossed with audiences, lengths and
styles; Faker's names, cities, companies and jobs from :mod:`workers.corpora.values`; paragraphs
built sentence by sentence from themed templates), so that two requests rarely share their text.
The answers are the model's own (no reference): general chat is open-ended.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import cache

from workers.corpora.values import ERRANDS, MEETING_TOPICS, PRODUCTS, Pools, pools

Message = dict[str, str]
Made = tuple[str, list[Message]]  # (task kind, messages)
Maker = Callable[[random.Random], Made]

CONCEPTS = (
    "compound interest",
    "inflation",
    "a credit score",
    "an index fund",
    "supply and demand",
    "opportunity cost",
    "a budget deficit",
    "exchange rates",
    "a mortgage",
    "diversification in investing",
    "photosynthesis",
    "the water cycle",
    "plate tectonics",
    "how vaccines work",
    "the greenhouse effect",
    "natural selection",
    "how the heart pumps blood",
    "why the sky is blue",
    "how tides work",
    "the phases of the moon",
    "black holes",
    "gravity",
    "electric current",
    "magnetism",
    "sound waves",
    "the speed of light",
    "DNA",
    "the immune system",
    "metabolism",
    "sleep cycles",
    "dehydration",
    "antibiotic resistance",
    "recursion",
    "a hash table",
    "an API",
    "encryption",
    "a database index",
    "machine learning",
    "a neural network",
    "cloud computing",
    "version control",
    "an operating system",
    "a compiler",
    "an IP address",
    "DNS",
    "two-factor authentication",
    "a password manager",
    "phishing",
    "a spreadsheet formula",
    "binary numbers",
    "an algorithm",
    "big O notation",
    "caching",
    "open source software",
    "a blockchain",
    "HTTP cookies",
    "the difference between RAM and storage",
    "a VPN",
    "a firewall",
    "unit testing",
    "the French Revolution",
    "the Industrial Revolution",
    "the Renaissance",
    "the printing press",
    "the Silk Road",
    "the Roman Republic",
    "the Cold War",
    "democracy",
    "the separation of powers",
    "a constitution",
    "the scientific method",
    "a hypothesis",
    "correlation versus causation",
    "a median",
    "standard deviation",
    "probability",
    "a percentage change",
    "fractions",
    "prime numbers",
    "the Pythagorean theorem",
    "negative numbers",
    "compound words",
    "the passive voice",
    "a metaphor",
    "irony",
    "a haiku",
    "the plot of a story",
    "sourdough fermentation",
    "how yeast makes bread rise",
    "why onions make you cry",
    "the Maillard reaction",
    "how a refrigerator works",
    "how a microwave heats food",
    "how solar panels work",
    "how wind turbines work",
    "how a battery stores energy",
    "how an electric car works",
    "how airplanes fly",
    "how a bicycle stays upright",
    "jet lag",
    "time zones",
    "leap years",
    "the seasons",
    "how rain forms",
    "how hurricanes form",
    "earthquakes",
    "volcanoes",
    "coral reefs",
    "pollination",
    "composting",
    "recycling",
    "carbon footprints",
    "renewable energy",
    "a food chain",
    "biodiversity",
    "a startup's seed round",
    "a business plan",
    "a profit margin",
    "cash flow",
    "a balance sheet",
    "marketing funnels",
    "customer retention",
    "agile project management",
    "a job interview's STAR method",
    "networking",
    "time blocking",
    "the Pomodoro technique",
    "active listening",
    "constructive feedback",
    "negotiation",
    "public speaking anxiety",
    "procrastination",
    "habit formation",
    "mindfulness",
    "stretching before exercise",
    "interval training",
    "protein in a diet",
    "fiber",
    "caffeine",
    "a balanced breakfast",
    "copyright",
    "a contract",
    "a warranty",
    "tenant rights",
    "a will",
    "insurance deductibles",
    "a pension",
    "taxes on savings",
)
AUDIENCES = (
    "to a beginner",
    "to a ten-year-old",
    "to a high school student",
    "to my grandmother",
    "to a busy manager",
    "in simple terms",
    "like I'm five",
    "to someone who has never heard of it",
    "to a university student",
    "to a new employee",
    "to a tourist",
    "to my teenage son",
    "to my daughter",
    "to a non-native English speaker",
)
LENGTHS = (
    "in two sentences",
    "in three sentences",
    "in one short paragraph",
    "in under 50 words",
    "in a few sentences",
    "briefly",
    "with one everyday example",
    "with an analogy",
    "in three bullet points",
    "step by step",
    "in plain English",
    "without jargon",
)
_EXPLAIN = (
    "Explain {concept} {audience} {length}.",
    "Can you explain {concept} {audience}? Keep it {length}.",
    "What is {concept}? Explain it {audience}, {length}.",
    "Please explain {concept} {length}, {audience}.",
    "I never understood {concept}. Explain it {audience} {length}.",
    "Could you describe {concept} {audience}, {length}?",
    "Help me understand {concept}, {length}, {audience}.",
    "Give me a quick explanation of {concept} {audience}, {length}.",
    "My friend {name} asked me about {concept}. How would you explain it {audience}, {length}?",
    "I'm a {job} and need to explain {concept} {audience}. Put it {length}.",
)
# (how-to template, slots it needs) — slots are filled by `_slots`.
_HOWTO = (
    "How do I clean a {product} without damaging it?",
    "What's the best way to pack a {product} for a move to {city}?",
    "How can I get from the airport to the centre of {city} cheaply?",
    "How do I plan a {days}-day trip to {city} on a budget of {amount} dollars?",
    "How do I split a bill of {amount} dollars between {people} people with a {pct}% tip?",
    "How do I politely decline a meeting invitation from {name}?",
    "How should I prepare for a job interview at {company}?",
    "How do I ask {name} for a deadline extension on the {topic} report?",
    "What's a good way to learn {language} in {months} months?",
    "How do I cook rice for {people} people?",
    "How do I make pancakes for {people} people?",
    "How can I keep my {product} working longer?",
    "How do I write a cover letter for a {job} position at {company}?",
    "How do I convert {amount} grams to ounces?",
    "How do I start running if I can only train {days} days a week?",
    "How do I set up a monthly budget on a salary of {amount} dollars?",
    "How do I remember to {errand} every week?",
    "How do I organise a surprise party for {name} with {people} guests?",
    "How do I choose a {product} as a gift for {name}?",
    "How can I reduce my electricity bill in a small flat in {city}?",
    "How do I prepare a {minutes}-minute presentation on {topic}?",
    "How do I tell {name} that their {topic} slides need work?",
    "How do I get started with gardening on a balcony in {city}?",
    "How do I save {amount} dollars in {months} months?",
    "How do I back up my photos before a trip to {city}?",
    "How can I study for an exam in {days} days?",
    "How do I make a to-do list I actually follow, with {people} projects at once?",
    "What should I pack for {days} days in {city} in {month}?",
)
# Context a how-to question may open or close with: a question alone would come from a small pool.
_HOWTO_OPENERS = (
    "",
    "",
    "Hi! ",
    "I'm in {city} this week. ",
    "Quick one: ",
    "I'm a {job}. ",
    "My friend {name} asked me this. ",
    "I have about {minutes} minutes. ",
    "Beginner here. ",
    "For a {topic} at {company}: ",
)
_HOWTO_CLOSERS = (
    "",
    "",
    " Keep it short.",
    " Give me {sentences} steps.",
    " Please answer in a few sentences.",
    " What do I need?",
    " I'm on a tight budget.",
    " Thanks!",
    " Explain it simply.",
    " Any common mistakes to avoid?",
)
_SITUATIONS = (
    "my landlord wants to raise the rent by {pct}% next {month}",
    "I got a job offer from {company} but it pays {pct}% less than my current job",
    "my colleague {name} keeps taking credit for my work",
    "I have {days} days to finish a report on {topic} and I haven't started",
    "I want to move to {city} but I don't know anyone there",
    "my manager asked me to lead the {topic} meeting tomorrow and I'm nervous",
    "I keep forgetting to {errand}",
    "I spend about {amount} dollars a month on takeaway food",
    "my {product} broke two weeks after the warranty ended",
    "I have two job interviews on the same day, at {company} and at {company2}",
    "I want to ask {name} for a raise after {years} years at {company}",
    "my team at {company} is moving to a four-day week",
    "I was offered a transfer to our office in {city}",
    "I can't sleep well since I started working night shifts",
    "I want to learn {language} but I only have {minutes} minutes a day",
    "my neighbour {name} plays loud music every night",
    "I need to choose between a {product} and a {product2} for my home office",
    "I'm planning my first marathon in {months} months",
    "my friend {name} owes me {amount} dollars and hasn't mentioned it",
    "I'm starting a small business selling {product}s in {city}",
)
_ADVISE = (
    "I'm a {job} in {city} and {situation}. What should I do?",
    "{situation}. Any advice?",
    "I'm {name}, a {job}. {situation}. How should I handle this?",
    "Quick question: {situation}. What would you suggest?",
    "Hi! {situation}. What are my options?",
    "I live in {city} and {situation}. Can you give me three tips?",
    "As a {job}, {situation}. What would you do in my place?",
)
# Paragraph themes: each a list of sentence slots, each slot a few variants with placeholders.
_INFORMAL = (
    (
        "hey team, quick heads up.",
        "hi all,",
        "hey everyone,",
    ),
    (
        "the {topic} with {company} got moved to {weekday} at {hour}.",
        "{name} says the {topic} is now on {weekday} at {hour}, not {weekday2}.",
        "we're pushing the {topic} to {weekday} at {hour} because {name} is out.",
        "the {company} folks want the {topic} on {weekday} at {hour} now.",
    ),
    (
        "bring the numbers from {month} and dont be late pls.",
        "can someone grab the {product} from the storage room before then?",
        "also the budget is like {amount} bucks so keep it cheap.",
        "if u cant make it just ping {name}.",
        "we still need the slides, {name} said she'd do them but idk.",
    ),
    (
        "thx!",
        "cheers",
        "see u there",
        "lmk if anything changes",
        "",
    ),
)
_COMPLAINT = (
    (
        "I ordered a {product} from {company} on {date}",
        "Three weeks ago I bought a {product} from your shop in {city}",
        "My order number {order} for a {product} arrived on {date}",
    ),
    (
        "and it stopped working after {days} days.",
        "but the box was damaged and one part is missing.",
        "and it is not the colour I picked.",
        "and I was charged {amount} dollars instead of the price on the website.",
    ),
    (
        "I called your support line twice and nobody called me back.",
        "Your chat assistant told me to wait, but nothing happened.",
        "I have already sent {n} emails about this.",
    ),
    (
        "I want a refund or a replacement by the end of the week.",
        "Please fix this as soon as possible.",
        "I'm really disappointed and I expect an answer.",
    ),
)
_ANNOUNCEMENT = (
    (
        "Starting {date}, the {city} office will move to a new building.",
        "From {date}, {company} will close its {city} branch on {weekday}s.",
        "On {date} we will launch the new {product} line in {city}.",
        "The {topic} planned for {date} will take place in {city}.",
    ),
    (
        "All staff should contact {name} with any questions.",
        "Parking will be limited during the first {days} days.",
        "Tickets cost {amount} dollars and include lunch.",
        "Around {n} people are expected to attend.",
    ),
    (
        "Please update your calendars accordingly.",
        "We apologise for any inconvenience this may cause.",
        "Further details will be shared by {name} next week.",
        "Thank you for your patience and support.",
    ),
)
_THEMES = (_INFORMAL, _COMPLAINT, _ANNOUNCEMENT)
_STYLES = (
    "more formally",
    "more politely",
    "in a friendlier tone",
    "more concisely",
    "in plain English",
    "as three bullet points",
    "for a customer",
    "for a ten-year-old",
    "in a more professional tone",
    "so it sounds calmer",
    "in the first person plural",
    "without any slang",
)
_REWRITE = (
    "Rewrite this {style}:\n\n{text}",
    "Please rewrite the following message {style}.\n\n{text}",
    "Can you make this sound {style_adj}?\n\n{text}",
    "Rewrite {style}: {text}",
    "Here is a draft. Rewrite it {style}, keeping every detail.\n\n{text}",
    "Fix the grammar and rewrite it {style}:\n{text}",
)
_STYLE_ADJ = ("more formal", "more polite", "friendlier", "shorter", "more professional", "calmer", "clearer")
_SUMMARISE = (
    "Summarize this in one sentence:\n\n{text}",
    "What is the main point of this message?\n\n{text}",
    "Give me a {n}-word summary of the following.\n\n{text}",
    "TL;DR please:\n{text}",
    "Summarise for {name} in one line: {text}",
    "List the key facts in this text:\n\n{text}",
)
_COMPOSE_KINDS = (
    "thank-you note",
    "apology",
    "invitation",
    "reminder",
    "congratulations message",
    "farewell message",
    "welcome message",
    "follow-up message",
)
_COMPOSE = (
    "Write a short {what} to {name} at {company} about the {topic}.",
    "Draft a {what} for {name}, who helped with the {topic} in {city}.",
    "Write a two-sentence {what} to my colleague {name} about {errand}.",
    "Compose a {what} to {name} for the {topic} on {date}.",
    "Can you write a brief {what} to the {company} team about the {topic}?",
    "Write a {what} to {name} from {city}, mentioning the {product} they sent.",
)
_SYSTEMS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are a friendly assistant. Keep answers short and clear.",
    "You are a concise assistant. Answer in at most {sentences} sentences.",
    "You are {company}'s virtual assistant. Be polite and brief.",
    "You are a patient tutor who explains things simply.",
    "You are an assistant for {name}, a {job} in {city}.",
)
_TOPICS = MEETING_TOPICS + (
    "quarterly report",
    "product launch",
    "team offsite",
    "customer workshop",
    "annual review",
    "sales kickoff",
    "safety training",
    "charity run",
    "hackathon",
    "website redesign",
)
_LANGUAGES = (
    "Spanish French German Italian Portuguese Dutch Polish Swedish Japanese Korean Mandarin Arabic Hindi "
    "Turkish Greek Czech Danish Norwegian Finnish Vietnamese Indonesian Swahili Hebrew Russian"
).split()
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
_MONTHS = ("January February March April May June July August September October November December").split()


@cache
def jobs() -> tuple[str, ...]:
    """Faker's job titles in a plain spelling (no "Engineer, civil" inversions), seeded."""
    from faker import Faker

    fake = Faker("en_US")
    fake.seed_instance(20_241_207)
    found = {fake.job() for _ in range(4000)}
    plain = {j for j in found if not any(c in j for c in ",/()")}
    return tuple(sorted(j[0].lower() + j[1:] for j in plain))


def _slots(rng: random.Random, p: Pools) -> dict[str, object]:
    """One value per placeholder a template may name (each template uses a few of them)."""
    first, second = rng.sample(p.companies, 2)
    product, product2 = (p.product(rng) for _ in range(2))
    return {
        "name": rng.choice(p.first_names),
        "company": first,
        "company2": second,
        "city": rng.choice(p.cities),
        "job": rng.choice(jobs()),
        "product": product,
        "product2": product2,
        "amount": rng.choice((rng.randint(5, 99), rng.randint(10, 400) * 5, rng.randint(2, 90) * 100)),
        "people": rng.randint(2, 14),
        "pct": rng.choice((5, 8, 10, 12, 15, 18, 20, 25, 30)),
        "days": rng.randint(2, 21),
        "months": rng.randint(2, 12),
        "years": rng.randint(2, 15),
        "minutes": rng.choice((5, 10, 15, 20, 30, 45)),
        "n": rng.randint(3, 30),
        "sentences": rng.randint(2, 5),
        "language": rng.choice(_LANGUAGES),
        "topic": rng.choice(_TOPICS).lower(),
        "errand": rng.choice(ERRANDS),
        "month": rng.choice(_MONTHS),
        "weekday": (days := rng.sample(_WEEKDAYS, 2))[0],
        "weekday2": days[1],
        "hour": f"{rng.randint(8, 17)}:{rng.choice(('00', '15', '30', '45'))}",
        "date": p.date(rng),
        "order": rng.randint(10_000, 9_999_999),
    }


def _fill(template: str, slots: dict[str, object]) -> str:
    return template.format(**slots)


def paragraph(rng: random.Random, p: Pools) -> str:
    """A short message or notice: one sentence per slot of a theme, each filled with new values."""
    theme = rng.choice(_THEMES)
    slots = _slots(rng, p)
    sentences = [_fill(rng.choice(options), slots) for options in theme]
    return " ".join(s for s in sentences if s)


def _with_system(rng: random.Random, p: Pools, user: str) -> list[Message]:
    # Half the requests carry no system message: the target's chat template supplies its default.
    if rng.random() < 0.5:
        return [{"role": "user", "content": user}]
    system = _fill(rng.choice(_SYSTEMS), _slots(rng, p))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _explain(rng: random.Random) -> Made:
    p = pools()
    slots = {
        **_slots(rng, p),
        "concept": rng.choice(CONCEPTS),
        "audience": rng.choice(AUDIENCES + (f"to a {rng.choice(jobs())}",)),
        "length": rng.choice(LENGTHS),
    }
    return "explain", _with_system(rng, p, _fill(rng.choice(_EXPLAIN), slots))


def _howto(rng: random.Random) -> Made:
    p = pools()
    slots = _slots(rng, p)
    question = rng.choice(_HOWTO_OPENERS) + rng.choice(_HOWTO) + rng.choice(_HOWTO_CLOSERS)
    return "howto", _with_system(rng, p, _fill(question, slots))


def _advise(rng: random.Random) -> Made:
    p = pools()
    slots = _slots(rng, p)
    situation = _fill(rng.choice(_SITUATIONS), slots)
    text = _fill(rng.choice(_ADVISE), {**slots, "situation": situation})
    return "advise", _with_system(rng, p, text[0].upper() + text[1:])


def _rewrite(rng: random.Random) -> Made:
    p = pools()
    slots = {
        **_slots(rng, p),
        "style": rng.choice(_STYLES),
        "style_adj": rng.choice(_STYLE_ADJ),
        "text": paragraph(rng, p),
    }
    return "rewrite", _with_system(rng, p, _fill(rng.choice(_REWRITE), slots))


def _summarise(rng: random.Random) -> Made:
    p = pools()
    slots = {**_slots(rng, p), "n": rng.choice((10, 12, 15, 20)), "text": paragraph(rng, p)}
    return "summarise", _with_system(rng, p, _fill(rng.choice(_SUMMARISE), slots))


def _compose(rng: random.Random) -> Made:
    p = pools()
    slots = {**_slots(rng, p), "what": rng.choice(_COMPOSE_KINDS)}
    return "compose", _with_system(rng, p, _fill(rng.choice(_COMPOSE), slots))


MAKERS: tuple[Maker, ...] = (_explain, _explain, _howto, _advise, _rewrite, _summarise, _compose)


def prepare() -> None:
    """Build the pools the makers draw from (Faker's, about a second), before any clock starts."""
    pools()
    jobs()


__all__ = ["CONCEPTS", "MAKERS", "PRODUCTS", "Made", "Message", "jobs", "paragraph", "prepare"]
