"""Account and API-key services (keyword-only, one transaction per caller)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.accounts.keys import generate_key, hash_key, key_matches, key_prefix
from controlplane.db.models import Account, ApiKey, Role
from controlplane.errors import ConflictError, NotFoundError, ValidationProblem
from controlplane.timestamps import utcnow

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9-]{0,61}[a-z0-9]$|^[a-z]$")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key's id, name, role and account."""

    key_id: int
    key_name: str
    role: Role
    account_id: int
    account_name: str

    @property
    def actor(self) -> str:
        return f"key:{self.key_name}#{self.key_id}"


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A freshly issued key: ``secret`` is shown once and never stored."""

    key: ApiKey
    secret: str


def validate_name(name: str, *, what: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ValidationProblem(
            f"{what} name {name!r} must be 1-63 lowercase letters, digits or '-', starting with a letter"
        )
    return name


def create_account(*, session: Session, name: str, secret: str) -> tuple[Account, IssuedKey]:
    """Create an account and its first admin key."""
    validate_name(name, what="account")
    if session.scalar(select(Account.id).where(Account.name == name)) is not None:
        raise ConflictError(f"account {name!r} already exists")
    account = Account(name=name)
    session.add(account)
    session.flush()
    issued = issue_key(session=session, account=account, name="admin", role=Role.admin, secret=secret)
    return account, issued


def issue_key(*, session: Session, account: Account, name: str, role: Role, secret: str) -> IssuedKey:
    """Create a key for an account; returns the secret once."""
    if not name or len(name) > 100:
        raise ValidationProblem("key name must be 1-100 characters")
    plaintext, prefix = generate_key()
    key = ApiKey(
        account_id=account.id,
        name=name,
        prefix=prefix,
        key_hash=hash_key(plaintext, secret=secret),
        role=role,
    )
    session.add(key)
    session.flush()
    return IssuedKey(key=key, secret=plaintext)


def authenticate(*, session: Session, presented: str, secret: str) -> Principal | None:
    """The principal behind a presented key, or None when it is unknown, wrong or revoked."""
    prefix = key_prefix(presented)
    if prefix is None:
        return None
    row = session.execute(
        select(ApiKey, Account.name)
        .join(Account, Account.id == ApiKey.account_id)
        .where(ApiKey.prefix == prefix, ApiKey.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    key, account_name = row
    if not key_matches(presented, key.key_hash, secret=secret):
        return None
    return Principal(
        key_id=key.id, key_name=key.name, role=key.role, account_id=key.account_id, account_name=account_name
    )


def list_keys(*, session: Session, account_id: int) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).where(ApiKey.account_id == account_id).order_by(ApiKey.id)))


def revoke_key(*, session: Session, account_id: int, key_id: int) -> ApiKey:
    key = session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.account_id == account_id))
    if key is None:
        raise NotFoundError(f"api key {key_id} not found")
    if key.revoked_at is None:
        key.revoked_at = utcnow()
    return key


def get_account_by_name(*, session: Session, name: str) -> Account | None:
    return session.scalar(select(Account).where(Account.name == name))


def first_account(*, session: Session) -> Account | None:
    return session.scalar(select(Account).order_by(Account.id).limit(1))


def key_summary(key: ApiKey) -> dict[str, str | int | None]:
    revoked: datetime | None = key.revoked_at
    return {
        "id": key.id,
        "name": key.name,
        "prefix": key.prefix,
        "role": key.role.value,
        "created_at": key.created_at.isoformat(),
        "revoked_at": revoked.isoformat() if revoked else None,
    }
