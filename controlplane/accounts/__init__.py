"""Accounts and API keys: creation, hashing, verification and revocation."""
