"""API-key format and hashing. Only an HMAC of a key is ever stored.

A key reads ``sk_<prefix>_<secret>``: the prefix (public, unique) finds the row, the HMAC of the
whole key (peppered with the server secret) proves possession. Keys carry 256 bits of
randomness, so a fast keyed hash is enough; a slow password hash would only slow ingestion.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_SCHEME = "sk"


def generate_key() -> tuple[str, str]:
    """A new key and its public prefix."""
    prefix = secrets.token_hex(6)
    return f"{KEY_SCHEME}_{prefix}_{secrets.token_urlsafe(32)}", prefix


def key_prefix(key: str) -> str | None:
    """The prefix of a well-formed key, or None."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_SCHEME or not parts[1] or not parts[2]:
        return None
    return parts[1]


def hash_key(key: str, *, secret: str) -> str:
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()


def key_matches(key: str, stored_hash: str, *, secret: str) -> bool:
    return hmac.compare_digest(hash_key(key, secret=secret), stored_hash)
