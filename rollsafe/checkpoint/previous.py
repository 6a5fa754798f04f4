"""The controller actor's class across releases (docs/upgrading.md).

A driver pickles an actor's class with every function it has, by qualified name, private ones
included, and the actor's process resolves each name on its own release's class: a process of
one release cannot load the class of a release with a function it lacks (every call to the
actor then fails). So :class:`~rollsafe.checkpoint.controller.Controller` keeps exactly the
previous release's functions: new code lives in functions and in the controller's parts
(properties are not pickled), and the previous release's helpers that this release moved into
those parts still resolve, to a stub of the same qualified name that is never called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

# The previous release's private helpers, moved into the controller's parts by issue 36.
PREVIOUS_HELPERS = (
    "_run", "_participant_phase", "_resume_participants", "_open_draft", "_capture",
    "_write_capture", "_publish", "_compact_journal", "_find_published", "_restore",
    "_check_fence", "_check_anchor", "_check_lease", "_abandon", "_discard", "_discard_locked",
    "_end_capture", "_drop_staged", "_admission_expired", "_record", "_entry", "_require_open",
    "_check_usable", "_effect", "_placed",
)  # fmt: skip


def keep_previous_helpers(cls: type) -> None:
    """Give ``cls`` a stub under each of :data:`PREVIOUS_HELPERS`."""
    for name in PREVIOUS_HELPERS:
        setattr(cls, name, _moved(cls, name))


def _moved(cls: type, name: str) -> Callable[..., NoReturn]:
    """A stub that pickles by the helper's own qualified name (so a process of either release
    resolves it on its own class)."""

    def moved(self: object, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"{cls.__name__}.{name}: a previous release's helper, moved")

    moved.__module__ = cls.__module__
    moved.__name__, moved.__qualname__ = name, f"{cls.__name__}.{name}"
    return moved
