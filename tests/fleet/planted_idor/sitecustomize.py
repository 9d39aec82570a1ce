"""A deliberately broken control plane for tests that must see tenant probes fail: started with
this folder first on PYTHONPATH, the API looks a canary up by its id alone, whatever account and
deployment the path names (an insecure direct object reference)."""

from __future__ import annotations

from sqlalchemy.orm import Session

import controlplane.canary.service as canary_service
from controlplane.db.models import Canary
from controlplane.errors import NotFoundError


def get_canary_by_id_alone(*, session: Session, deployment_id: int, canary_id: int) -> Canary:
    row = session.get(Canary, canary_id)
    if row is None:
        raise NotFoundError(f"canary {canary_id} not found")
    return row


canary_service.get_canary = get_canary_by_id_alone  # type: ignore[assignment]
