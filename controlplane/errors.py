"""Domain errors that services raise and the API maps onto HTTP status codes."""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """Base class: a message safe to show to the caller."""

    status_code = 400

    def __init__(self, message: str, *, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class NotFoundError(DomainError):
    status_code = 404


class ConflictError(DomainError):
    status_code = 409


class ValidationProblem(DomainError):
    status_code = 422


class PayloadTooLargeError(DomainError):
    status_code = 413


class UnavailableError(DomainError):
    """The service cannot take this now (shutting down); nothing was done, retry elsewhere."""

    status_code = 503
