"""The reference serving layer: an OpenAI-compatible completions server on top of `workers.engine`."""
