"""Measurements are independent: every test, and every ``spec.detection`` run, has its own empty example
database, never the working directory's ``.hypothesis`` nor one a user configured.

With a shared database a ``ci`` run replays what an earlier run saved, and a bug "found" in one example
was found by another run (measured: a planted bug needing 69 examples under ``ci`` alone took 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import settings
from hypothesis.database import InMemoryExampleDatabase, ReadOnlyDatabase

import spec.detection as detection
from spec.planted import PLANTED

ROOT = Path(__file__).resolve().parents[1]
KEY = b"test_isolation/key"


def _fetch(db) -> list[bytes]:
    return list(db.fetch(KEY))


def test_every_profile_starts_on_an_empty_in_memory_database() -> None:
    for name in ("default", "dev", "ci", "thorough", "cuda", "debug"):
        db = settings.get_profile(name).database
        inner = getattr(db, "_wrapped", db)  # the derandomized ci profile reads through a read-only view
        assert isinstance(inner, InMemoryExampleDatabase), (name, db)
        assert isinstance(db, ReadOnlyDatabase) == (name == "ci"), (name, db)
        assert _fetch(db) == [], f"profile {name} starts with a saved example"
    loaded = settings.default.database  # the profile conftest.py loaded
    assert isinstance(getattr(loaded, "_wrapped", loaded), InMemoryExampleDatabase) and _fetch(loaded) == []


def test_what_one_test_saves_the_next_does_not_see() -> None:
    first = settings.get_profile("default").database
    first.save(KEY, b"saved by an earlier test")
    # what conftest.py's fixture does before every test
    from conftest import PROFILE
    from spec.run.profiles import use_database

    use_database(InMemoryExampleDatabase(), PROFILE)
    for name in ("default", "ci"):
        assert _fetch(settings.get_profile(name).database) == [], name


def test_subprocesses_get_a_fresh_in_memory_database() -> None:
    assert os.environ["SPEC_EXAMPLE_DB"] == ":memory:"
    code = ("from hypothesis import settings; import spec.run.profiles; "
            "print(type(settings.get_profile('default').database._db).__name__)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0 and run.stdout.strip() == "InMemoryExampleDatabase", run.stdout + run.stderr


def test_profiles_do_not_inherit_hypothesis_ci_profile() -> None:
    """With ``CI`` set, hypothesis loads its own derandomized ``ci`` profile at import; the suite's ``default``,
    ``dev`` and ``thorough`` profiles stay random (a ``thorough`` or ``default`` run on GitHub, where ``CI=true``, must
    draw new cases), and only the suite's ``ci`` profile is derandomized."""
    code = ("from hypothesis import settings; import spec.run.profiles; "
            "print(*[settings.get_profile(n).derandomize for n in ('default', 'dev', 'thorough', 'ci')])")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CI": "true", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0 and run.stdout.split() == ["False", "False", "False", "True"], run.stdout + run.stderr


def test_the_default_directory_follows_hypothesis_storage_directory(tmp_path: Path) -> None:
    code = "from spec.run.database import example_database; print(example_database('').path)"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore",
           "HYPOTHESIS_STORAGE_DIRECTORY": str(tmp_path / "store")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and Path(run.stdout.strip()) == tmp_path / "store" / "examples", run.stdout + run.stderr


def test_detection_runs_use_no_example_database(monkeypatch) -> None:
    calls = []

    def run_invariant(*args, **kwargs):
        calls.append(kwargs)
        return detection.run_invariant.__wrapped__(*args, **kwargs)

    run_invariant.__wrapped__ = detection.run_invariant  # type: ignore[attr-defined]
    monkeypatch.setattr(detection, "run_invariant", run_invariant)
    bug = PLANTED["loss_mask_attention"]
    assert detection.detects(bug, "ci") and detection.detects(bug, "default", seed=3)
    assert calls and all("database" in kw and kw["database"] is None for kw in calls), calls
