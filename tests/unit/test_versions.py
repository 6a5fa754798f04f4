"""Contracts between releases (rollsafe.versions): who works with whom, what a release writes
for the one before, and what it reads of the one after (rollsafe.temporal.converter)."""

from __future__ import annotations

import ast
import inspect
import json
import logging
import tomllib
import zipfile
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.api.common.v1 import Payload

from rollsafe import versions
from rollsafe.checkpoint import controller
from rollsafe.checkpoint.previous import PREVIOUS_HELPERS
from rollsafe.errors import VersionSkew
from rollsafe.temporal.converter import CONTRACT_KEY, data_converter, written_by
from rollsafe.versions import CONTRACT, Peer, check_peer
from rollsafe.workflows.models import SupervisorConfig, SupervisorState, SupervisorStatus

converter = data_converter.payload_converter


def payload_of(data: dict[str, object], contract: int | None) -> Payload:
    payload = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(data).encode())
    if contract is not None:
        payload.metadata[CONTRACT_KEY] = str(contract).encode()
    return payload


def test_one_contract_apart_works_either_way_and_two_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(versions, "CONTRACT", 5)  # so that two below exists
    assert all(versions.supported(c) for c in (4, 5, 6))
    assert not versions.supported(3) and not versions.supported(7)
    check_peer("the controller actor", Peer(release="x", contract=6))
    with pytest.raises(VersionSkew) as older:
        check_peer("the controller actor of run 'r'", Peer(release="0.0.9", contract=3))
    assert str(older.value) == (
        "the controller actor of run 'r' is rollsafe 0.0.9 (contract 3); this process is "
        f"rollsafe {versions.THIS.release} (contract 5), which works with contracts 4 to 6: "
        "upgrade it to a release at most one apart (docs/upgrading.md)"
    )
    with pytest.raises(VersionSkew, match="upgrade this process"):
        check_peer("a worker", Peer(release="9.0", contract=7))


def test_payloads_are_stamped_with_the_contract_that_wrote_them() -> None:
    [payload] = converter.to_payloads([SupervisorConfig(run_id="r")])
    assert written_by(payload) == CONTRACT
    assert written_by(payload_of({}, None)) == 1  # a release before contracts


def test_fields_this_release_added_are_written_only_when_used() -> None:
    """So the release before (unknown fields forbidden) reads every payload that does not use
    them: the supervisor's state, config and status at their defaults."""
    state = json.loads(converter.to_payloads([SupervisorState()])[0].data)
    assert "unpublished_in_a_row" not in state and "published" in state
    config = json.loads(converter.to_payloads([SupervisorConfig(run_id="r")])[0].data)
    assert "warn_unpublished_after" not in config and "max_consecutive_failures" in config
    used = json.loads(converter.to_payloads([SupervisorState(unpublished_in_a_row=2)])[0].data)
    assert used["unpublished_in_a_row"] == 2
    status = SupervisorStatus(
        run_id="r",
        state=SupervisorState(),
        running_seq=None,
        running_workflow_id=None,
        queued_requests=0,
    )
    assert "warning" not in json.loads(converter.to_payloads([status])[0].data)


def test_a_payload_of_the_next_contract_is_read_without_its_new_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = {"run_id": "r", "from_the_future": 1, "options": {"retry_attempts": 2, "later": True}}
    with caplog.at_level(logging.WARNING, logger="rollsafe.temporal.converter"):
        [config] = converter.from_payloads([payload_of(data, CONTRACT + 1)], [SupervisorConfig])
        converter.from_payloads([payload_of(data, CONTRACT + 1)], [SupervisorConfig])
    assert config == SupervisorConfig(run_id="r", options={"retry_attempts": 2})
    named = sorted(r.getMessage().split("field ")[1].split(" ")[0] for r in caplog.records)
    assert named == ["'from_the_future'", "'options.later'"]  # each once, not per payload


def test_an_unknown_field_from_this_contract_or_an_earlier_one_is_an_error() -> None:
    for contract in (CONTRACT, CONTRACT - 1, None):
        with pytest.raises(ValidationError, match="from_the_future"):
            converter.from_payloads(
                [payload_of({"run_id": "r", "from_the_future": 1}, contract)], [SupervisorConfig]
            )


def test_a_next_contract_payload_with_a_bad_known_field_is_still_an_error() -> None:
    bad = {"run_id": "r", "max_consecutive_failures": 0, "from_the_future": 1}
    with pytest.raises(ValidationError, match="max_consecutive_failures"):
        converter.from_payloads([payload_of(bad, CONTRACT + 1)], [SupervisorConfig])


def test_a_payload_two_contracts_ahead_is_refused_before_it_is_read() -> None:
    with pytest.raises(VersionSkew, match=f"contract {CONTRACT + 2}"):
        converter.from_payloads([payload_of({"run_id": "r"}, CONTRACT + 2)], [SupervisorConfig])


PREVIOUS_WHEEL = Path(__file__).resolve().parents[1] / "fixtures" / "releases"
CONTROLLER_SOURCE = "rollsafe/checkpoint/controller.py"


def controller_methods(source: str) -> dict[str, ast.arguments]:
    """The functions defined in ``class Controller``'s body, by name."""
    [cls] = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and node.name == "Controller"
    ]
    return {
        node.name: node.args
        for node in cls.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and not any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
    }


def functions_of(cls: type) -> set[str]:
    """What Ray pickles an actor class with: its functions and methods (not properties)."""
    return {
        name
        for name, value in inspect.getmembers(cls)
        if (inspect.isfunction(value) or inspect.ismethod(value)) and not name.startswith("__")
    }


def test_the_controller_actor_has_the_previous_releases_functions() -> None:
    """A driver pickles an actor's class with its functions by qualified name, private ones
    included, and the actor's process resolves each on its own release's class: a worker
    process of this release could not load a class of the previous one with a function it
    lacks, and one of the previous release a class of this one with a function it has not
    (every call then fails). So the functions stay those of the previous release (its helpers
    that moved resolve to a stub), the public ones taking the previous release's arguments
    first (new ones only with defaults); a new call goes through ``__ray_call__``."""
    [wheel] = PREVIOUS_WHEEL.glob("rollsafe-*.whl")
    with zipfile.ZipFile(wheel) as unpacked:
        previous = controller_methods(unpacked.read(CONTROLLER_SOURCE).decode())
    now = controller_methods(Path(controller.__file__).read_text())
    own = {name for name in previous if not name.startswith("__")}
    assert functions_of(controller.Controller) == own
    for name in own:  # each pickles by a name the other release's class resolves
        function = getattr(controller.Controller, name)
        function = getattr(function, "__func__", function)
        assert (function.__module__, function.__qualname__) == (
            controller.__name__,
            f"Controller.{name}",
        ), name
    for name, before in previous.items():
        if name not in now:
            assert name in PREVIOUS_HELPERS, f"{name} vanished"
            continue
        after = now[name]
        old_names = [a.arg for a in [*before.posonlyargs, *before.args]]
        new_names = [a.arg for a in [*after.posonlyargs, *after.args]]
        assert new_names[: len(old_names)] == old_names, name
        added = len(new_names) - len(old_names)
        assert added <= len(after.defaults), f"{name}: a new argument needs a default"


def test_the_release_is_the_packages() -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == versions.THIS.release
