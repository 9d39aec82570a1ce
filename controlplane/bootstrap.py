"""Composition root helpers: prepare a database and create the first account."""

from __future__ import annotations

import sys

from controlplane.accounts.service import IssuedKey, create_account, first_account
from controlplane.config import Settings, dev_key_file
from controlplane.db.migrate import upgrade_to_head
from controlplane.db.session import unit_of_work
from controlplane.models.service import register_reference_models


def init_account(settings: Settings, *, account_name: str) -> IssuedKey | None:
    """Migrate to head, register the bundled reference pair as platform models, and create
    ``account_name`` with an admin key, unless an account exists."""
    settings.ensure_local_dirs()
    upgrade_to_head(settings.database_url)
    with unit_of_work(settings.database_url) as session:
        register_reference_models(session=session, settings=settings)
    with unit_of_work(settings.database_url) as session:
        if first_account(session=session) is not None:
            return None
        _, issued = create_account(session=session, name=account_name, secret=settings.secret_key)
        return issued


def prepare_embedded_database(settings: Settings, *, account_name: str = "default") -> None:
    """First start of the embedded default: print the admin key once, never again.

    In development the key is also kept in var/admin.key (mode 0600) so that the local CLI and
    the demo work without copying it by hand; outside development it is only printed.
    """
    issued = init_account(settings, account_name=account_name)
    if issued is None:
        return
    print(
        f"created account {account_name!r}; admin API key (shown once, store it now):\n  {issued.secret}",
        file=sys.stderr,
        flush=True,
    )
    if settings.environment == "development":
        path = dev_key_file(settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(issued.secret + "\n")
