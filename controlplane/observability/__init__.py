"""Observability: Prometheus metrics computed from the database on each scrape."""
