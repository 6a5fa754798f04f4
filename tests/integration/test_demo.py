"""``rollsafe demo`` as a user runs it (a subprocess that starts Temporal, Ray, the engine,
three environment servers and a checkpoint worker itself): the default faults, a passing
verdict, and the same tokens as an unfaulted run with the same seed, on the reference engine
and on vLLM."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from rollsafe.evidence.files import Evidence
from rollsafe.evidence.verify import verify
from rollsafe.http.served import rollsafe_command

STEPS = "3"
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


Demo = Future[subprocess.CompletedProcess[str]]
ENGINES = ("reference", "vllm")
SIDE_BY_SIDE = 2  # demos at a time (the fixture says why)


# On the reference engine, the faults around the run too: the Temporal server killed while a
# snapshot is in commit_envs, and (in place of run@step3: the same, and more) an environment
# instance lost for good after a snapshot mid-generation, the run restored onto the others.
AROUND = ["--fault", "temporal@commit_envs", "--fault", "env-lost@step3"]
WITH_ALL = ["--fault", "coordinator@capture", "--fault", "kill@step2", "--fault", "env@prepare"]


def deterministic_faults(engine: str) -> list[str]:
    # With vLLM, no kill between snapshots (the journal's restore does not depend on the
    # engine, and a third vLLM start would cost a minute of the suite): the other faults.
    return [*WITH_ALL, *AROUND] if engine == "reference" else NO_KILL


@pytest.fixture(scope="module")
def demos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Demo]]]:
    """Every demo of the module, started with it and run two at a time (the tests read them):
    each leaves much of the two cores idle, and none depends on its pace (a deterministic run's
    tokens do not depend on how fast it goes), so side by side they end minutes sooner than one
    after another. Never two vLLM demos at once, and not more than two demos: `make test` runs
    another module's tests beside this one (docs/testing.md), and starved so, a vLLM demo's
    dispatcher missed its run lease (5 s then; 30 s since) and a cut waited 38 s for a vLLM
    step, past the environments' park lease. The vLLM demos go first and last, so the
    one-at-a-time rule rarely keeps a slot idle. Each demo has its own Temporal server, Ray and
    servers on free ports. Keys: ``default``, ``<engine>/faulted``, ``<engine>/clean``."""
    outs = {"default": tmp_path_factory.mktemp("default") / "async"}
    flags: dict[str, list[str]] = {"default": []}
    for engine in ENGINES:
        root = tmp_path_factory.mktemp(engine)
        outs[f"{engine}/faulted"] = root / "faulted"
        outs[f"{engine}/clean"] = root / "clean"
        run = ["--deterministic", "--engine", engine]
        flags[f"{engine}/faulted"] = [*run, *deterministic_faults(engine)]
        flags[f"{engine}/clean"] = [*run, "--no-faults"]
    one_vllm = threading.Semaphore(1)

    def run_demo(key: str) -> subprocess.CompletedProcess[str]:
        if not key.startswith("vllm/"):
            return demo(outs[key], *flags[key])
        with one_vllm:
            return demo(outs[key], *flags[key])

    order = ("vllm/faulted", "reference/faulted", "reference/clean", "default", "vllm/clean")
    with ThreadPoolExecutor(max_workers=SIDE_BY_SIDE) as pool:
        yield {key: (outs[key], pool.submit(run_demo, key)) for key in order}


@pytest.mark.parametrize("engine", ENGINES)
def test_deterministic_faulted_and_unfaulted_runs_train_the_same_tokens(
    demos: dict[str, tuple[Path, Demo]], engine: str
) -> None:
    """``--engine vllm``: vLLM serves the policy (a tiny dense model the demo builds), and the
    run killed mid-generation resumes from cut prefixes on a fresh vLLM server."""
    faulted_dir, faulted_run = demos[f"{engine}/faulted"]
    clean_dir, clean_run = demos[f"{engine}/clean"]
    faulted, clean = faulted_run.result(), clean_run.result()
    assert faulted.returncode == 0, faulted.stdout[-3000:] + faulted.stderr[-3000:]
    assert "[restore]" in faulted.stdout
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert (clean_dir / "faults.jsonl").read_text() == ""

    against = subprocess.run(
        rollsafe_command("verify", str(faulted_dir), "--against", str(clean_dir), "--json"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert against.returncode == 0, against.stdout
    assert all(check["ok"] for check in json.loads(against.stdout)["checks"])
    evidence = Evidence.read(faulted_dir)
    assert len(evidence.trained) == int(STEPS) * 2 * 4
    assert len(evidence.handed_out) == int(STEPS) * 2  # nothing generated ahead
    # The run was killed with calls mid-generation: some resumed from their staged prefixes.
    assert sum(row.restored_prefix_tokens for row in evidence.trained) > 0
    if engine == "reference":  # the faults around the run, recorded and recovered from
        kinds = {json.loads(line)["kind"] for line in (faulted_dir / "faults.jsonl").open()}
        assert {"temporal", "env-lost", "kill", "coordinator", "env"} <= kinds, kinds
        assert "[restore] w2 is not in the fleet" in faulted.stdout, faulted.stdout


def test_the_demo_with_its_default_faults_passes_verification(
    demos: dict[str, tuple[Path, Demo]],
) -> None:
    """Asynchronous (the default): generation a step ahead, the windowed sampler."""
    out, running = demos["default"]
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
