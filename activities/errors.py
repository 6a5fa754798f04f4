"""rollsafe errors at the Temporal boundary (docs/design.md section 11)."""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

from rollsafe.errors import RollsafeError


def to_application_error(error: RollsafeError) -> ApplicationError:
    """``ApplicationError(type=<class name>, non_retryable=not transient)``."""
    return ApplicationError(
        str(error), type=type(error).__name__, non_retryable=not error.transient
    )
