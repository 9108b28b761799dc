"""``python -m spec verify``: the short summary on stdout, the full reports in the files, the exit codes (0 pass,
1 failed verdict, 2 usage error), user engines, and ``--help`` without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def verify(tmp_path: Path, *args: str, workers: str = "1", env: dict | None = None) -> subprocess.CompletedProcess:
    """One process (``-n 1``): these runs are a handful of targets; tests/test_parallel.py runs the pool."""
    return subprocess.run([sys.executable, "-m", "spec", "verify", "--profile", "dev", "--out", str(tmp_path),
                           "-n", workers, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def report_md(folder: Path) -> str:
    (md,) = folder.glob("verify-*.md")
    return md.read_text()


def test_verify_impl_passes_and_writes_reports(tmp_path: Path) -> None:
    run = verify(tmp_path, "--only", "INV-MASK")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "verdict pass: 4 passed, 0 failed" in run.stdout
    assert "[  4/4]" in run.stderr  # progress
    report = json.loads((tmp_path / "verify-impl.json").read_text())
    assert report["engine"] == "impl" and len(report["outcomes"]) == 4
    md = (tmp_path / "verify-impl.md").read_text()
    assert md.startswith("# Conformance report") and "| INV-MASK-001 |" in md and "## Coverage of the input space" in md
    # stdout is the summary: no table, the slowest targets, the report paths
    assert "| INV-MASK-001 |" not in run.stdout and "## Coverage" not in run.stdout
    assert len(run.stdout.splitlines()) <= 6, run.stdout
    slowest = next(line for line in run.stdout.splitlines() if line.startswith("slowest: "))
    assert slowest.count("INV-MASK-") == 4 and slowest.endswith("s")
    assert f"{tmp_path / 'verify-impl.md'}, {tmp_path / 'verify-impl.json'}" in run.stdout
    # the report names the same targets (the JSON has every outcome's seconds)
    assert f"at most 5: {slowest[len('slowest: '):]}." in md
    by_time = sorted(report["outcomes"], key=lambda o: -o["seconds"])
    assert [f"{o['invariant']}/{o['mode']}" for o in by_time] == [s.split()[0] for s in slowest[9:].split(", ")]


def test_verify_planted_bug_fails_with_one_line_per_failure(tmp_path: Path) -> None:
    run = verify(tmp_path, "--engine", "planted:loss_mask_attention", "--only", "INV-MASK-001")
    assert run.returncode == 1, run.stdout + run.stderr
    line = next(line for line in run.stdout.splitlines() if "INV-MASK-001" in line)
    assert line.strip() == ("FAIL INV-MASK-001/padded: attention_mask row 0 is [1, 0], expected [1, 1] "
                            "(sequence length 2, response length 1)"), run.stdout
    # the full row, counterexample and all, is in the report file
    md = (tmp_path / "verify-planted-loss_mask_attention.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| INV-MASK-001 |"))
    assert "FAIL" in row and "`EngineCase(" in row and "attention_mask row" in row
    # its standalone reproducer, run once by verify and linked from the report (spec/repro/): the engine name's
    # colon becomes a dash in the folder
    repro = tmp_path / "planted-loss_mask_attention" / "repro" / "INV-MASK-001-padded.py"
    assert repro.exists()
    assert "](planted-loss_mask_attention/repro/INV-MASK-001-padded.py)" in md and "fails standalone (exit 1)" in md
    # the next commands: the reproducer, and the failures rerun
    assert f"  python {repro}  # INV-MASK-001/padded standalone" in run.stdout.splitlines()
    assert any(line.strip().startswith("python -m spec verify --engine planted:loss_mask_attention --profile dev")
               and "--only INV-MASK-001" in line for line in run.stdout.splitlines()), run.stdout


def test_verify_user_factory_engine(tmp_path: Path) -> None:
    run = verify(tmp_path, "--engine", "tests.factory_engine:make_engine", "--only", "INV-SLICE-00")
    assert run.returncode == 0, run.stdout + run.stderr
    # an engine name with a dot keeps it in the report's name (not cut at the dot as a suffix)
    assert (tmp_path / "verify-tests.factory_engine-make_engine.json").is_file(), sorted(tmp_path.iterdir())
    # the factory's module ships no_padding_2_padding but not response_from_nested/response_to_nested
    md = report_md(tmp_path)
    assert "| skip |" in md and "ships no response_from_nested" in md
    assert "skipped" in run.stdout


def test_list() -> None:
    listing = subprocess.run([sys.executable, "-m", "spec", "list"], cwd=ROOT, capture_output=True, text=True)
    assert listing.returncode == 0 and "INV-MASK-001" in listing.stdout


@pytest.mark.parametrize("args, says", [
    (["verify", "--engine", "nope"], "unknown engine 'nope'"),
    (["verify", "--engine", "verl-megatorn"], "unknown engine 'verl-megatorn'; did you mean 'verl-megatron'"),
    (["verify", "--engine", "planted:loss_mask_atention"],
     "unknown planted bug 'loss_mask_atention'; did you mean 'loss_mask_attention'?"),
    (["verify", "--profile", "cii"], "unknown hypothesis profile 'cii'; did you mean 'ci'?"),
    (["verify", "--only", "INV-MSK"], "--only 'INV-MSK' matches no invariant ID; did you mean 'INV-MASK'"),
    (["verify", "--engine", "tests.factory_engine:make_engin"],
     "module 'tests.factory_engine' has no attribute 'make_engin'; did you mean 'make_engine'?"),
    (["verify", "--engine", "tests.no_such_module:x"], "no module named 'tests.no_such_module'"),
    (["engines", "--capabilities", "planted:nope"], "unknown planted bug 'nope'"),
])
def test_a_usage_error_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    run = subprocess.run([sys.executable, "-m", "spec", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and says in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith(f"python -m spec {args[0]}: error: ") and len(run.stderr) < 300, run.stderr
    assert run.stdout == ""


def test_help_imports_neither_torch_nor_the_suite() -> None:
    """Every command's ``--help`` is parsed before anything heavy is imported (measured by what is imported, not
    by time)."""
    code = ("import sys, spec.__main__ as m\n"
            "for argv in (['--help'], ['verify', '--help'], ['list', '--help'], ['engines', '--help'],"
            " ['fuzz', '--help']):\n"
            "    try:\n        m.main(argv)\n    except SystemExit as exc:\n        assert exc.code == 0, argv\n"
            "heavy = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'hypothesis', 'impl', 'numpy')"
            " or n.startswith(('spec.run', 'spec.invariants', 'spec.engines', 'spec.report')))\n"
            "print('HEAVY', heavy)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage: python -m spec verify" in run.stdout and "HEAVY []" in run.stdout, run.stdout[-500:]


NOISY = """import logging
import os
import warnings

