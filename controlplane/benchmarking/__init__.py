"""`controlplane benchmark`: the same prompts against several OpenAI-compatible configurations.

``runner`` is the async load generator (closed and open loop, the throughput search); ``report``
holds the per-request records (AIPerf-shaped), the statistics and the table / JSON / CSV output.
Neither imports torch; built-in domain prompts come from ``workers.corpora`` only when asked for.
"""
