"""Reading a Temporal failure chain (workflow -> child -> activity -> ApplicationError).

Sandbox-safe (temporalio only): workflow code uses it as well as clients.
"""

from __future__ import annotations

from temporalio.exceptions import ApplicationError


def root_application_error(error: BaseException | None) -> ApplicationError | None:
    """The ApplicationError a failure chain ends in (its ``type`` is the rollsafe error class
    name, docs/design.md section 11), or None for timeouts, cancellations and the like."""
    while error is not None:
        if isinstance(error, ApplicationError):
            return error
        error = getattr(error, "cause", None) or error.__cause__
    return None


def describe_failure(error: BaseException) -> tuple[str, str]:
    """``(type, message)`` of the root of a failure chain, for people and typed errors."""
    root = root_application_error(error)
    if root is not None:
        return root.type or "ApplicationError", root.message
    while (cause := getattr(error, "cause", None) or error.__cause__) is not None:
        error = cause  # a timeout or cancellation: name the innermost failure
    return type(error).__name__, str(error)
