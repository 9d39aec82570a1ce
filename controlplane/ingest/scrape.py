"""Pull scraping of backends' Prometheus ``/metrics``: scrape targets and scraping them.

This module owns the ``scrape_targets`` of a deployment (register, list, get, delete, with their
validation), scraping one target (``scrape_target``: fetch, parse, diff against the target's last
snapshot, store the delta records and the new snapshot in the caller's transaction), scraping every
enabled target (``scrape_all``, one transaction per target) and the real HTTP fetcher
(``http_fetch``). Parsing and the counter-delta logic are ``controlplane.ingest.prometheus``'s.

A target names one engine through one or more URLs (several API servers in front of one engine
expose the same counters, so they must count once): a scrape reads the first URL that answers
with a usable exposition and falls over to the next. A failed scrape (every URL down or answering
something unparseable) records ``last_error`` and keeps the old snapshot, so the next good scrape
diffs against the last counters actually seen and loses nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, cast
from urllib.parse import urlsplit

import httpx
from sqlalchemy import CursorResult, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.db.models import Deployment, ScrapeTarget
from controlplane.errors import ConflictError, NotFoundError, ValidationProblem
from controlplane.ingest.formats import MAX_COUNT, BatchValidationError
from controlplane.ingest.prometheus import (
    MAX_LABEL_SETS,
    CounterSnapshot,
    counter_deltas,
    is_openmetrics_media_type,
    parse_exposition,
)
from controlplane.ingest.record import ARM_BASELINE, ARM_CANARY_PREFIX, ARM_LIVE
from controlplane.ingest.service import store_records
from controlplane.timestamps import as_utc, utcnow

log = logging.getLogger(__name__)

NAME_PATTERN: Final = re.compile(r"[a-z0-9-]{1,100}")
MAX_URLS: Final = 8
MAX_URL_CHARS: Final = 2000
# A scrape is one small GET on the beat's clock: a backend slower than this is treated as down
# (the next URL, or the next tick, gets a chance) rather than holding the worker.
FETCH_TIMEOUT_S: Final = 5.0
# vLLM's full exposition (histograms per model and engine) is tens of KB; a body this large is
# not a metrics page, and reading it whole would cost the worker memory for nothing.
MAX_BODY_BYTES: Final = 4 * 1024 * 1024
# Stored errors are for people to read; a huge one (say, an HTML error page quoted back) is cut.
MAX_ERROR_CHARS: Final = 2000
# What Prometheus itself asks for: OpenMetrics first (it carries `_created`, which catches
# restarts that values alone miss), the classic text format otherwise.
ACCEPT: Final = "application/openmetrics-text;version=1.0.0;q=0.9,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"

# fetch(url) -> (HTTP status, Content-Type header or None, body text); may raise on transport errors.
Fetch = Callable[[str], tuple[int, str | None, str]]
SessionFactory = Callable[[], Session]


class FetchError(Exception):
    """A URL answered something that is not a metrics page (too large, not text)."""


# --- validation (pure) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """A validated scrape target, before it is stored."""

    name: str
    urls: tuple[str, ...]
    arm: str = ARM_LIVE
    drafter_version: int | None = None
    enabled: bool = True


def _url_problem(url: object) -> str | None:
    if not isinstance(url, str):
        return "must be a string"
    if len(url) > MAX_URL_CHARS:
        return f"must be at most {MAX_URL_CHARS} characters"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port out of range or not a number
    except ValueError as exc:
        return f"is not a valid URL: {exc}"
    if parts.scheme not in ("http", "https"):
        return f"must be an http:// or https:// URL, got {url!r}"
    if not parts.hostname:
        return f"names no host: {url!r}"
    if parts.username is not None or parts.password is not None:
        # Every viewer of the deployment reads the target back; a password must not ride along.
        return "must not carry credentials (user:password@)"
    return None


def validate_target(
    *,
    name: object,
    urls: object,
    arm: object = ARM_LIVE,
    drafter_version: object = None,
    enabled: object = True,
) -> TargetSpec:
    """A ``TargetSpec``, or ``ValidationProblem`` (422) listing every field that is wrong.

    ``canary:<n>`` is served by drafter version n by definition: a missing ``drafter_version``
    becomes n, a different one is refused.
    """
    problems: list[dict[str, str]] = []
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        problems.append({"field": "name", "message": "must be 1-100 characters of a-z, 0-9 and '-'"})
    clean_urls: list[str] = []
    if not isinstance(urls, list | tuple) or not urls:
        problems.append({"field": "urls", "message": "must be a list of one or more URLs"})
    elif len(urls) > MAX_URLS:
        problems.append({"field": "urls", "message": f"at most {MAX_URLS} URLs, got {len(urls)}"})
    else:
        for i, url in enumerate(urls):
            problem = _url_problem(url)
            if problem is not None:
                problems.append({"field": f"urls.{i}", "message": problem})
            elif url in clean_urls:
                problems.append({"field": f"urls.{i}", "message": f"repeats {url!r}"})
            else:
                clean_urls.append(url)
    version: int | None = None
    if drafter_version is not None:
        if type(drafter_version) is not int or not 1 <= drafter_version <= MAX_COUNT:
            problems.append(
                {"field": "drafter_version", "message": f"must be an integer in 1..{MAX_COUNT} or null"}
            )
        else:
            version = drafter_version
    clean_arm = ARM_LIVE
    if arm in (ARM_LIVE, ARM_BASELINE):
        clean_arm = str(arm)
        if arm == ARM_BASELINE and version is not None:
            problems.append({"field": "drafter_version", "message": "the baseline arm serves no drafter"})
    elif (
        isinstance(arm, str)
        and arm.startswith(ARM_CANARY_PREFIX)
        and arm[len(ARM_CANARY_PREFIX) :].isascii()
        and arm[len(ARM_CANARY_PREFIX) :].isdigit()
        # canary:<n> names a drafter version: an INTEGER column (and a 40-character arm).
        and len(arm[len(ARM_CANARY_PREFIX) :]) <= 10
        and int(arm[len(ARM_CANARY_PREFIX) :]) <= MAX_COUNT
    ):
        arm_version = int(arm[len(ARM_CANARY_PREFIX) :])
        clean_arm = f"{ARM_CANARY_PREFIX}{arm_version}"
        if version is None:
            version = arm_version
        elif version != arm_version:
            problems.append({"field": "drafter_version", "message": f"is {version} but arm is {clean_arm}"})
    else:
        problems.append(
            {
                "field": "arm",
                "message": f'must be "live", "baseline" or "canary:<drafter version up to {MAX_COUNT}>", '
                f"got {str(arm)[:60]!r}",
            }
        )
    if not isinstance(enabled, bool):
        problems.append({"field": "enabled", "message": "must be true or false"})
    if problems:
        summary = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
        raise ValidationProblem(f"invalid scrape target: {summary}", details=problems)
    assert isinstance(name, str)
    return TargetSpec(name, tuple(clean_urls), clean_arm, version, bool(enabled))


def scrape_id_for(
    target_id: int, sequence: int, previous: CounterSnapshot | None, current: CounterSnapshot
) -> str:
    """Deterministic: the same target, at the same point of its history, seeing the same counters
    gets the same id, so a scrape applied twice (two scrapers racing, a retried transaction)
    stores its records once. The sequence number keeps a later identical transition (a restart
    that climbs back to the very same counters) from being mistaken for a repeat."""
    body = json.dumps(
        [target_id, sequence, previous.to_dict() if previous is not None else None, current.to_dict()],
        sort_keys=True,
        separators=(",", ":"),
    )
    return f"scrape:{hashlib.sha256(body.encode()).hexdigest()[:32]}"


def _short(message: str) -> str:
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


# --- targets ----------------------------------------------------------------------------------


def describe_target(target: ScrapeTarget) -> dict[str, Any]:
    """The target as the API shows it (the stored snapshot only as how many engines it holds)."""
    snapshot = target.snapshot or {}
    series = snapshot.get("series") if isinstance(snapshot, dict) else None
    return {
        "name": target.name,
        "urls": list(target.urls),
        "arm": target.arm,
        "drafter_version": target.drafter_version,
        "enabled": target.enabled,
        "scrapes": target.scrapes,
        "records_stored": target.records_stored,
        # Label sets of the last scrape (the snapshot also remembers recently vanished ones).
        "label_sets": sum(1 for item in series if isinstance(item, dict) and not item.get("missed"))
        if isinstance(series, list)
        else 0,
        # SQLite hands datetimes back naive (they are stored in UTC): one spelling for both.
        "last_scraped_at": as_utc(target.last_scraped_at).isoformat() if target.last_scraped_at else None,
        "last_error": target.last_error,
        "created_at": as_utc(target.created_at).isoformat(),
    }


def create_target(*, session: Session, deployment_id: int, spec: TargetSpec) -> ScrapeTarget:
    """Register a target (flushed, not committed); a name already used here is a 409."""
    taken = session.scalar(
        select(ScrapeTarget.id).where(
            ScrapeTarget.deployment_id == deployment_id, ScrapeTarget.name == spec.name
        )
    )
    if taken is not None:
        raise ConflictError(f"scrape target {spec.name!r} already exists in this deployment")
    target = ScrapeTarget(
        deployment_id=deployment_id,
        name=spec.name,
        urls=list(spec.urls),
        arm=spec.arm,
        drafter_version=spec.drafter_version,
        enabled=spec.enabled,
        snapshot=None,
        scrapes=0,
        records_stored=0,
        created_at=utcnow(),
    )
    try:
        # A savepoint: a concurrent registration of the same name fails only this insert.
        with session.begin_nested():
            session.add(target)
            session.flush()
    except IntegrityError as exc:
        raise ConflictError(f"scrape target {spec.name!r} already exists in this deployment") from exc
    return target


def list_targets(*, session: Session, deployment_id: int) -> list[ScrapeTarget]:
    return list(
        session.scalars(
            select(ScrapeTarget)
            .where(ScrapeTarget.deployment_id == deployment_id)
            .order_by(ScrapeTarget.name)
        )
    )


def get_target(*, session: Session, deployment_id: int, name: str) -> ScrapeTarget:
    target = session.scalar(
        select(ScrapeTarget).where(ScrapeTarget.deployment_id == deployment_id, ScrapeTarget.name == name)
    )
    if target is None:
        raise NotFoundError(f"scrape target {name!r} not found")
    return target


def delete_target(*, session: Session, deployment_id: int, name: str) -> dict[str, Any]:
    """Remove a target (the records it stored stay); answers what it was, for the audit log."""
    target = get_target(session=session, deployment_id=deployment_id, name=name)
    before = describe_target(target)
    session.delete(target)
    session.flush()
    return before


# --- scraping ---------------------------------------------------------------------------------


@dataclass
class ScrapeOutcome:
    """What one scrape of one target did."""

    name: str
    ok: bool
    url: str | None = None
    format: str | None = None  # "openmetrics" or "prometheus"
    label_sets: int = 0
    baseline_label_sets: int = 0
    inserted: int = 0
    duplicates: int = 0
    error: str | None = None
    url_errors: list[str] = field(default_factory=list)
    scraped_at: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "url": self.url,
            "format": self.format,
            "label_sets": self.label_sets,
            "baseline_label_sets": self.baseline_label_sets,
            "inserted": self.inserted,
            "duplicates": self.duplicates,
            "error": self.error,
            "url_errors": list(self.url_errors),
            "scraped_at": self.scraped_at.isoformat() if self.scraped_at else None,
        }


def _read_one(url: str, fetch: Fetch, max_label_sets: int) -> tuple[CounterSnapshot, str]:
    """The counters one URL exposes and the format they came in; raises with a readable reason."""
    status, content_type, text = fetch(url)
    if not 200 <= status < 300:
        raise FetchError(f"HTTP {status}")
    openmetrics = is_openmetrics_media_type(content_type)
    # Declared OpenMetrics requires its `# EOF` (a truncated body must not pass for Prometheus
    # text); otherwise the body is the classic text format, whatever else it claims to be.
    snapshot = parse_exposition(text, openmetrics=openmetrics, max_label_sets=max_label_sets)
    return snapshot, "openmetrics" if openmetrics else "prometheus"


def _lock(session: Session, target_id: int) -> ScrapeTarget | None:
    """The target row, reloaded and locked (PostgreSQL; SQLite serialises writers instead), so
    two scrapers of one target take turns and the second diffs against the first's snapshot."""
    return session.scalar(
        select(ScrapeTarget)
        .where(ScrapeTarget.id == target_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )


def scrape_target(
    session: Session, target: ScrapeTarget, fetch: Fetch, *, max_label_sets: int = MAX_LABEL_SETS
) -> ScrapeOutcome:
    """Scrape one target into the caller's transaction; the caller commits.

    The targets are the serving fleet itself, so the records count as the fleet's own
    (``from_serving_key``: they may steer a canary). A label set's first scrape is a baseline
    (see controlplane.ingest.prometheus). On success the delta records, the new snapshot and
    the counters go in together; on failure
    only ``last_error`` (and the attempt) is written and the snapshot is kept. Raises
    ``ConflictError`` when another scraper moved the target on meanwhile (the caller rolls back;
    nothing of this attempt counts), ``NotFoundError`` when the target was deleted.
    """
    locked = _lock(session, target.id)
    if locked is None:
        raise NotFoundError(f"scrape target {target.name!r} not found")
    target = locked
    sequence = target.scrapes
    outcome = ScrapeOutcome(name=target.name, ok=False)
    current: CounterSnapshot | None = None
    for url in target.urls:
        try:
            current, outcome.format = _read_one(url, fetch, max_label_sets)
        except BatchValidationError as exc:
            outcome.url_errors.append(_short(f"{url}: not a usable vLLM spec-decode exposition: {exc}"))
            continue
        except Exception as exc:  # noqa: BLE001 - any failure of one URL means: try the next one
            outcome.url_errors.append(_short(f"{url}: {type(exc).__name__}: {exc}"))
            continue
        outcome.url = url
        break
    now = utcnow()
    outcome.scraped_at = now
    records = []
    kept: CounterSnapshot | None = None
    if current is None:
        outcome.error = _short("no URL answered with a usable exposition: " + "; ".join(outcome.url_errors))
    else:
        try:
            previous = CounterSnapshot.from_dict(target.snapshot) if target.snapshot is not None else None
        except ValueError as exc:
            # A snapshot this release cannot read counts as none: the next deltas start from zero.
            log.warning("scrape target %s: stored snapshot ignored: %s", target.id, exc)
            previous = None
        try:
            deltas = counter_deltas(
                previous,
                current,
                scrape_id_for(target.id, sequence, previous, current),
                arm=target.arm,
                drafter_version=target.drafter_version,
                scraped_at=now,
                max_label_sets=max_label_sets,
            )
            records, kept = deltas.records, deltas.snapshot
            outcome.baseline_label_sets = len(deltas.baselines)
            for record in records:
                record.from_serving_key = True
        except BatchValidationError as exc:
            # E.g. a baseline target whose engine drafts, or a scrape torn between counter updates.
            outcome.error = _short(f"{outcome.url}: counter deltas are inconsistent: {exc}")
            current = None
    # Compare-and-set on the attempt count: should a second scraper have moved the target on since
    # this one read it (possible on SQLite, which has no row lock), this attempt is dropped whole.
    values: dict[str, Any] = {"scrapes": sequence + 1, "last_scraped_at": now, "last_error": outcome.error}
    if current is not None and kept is not None:
        values["snapshot"] = kept.to_dict()
    claimed = session.execute(
        update(ScrapeTarget)
        .where(ScrapeTarget.id == target.id, ScrapeTarget.scrapes == sequence)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if cast(CursorResult[Any], claimed).rowcount != 1:
        raise ConflictError(
            f"scrape target {target.name!r} was scraped concurrently; this attempt is dropped"
        )
    if current is not None:
        result = store_records(session=session, deployment_id=target.deployment_id, records=records)
        outcome.ok = True
        outcome.label_sets = len(current.series)
        outcome.inserted = result.inserted
        outcome.duplicates = result.duplicates
        if result.inserted:
            session.execute(
                update(ScrapeTarget)
                .where(ScrapeTarget.id == target.id)
                .values(records_stored=ScrapeTarget.records_stored + result.inserted)
                .execution_options(synchronize_session=False)
            )
    session.flush()
    session.refresh(target)
    return outcome


def scrape_all(session_factory: SessionFactory, fetch: Fetch) -> dict[str, Any]:
    """Scrape every enabled target of every live deployment, one transaction per target; one
    target's failure (down, garbage, a database error) never stops the others.

    Answers ``{"targets", "ok", "failed", "skipped", "inserted", "errors": {target id: error}}``.
    """
    with session_factory() as session:
        ids = list(
            session.scalars(
                select(ScrapeTarget.id)
                .join(Deployment, Deployment.id == ScrapeTarget.deployment_id)
                .where(ScrapeTarget.enabled.is_(True), Deployment.deleted_at.is_(None))
                .order_by(ScrapeTarget.id)
            )
        )
    summary: dict[str, Any] = {
        "targets": len(ids),
        "ok": 0,
        "failed": 0,
        "skipped": 0,
        "inserted": 0,
        "errors": {},
    }
    for target_id in ids:
        session = session_factory()
        try:
            target = session.get(ScrapeTarget, target_id)
            if target is None:  # deleted since the list was read
                summary["skipped"] += 1
                continue
            outcome = scrape_target(session, target, fetch)
            session.commit()
        except (ConflictError, NotFoundError) as exc:
            session.rollback()
            log.info("scrape target %s skipped: %s", target_id, exc.message)
            summary["skipped"] += 1
            continue
        except Exception as exc:  # noqa: BLE001 - one target's failure must not stop the rest
            session.rollback()
            log.exception("scraping target %s failed", target_id)
            summary["failed"] += 1
            summary["errors"][str(target_id)] = _short(f"{type(exc).__name__}: {exc}")
            continue
        finally:
            session.close()
        if outcome.ok:
            summary["ok"] += 1
            summary["inserted"] += outcome.inserted
        else:
            summary["failed"] += 1
            summary["errors"][str(target_id)] = outcome.error
    return summary


# --- the real fetcher -------------------------------------------------------------------------


def http_fetch(
    url: str, *, timeout_s: float = FETCH_TIMEOUT_S, max_bytes: int = MAX_BODY_BYTES
) -> tuple[int, str | None, str]:
    """GET a metrics page: (status, Content-Type, body as text), at most ``max_bytes`` read.

    Raises ``httpx.HTTPError`` when the URL cannot be reached in time and ``FetchError`` when the
    body is too large or not UTF-8 text.
    """
    with (
        # Redirects are followed: some servers answer /metrics with a redirect to /metrics/.
        httpx.Client(timeout=timeout_s, follow_redirects=True, max_redirects=3) as client,
        client.stream("GET", url, headers={"Accept": ACCEPT}) as response,
    ):
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise FetchError(f"body of {declared} bytes exceeds the {max_bytes}-byte limit")
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > max_bytes:
                raise FetchError(f"body exceeds the {max_bytes}-byte limit")
            chunks.append(chunk)
        content_type = response.headers.get("content-type")
        status = response.status_code
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FetchError(f"body is not UTF-8 text: {exc}") from exc
    return status, content_type, text
