"""A restore against damaged, missing and hostile state (docs/journal.md and
docs/snapshot-format.md, "What a restore does with damage"): a seeded, bounded fuzz.

A run is built once (two snapshots, a restore in its history, records after each), restored
as it is for the reference, then mutated a few hundred ways (rollsafe.testing.damage) and
restored again, each mutant in its own copy. Every outcome must be one of:

- *refused*: a RollsafeError naming what is wrong;
- *fell back* or *stopped*: restored, with the reason named in the plan (a newer snapshot
  passed over, a journal stop, a loss the restore was told to accept);
- *identical*: restored to exactly the reference state;

never an exception of another kind, a hang, or a different state with nothing said. And
whatever a restore read, every file it found is still there with the same bytes afterwards
(its own new segment and HEAD aside; what an accepted loss set aside, moved whole).
Then the CLI walks one mutant in twenty: `rollsafe ls` and `rollsafe restore plan` never
print a traceback and end 0, 1 or 2.
"""

from __future__ import annotations

import collections
import hashlib
import shutil
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rollsafe.cli.app import app
from rollsafe.core.columns import in_key_order
from rollsafe.core.config import RunConfig
from rollsafe.core.phases import RestorePlan
from rollsafe.core.run_state import ROLLOUT_PARTITION, RunState
from rollsafe.dataplane import make_dataplane
from rollsafe.errors import RollsafeError
from rollsafe.evidence.scenario import commit_rollout
from rollsafe.journal.run import SET_ASIDE_DIR, RunJournal
from rollsafe.snapshot import SnapshotStore, state_files
from rollsafe.testing.damage import Mutation, mutations

RUN = "fuzz"
CONFIG = RunConfig(run_id=RUN, group_size=2, groups_per_step=1, restore_level="turn")
MUTANTS = 300
SEED = 32
CLI_EVERY = 20  # one mutant in this many is also walked through the CLI
HANG_S = 20.0


def build_run(root: Path) -> None:
    """Two snapshots with records after each, a crash and a restore between them, and records
    after the restore: every kind of segment a journal holds."""
    store = SnapshotStore(root, RUN)
    journal = RunJournal.for_store(store, flush_ms=None, mirror_every_s=None)
    state = RunState(CONFIG, make_dataplane("memory"))
    journal.start(state)
    state.handout([0, 1, 2])
    for idx, i in ((0, 0), (0, 1), (1, 0)):
        commit_rollout(state, idx, i, owner="w0")
    state.dispatch(2, 0, owner="w0")
    state_files.checkpoint(state, store, "c-1")
    journal.compact(store)
    commit_rollout(state, 1, 1, owner="w0")
    state.claim([0], step=0)
    state.commit_step([0])
    journal.wait_durable(journal.last_id)
    journal.close()  # a crash; the next process restores
    state, _ = restore(root)
    state.handout([3, 4])
    commit_rollout(state, 3, 0, owner="w0")
    state.evict(4)
    state_files.checkpoint(state, store, "c-2")
    journal = _attached(state)
    journal.compact(store)
    commit_rollout(state, 3, 1, owner="w0")
    state.claim([1], step=1)
    state.handout([5])
    commit_rollout(state, 5, 0, owner="w0")
    journal.wait_durable(journal.last_id)
    journal.close()


def _attached(state: RunState) -> RunJournal:
    assert isinstance(state.journal, RunJournal)
    return state.journal


def restore(root: Path, *, accept_loss: bool = False) -> tuple[RunState, RestorePlan]:
    """As the controller restores: snapshot, journal, then the journal goes on."""
    store = SnapshotStore(root, RUN)
    journal = RunJournal.for_store(store, flush_ms=None, mirror_every_s=None)
    try:
        state, plan = state_files.restore(
            CONFIG,
            store,
            make_dataplane("memory"),
            journal=journal.replayer(accept_loss=accept_loss),
        )
        journal.resume()
    except BaseException:
        journal.abandon_restore()
        journal.close()
        raise
    assert journal.replayed is not None
    return state, plan.model_copy(update={"journal": journal.replayed.summary()})


def picture(run: RunState) -> tuple[Any, ...]:
    """Everything a restore brings back: ledger, index, loader, weights, rows."""
    ledger, index = run.ledger.capture(), run.index.capture()
    keys = sorted(
        run.row_key(idx, i) for idx in run.ledger.groups() for i in run.ledger.sealed(idx)
    )
    rows = run.dataplane.get(ROLLOUT_PARTITION, keys)
    return (
        {name: array.tobytes() for name, array in in_key_order(ledger[0]).items()},
        ledger[1],
        {name: array.tobytes() for name, array in in_key_order(index[0]).items()},
        index[1],
        (run.loader_position, run.handed_out, run.weight_version),
        {key: {name: a.tobytes() for name, a in rows[key].items()} for key in keys},
    )


