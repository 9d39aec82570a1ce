"""Trace capture: sampled prompt/completion text and uploaded sample datasets per deployment.

``formats`` validates what callers send (batch JSON, JSONL datasets), ``scrub`` replaces
personal data with typed placeholders, ``service`` stores, pages and ages out the scrubbed rows.
The realignment job reads its training text from here; nothing unscrubbed is ever stored.
"""
