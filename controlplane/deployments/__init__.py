"""Deployments: speculation settings (firectl semantics), their validation and lifecycle."""
