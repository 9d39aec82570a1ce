"""Celery tasks that pull backends' Prometheus /metrics into acceptance records (beat-driven).

A thin adapter: the scraping, its transactions and its rules are ``controlplane.ingest.scrape``'s.
"""

from __future__ import annotations

from typing import Any

from controlplane import messaging
from controlplane.config import get_settings
from controlplane.db.session import TRANSIENT_DATABASE_ERRORS, get_sessionmaker
from controlplane.ingest.scrape import http_fetch, scrape_all
from workers.celery_app import TransientError, project_task


@project_task(messaging.METRICS_SCRAPE_ALL, ignore_result=True)
def scrape_all_targets() -> dict[str, Any]:
    """Beat entry point: scrape every enabled target once (one transaction per target)."""
    settings = get_settings()
    try:
        return scrape_all(get_sessionmaker(settings.database_url), http_fetch)
    except TRANSIENT_DATABASE_ERRORS as exc:  # listing the targets failed: the next tick retries
        raise TransientError(str(exc)) from exc
