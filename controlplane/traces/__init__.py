"""Trace capture: sampled prompt/completion text and uploaded sample datasets per deployment.

``formats`` validates what callers send (batch JSON, JSONL datasets), ``scrub`` replaces
personal data and secrets with surrogates of the same shape (with ``recognizers``: Presidio,
phonenumbers and detect-secrets; ``surrogates``), ``service`` stores, pages and ages out the
scrubbed rows.
The realignment job reads its training text from here; nothing unscrubbed is ever stored.
"""
