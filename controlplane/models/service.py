"""Registered models: register, resolve by name, pair a drafter with a target, delete.

Deployments name registered models only, and nothing anywhere substitutes another model for a name
that does not resolve. An account sees its own models and the platform's (``account_id`` NULL, such
as the bundled reference pair that ``controlplane init`` registers); its own come first, and it
cannot register a name the platform already uses.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from controlplane.config import Settings
from controlplane.db.models import Deployment, RegisteredModel, SpeculationMode
from controlplane.errors import ConflictError, DomainError, NotFoundError, ValidationProblem
from controlplane.models.inspect import ModelFacts, inspect_folder
from controlplane.models.location import ModelLocation
from controlplane.models.sources import (
    ModelSourceError,
    hf_cache_root,
    parse_hf_id,
    resolve_hf_snapshot,
    resolve_local_folder,
)
from controlplane.models.vocabulary import TokenizerMismatchError, check_compatible, load_vocabulary

MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
REFERENCE_TARGET = "reference-target"
REFERENCE_DRAFTER = "reference-drafter"
HOW_TO_REGISTER = "register it first: controlplane model register {name} --path DIR (or --hf-id ORG/NAME)"


class ForbiddenModelChange(DomainError):
    status_code = 403


def validate_model_name(name: str) -> str:
    if not MODEL_NAME_PATTERN.match(name) or ".." in name:
        raise ValidationProblem(
            f"model name {name!r} must be 1-100 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


def allowed_roots(settings: Settings) -> list[Path]:
    """Where registered models may be loaded from: the configured model roots, the bundled
    reference models and the Hugging Face cache."""
    return [*settings.model_roots, settings.reference_models_dir, hf_cache_root(settings.hf_cache_dir)]


def _scope(account_id: int | None) -> Any:
    return (
        RegisteredModel.account_id.is_(None)
        if account_id is None
        else (RegisteredModel.account_id == account_id)
    )


def visible_models(*, session: Session, account_id: int) -> list[RegisteredModel]:
    """The account's own models, then the platform's, each by name."""
    rows = session.scalars(
        select(RegisteredModel)
        .where(or_(RegisteredModel.account_id == account_id, RegisteredModel.account_id.is_(None)))
        .order_by(RegisteredModel.account_id.is_(None), RegisteredModel.name)
    )
    return list(rows)


def find_model(*, session: Session, account_id: int, name: str) -> RegisteredModel | None:
    """The model ``name`` as this account sees it: its own first, else the platform's."""
    for scope in (account_id, None):
        row = session.scalar(select(RegisteredModel).where(_scope(scope), RegisteredModel.name == name))
        if row is not None:
            return row
    return None


def require_model(*, session: Session, account_id: int, name: str, field: str) -> RegisteredModel:
    """The registered model ``name``, or a 422 naming the field and how to register it."""
    row = find_model(session=session, account_id=account_id, name=name)
    if row is None:
        raise ValidationProblem(
            f"{field} {name!r} is not a registered model; " + HOW_TO_REGISTER.format(name=name),
            details={"field": field, "model": name},
        )
    return row


def get_model(*, session: Session, account_id: int, name: str) -> RegisteredModel:
    row = find_model(session=session, account_id=account_id, name=name)
    if row is None:
        raise NotFoundError(f"model {name!r} not found")
    return row


