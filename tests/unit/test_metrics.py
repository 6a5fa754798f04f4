"""Metrics: a real Controller (controller, memory data plane, snapshot store) driven through
a snapshot's ten phases and a restore records the exact park, drain, cut, capture and restore
values; the exporter is picked by OTEL_METRICS_EXPORTER.

OpenTelemetry allows one meter provider per process, so this module installs one with an
in-memory reader (once) and tells tests apart by their run id: every measurement carries it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, InMemoryMetricReader

from rollsafe.checkpoint import restore as restore_module
from rollsafe.checkpoint.controller import Controller
from rollsafe.checkpoint.phases import (
    commit_envs,
    cut_generation,
    drain,
    prepare_envs,
    resume,
    retire_dropped,
)
from rollsafe.checkpoint.phases.commit_envs import ENVS_DIR
from rollsafe.checkpoint.restore_envs import EnvsRestored
from rollsafe.core.config import RunConfig
from rollsafe.core.ids import EpisodeId, GroupId
from rollsafe.core.phases import (
    PHASES,
    Phase,
    PhaseRequest,
    PhaseResult,
    RestoreRequest,
    SnapshotSpec,
)
from rollsafe.core.run_state import EnvironmentsRestored
from rollsafe.engine.protocol import CutRefusal
from rollsafe.engine.staging import StagedCut
from rollsafe.env.fleet_rules import FleetCommitted, FleetPrepared
from rollsafe.env.protocol import EpisodeRef
from rollsafe.errors import InjectedFault, InvalidInput
from rollsafe.evidence.scenario import row_content
from rollsafe.faults import ENV_VAR, arm, disarm_all
from rollsafe.observability import metrics
from rollsafe.snapshot import verify_snapshot

READER = InMemoryMetricReader()
GROUP_SIZE = 2
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _meter_provider() -> None:
    assert metrics.configure_metrics(READER)


@pytest.fixture(autouse=True)
def _no_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV_VAR, raising=False)
    disarm_all()
    yield
    disarm_all()


def new_run() -> str:
    return f"m-{uuid.uuid4().hex[:10]}"


def busy(service: Controller) -> Controller:
    """Groups 0-1 ready, 2 half done (sibling 1 dispatched), 3 never dispatched, 4 trained."""
    service.handout([0, 1, 2, 3, 4])
    for idx, i in [(0, 0), (0, 1), (1, 0), (1, 1), (4, 0), (4, 1), (2, 0)]:
        episode = service.dispatch(idx, i)
        assert episode is not None
        service.seal(idx, i, episode.attempt, row_content(idx, i, episode.attempt))
    service.dispatch(2, 1, owner="w0")  # on environment instance w0
    service.commit_step([4])
    return service


def make_ops(tmp_path: Path, run_id: str, participants: Any = None) -> Controller:
    # Turn level: an environment may restore an unsealed sibling (FakeParticipants does).
    config = RunConfig(
        run_id=run_id, group_size=GROUP_SIZE, groups_per_step=2, restore_level="turn"
    )
    return busy(Controller(config, tmp_path, participants=participants))


def run_phases(ops: Controller, run_id: str, seq: int = 1) -> list[PhaseResult]:
    spec = SnapshotSpec(run_id=run_id, seq=seq)
    return [ops.run_phase(PhaseRequest(spec=spec, phase=phase)) for phase in PHASES]


def points(run_id: str) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """Metric name -> (attributes, data point) of this run's measurements."""
    data = READER.get_metrics_data()
    assert data is not None, "the in-memory reader is not installed (another provider won?)"
    found: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    if attributes.get(metrics.RUN_ID) == run_id:
                        found.setdefault(metric.name, []).append((attributes, point))
    return found


def counter(run_id: str, name: str, key: str) -> dict[str, int]:
    return {attrs[key]: point.value for attrs, point in points(run_id).get(name, [])}


