"""Routes for the speculation check: does speculation pay on this deployment, and what was done."""

from __future__ import annotations

from fastapi import APIRouter

from controlplane.api import schemas
from controlplane.api.deps import ReadableDeployment, SessionDep
from controlplane.speculation_check.service import check_status

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["speculation"])


@router.get("/speculation-check")
def speculation_check(
    account: str, deployment: ReadableDeployment, session: SessionDep
) -> schemas.SpeculationCheck:
    """Whether the live arm is faster than the standing no-speculation arm, why, and the last
    action taken when it was not."""
    return schemas.SpeculationCheck.model_validate(check_status(session=session, deployment=deployment))
