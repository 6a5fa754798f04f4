"""``rollsafe demo`` as a user runs it (a subprocess that starts Temporal, Ray, the engine,
three environment servers and a checkpoint worker itself): the default faults, a passing
verdict, and the same tokens as an unfaulted run with the same seed, on the reference engine
and on vLLM."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from rollsafe.evidence.files import Evidence
from rollsafe.evidence.verify import verify
from rollsafe.http.served import rollsafe_command

STEPS = "4"
NO_KILL = ["--fault", "coordinator@capture", "--fault", "run@step3", "--fault", "env@prepare"]
# Whole demos as subprocesses, each bounded by its own 600 s: the test's limit covers two.
pytestmark = pytest.mark.timeout(1500)


def demo(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # A relative --out, as `make demo` passes one: the environment servers, in their own
    # working directories, must still be told absolute paths.
    relative = out.relative_to(out.parent)
    command = rollsafe_command("demo", "--steps", STEPS, "--seed", "3", "--out", str(relative))
    return subprocess.run(
        [*command, *extra], capture_output=True, text=True, timeout=600, cwd=out.parent
    )


@pytest.fixture(scope="module", autouse=True)
def default_demo(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, Future[subprocess.CompletedProcess[str]]]]:
    """The default demo, started with the module and run beside the deterministic ones (the
    last test reads it): each demo leaves much of the two cores idle, so side by side they end
    minutes sooner than one after another, and none of them depends on its pace."""
    out = tmp_path_factory.mktemp("default") / "async"
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield out, pool.submit(demo, out)


@pytest.mark.parametrize("engine", ["reference", "vllm"])
def test_deterministic_faulted_and_unfaulted_runs_train_the_same_tokens(
    tmp_path: Path, engine: str
) -> None:
    """``--engine vllm``: vLLM serves the policy (a tiny dense model the demo builds), and the
    run killed mid-generation resumes from cut prefixes on a fresh vLLM server. The two runs
    go side by side (each its own Temporal server, Ray and servers on free ports): a
    deterministic run's tokens do not depend on how fast it goes."""
    # With vLLM, no kill between snapshots (the journal's restore does not depend on the
    # engine, and a third vLLM start would cost a minute of the suite): the other faults.
    faults = [] if engine == "reference" else NO_KILL
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = pool.submit(
            demo, tmp_path / "faulted", "--deterministic", "--engine", engine, *faults
        )
        clean = demo(tmp_path / "clean", "--deterministic", "--no-faults", "--engine", engine)
        faulted = running.result()
    assert faulted.returncode == 0, faulted.stdout[-3000:] + faulted.stderr[-3000:]
    assert "[restore]" in faulted.stdout
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert (tmp_path / "clean" / "faults.jsonl").read_text() == ""

    against = subprocess.run(
        rollsafe_command(
            "verify", str(tmp_path / "faulted"), "--against", str(tmp_path / "clean"), "--json"
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert against.returncode == 0, against.stdout
    assert all(check["ok"] for check in json.loads(against.stdout)["checks"])
    evidence = Evidence.read(tmp_path / "faulted")
    assert len(evidence.trained) == int(STEPS) * 2 * 4
    assert len(evidence.handed_out) == int(STEPS) * 2  # nothing generated ahead
    # The run was killed with calls mid-generation: some resumed from their staged prefixes.
    assert sum(row.restored_prefix_tokens for row in evidence.trained) > 0


def test_the_demo_with_its_default_faults_passes_verification(
    default_demo: tuple[Path, Future[subprocess.CompletedProcess[str]]],
) -> None:
    """Asynchronous (the default): generation a step ahead, the windowed sampler."""
    out, running = default_demo
    run = running.result()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for line in ("[fault] checkpoint worker died", "[fault] environment w1", "[restore]"):
        assert line in run.stdout, run.stdout
    assert "parked" in run.stdout  # the snapshots' park windows are shown as they close
    faults = [json.loads(line) for line in (out / "faults.jsonl").open()]
    assert sorted(f["kind"] for f in faults) == ["coordinator", "env", "kill", "run"]
    # Killed between two snapshots: the journal gave back what sealed since the snapshot.
    assert "journal records" in run.stdout and "[fault] the whole run is killed" in run.stdout
    checks = {c.name: c for c in verify(Evidence.read(out))}
    twice = checks["no sealed rollout generated twice"]
    assert twice.ok and "0.0 generation-seconds lost" in twice.detail, twice.detail
    report = json.loads((out / "report.json").read_text())
    assert report["deterministic"] is False and report["sampler"] == "windowed"
    assert report["totals"]["snapshots_published"] >= 2
    assert (out / "timeline.png").read_bytes().startswith(b"\x89PNG")
    evidence = Evidence.read(out)
    assert len(evidence.trained) == int(STEPS) * 2 * 4  # steps x groups x rollouts
    # Generation ran ahead of training: groups were handed out beyond those trained.
    assert len(evidence.handed_out) > int(STEPS) * 2