def files_of(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's sha256, or what else it is."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[rel] = f"link to {path.readlink()}"
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).digest()
        elif not path.is_dir():
            found[rel] = "special"
    return found


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()`` in a thread of its own; a hang fails the test instead of stopping it."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    if not done.wait(seconds):
        pytest.fail(f"hung for {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, tuple[Any, ...]]:
    """The run's root, another run's (the same run id, another journal), and the reference
    state restored from the run as it is."""
    root = tmp_path_factory.mktemp("pristine")
    build_run(root)
    foreign = tmp_path_factory.mktemp("foreign")
    build_run(foreign)
    copy = tmp_path_factory.mktemp("reference") / "root"
    shutil.copytree(root, copy, symlinks=True)
    state, plan = restore(copy)
    _attached(state).close()
    assert plan.skipped == {} and plan.journal is not None and plan.journal.stops == []
    return root, foreign, picture(state)


def outcome(mutation: Mutation, root: Path, reference: tuple[Any, ...], accept_loss: bool) -> str:
    """Restore the mutated ``root``; which of the allowed outcomes it was (asserted)."""
    before = files_of(root)
    try:
        state, plan = within(HANG_S, lambda: restore(root, accept_loss=accept_loss))
    except RollsafeError as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    else:
        return _restored(mutation, root, reference, before, state, plan)
    named = [word for word in mutation.names if word in refusal]
    assert named, f"{mutation.name}: refused without naming it: {refusal}"
    assert files_of(root) == before, f"{mutation.name}: a refused restore changed files"
    return "refused"


def _restored(
    mutation: Mutation,
    root: Path,
    reference: tuple[Any, ...],
    before: dict[str, bytes | str],
    state: RunState,
    plan: RestorePlan,
) -> str:
    _attached(state).close()
    _nothing_overwritten(mutation, root, before)
    journal = plan.journal
    assert journal is not None
    said = bool(plan.skipped) or bool(journal.stops) or bool(journal.accepted_loss)
    if picture(state) == reference:
        return "fell back, identical" if plan.skipped else "identical"
    assert said, f"{mutation.name}: restored a different state without a word: {plan}"
    if journal.accepted_loss:
        return "loss accepted, named"
    return "fell back, named" if plan.skipped else "stopped, named"


def _nothing_overwritten(mutation: Mutation, root: Path, before: dict[str, bytes | str]) -> None:
    after = files_of(root)
    journal = f"{RUN}/journal/"
    aside = {rel: digest for rel, digest in after.items() if f"/{SET_ASIDE_DIR}/" in rel}
    for rel, digest in before.items():
        if rel == f"{journal}HEAD":
            continue  # replaced, atomically, to name the restore's segment
        moved = f"{journal}{SET_ASIDE_DIR}/{rel.removeprefix(journal)}"
        assert after.get(rel) == digest or aside.get(moved) == digest, (
            f"{mutation.name}: the restore changed or removed {rel}"
        )


def test_every_mutant_is_refused_by_name_fell_back_stopped_or_identical(
    pristine: tuple[Path, Path, tuple[Any, ...]],
) -> None:
    root, foreign, reference = pristine
    work = root.parent / "mutants"
    counts: collections.Counter[str] = collections.Counter()
    for n, mutation in enumerate(mutations(root / RUN, foreign / RUN, SEED, MUTANTS)):
        copy = work / str(n)
        shutil.copytree(root, copy, symlinks=True)
        mutation.apply(copy / RUN)
        if n % CLI_EVERY == 0:
            walk_the_cli(mutation, copy)
        accept_loss = n % 7 == 3  # some restores are told to go on without what is lost
        counts[outcome(mutation, copy, reference, accept_loss)] += 1
        shutil.rmtree(copy, ignore_errors=True)
    print(f"{MUTANTS} mutants (seed {SEED}): {dict(sorted(counts.items()))}")
    assert sum(counts.values()) == MUTANTS
    # The catalogue reaches every kind of outcome: a fuzz that only ever restores is no test.
    assert {"refused", "identical", "stopped, named"} <= set(counts), counts


def walk_the_cli(mutation: Mutation, root: Path) -> None:
    runner = CliRunner()
    before = files_of(root)
    for args in (
        ("ls", RUN, "--root", str(root)),
        ("ls", RUN, "--root", str(root), "--json"),
        ("restore", "plan", RUN, "--root", str(root)),
        ("restore", "plan", RUN, "--root", str(root), "--json", "--accept-journal-loss"),
    ):
        result = within(HANG_S, partial(runner.invoke, app, list(args)))
        where = f"{mutation.name}: rollsafe {' '.join(args[:2])}"
        assert result.exit_code in (0, 1, 2), f"{where}: exit {result.exit_code}"
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            f"{where}: {type(result.exception).__name__}: {result.exception}"
        )
        assert "Traceback" not in result.output, f"{where}: {result.output}"
    assert files_of(root) == before, f"{mutation.name}: the CLI changed files"
