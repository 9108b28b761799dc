"""``python -m spec verify``: the table, the reports, the exit code, user engines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def verify(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """One process (``-n 1``): these runs are a handful of targets; tests/test_parallel.py runs the pool."""
    return subprocess.run([sys.executable, "-m", "spec", "verify", "--profile", "dev", "--out", str(tmp_path), "-n", "1",
                           *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_verify_impl_passes_and_writes_reports(tmp_path: Path) -> None:
    run = verify(tmp_path, "--only", "INV-MASK")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| INV-MASK-001 |" in run.stdout and "4 passed, 0 failed" in run.stdout
    assert "[  4/4]" in run.stderr  # progress
    report = json.loads((tmp_path / "verify-impl.json").read_text())
    assert report["engine"] == "impl" and len(report["outcomes"]) == 4
    assert (tmp_path / "verify-impl.md").read_text().startswith("# Conformance report")


def test_verify_planted_bug_fails_with_one_line_counterexample(tmp_path: Path) -> None:
    run = verify(tmp_path, "--engine", "planted:loss_mask_attention", "--only", "INV-MASK-001")
    assert run.returncode == 1, run.stdout + run.stderr
    row = next(line for line in run.stdout.splitlines() if line.startswith("| INV-MASK-001 |"))
    assert "FAIL" in row and "`EngineCase(" in row and "attention_mask row" in row
    # its standalone reproducer, run once by verify and linked from the report (spec/repro/)
    assert (tmp_path / "planted-loss_mask_attention" / "repro" / "INV-MASK-001-padded.py").exists()
    md = (tmp_path / "verify-planted-loss_mask_attention.md").read_text()
    assert "](planted-loss_mask_attention/repro/INV-MASK-001-padded.py)" in md and "fails standalone (exit 1)" in md


def test_verify_user_factory_engine(tmp_path: Path) -> None:
    run = verify(tmp_path, "--engine", "tests.factory_engine:make_engine", "--only", "INV-SLICE-00")
    assert run.returncode == 0, run.stdout + run.stderr
    # the factory's module ships no_padding_2_padding but not response_from_nested/response_to_nested
    assert "skip" in run.stdout and "ships no response_from_nested" in run.stdout


def test_list_and_unknown_engine() -> None:
    listing = subprocess.run([sys.executable, "-m", "spec", "list"], cwd=ROOT, capture_output=True, text=True)
    assert listing.returncode == 0 and "INV-MASK-001" in listing.stdout
    bad = subprocess.run([sys.executable, "-m", "spec", "verify", "--engine", "nope"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown engine 'nope'" in bad.stderr


def test_verify_engine_class_and_object(tmp_path: Path) -> None:
    run = verify(tmp_path, "--engine", "tests.user_engines:MyEngine", "--only", "INV-SP-001")
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
    run = verify(tmp_path, "--engine", "tests.user_engines:ENGINE_OBJECT", "--only", "INV-SP-00")
    assert run.returncode == 0, run.stdout + run.stderr
    results, _, coverage = run.stdout.partition("## Coverage of the input space")
    assert results.count("cannot build 'sp'") == 1 and "cannot build 'bucket'" in results
    # the coverage table gives the same reason for each sp size the engine never saw
    assert all(f"| sp size | {n} | 0 | 0.0% | " in coverage for n in (2, 3, 4)) and "cannot build 'sp'" in coverage
