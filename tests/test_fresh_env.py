"""``python -m spec.repro.fresh_env``: runs reproducers with a given interpreter in a temporary cwd with only PATH and
HOME set, and judges each run (exit 1 as released, 0 with ``--fixed``; exit 2 ``NOT STANDALONE`` counted apart;
anything else unexpected). On tiny files written here and on one reproducer the suite writes for a planted bug.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from spec.engines.impl.adapter import ImplEngine
from spec.invariants import CATALOGUE
from spec.repro import write_reproducer, write_reproducers
from spec.repro.fresh_env import files_under, main
from spec.run.registry import load_engine
from spec.run.runner import SEED_CASES, run_invariant

ROOT = Path(__file__).resolve().parents[1]

#: exits 1 only in the environment fresh_env promises (no PYTHONPATH, no other variable, a cwd that is neither
#: this folder nor the caller's); 3 when something leaked
ENV_PROBE = """
import os, sys
from pathlib import Path
leaked = sorted(set(os.environ) - {"PATH", "HOME", "LC_CTYPE"})
here = Path(__file__).resolve().parent
if leaked or Path.cwd().resolve() in (here, Path(sys.argv[0]).resolve().parent) or "fresh-env-" not in os.getcwd():
    print("leaked:", leaked, os.getcwd())
    sys.exit(3)
print("got 1, expected 2")
sys.exit(1)
"""

FINDING = """
import sys
if "--fixed" in sys.argv:
    print("fixed: ok")
    sys.exit(0)
print("BUG: got 1, expected 2")
sys.exit(1)
"""


def _judge(tmp_path: Path, name: str, source: str, *extra: str) -> tuple[int, str]:
    path = tmp_path / name
    path.write_text(source)
    out = subprocess.run([sys.executable, "-m", "spec.repro.fresh_env", "--python", sys.executable, *extra,
                          str(path)], cwd=ROOT, capture_output=True, text=True, env={"SPEC_LEAK": "1",
                                                                                      "PATH": "/usr/bin:/bin",
                                                                                      "PYTHONPATH": str(ROOT)})
    return out.returncode, out.stdout


def test_expected_runs_pass_and_the_environment_is_empty(tmp_path) -> None:
    code, out = _judge(tmp_path, "probe.py", ENV_PROBE)
    assert code == 0 and "| 1 | ok | got 1, expected 2 |" in out, out
    code, out = _judge(tmp_path, "finding.py", FINDING)
    assert code == 0, out
    assert "| released | 1 | ok |" in out and "| --fixed | 0 | ok | fixed: ok |" in out, out
    assert "2 runs of 1 files" in out and "as expected" in out, out


def test_unexpected_runs_fail(tmp_path) -> None:
    code, out = _judge(tmp_path, "passes.py", "print('all right')\n")  # exit 0 as released: the bug does not show
    assert code == 1 and "| 0 | UNEXPECTED |" in out, out
    code, out = _judge(tmp_path, "imports.py", "import no_such_package_here\n")  # a missing package: exit 1 too
    assert code == 1 and "UNEXPECTED | ModuleNotFoundError: No module named 'no_such_package_here'" in out, out
    code, out = _judge(tmp_path, "fixed_still_fails.py", FINDING.replace("sys.exit(0)", "sys.exit(1)"))
    assert code == 1 and "| --fixed | 1 | UNEXPECTED |" in out, out


def test_not_standalone_counts_apart(tmp_path) -> None:
    source = "import sys\nprint('NOT STANDALONE: why')\nsys.exit(2)\n"
    code, out = _judge(tmp_path, "why.py", source)
    assert code == 1 and "| 2 | not-standalone |" in out, out
    code, out = _judge(tmp_path, "why.py", source, "--allow", "not-standalone")
    assert code == 0 and "1 not-standalone" in out, out


def test_a_written_reproducer_and_its_impl_twin(tmp_path) -> None:
    """A planted bug's reproducer exits 1 in the fresh environment; its impl twin exits 0, which is unexpected for a
    reproducer (the tool's non-zero exit says so)."""
    engine = load_engine("planted:loss_mask_attention")
    outcome = run_invariant(CATALOGUE["INV-MASK-001"], engine, "padded", "cpu", profile="ci", shrink=False,
                            max_examples=5, database=None)
    assert outcome.status == "fail", outcome.error
    (rep,) = write_reproducers([outcome], engine, tmp_path / "bug", check=False)
    twin, why = write_reproducer(tmp_path / "twin" / "INV-MASK-001-padded-impl.py", invariant="INV-MASK-001",
                                 mode="padded", engine=ImplEngine(), case=outcome.case)
    assert why is None and files_under([tmp_path]) == [rep.path, twin]  # sorted: bug/ before twin/
    assert main(["--python", sys.executable, str(rep.path)]) == 0
    assert main(["--python", sys.executable, str(tmp_path)]) == 1  # the twin exits 0


def test_an_import_error_of_the_engine_is_never_a_reproduction(tmp_path) -> None:
    """A written reproducer whose engine cannot be built here for a missing module (an adapter that needs a package the
    environment lacks) prints no FAIL line and ends on the ImportError: fresh_env counts it unexpected, the writer an
    error, never 'reproduces'."""
    engine = load_engine("tests.user_engines:NeedsAMissingModule")
    path, why = write_reproducer(tmp_path / "INV-VAL-001-packed.py", invariant="INV-VAL-001", mode="packed",
                                 engine=engine, case=SEED_CASES[0])
    assert why is None
    run = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert run.returncode == 1 and "FAIL" not in run.stdout, run.stdout + run.stderr
    assert "ImportError: NeedsAMissingModule needs the module not_installed_here" in run.stderr
    assert "not run" in run.stderr
    assert main(["--python", sys.executable, str(path)]) == 1  # unexpected: the file broke, the engine did not


def test_an_adapter_is_carried_as_source(tmp_path) -> None:
    """The default snippet of an adapter of spec.engines imports it; carried, the file serves the adapter and every
    project module it imports from its own sources (hypothesis and pytest unimportable, the installed suite unused)."""
    from spec.protocol.engine import ReproSnippet
    from spec.repro.carry import carried, closure

    modules = closure("spec.engines.kit.hf_batch")
    assert {"spec", "spec.engines", "spec.engines.kit.hf_batch", "impl", "impl.flags"} <= set(modules), sorted(modules)
    assert closure("spec.cases.topology_draws") is None  # imports hypothesis: not carried
    snippet = carried(ReproSnippet("from spec.engines.kit.hf_batch import one_temperature as _build\n", standalone=False))
    assert snippet is not None and snippet.standalone
    script = tmp_path / "carried.py"
    script.write_text("import sys\nsys.modules['hypothesis'] = sys.modules['pytest'] = None\n" + snippet.code + """
import spec.engines.kit.hf_batch as m
assert type(m.__spec__.loader).__name__ == "_Carried", m.__spec__
print(_build({"temperature": 0.5}))
""")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env={})
    assert out.returncode == 0 and out.stdout.strip() == "0.5", out.stderr
    assert carried(ReproSnippet("from spec.planted.harmless import X as _build\n", standalone=False)) is None


