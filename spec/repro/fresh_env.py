"""Run reproducers in a fresh environment: ``python -m spec.repro.fresh_env --python VENV/bin/python PATH...``.

Every ``.py`` under the given folders (or the files given) runs with that interpreter (a venv holding only torch,
tensordict and the engine's package, without this suite), in a fresh temporary working directory, with an empty
environment except ``PATH`` and ``HOME`` (no ``PYTHONPATH``), one file at a time. An uncaught exception (a traceback and no ``FAIL`` printed) exits 1 as well:
its last line is shown instead of the output's first, and it is never a reproduction (the file broke: a missing package, the suite, its own harness;
a reproducer reports what the engine raised itself and exits 1). A file whose source takes
``--fixed`` (the findings' scripts, docs/findings/repro/) runs a second time with it. Expected: exit 1 as released
(the bug shows) and exit 0 with ``--fixed``. A file that exits 2 printing ``NOT STANDALONE`` (the writer's file for
a check it cannot write out) is counted apart, and so is any other exit 2 (a findings script that checked nothing,
e.g. for want of an optional package); anything else (an ImportError of the suite or of a package, a crash, exit 0 as released) is unexpected. Prints one row per
run (exit code, the first line of output, or the verdict line: ``FAIL``/``PASS``/``NOT STANDALONE``) and a summary line; exits 1 when a run is not as expected (``--allow``
names the outcomes that do not count: ``not-standalone``, ``nothing-checked``).

Imports nothing of the suite (a face: tests/test_layering.py), so it runs from any interpreter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Run", "files_under", "run_file", "classify", "main"]

#: how each run is judged
OK, NOT_STANDALONE, NOTHING_CHECKED, UNEXPECTED = "ok", "not-standalone", "nothing-checked", "UNEXPECTED"
#: how a reproducer's verdict line starts (the table shows it, not a log line the engine printed first: VeOmni's)
VERDICTS = ("FAIL", "PASS", "NOT STANDALONE")


@dataclass
class Run:
    path: Path
    fixed: bool  # run with --fixed
    code: int
    first: str  # the verdict line (FAIL/PASS/NOT STANDALONE), else the first line of output (stdout, else stderr)
    seconds: float
    uncaught: bool = False  # it ended in an uncaught exception (first: the exception's line)
    verdict: str = ""


#: the modules written beside the reproducers they serve (spec/repro/templates.py's RUNTIME_NAME, SUITE_NAME): not
#: reproducers themselves
BESIDE = ("repro_runtime.py", "repro_suite.py")


def files_under(paths: list[Path]) -> list[Path]:
    """Every ``.py`` file under ``paths`` (files given are kept), sorted, without ``__pycache__`` and the modules
    written beside the reproducers (:data:`BESIDE`)."""
    found: list[Path] = []
    for p in paths:
        if p.is_dir():
            found += [f for f in sorted(p.rglob("*.py")) if "__pycache__" not in f.parts and f.name not in BESIDE]
        elif p.suffix == ".py":
            found.append(p)
        else:
            raise SystemExit(f"fresh_env: {p} is neither a folder nor a .py file")
    return found


def takes_fixed(path: Path) -> bool:
    return '"--fixed"' in path.read_text(errors="replace")


def run_file(python: str, path: Path, *, fixed: bool = False, timeout: float = 900.0) -> Run:
    """``python path [--fixed]`` in a fresh temporary cwd with only PATH and HOME set."""
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fresh-env-") as cwd:
        try:
            done = subprocess.run([python, str(path.resolve())] + (["--fixed"] if fixed else []), cwd=cwd, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
            code, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired:
            code, out, err = 124, "", f"timed out after {timeout:.0f} s"
    lines = [line.strip() for line in (out.splitlines() or err.splitlines()) if line.strip()]
    lines = [line for line in lines if line.startswith(VERDICTS)][:1] or lines  # past what the engine logged
    tail = [line.strip() for line in err.splitlines() if line.strip()]
    # uncaught: a traceback and no verdict printed (a reproducer that catches what the engine raised prints its
    # traceback too, then its "FAIL ..." line)
    uncaught = "Traceback (most recent call last):" in err and "FAIL" not in out
    if uncaught or code not in (0, 1, 2):  # an uncaught exception (exit 1 too): its last line says more
        lines = tail[-1:] or lines
    return Run(path, fixed, code, lines[0] if lines else "", time.perf_counter() - start, uncaught=uncaught)


def classify(run: Run) -> str:
    if run.uncaught:  # exit 1 too, but the file broke (a missing package, the suite, its own harness): a
        return UNEXPECTED  # reproducer reports what the engine did itself ("FAIL ...", exit 1)
    if run.code == (0 if run.fixed else 1):
        return OK
    if run.code == 2 and run.first.startswith("NOT STANDALONE"):
        return NOT_STANDALONE
    if run.code == 2:  # the file says it checked nothing (a findings script without an optional package)
        return NOTHING_CHECKED
    return UNEXPECTED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spec.repro.fresh_env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="the fresh venv's interpreter")
    parser.add_argument("--allow", action="append", default=[], choices=[NOT_STANDALONE, NOTHING_CHECKED],
                        help="an outcome that does not make the exit status non-zero (repeatable)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    parser.add_argument("paths", nargs="+", type=Path, help="folders (every .py under them) or .py files")
    args = parser.parse_args(argv)
    runs = []
    print("| file | mode | exit | verdict | verdict line, else the first line of output |\n|---|---|---:|---|---|")
    for path in files_under(args.paths):
        for fixed in (False, True) if takes_fixed(path) else (False,):
            run = run_file(args.python, path, fixed=fixed, timeout=args.timeout)
            run.verdict = classify(run)
            runs.append(run)
            first = run.first.replace("|", "\\|")[:160]
            print(f"| {path} | {'--fixed' if fixed else 'released'} | {run.code} | {run.verdict} | {first} |",
                  flush=True)
    counts = {v: sum(r.verdict == v for r in runs) for v in (OK, NOT_STANDALONE, NOTHING_CHECKED, UNEXPECTED)}
    bad = [r for r in runs if r.verdict != OK and r.verdict not in args.allow]
    print(f"\n{len(runs)} runs of {len({r.path for r in runs})} files with {args.python}: "
          + ", ".join(f"{n} {v}" for v, n in counts.items()) + (" -- as expected" if not bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