def histogram(run_id: str, name: str) -> Any:
    [(_, point)] = points(run_id)[name]
    return point


def manifest_bytes(ops: Controller, run_id: str) -> int:
    [entry] = ops.store.list()
    manifest, _ = verify_snapshot(entry.path, run_id)
    return sum(f.bytes for f in manifest.files.values())


def test_a_snapshot_and_a_restore_record_exact_values(tmp_path: Path) -> None:
    run_id = new_run()
    ops = make_ops(tmp_path, run_id)
    started = time.monotonic()
    results = run_phases(ops, run_id)
    wall = time.monotonic() - started
    assert results[-1].published is not None

    park = histogram(run_id, "rollsafe.snapshot.park_seconds")
    assert park.count == 1 and 0 < park.sum <= wall
    drain = histogram(run_id, "rollsafe.snapshot.drain_seconds")
    assert drain.count == 1 and 0 <= drain.sum <= park.sum  # the drain is inside the park
    [(_, captured)] = points(run_id)["rollsafe.snapshot.capture_bytes"]
    assert captured.value == manifest_bytes(ops, run_id) > 0
    assert "rollsafe.snapshot.cuts" not in points(run_id)  # no engines: nothing to cut

    plan = ops.restore(RestoreRequest(run_id=run_id, restore_id="r1"))
    expected = metrics.restore_counts(plan, GROUP_SIZE)
    # Groups 0-1 ready (4 rollouts) + group 2's sealed sibling; group 2's other sibling and
    # both of group 3 run again; nothing was restored by an environment.
    assert expected == {"reused": 5, "resumed": 0, "rerun": 3}
    assert counter(run_id, "rollsafe.restore.rollouts", "kind") == expected
    ops.restore(RestoreRequest(run_id=run_id, restore_id="r1"))  # idempotent: counted once
    assert counter(run_id, "rollsafe.restore.rollouts", "kind") == expected


def test_units_and_run_id_on_every_measurement(tmp_path: Path) -> None:
    run_id = new_run()
    run_phases(make_ops(tmp_path, run_id), run_id)
    metrics.record_restored_prefix_tokens(run_id, 3)
    data = READER.get_metrics_data()
    assert data is not None
    units = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                units[metric.name] = metric.unit
                for point in metric.data.data_points:
                    assert metrics.RUN_ID in dict(point.attributes or {}), metric.name
    assert units["rollsafe.snapshot.park_seconds"] == "s"
    assert units["rollsafe.snapshot.drain_seconds"] == "s"
    assert units["rollsafe.snapshot.capture_bytes"] == "By"
    assert units["rollsafe.restore.prefix_tokens"] == "{token}"


def test_replayed_phases_record_nothing_again(tmp_path: Path) -> None:
    run_id = new_run()
    ops = make_ops(tmp_path, run_id)
    run_phases(ops, run_id)
    first = points(run_id)
    replays = run_phases(ops, run_id)  # a replayed workflow: every phase returns its result
    assert all(r.replayed for r in replays)
    again = points(run_id)
    assert histogram(run_id, "rollsafe.snapshot.park_seconds").count == 1
    assert histogram(run_id, "rollsafe.snapshot.drain_seconds").count == 1
    assert [p.value for _, p in again["rollsafe.snapshot.capture_bytes"]] == [
        p.value for _, p in first["rollsafe.snapshot.capture_bytes"]
    ]


