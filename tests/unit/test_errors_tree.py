"""rollsafe/errors.py is the one home of every rollsafe exception, and its docstring draws the
whole tree: every class the package defines under RollsafeError appears there once, under one
of its direct bases, and nothing else does."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import rollsafe
from rollsafe import errors

BRANCH = re.compile(r"^(?P<indent>[\s│]*)[├└]── (?P<name>\w+)")


def tree(doc: str) -> dict[str, str]:
    """Each class drawn in ``doc``'s tree -> the class drawn above it (its parent)."""
    lines = doc.split("::", 1)[1].splitlines()
    root_line = next(line for line in lines if line.strip())
    margin = len(root_line) - len(root_line.lstrip())
    parents: dict[str, str] = {}
    path = [root_line.strip()]  # path[d]: the class last seen at depth d
    for line in lines:
        found = BRANCH.match(line)
        if not found:
            continue
        depth = (len(found["indent"]) - margin) // 4  # each level indents by four columns
        name = found["name"]
        assert name not in parents, f"{name} is drawn twice"
        parents[name] = path[depth]
        del path[depth + 1 :]
        path.append(name)
    return parents


def rollsafe_error_classes() -> dict[str, type]:
    """Every subclass of RollsafeError defined anywhere in the package, by name."""
    for module in pkgutil.walk_packages(rollsafe.__path__, "rollsafe."):
        if module.name.endswith("__main__") or module.name.startswith(
            ("rollsafe.engine.vllm", "rollsafe.reference")
        ):
            continue  # vLLM's import is slow and the reference run defines no rollsafe errors
        importlib.import_module(module.name)
    found: dict[str, type] = {}
    pending = [errors.RollsafeError]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("rollsafe") and sub.__name__ not in found:
                found[sub.__name__] = sub
                pending.append(sub)
    return found


def test_every_rollsafe_error_lives_in_errors() -> None:
    elsewhere = {
        name: cls.__module__
        for name, cls in rollsafe_error_classes().items()
        if cls.__module__ != "rollsafe.errors"
    }
    assert not elsewhere, f"define these in rollsafe/errors.py: {elsewhere}"


def test_the_tree_and_the_classes_agree() -> None:
    drawn = tree(errors.__doc__ or "")
    classes = {
        name: cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, errors.RollsafeError)
    }
    assert set(drawn) == set(classes) - {"RollsafeError"}
    wrong = {
        name: (parent, [base.__name__ for base in classes[name].__bases__])
        for name, parent in drawn.items()
        if parent not in {base.__name__ for base in classes[name].__bases__}
    }
    assert not wrong, f"drawn under a class that is not a direct base: {wrong}"


def test_the_tree_check_can_fail() -> None:
    doc = "::\n\n    RollsafeError\n    ├── TransientError\n    │   └── InvalidInput\n"
    assert tree(doc) == {"TransientError": "RollsafeError", "InvalidInput": "TransientError"}
    assert errors.TransientError not in errors.InvalidInput.__bases__
