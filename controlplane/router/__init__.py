"""The arm router: an OpenAI-compatible reverse proxy that splits a deployment's traffic into the
control plane's speculation arms, and reports every reply's acceptance back (torch-free)."""
