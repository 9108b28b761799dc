"""CI parity: one list of CI steps (.ci/steps.sh), run in order by .ci/run and one GitHub job each by the workflow,
and a tox matrix with the oldest supported torch and the newest release.

The step list, the workflow and the README's table of what CI runs (a generated block, tests/test_docs.py) are
read from the same files, so a step added to .ci/steps.sh runs on both machines and shows in the README.
"""

from __future__ import annotations

import json
import re
import subprocess

from spec import docs

ROOT = docs.ROOT
STEPS = ROOT / ".ci" / "steps.sh"
WORKFLOW = (ROOT / ".github" / "workflows" / "ci.yml").read_text()


def _steps_sh(*args: str) -> str:
    run = subprocess.run(["bash", str(STEPS), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_the_step_list_is_one_list() -> None:
    listed = json.loads(_steps_sh("--list"))
    assert listed == [name for name, _ in docs.ci_steps()] == _steps_sh("--names").split()
    assert {"tests", "verl091", "verl-engines", "verl071"} <= set(listed)
    assert len(set(listed)) == len(listed)


def test_the_tests_step_is_the_readme_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = dict(docs.ci_steps())["tests"]
    readme_command = "pip install torch==2.13.0 -e '.[test]' && pytest -n auto"
    assert readme_command in readme and command.endswith(readme_command), command


def test_the_verl071_step_checks_the_expected_mask_failure() -> None:
    command = dict(docs.ci_steps())["verl071"]
    assert "verl==0.7.1" in command and "VERL_EXPECT_MASK_BUG=1" in command and "test_verl_conformance.py" in command


def test_ci_run_and_the_workflow_run_every_step() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    assert ".ci/steps.sh --names" in run and '.ci/steps.sh "$step"' in run
    assert "run: echo \"steps=$(.ci/steps.sh --list)\"" in WORKFLOW
    assert "step: ${{ fromJSON(needs.list.outputs.steps) }}" in WORKFLOW
    # every step runs through .ci/steps.sh; an advisory one (.ci/steps.sh --advisory) the same way, reported
    assert '.ci/steps.sh "${{ matrix.step }}"' in WORKFLOW
    assert '.ci/steps.sh --advisory "$step"' in run and '.ci/steps.sh --advisory "${{ matrix.step }}"' in WORKFLOW
    assert re.search(r"services:\n\s+redis:", WORKFLOW) and "SPEC_TEST_REDIS_URL: redis://localhost:6379/0" in WORKFLOW


def test_an_unknown_step_fails() -> None:
    run = subprocess.run(["bash", str(STEPS), "no-such-step"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "unknown CI step" in run.stderr


def test_the_tox_matrix_has_the_oldest_and_the_newest_torch() -> None:
    pins = docs._tox_pins()
    ci = docs.workflow_tox_envs()
    assert set(ci) <= set(pins)
    versions = sorted((tuple(int(x) for x in pins[env][0].split(".")), env) for env in ci)
    assert versions[0][0] == (2, 4, 0), "the oldest supported torch (2.4.0) is in the CI matrix"
    assert versions[-1][0] >= (2, 15, 0), "the newest torch release is in the CI matrix"
    assert pins[versions[-1][1]][1] == "0.15.3", "the newest torch runs with the newest tensordict"
    tox = (ROOT / "tox.ini").read_text()
    assert all(env in tox.split("env_list =", 1)[1].splitlines()[0] for env in pins)
