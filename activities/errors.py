"""rollsafe errors at the Temporal boundary (docs/design.md section 11)."""

from __future__ import annotations

from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from rollsafe.errors import RollsafeError


def to_application_error(error: RollsafeError) -> ApplicationError:
    """``ApplicationError(type=<class name>, non_retryable=not transient)``; BENIGN when the
    design expects it (``RollsafeError.expected``): the SDK then logs it at DEBUG, without
    the traceback it gives every other failed activity."""
    benign = error.expected
    return ApplicationError(
        str(error),
        type=type(error).__name__,
        non_retryable=not error.transient,
        category=ApplicationErrorCategory.BENIGN
        if benign
        else ApplicationErrorCategory.UNSPECIFIED,
    )