def test_a_carried_file_needs_the_packages_the_suite_ran_with(tmp_path, monkeypatch) -> None:
    """A package installed when the file was written (pinned in its header's Needs) must be there when it runs:
    without it the adapter would stub it and run what the suite did not (verl's VeOmni engine without veomni gets
    no varlen kwargs). One not installed then (the suite ran the stubs too) is not required."""
    from spec.protocol.engine import ReproSnippet
    from spec.repro import carry

    monkeypatch.setitem(carry.PACKAGES, "spec.engines.kit.hf_batch", ("tensordict", "no-such-distribution"))
    snippet = carry.carried(ReproSnippet("from spec.engines.kit.hf_batch import one_temperature as _build\n",
                                         standalone=False))
    assert snippet is not None and "tensordict==" in snippet.requires and "no-such-distribution" in snippet.requires
    script = tmp_path / "carried.py"
    for hide, code in (("", 0), ("import sys\nsys.modules['tensordict'] = None\n", 1)):
        script.write_text(hide + snippet.code + "\nprint(_build({'temperature': 0.5}))\n")
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env={})
        assert out.returncode == code, out.stderr
    assert "ModuleNotFoundError: No module named 'tensordict': this reproducer needs tensordict==" in out.stderr, out.stderr


def test_a_caught_engine_exception_with_its_traceback_is_a_reproduction(tmp_path) -> None:
    source = ("import sys, traceback\ntry:\n    raise ValueError('the engine')\nexcept ValueError:\n"
              "    traceback.print_exc()\n    print('FAIL: the engine raised ValueError')\n    sys.exit(1)\n")
    code, out = _judge(tmp_path, "caught.py", source)
    assert code == 0 and "| 1 | ok | FAIL: the engine raised ValueError |" in out, out
    logged = "print('[INFO] patches applied')\nprint('FAIL: got 0, expected 0.69')\nraise SystemExit(1)\n"
    code, out = _judge(tmp_path, "logged.py", logged)  # the verdict line is shown, not what the engine logged first
    assert code == 0 and "| 1 | ok | FAIL: got 0, expected 0.69 |" in out, out
    code, out = _judge(tmp_path, "uncaught.py", "raise ValueError('the harness')\n")
    assert code == 1 and "| 1 | UNEXPECTED | ValueError: the harness |" in out, out
