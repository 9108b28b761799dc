"""A failing vision-language case's reproducer is a standalone file, as a text case's is: it rebuilds the micro-batch
with each sample's image and video features and grids (``multi_modal_inputs``), the media tokens among the ids and the
mRoPE positions, runs the engine (a planted engine written out over impl imported; its twin impl's snippet) around
the suite's stand-in model and vision tower, and runs INV-MM-001's own check (spec/truth/media_checks.py) or compares
the log-probs with the float64 reference of each sample with its own images (INV-MM-002).

Each file is copied into a folder of its own outside the repository and run there by another interpreter with
``PYTHONPATH`` unset and ``spec`` unimportable (spec/repro/run_files.py ``--no-spec``): the planted bug's file exits 1
printing what the suite printed, impl's twin exits 0. Fails on the tree before the media plans: every INV-MM file
said it was not standalone and exited 2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spec.cases.media import with_media
from spec.cases.structure import EngineCase
from spec.engines.impl.adapter import ImplEngine
from spec.invariants import CATALOGUE
from spec.planted import planted_engine
from spec.repro import write_reproducer, write_reproducers
from spec.run.registry import load_engine
from spec.run.runner import run_invariant

ROOT = Path(__file__).resolve().parents[1]
RUN_FILES = ROOT / "spec" / "repro" / "run_files.py"

#: (planted bug, invariant, mode): the hand-off check and the values, each on both modes
BUGS = (
    ("media_reversed", "INV-MM-001", "packed"),  # the samples' features concatenated last sample first
    ("media_lost_padded", "INV-MM-001", "padded"),  # the padded path drops the media keys
    ("media_grids_sorted", "INV-MM-002", "packed"),  # the grids reordered, the features not
    ("media_last_sample_dropped", "INV-MM-002", "padded"),  # fewer features than image tokens: the hand-off refuses
)


def _run_outside(files: list[Path], folder: Path) -> dict[str, tuple[int, str]]:
    """Each file copied (with what lies beside it) into ``folder`` and run there with ``spec`` unimportable and no
    ``PYTHONPATH``: file name -> (exit code, ``check`` or ``raised``)."""
    for path in files:
        for item in path.parent.iterdir():
            if item.is_file():
                shutil.copyfile(item, folder / item.name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONWARNINGS"] = "ignore"
    done = subprocess.run([sys.executable, str(RUN_FILES), "--no-spec", *(str(folder / p.name) for p in files)],
                          capture_output=True, text=True, env=env, cwd=str(folder), timeout=600)
    codes = {}
    for line in done.stdout.splitlines():
        if line.startswith("EXIT "):
            _, code, how, path = line.split(" ", 3)
            codes[Path(path).name] = (int(code), how)
    assert len(codes) == len(files), done.stdout[-3000:] + done.stderr[-3000:]
    return codes


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """For each bug: the suite's outcome, its reproducer and impl's twin on the same case, each in a folder."""
    made = []
    for bug, invariant, mode in BUGS:
        folder = tmp_path_factory.mktemp(bug)
        engine = load_engine(f"planted:{bug}")
        outcome = run_invariant(CATALOGUE[invariant], engine, mode, "cpu", profile="ci", shrink=False,
                                max_examples=5, database=None)
        assert outcome.status == "fail" and outcome.case.media, (bug, outcome.status, outcome.error)
        (rep,) = write_reproducers([outcome], engine, folder, check=False)
        twin, why = write_reproducer(folder / f"{invariant}-{mode}-impl.py", invariant=invariant, mode=mode,
                                     engine=ImplEngine(), case=outcome.case)
        assert why is None and rep.status == "written", (bug, why, rep.status, rep.detail)
        made.append((bug, outcome, rep.path, twin))
    return made


def test_a_media_file_carries_the_samples_media_and_its_mrope_positions(written) -> None:
    """The micro-batch's ``multi_modal_inputs`` (each sample's features and grids, a text-only sample's entry as the
    trainer handed it) and the case's media items are in the file; nothing of the suite is imported."""
    for bug, outcome, path, twin in written:
        text = path.read_text()
        assert "'stacks': {'multi_modal_inputs': [" in text and "'image_grid_thw':" in text, bug
        assert "'media': [[{'kind': 'image'" in text, bug
        assert "'ragged_dim': 2" in text, bug  # the (4, n) mRoPE positions, nested on their second dim
        assert not re.search(r"^\s*(import|from)\s+spec\b", text, re.M), bug
        assert "NOT STANDALONE" not in text and "WHY = " not in text, bug


def test_planted_media_files_fail_and_their_twins_pass_outside_the_repository(written, tmp_path) -> None:
    for bug, outcome, path, twin in written:
        (tmp_path / bug).mkdir()
        codes = _run_outside([path, twin], tmp_path / bug)
        assert codes[path.name][0] == 1, (bug, codes)
        assert codes[twin.name] == (0, "check"), (bug, codes)


def test_a_planted_media_file_prints_what_the_suite_saw(written) -> None:
    """The file's failure is the suite's: INV-MM-001's message from the same check, INV-MM-002's got vs expected at
    the same position (or the hand-off's refusal of image tokens without their features, where the suite's was)."""
    for bug, outcome, path, _ in written:
        done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=str(path.parent),
                              env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=600)
        said = str(outcome.error).split("AssertionError: ", 1)[-1].splitlines()[0][:80]
        assert done.returncode == 1 and said in done.stdout, (bug, said, done.stdout[-2000:])
        assert re.search(rf"^FAIL {outcome.invariant}\b", done.stdout, re.M), (bug, done.stdout[-2000:])


def test_a_text_invariant_on_a_media_case_reproduces_too(tmp_path) -> None:
    """Every engine-case invariant meets media cases (a share of the stream's draws): INV-VAL-001's file on a
    vision-language case rebuilds its images too, so impl passes it and the reversed-media engine fails it."""
    case = with_media(EngineCase((2, 3, 2), (2, 1, 3), vocab=16, temperature=0.7, seed=4))
    assert sum(bool(items) for items in case.media) >= 2
    for name, engine, code in (("impl", ImplEngine(), 0), ("reversed", planted_engine("media_reversed"), 1)):
        path, why = write_reproducer(tmp_path / name / "file.py", invariant="INV-VAL-001", mode="packed",
                                     engine=engine, case=case)
        assert why is None, why
        (tmp_path / f"{name}-outside").mkdir()
        codes = _run_outside([path], tmp_path / f"{name}-outside")
        assert codes[path.name] == (code, "check"), (name, codes)