def test_capture_bytes_count_once_when_publish_is_retried(tmp_path: Path) -> None:
    run_id = new_run()
    ops = make_ops(tmp_path, run_id)
    spec = SnapshotSpec(run_id=run_id, seq=1)
    for phase in PHASES[:-1]:
        ops.run_phase(PhaseRequest(spec=spec, phase=phase))
    arm("store.before_latest", "raise")  # the snapshot is renamed into place, then a crash
    with pytest.raises(InjectedFault):
        ops.run_phase(PhaseRequest(spec=spec, phase=Phase.PUBLISH))
    disarm_all()
    ops.run_phase(PhaseRequest(spec=spec, phase=Phase.PUBLISH))  # finds it on disk
    # A restarted controller finds the publish too, but wrote none of its bytes.
    config = RunConfig(run_id=run_id, group_size=GROUP_SIZE, groups_per_step=2)
    fresh = Controller(config, tmp_path)
    assert fresh.run_phase(PhaseRequest(spec=spec, phase=Phase.PUBLISH)).published is not None
    [(_, captured)] = points(run_id)["rollsafe.snapshot.capture_bytes"]
    assert captured.value == manifest_bytes(ops, run_id)


@pytest.mark.parametrize("order", ["resume_then_abort", "abort_only"])
def test_an_aborted_checkpoint_records_its_park_once(tmp_path: Path, order: str) -> None:
    run_id = new_run()
    ops = make_ops(tmp_path, run_id)
    spec = SnapshotSpec(run_id=run_id, seq=1)
    for phase in (Phase.OPEN, Phase.CLOSE_ADMISSION):
        ops.run_phase(PhaseRequest(spec=spec, phase=phase))
    time.sleep(0.02)
    if order == "resume_then_abort":  # the workflow's compensation: resume, then abort
        ops.run_phase(PhaseRequest(spec=spec, phase=Phase.RESUME))
    ops.abort(spec)
    park = histogram(run_id, "rollsafe.snapshot.park_seconds")
    assert park.count == 1 and park.sum >= 0.02
    assert "rollsafe.snapshot.capture_bytes" not in points(run_id)


class FakeParticipants:
    """Environments and engines with the real return types, in place of the phases' calls to
    them (:meth:`install`): the drain takes a moment, the cut stages two calls and refuses
    three (two skipped, one failed), the commit exports one file, and the restore brings group
    2's unsealed sibling back in its environment."""

    DRAIN_S = 0.05

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.instance_for = lambda placement: "w0"  # every episode on one instance
        self.cut_result = StagedCut(
            staged={"c1": 7, "c2": 3},
            refused=(
                CutRefusal(call_id="c3", reason="unknown_call"),
                CutRefusal(call_id="c4", reason="no_tokens"),
                CutRefusal(call_id="c5", reason="constrained_decoding"),
            ),
            handoffs=1,
        )

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for module, name, fake in [
            (retire_dropped, "retire", lambda _, retirements: len(retirements)),
            (prepare_envs, "park", self.park),
            (drain, "wait_for_replies", self.wait_for_replies),
            (cut_generation, "cut_calls", lambda *_: self.cut_result),
            (commit_envs, "commit", self.commit),
            (resume, "resume_participants", lambda *_: "1 instance resumed"),
            (restore_module, "restore_envs", self.restore_envs),
        ]:
            monkeypatch.setattr(module, name, fake)

    @staticmethod
    def park(_: object, checkpoint_id: str) -> FleetPrepared:
        return FleetPrepared(checkpoint_id=checkpoint_id, deadline_ts=time.time(), instances={})

    def wait_for_replies(self, *_: object, wait: bool = True) -> list[EpisodeRef]:
        time.sleep(self.DRAIN_S)
        return []

    @staticmethod
    def commit(
        _: object, prepared: FleetPrepared, snapshot_dir: Path, *__: object
    ) -> FleetCommitted:
        (snapshot_dir / ENVS_DIR).mkdir()
        (snapshot_dir / ENVS_DIR / "w0.json").write_bytes(b'{"episodes": []}' * 10)
        return FleetCommitted(checkpoint_id=prepared.checkpoint_id, instances={})

    def restore_envs(self, *_: object) -> EnvsRestored:
        episode = EpisodeId(GroupId(self.run_id, 2).rollout(1), 0)
        return EnvsRestored(EnvironmentsRestored({episode: "w0"}), None, 0)


