"""``python -m spec fuzz``: a campaign on worker processes, its progress line, report and exit code,
and the ``ci`` profile replaying what it saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import Verbosity

from spec.database import replay_database
from spec.engines import load_engine
from spec.invariants import CATALOGUE
from spec.runner import run_invariant
from tests.test_example_db import BUG, free_port

ROOT = Path(__file__).resolve().parents[1]


def fuzz(database: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    env.update(SPEC_EXAMPLE_DB=database, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "spec", "fuzz", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_campaign_finds_a_planted_bug_and_ci_replays_it_first(tmp_path: Path) -> None:
    database = str(tmp_path / "db")
    run = fuzz(database, "--engine", BUG[2], "--only", "INV-DENSE-00", "--workers", "2", "--seconds", "3",
               "--out", str(tmp_path))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAIL INV-DENSE-002/any: DenseCase(" in run.stdout
    assert "2 workers" in run.stderr and "failures: 1 [INV-DENSE-002/any]" in run.stderr
    progress = [line for line in run.stderr.splitlines() if line.startswith("fuzz:") and "/s)" in line]
    assert progress, run.stderr
    report = json.loads((tmp_path / "fuzz-planted-left_right_as_nested_positions.json").read_text())
    by_target = {t["target"]: t for t in report["targets"]}
    assert by_target["INV-DENSE-002/any"]["status"] == "fail"
    # the other dense invariants hold for this bug: fuzzed, nothing found
    others = [t for key, t in by_target.items() if key != "INV-DENSE-002/any"]
    assert others and all(t["status"] == "pass" for t in others)
    assert sum(t["examples"] for t in others) > 0
    assert (tmp_path / "fuzz-planted-left_right_as_nested_positions.md").read_text().startswith("# Fuzz campaign")

    # a later CI run (here, in this process) on the campaign's database replays the failure first
    replay = run_invariant(CATALOGUE[BUG[0]], load_engine(BUG[2]), BUG[1], profile="ci",
                           database=replay_database(database), verbosity=Verbosity.quiet)
    assert replay.status == "fail" and replay.distinct_cases == 1, replay
    assert replay.counterexample == by_target["INV-DENSE-002/any"]["counterexample"]


def test_campaign_on_impl_finds_nothing_and_exits_0(tmp_path: Path) -> None:
    run = fuzz(str(tmp_path / "db"), "--only", "INV-MASK-001", "--workers", "1", "--seconds", "1",
               "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "fuzz-impl.json").read_text())
    assert [t["status"] for t in report["targets"]] == ["pass"]
    assert report["targets"][0]["examples"] > 0 and "failures: 0" in run.stderr


def test_campaign_refuses_an_unreachable_redis(tmp_path: Path) -> None:
    pytest.importorskip("redis", reason="the redis package is not installed")
    run = fuzz(f"redis://127.0.0.1:{free_port()}/0", "--seconds", "1", "--out", str(tmp_path))
    assert run.returncode == 2 and "unreachable" in run.stderr, run.stdout + run.stderr
    assert not list(tmp_path.iterdir())
