"""A load-test client for OpenAI-compatible ``/v1/completions`` endpoints (``controlplane benchmark``).

The same prompts, output lengths and sampling parameters go to several configurations (a named
endpoint + model + extra request fields), and the latencies, throughput and the acceptance the
responses report are compared.

``prompts`` owns where the prompts come from (a file the user gives, or a small built-in set);
``runner`` is the async load generator (closed and open loop, the throughput search); ``report``
holds the per-request records (AIPerf-shaped), the statistics and the table / JSON / CSV output;
``cli`` is the typer command that ``controlplane.cli`` registers as ``benchmark``.

A client of the control plane, not part of it: it reuses the control plane's public response
parsers (``controlplane.ingest``) and imports nothing of the workers, so torch is never loaded.
"""
