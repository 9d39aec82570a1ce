"""The loop: the steps that carry one lifecycle into the next, where the lower lifecycle would
otherwise have to call up into a higher one.

A drift event is answered by a realignment (``drift``: the monitors detect and record, the loop
responds with ``jobs.service.realign_on_drift`` in the same transaction); a realignment's trained
drafter becomes a candidate and opens its canary (``realign``); a person's change to a deployment
ends a guardrail fallback and marks the drafters trained for an old target stale (``deployments``).
Every realignment, whatever asks for it (a drift event, a guardrail, the adaptation policy, the
check that speculation pays, a person), is created by one function,
``jobs.service.queue_realign_job``, which checks its trigger and validates its parameters
(``validate_realign_params``); ``request_realign`` (a request, audited, sent after the commit) and
``schedule_guardrail_realign`` (a guardrail's next try, due after its backoff) are its two callers.

Routes, Celery tasks and the CLI call these functions; the lifecycle packages never import this one.

The control plane's layers, bottom first; a package imports only lower layers (checked by
tests/unit/test_architecture.py, which holds the same list):

1. leaves (nothing of the project below them): errors, timestamps, lifecycle, messaging,
   speculation_math, canary_policy, adaptation_policy, artifacts, tuning
2. config, db
3. audit
4. ingest (acceptance records, rollups, window aggregates: data every lifecycle reads)
5. accounts, stats
6. models
7. traces (a chat trace is rendered with its target model's template)
8. deployments, router
9. fleet
10. drafters
11. drift (detectors, the monitors, the drift event lifecycle)
12. jobs (realign and replay jobs; a job's end ends the drift events it answered)
13. canary (a promotion resolves the drift events and ends a guardrail fallback)
14. adaptation, then speculation_check (standing triggers that request realignments)
15. loop
16. api, then dashboard and observability, bootstrap, app and supervisor, then the CLI: its
    HTTP client (cli_client), the verb modules (cli_canary, cli_models, cli_scrape), cli itself

Two placements follow from the code rather than from the order in which the loop runs: ingest
sits below accounts, because ingest imports no lifecycle while an account's settings are bounded by
ingest's retention limits; and drift sits below jobs and the canary, because a job's failure and a
canary's decision end the drift events they answered (the event lifecycle is theirs to call), while
the monitor's response to a new event is handed in by the loop.
"""