def files_digest(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def location_of(model: RegisteredModel) -> ModelLocation:
    return ModelLocation(
        name=model.name,
        uri=Path(model.location).as_uri(),
        files=dict(model.files),
        identity=model.manifest_sha256,
    )


def default_drafter_of(*, session: Session, target: RegisteredModel) -> RegisteredModel | None:
    if target.default_drafter_id is None:
        return None
    return session.get(RegisteredModel, target.default_drafter_id)


def check_pair(*, target: RegisteredModel, drafter: RegisteredModel) -> None:
    """Refuse a drafter that does not tokenize like the target (422 naming the first differences).

    Equal fingerprints settle it at once; otherwise the two vocabularies must map the same tokens
    to the same ids over their shared range: padding rows and extra trailing tokens are fine.
    """
    if target.tokenizer_fingerprint == drafter.tokenizer_fingerprint:
        return
    try:
        check_compatible(
            load_vocabulary(Path(target.location)),
            load_vocabulary(Path(drafter.location)),
            target_name=target.name,
            drafter_name=drafter.name,
        )
    except TokenizerMismatchError as exc:
        raise ValidationProblem(str(exc), details={"target": target.name, "drafter": drafter.name}) from exc
    except (OSError, ValueError) as exc:
        raise ValidationProblem(
            f"cannot read the tokenizers of {target.name!r} and {drafter.name!r}: {exc}"
        ) from exc


def check_drafter_serves(*, target: RegisteredModel, drafter: RegisteredModel) -> None:
    """A drafter serves only the targets it was registered for, and tokenizes like them."""
    if target.name not in drafter.drafter_for:
        raise ValidationProblem(
            f"model {drafter.name!r} is not registered as a drafter for {target.name!r} "
            f"(it drafts for: {', '.join(drafter.drafter_for) or 'nothing'}); register it with "
            f"--drafter-for {target.name}",
            details={"target": target.name, "drafter": drafter.name},
        )
    check_pair(target=target, drafter=drafter)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What to register from: a folder under a model root, or a Hugging Face id."""

    path: str | None = None
    hf_id: str | None = None


def _resolve_source(
    source: ModelSource, settings: Settings, roots: Sequence[Path]
) -> tuple[Path, str, str | None, str | None]:
    if (source.path is None) == (source.hf_id is None):
        raise ValidationProblem("give exactly one of path (a folder under a model root) or hf_id")
    try:
        if source.path is not None:
            return resolve_local_folder(source.path, roots), "path", None, None
        assert source.hf_id is not None
        repo_id, revision = parse_hf_id(source.hf_id)
        folder = resolve_hf_snapshot(repo_id, revision, cache_dir=settings.hf_cache_dir)
        return folder, "hf", repo_id, revision or folder.name
    except ModelSourceError as exc:
        raise ValidationProblem(str(exc)) from exc


def _facts(folder: Path) -> ModelFacts:
    try:
        return inspect_folder(folder)
    except ModelSourceError as exc:
        raise ValidationProblem(str(exc)) from exc


def register_model(
    *,
    session: Session,
    account_id: int | None,
    name: str,
    source: ModelSource,
    settings: Settings,
    drafter_for: Sequence[str] = (),
    default_for: Sequence[str] = (),
    roots: Sequence[Path] | None = None,
) -> RegisteredModel:
    """Register ``name`` (platform-wide when ``account_id`` is None) after inspecting its folder.

    A drafter lists the targets it may serve (they must be registered and tokenize alike);
    ``default_for`` also makes it the default drafter of those targets (and so drafts for them).
    """
    validate_model_name(name)
    if session.scalar(select(RegisteredModel.id).where(_scope(account_id), RegisteredModel.name == name)):
        raise ConflictError(f"model {name!r} is already registered")
    if account_id is not None and session.scalar(
        select(RegisteredModel.id).where(_scope(None), RegisteredModel.name == name)
    ):
        raise ConflictError(f"model {name!r} is a platform model; choose another name")
    drafter_for = sorted(set(drafter_for) | set(default_for))  # a default drafter drafts for it
    folder, kind, hf_id, revision = _resolve_source(
        source, settings, settings.model_roots if roots is None else roots
    )
    facts = _facts(folder)
    model = RegisteredModel(
        account_id=account_id,
        name=name,
        source=kind,
        hf_id=hf_id,
        hf_revision=revision,
        location=str(folder),
        family=facts.family,
        architecture=facts.architecture,
        parameter_count=facts.parameter_count,
        dtype=facts.dtype,
        vocab_size=facts.vocab_size,
        embedding_rows=facts.embedding_rows,
        tokenizer_size=facts.tokenizer_size,
        tokenizer_fingerprint=facts.tokenizer_fingerprint,
        files=dict(facts.files),
        manifest_sha256=files_digest(dict(facts.files)),
        total_bytes=facts.total_bytes,
        drafter_for=sorted(set(drafter_for)),
    )
    targets = [_target_for(session, account_id, target_name) for target_name in model.drafter_for]
    for target in targets:
        check_pair(target=target, drafter=model)
    session.add(model)
    session.flush()
    for target in targets:
        if target.name in default_for:
            _set_default(target, model, account_id)
    return model


def _target_for(session: Session, account_id: int | None, name: str) -> RegisteredModel:
    if account_id is None:
        row = session.scalar(select(RegisteredModel).where(_scope(None), RegisteredModel.name == name))
        if row is None:
            raise ValidationProblem(f"target {name!r} is not a registered platform model")
        return row
    return require_model(session=session, account_id=account_id, name=name, field="drafter_for")


def _set_default(target: RegisteredModel, drafter: RegisteredModel | None, account_id: int | None) -> None:
    if target.account_id != account_id:
        raise ForbiddenModelChange(
            f"target {target.name!r} is a platform model: only its operator sets its default drafter"
        )
    target.default_drafter_id = drafter.id if drafter is not None else None


def set_default_drafter(
    *, session: Session, account_id: int, target_name: str, drafter_name: str | None
) -> RegisteredModel:
    """Make ``drafter_name`` (registered to serve this target) its default, or clear it (None)."""
    target = get_model(session=session, account_id=account_id, name=target_name)
    drafter = None
    if drafter_name is not None:
        drafter = require_model(session=session, account_id=account_id, name=drafter_name, field="drafter")
        check_drafter_serves(target=target, drafter=drafter)
    _set_default(target, drafter, account_id)
    session.flush()
    return target


def deployments_using(*, session: Session, model: RegisteredModel) -> list[str]:
    """Names of live deployments that would lose this model: they name it, or rely on it as a
    default drafter."""
    scope: Any = Deployment.deleted_at.is_(None)
    if model.account_id is not None:
        scope = scope & (Deployment.account_id == model.account_id)
    named = or_(Deployment.target_model == model.name, Deployment.draft_model == model.name)
    relying_targets = select(RegisteredModel.name).where(RegisteredModel.default_drafter_id == model.id)
    relying = (Deployment.draft_model.is_(None)) & Deployment.target_model.in_(relying_targets)
    rows = session.scalars(
        select(Deployment.name).where(scope, or_(named, relying)).order_by(Deployment.name)
    )
    return list(rows)


def delete_model(*, session: Session, account_id: int, name: str) -> None:
    """Unregister an account's model; refused while a deployment uses it. Files are not touched."""
    model = get_model(session=session, account_id=account_id, name=name)
    if model.account_id is None:
        raise ForbiddenModelChange(f"model {name!r} is a platform model: only its operator removes it")
    in_use = deployments_using(session=session, model=model)
    if in_use:
        raise ConflictError(f"model {name!r} is used by deployments {', '.join(in_use)}; change them first")
    session.delete(model)
    session.flush()


def describe_model(*, session: Session, model: RegisteredModel) -> dict[str, Any]:
    default = default_drafter_of(session=session, target=model)
    return {
        "name": model.name,
        "scope": "platform" if model.account_id is None else "account",
        "source": model.source,
        "hf_id": model.hf_id,
        "hf_revision": model.hf_revision,
        "family": model.family,
        "architecture": model.architecture,
        "parameter_count": model.parameter_count,
        "dtype": model.dtype,
        "vocab_size": model.vocab_size,
        "embedding_rows": model.embedding_rows,
        "tokenizer_size": model.tokenizer_size,
        "tokenizer_fingerprint": model.tokenizer_fingerprint,
        "files": dict(model.files),
        "manifest_sha256": model.manifest_sha256,
        "total_bytes": model.total_bytes,
        "drafter_for": list(model.drafter_for),
        "default_drafter": default.name if default is not None else None,
        "created_at": model.created_at.isoformat(),
    }


def register_reference_models(*, session: Session, settings: Settings) -> list[str]:
    """Register the bundled reference pair as platform models (once; later calls do nothing).

    The generic drafter is the reference target's default drafter, so a deployment of
    ``reference-target`` with no speculation flags speculates with it.
    """
    done: list[str] = []
    root = settings.reference_models_dir
    wanted: Iterable[tuple[str, str, list[str]]] = (
        (REFERENCE_TARGET, "target", []),
        (REFERENCE_DRAFTER, "generic-drafter", [REFERENCE_TARGET]),
    )
    for name, folder, drafts_for in wanted:
        exists = session.scalar(select(RegisteredModel.id).where(_scope(None), RegisteredModel.name == name))
        if exists is not None:
            continue
        register_model(
            session=session,
            account_id=None,
            name=name,
            source=ModelSource(path=str(root / folder)),
            settings=settings,
            drafter_for=drafts_for,
            default_for=drafts_for,
            roots=[root],
        )
        done.append(name)
    return done


@dataclass(frozen=True, slots=True)
class DrafterChoice:
    """Which registered drafter a deployment speculates with when no trained version is active,
    and why: ``explicit`` (its draft_model), ``target_default`` (its target's default drafter),
    ``none`` (no speculation flags and no default: it runs without speculation) or
    ``not_applicable`` (n-gram lookup or speculation disabled)."""

    model: RegisteredModel | None
    source: str
    note: str


def drafter_choice(*, session: Session, deployment: Deployment) -> DrafterChoice:
    mode = deployment.speculation_mode
    if mode in (SpeculationMode.disabled, SpeculationMode.ngram):
        return DrafterChoice(None, "not_applicable", f"speculation mode {mode.value}: no draft model")
    if deployment.draft_model:
        drafter = find_model(session=session, account_id=deployment.account_id, name=deployment.draft_model)
        if drafter is None:
            return DrafterChoice(
                None, "none", f"draft model {deployment.draft_model!r} is no longer registered"
            )
        return DrafterChoice(drafter, "explicit", f"draft model {drafter.name!r} set on the deployment")
    target = find_model(session=session, account_id=deployment.account_id, name=deployment.target_model)
    default = default_drafter_of(session=session, target=target) if target is not None else None
    if default is None:
        return DrafterChoice(
            None,
            "none",
            f"target {deployment.target_model!r} has no default drafter: running without speculation",
        )
    return DrafterChoice(default, "target_default", f"default drafter of target {deployment.target_model!r}")


def validate_deployment_models(
    *, session: Session, account_id: int, target_model: str, draft_model: str | None
) -> None:
    """A deployment's target and explicit drafter must be registered, and pair (422 otherwise)."""
    target = require_model(session=session, account_id=account_id, name=target_model, field="target_model")
    if draft_model is not None:
        drafter = require_model(session=session, account_id=account_id, name=draft_model, field="draft_model")
        check_drafter_serves(target=target, drafter=drafter)
