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

from spec.run.database import replay_database
from spec.run.registry import load_engine
from spec.invariants import CATALOGUE
from spec.run.runner import run_invariant
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
    report = json.loads((tmp_path / "fuzz-planted-left_right_as_nested_positions.json").read_text())
    by_target = {t["target"]: t for t in report["targets"]}
    assert set(by_target) == {f"{info.id}/any" for info in CATALOGUE.values() if info.id.startswith("INV-DENSE-00")}
    assert by_target["INV-DENSE-002/any"]["status"] == "fail" and by_target["INV-DENSE-002/any"]["examples"] > 0
    # (with fresh seeds another dense invariant may trip over the same bug: every failure is reported)
    failures = sorted(key for key, t in by_target.items() if t["status"] == "fail")
    assert all(f"FAIL {key}: " in run.stdout for key in failures)
    progress = [line for line in run.stderr.splitlines() if line.startswith("fuzz:") and "/s)" in line]
    assert "2 workers" in progress[-1] and f"failures: {len(failures)} [" in progress[-1], run.stderr
    assert (tmp_path / "fuzz-planted-left_right_as_nested_positions.md").read_text().startswith("# Fuzz campaign")

    # A later CI run (here, in this process) on the campaign's database fails on the saved cases
    # alone: each worker may have saved its own failure (both can be in that target's round at
    # once), and the ci run replays them all and draws nothing; on an empty database it needs
    # dozens of cases (the control in tests/test_example_db.py).
    replay = run_invariant(CATALOGUE[BUG[0]], load_engine(BUG[2]), BUG[1], profile="ci",
                           database=replay_database(database), verbosity=Verbosity.quiet)
    assert replay.status == "fail" and replay.distinct_cases <= 2, replay
    assert "mRoPE position_ids" in replay.error


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