def test_participant_phases_record_cuts_drain_and_resumed_rollouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = new_run()
    fake = FakeParticipants(run_id)
    fake.install(monkeypatch)
    ops = make_ops(tmp_path, run_id, fake)
    run_phases(ops, run_id)
    assert metrics.cut_outcomes(fake.cut_result) == {
        "cut": 2,
        "skipped": 2,
        "failed": 1,
    }
    assert counter(run_id, "rollsafe.snapshot.cuts", "outcome") == {
        "cut": 2,
        "skipped": 2,
        "failed": 1,
    }
    drain = histogram(run_id, "rollsafe.snapshot.drain_seconds")
    assert drain.count == 1 and drain.sum >= FakeParticipants.DRAIN_S
    park = histogram(run_id, "rollsafe.snapshot.park_seconds")
    assert park.sum >= drain.sum
    [(_, captured)] = points(run_id)["rollsafe.snapshot.capture_bytes"]
    assert captured.value == manifest_bytes(ops, run_id)  # the envs file and participants.json

    plan = ops.restore(RestoreRequest(run_id=run_id, restore_id="r1"))
    assert plan.partial[2].resumed  # the environment restored group 2's sibling 1
    expected = {"reused": 5, "resumed": 1, "rerun": 2}
    assert metrics.restore_counts(plan, GROUP_SIZE) == expected
    assert counter(run_id, "rollsafe.restore.rollouts", "kind") == expected


def test_restored_prefix_tokens_add_up() -> None:
    run_id = new_run()
    metrics.record_restored_prefix_tokens(run_id, 12)
    metrics.record_restored_prefix_tokens(run_id, 30)
    [(_, point)] = points(run_id)["rollsafe.restore.prefix_tokens"]
    assert point.value == 42


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, type(None)),
        ("none", type(None)),
        ("", type(None)),
        ("console", ConsoleMetricExporter),
        (" OTLP ", OTLPMetricExporter),
    ],
)
def test_the_exporter_follows_the_standard_variable(value: str | None, expected: type) -> None:
    environ = {} if value is None else {metrics.EXPORTER_ENV: value}
    assert isinstance(metrics.exporter_from_env(environ), expected)


def test_an_unknown_exporter_names_the_variable_and_the_choices() -> None:
    with pytest.raises(InvalidInput) as error:
        metrics.exporter_from_env({metrics.EXPORTER_ENV: "prometheus"})
    assert str(error.value) == (
        "OTEL_METRICS_EXPORTER='prometheus': expected one of none, console, otlp"
    )


# A fresh process: the provider is process-global and this one already has a provider.
SCRIPT = textwrap.dedent(
    """
    import os
    from opentelemetry import metrics as api
    from rollsafe.observability import metrics
    from rollsafe.errors import InvalidInput

    os.environ["OTEL_METRICS_EXPORTER"] = "bogus"
    try:
        metrics.configure_metrics()
    except InvalidInput as exc:
        print("refused:", exc)
    os.environ["OTEL_METRICS_EXPORTER"] = "none"
    print("none configured:", metrics.configure_metrics())
    print("provider:", type(api.get_meter_provider()).__name__)
    metrics.record_park("noop-run", 1.0)  # the API's no-op: nothing to see, nothing raised
    os.environ["OTEL_METRICS_EXPORTER"] = "console"
    print("console configured:", metrics.configure_metrics())
    metrics.record_park("console-run", 0.25)
    """
)


def test_console_exports_at_exit_and_none_installs_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "refused: OTEL_METRICS_EXPORTER='bogus'" in out
    assert "none configured: False" in out
    assert "provider: _ProxyMeterProvider" in out
    assert "console configured: True" in out
    # The exit flush of the periodic reader prints the histogram with its run id.
    assert "rollsafe.snapshot.park_seconds" in out and "console-run" in out
    assert "noop-run" not in out
