"""Trace capture: sampled prompt/completion text and uploaded sample datasets per deployment.

``formats`` validates what callers send (batch JSON, JSONL datasets), ``scrub`` replaces
personal data and secrets with surrogates of the same shape (with ``recognizers``: Presidio,
phonenumbers and detect-secrets; ``surrogates``), ``service`` stores, pages and ages out the
scrubbed rows, each with the ``category`` and source ``document`` the client named; ``holdout``
says what counts as the same prompt and splits traces into trained and held out by content.
The realignment job reads its training text from here; nothing unscrubbed is ever stored.
"""