import impl


class NoisyEngine(impl.LMHeadEngine):
    \"\"\"impl's engine writing to stderr whenever it is built, as torch's and engines' warnings do.\"\"\"

    def __init__(self, **settings):
        logging.getLogger("noisy").warning("noisy engine logs a warning")
        warnings.warn("noisy engine warns", UserWarning)
        os.write(2, b"noisy engine writes to fd 2\\n")
        super().__init__(**settings)
"""


@pytest.mark.parametrize("workers", ["1", "2"])
def test_what_workers_write_to_stderr_stays_off_the_progress_line(tmp_path: Path, workers: str) -> None:
    (tmp_path / "noisy_engine.py").write_text(NOISY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    run = verify(tmp_path / "out", "--engine", "noisy_engine:NoisyEngine", "--only", "INV-MASK-001,INV-MASK-002",
                 workers=workers, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    # text mode reads each "\r" of the progress line as a line break: the progress first, then the rest
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    progress = [n for n, line in enumerate(lines) if line.startswith("[")]
    assert progress == list(range(len(progress))) and lines[progress[-1]].startswith("[  2/2]"), lines
    after = "\n".join(lines[len(progress):])
    # printed once each, after the progress line, however many processes built the engine how many times
    for said in ("noisy engine writes to fd 2", "noisy engine logs a warning"):
        assert after.count(said) == 1, after


def test_the_summary_names_each_failure_in_a_line_and_the_next_commands() -> None:
    from spec.report import summary
    from spec.run.runner import Outcome

    outcomes = [Outcome("INV-MASK-001", "e", "padded", "cpu", "pass", seconds=0.5),
                Outcome("INV-VAL-001", "e", "packed", "cpu", "fail", seconds=3.0, counterexample="EngineCase(a)",
                        error="AssertionError: log_probs[0] is 1.0, expected 2.0\nthe rest of a long message"),
                Outcome("INV-RANK-002", "e", "packed", "cpu", "error", seconds=9.0,
                        error="suite error: the worker raised\nTraceback (most recent call last):\n  File \"x\"\n"
                              "RuntimeError: rank 1 is gone"),
                Outcome("INV-TEMP-001", "e", "padded", "cpu", "xpass", seconds=1.0, reason="verl clamps nothing"),
                Outcome("INV-SP-001", "e", "packed", "cpu", "skip", reason="no sp")]
    lines = summary(outcomes, engine="e", profile="ci", device="cpu", seconds=12.0, paths=[Path("r/verify-e.md")],
                    rerun=["python", "-m", "spec", "verify", "--engine", "e", "--profile", "ci"])
    assert lines[0] == ("verify: engine e, profile ci, device cpu: verdict FAIL: 1 passed, 1 failed, 1 suite errors, "
                        "1 skipped, 1 stale known failures in 12.0s")
    assert lines[1:4] == ["  FAIL INV-VAL-001/packed: log_probs[0] is 1.0, expected 2.0",
                          "  ERROR (suite) INV-RANK-002/packed: suite error: the worker raised: RuntimeError: rank 1 "
                          "is gone",
                          "  STALE known failure INV-TEMP-001/padded: known-failure record never fired: verl clamps "
                          "nothing"]
    assert lines[4] == "slowest: INV-RANK-002/packed 9.0s, INV-VAL-001/packed 3.0s, INV-TEMP-001/padded 1.0s, " \
                       "INV-MASK-001/padded 0.5s"
    assert lines[5] == "report (every table): r/verify-e.md"
    assert lines[6:] == ["next:", "  python -m spec verify --engine e --profile ci --only "
                                  "INV-VAL-001,INV-RANK-002,INV-TEMP-001  # rerun the failures"]
