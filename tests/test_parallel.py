"""``spec verify -n N``: the targets over worker processes give the one-process report; the schedule runs the
longest targets first; a worker that dies is that target's suite error, with its traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from spec.run.parallel import Target, next_for, recorded_seconds, schedule, static_estimate

ROOT = Path(__file__).resolve().parents[1]


def verify(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spec", "verify", "--profile", "ci", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          # no shrink deadline: a wall-clock limit would make the shrunk case depend on the load
                          # (a loaded 2-core CI machine spent the 120 s default on one side only)
                          env={**__import__("os").environ, "SPEC_EXAMPLE_DB": ":memory:",
                               "SPEC_SHRINK_DEADLINE": "3600"})


#: what may differ between processes: timings, and the counts of the path hypothesis took to the (same) shrunk
#: case: a worker runs torch on one thread, the parent on all, and a float32 reduction over a wide vocabulary can
#: round differently at a tolerance's edge, which changes how many examples the search and the shrink take (and so
#: the coverage counts of those examples)
RUN_DEPENDENT = ("seconds", "examples", "exercised", "distinct_cases", "coverage")


def without_timings(path: Path) -> dict:
    report = json.loads(path.read_text())
    report["outcomes"] = [{k: v for k, v in o.items() if k not in RUN_DEPENDENT} for o in report["outcomes"]]
    report.pop("coverage", None)  # the sum of the outcomes' coverage counts
    return report


def test_two_workers_give_the_one_process_report(tmp_path: Path) -> None:
    """Derandomized draws and verdict are per target (its seed stream and database key), not per process."""
    only = ["--only", "INV-LEAK-001", "--engine", "planted:global_max_shift"]
    one, two = verify(tmp_path / "one", *only, "-n", "1"), verify(tmp_path / "two", *only, "-n", "2")
    assert one.returncode == two.returncode == 1, one.stdout[-2000:] + two.stderr[-2000:]  # the planted bug fails
    a = without_timings(tmp_path / "one" / "verify-planted-global_max_shift.json")
    b = without_timings(tmp_path / "two" / "verify-planted-global_max_shift.json")
    assert [o["status"] for o in a["outcomes"]].count("fail") >= 1
    # each run writes its failure's reproducer (spec/repro) under its own folder: the same file, another path
    for report, folder in ((a, "one"), (b, "two")):
        for rep in report.get("reproducers", []):
            rep["path"] = Path(rep["path"]).relative_to(tmp_path / folder).as_posix()
    assert a["reproducers"] and a["reproducers"][0]["status"] == "reproduces"
    # the engine-code coverage is measured in either (the same surface), but what the processes around the targets
    # run differs with the worker layout (one branch of impl's input step, measured 2026-12-04): not part of the verdict
    cov_a, cov_b = a.pop("engine_coverage"), b.pop("engine_coverage")
    assert cov_a["measured"] and cov_b["measured"] and cov_a["branches"] == cov_b["branches"]
    assert a == b


def test_a_dead_worker_is_its_targets_error_and_the_run_goes_on(tmp_path: Path) -> None:
    run = verify(tmp_path, "--engine", "tests.crashing_engine:CrashOnPadded", "--only", "INV-KEYS-001", "-n", "2")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    (report,) = tmp_path.glob("verify-*.json")
    outcomes = {o["mode"]: o for o in json.loads(report.read_text())["outcomes"]}
    assert outcomes["packed"]["status"] == "pass"
    dead = outcomes["padded"]
    assert dead["status"] == "error" and "killed by SIGSEGV" in dead["error"]
    assert "prepare_model_inputs" in dead["error"]  # the worker's Python stack, from faulthandler


def test_schedule_runs_the_longest_first() -> None:
    targets = [Target("INV-MASK-001", "padded"), Target("INV-LEAK-002", "packed"), Target("INV-SP-001", "packed"),
               Target("INV-KEYS-003", "both")]
    recorded = {"INV-MASK-001/padded": 1.0, "INV-LEAK-002/packed": 9.0, "INV-SP-001/packed": 3.0}
    order = [targets[i].key for i in schedule(targets, recorded)]
    assert [key for key in order if key in recorded] == \
        ["INV-LEAK-002/packed", "INV-SP-001/packed", "INV-MASK-001/padded"]
    # the one never recorded: its static estimate in the recorded targets' seconds (4 runs x 13 s / 5 runs)
    assert order[0] == "INV-KEYS-003/both"
    # without a record: the static estimate (engine runs the check asks for; the both-modes check doubled)
    assert static_estimate(Target("INV-LEAK-002", "packed")) > static_estimate(Target("INV-MASK-001", "padded"))
    assert targets[schedule(targets)[0]].key == "INV-KEYS-003/both"


def test_recorded_seconds_reads_a_report(tmp_path: Path) -> None:
    path = tmp_path / "verify-impl.json"
    path.write_text(json.dumps({"outcomes": [
        {"invariant": "INV-MASK-001", "mode": "padded", "status": "pass", "seconds": 2.5},
        {"invariant": "INV-CU-001", "mode": "packed", "status": "skip", "seconds": 0.0}]}))
    assert recorded_seconds(path) == {"INV-MASK-001/padded": 2.5}
    assert recorded_seconds(tmp_path / "absent.json") == {}


def test_real_rank_targets_go_to_the_worker_that_owns_the_pool() -> None:
    """One rank pool per run: a real-rank target is taken only by the worker that took the first one; the others
    take the next target that needs no ranks, or nothing."""
    waiting, on_ranks = [4, 7, 2, 9], frozenset({4, 2})
    assert next_for(waiting, on_ranks, None, 1) == 0  # no owner yet: any worker takes the head
    assert next_for(waiting, on_ranks, 1, 1) == 0  # the owner takes the head
    assert next_for(waiting, on_ranks, 1, 0) == 1  # another worker skips the real-rank head
    assert next_for([4, 2], on_ranks, 1, 0) is None  # only real-rank targets left: nothing for it
    assert next_for([], on_ranks, None, 0) is None


def test_verify_marks_the_real_rank_targets() -> None:
    """The targets run on ranks are those that need them, or that need sequence parallelism from an engine whose
    sequence parallelism runs on a process group (verl's); none of an engine's other targets."""
    from spec.invariants import CATALOGUE
    from spec.run.registry import load_engine
    from spec.run.runner import runs_on_ranks

    impl = load_engine("impl")
    marked = {i for i, info in CATALOGUE.items() if runs_on_ranks(info, impl)}
    assert {i for i in CATALOGUE if i.startswith("INV-RANK")} <= marked  # the real-rank family, every one
    assert not marked & {"INV-VAL-001", "INV-TEMP-001", "INV-MASK-001"}  # single-process checks
    assert not runs_on_ranks(CATALOGUE["INV-LABEL-002"], impl)  # impl's SP runs in one process
    Ranked = type("Ranked", (), {"sp_on_real_ranks": True})
    assert runs_on_ranks(CATALOGUE["INV-LABEL-002"], Ranked())
