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
    assert listed[:2] == ["tests", "torch24"]  # the core steps, the suite first (.ci/run installs the rest meanwhile)
    assert {"verl091", "verl071", "verl-veomni", "trl", "openrlhf", "skyrl"} <= set(listed)
    assert len(set(listed)) == len(listed)


def test_the_tests_step_is_the_readme_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = dict(docs.ci_steps())["tests"]
    readme_command = "pip install torch==2.13.0 -e '.[test]' && pytest -n auto"
    assert readme_command in readme and command.endswith(readme_command), command


def test_the_verl071_step_checks_the_expected_mask_failure() -> None:
    command = dict(docs.ci_steps())["verl071"]
    assert command == "bash spec/engines/verl/ci-verl071.sh", command  # verl's step script, in verl's folder
    command = (ROOT / command.split()[1]).read_text()
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


def test_every_step_begins_with_its_setup() -> None:
    """`.ci/steps.sh --setup STEP` installs only: the step's leading venv/with_redis/pip commands (or its script's
    --setup); what the step runs comes after, so .ci/run can install a later step ahead while an earlier one runs."""
    for name, command in docs.ci_steps():
        setup = _steps_sh("--show-setup", name).strip()
        assert setup, f"step {name} installs nothing before it runs: {command}"
        parts = setup.split(" && ")
        assert all(p.startswith(("venv ", "with_redis", "pip install ", "bash spec/engines/")) for p in parts), setup
        if setup.startswith("bash spec/engines/"):
            assert setup == f"{command} --setup", (setup, command)
            assert '"${1:-}" = "--setup"' in _script_text(command.split()[1])  # the script stops after its installs
        else:
            assert command.startswith(setup + " && "), (setup, command)
            assert "pytest" not in setup and "spec verify" not in setup


def _script_text(script: str) -> str:
    """A step script's text, with the text of each file it sources from beside it (`. "$(dirname "$0")/PATH"`, as
    verl's native engines' steps source spec/engines/verl/native-step.sh and pass it their arguments)."""
    text = (ROOT / script).read_text()
    sourced = re.findall(r'^\. "\$\(dirname "\$0"\)/([^"]+)"', text, re.M)
    return "\n".join([text] + [((ROOT / script).parent / path).read_text() for path in sourced])


def _engine_folder(name: str) -> str:
    """The folder under spec/engines/ holding a registered engine's adapter."""
    from spec.run.registry import ENGINES

    return ENGINES[name][0].__module__.split(".")[2]


def test_every_engine_has_its_ci_step_in_its_own_folder() -> None:
    """Adding an engine touches its folder and the registry, nothing else (the CI included): every registered engine
    that no core step of .ci/steps.sh verifies (their libraries are not installed in the ci venv: each needs a venv of
    its own) has a CI step script in its own folder, spec/engines/<folder>/ci*.sh, that runs its
    `spec verify --engine <name>`, and .ci/steps.sh lists that step (found, not written in)."""
    from spec.run.registry import ENGINES

    core = {name: command for name, command in docs.ci_steps() if not command.startswith("bash spec/engines/")}
    verified_by_core = {e for e in ENGINES if any(re.search(rf"spec verify --engine {re.escape(e)}(\s|$)", c)
                                                   for c in core.values())}
    assert verified_by_core == {"impl"}, verified_by_core  # this project's engine: the torch24 step
    listed = dict(docs.ci_steps())
    by_script = {script: name for name, script, _ in docs.engine_ci_steps()}
    for engine in sorted(set(ENGINES) - verified_by_core):
        folder = _engine_folder(engine)
        runs = [script for script in sorted(by_script) if script.startswith(f"spec/engines/{folder}/")
                and re.search(rf"spec verify --engine {re.escape(engine)}(\s|$)", (ROOT / script).read_text(), re.M)]
        assert runs, f"engine {engine}: no CI step script in spec/engines/{folder}/ runs `spec verify --engine {engine}`"
        for script in runs:
            assert listed.get(by_script[script]) == f"bash {script}", (engine, script, listed)
    assert set(json.loads(_steps_sh("--list"))) == set(listed)


def test_no_engine_step_lives_outside_an_engine_folder() -> None:
    """The engine steps are scripts in the engines' folders: .ci/ holds the shared helpers (lib.sh, bert_padding.py)
    and no step script, the core steps run no engine but impl, and every step script is a ci*.sh of an engine
    folder that names its step and installs only when asked (`--setup`)."""
    assert {p.relative_to(ROOT / ".ci").as_posix() for p in (ROOT / ".ci").rglob("*.sh")} == {"lib.sh", "steps.sh"}
    for name, command in docs.ci_steps():
        if command.startswith("bash "):
            script = command.split()[1]
            assert re.fullmatch(r"spec/engines/[a-z0-9_]+/ci[A-Za-z0-9_.-]*\.sh", script), (name, script)
            text = (ROOT / script).read_text()
            assert f"\n# CI step: {name}\n" in text and '"${1:-}" = "--setup"' in _script_text(script), script
        else:
            assert set(re.findall(r"--engine (\S+)", command)) <= {"impl"}, (name, command)
    # the adapter kit names an engine's CI step in its ImportError: the script in the engine's own folder
    from spec.run.registry import ENGINES

    for engine, (make, _) in ENGINES.items():
        step = getattr(make, "ci_step", "")
        assert not step or step.startswith(f"spec/engines/{_engine_folder(engine)}/ci"), (engine, step)
        assert not step or (ROOT / step).is_file(), (engine, step)


FAKE_STEPS = r'''#!/usr/bin/env bash
# a stand-in for .ci/steps.sh: three steps whose setups and runs log when they start and end
cd "$(dirname "$0")/.."
log() { echo "$1 $(date +%s.%N)" >> events.log; }
case "$1" in
    --names) printf 'one\ntwo\nthree\n' ;;
    --advisory) exit 1 ;;
    --setup) log "setup-$2-start"; sleep 0.4; if [ "$2" = "$FAIL_SETUP" ]; then exit 7; fi; log "setup-$2-end" ;;
    *) log "run-$1-start"; sleep 0.6; log "run-$1-end" ;;
esac
'''


def _fake_ci(tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text((ROOT / ".ci" / "run").read_text())
    (tmp_path / ".ci" / "steps.sh").write_text(FAKE_STEPS)
    (tmp_path / ".ci" / "steps.sh").chmod(0o755)
    run = subprocess.run(["bash", ".ci/run"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env})
    events = [line.split()[0] for line in sorted((tmp_path / "events.log").read_text().splitlines(),
                                                   key=lambda line: float(line.split()[1]))]
    return run, events


def test_ci_run_installs_the_later_steps_ahead_and_waits_for_each(tmp_path) -> None:
    run, events = _fake_ci(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    at = {e: i for i, e in enumerate(events)}
    assert at["setup-one-end"] < at["run-one-start"]  # the first step's setup in the foreground
    assert at["setup-two-start"] < at["run-one-end"]  # the next one's while the first step runs
    for step in ("two", "three"):
        assert at[f"setup-{step}-end"] < at[f"run-{step}-start"]
    assert [e for e in events if e.startswith("run-")] == [
        "run-one-start", "run-one-end", "run-two-start", "run-two-end", "run-three-start", "run-three-end"]
    assert "two setup:" in run.stdout and "in the background" in run.stdout


def test_a_failed_setup_ahead_leaves_the_step_to_install_itself(tmp_path) -> None:
    run, events = _fake_ci(tmp_path, FAIL_SETUP="two")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "run-two-start" in events and "setup two ended with 7 in the background" in run.stdout
    assert "two setup: failed in the background (exit 7); installed by the step" in run.stdout


def test_ci_install_ahead_can_be_turned_off(tmp_path) -> None:
    run, events = _fake_ci(tmp_path, CI_INSTALL_AHEAD="0")
    assert run.returncode == 0, run.stdout + run.stderr
    assert not any(e.startswith("setup-") for e in events)


def test_ci_run_says_the_free_disk_first_and_warns_when_short(tmp_path) -> None:
    """A disk that fills fails tests far from the cause ("No space left on device" in a tmp_path fixture, stop 57's
    CI): .ci/run says the free space before any step, and warns when it is under what the run wants."""
    run, events = _fake_ci(tmp_path)
    first = run.stdout.splitlines()[0]
    assert re.fullmatch(r"=== CI disk: \d+ GiB free here, \d+ GiB in \S+ \(this run wants about 20\)", first), first
    assert "CI warning" not in run.stdout and "disk after:" in run.stdout
    (tmp_path / "short").mkdir()
    short, _ = _fake_ci(tmp_path / "short", CI_MIN_FREE_GIB="100000000")
    assert short.returncode == 0 and "=== CI warning: " in short.stdout, short.stdout


def test_the_torch24_step_runs_impl_and_the_catalogue_on_the_floor() -> None:
    """The floor in CI (issue 39): torch 2.4.0 with tox torch24's tensordict, impl's own tests with the pins checked
    (tests/test_environment.py), and a quick `spec verify` of the catalogue on impl."""
    command = dict(docs.ci_steps())["torch24"]
    torch_v, tensordict_v = docs._tox_pins()["torch24"]
    assert command.startswith(f"venv torch24 torch=={torch_v} tensordict=={tensordict_v} -e '.[test]' && "), command
    assert f"SPEC_EXPECT_TORCH={torch_v} SPEC_EXPECT_TENSORDICT={tensordict_v} pytest" in command
    for test in ("test_environment", "test_microbatch", "test_dense_kernels", "test_examples", "test_errors"):
        assert f"tests/{test}.py" in command, test
    assert re.search(r"python -m spec verify --engine impl --profile \w+", command), command


FAKE_PYTHON = r'''#!/usr/bin/env bash
# a stand-in for the venv's python: logs each call; `-m venv DIR` makes DIR with an activate script
echo "$*" >> "$CALLS"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; echo 'PATH="$FAKE_BIN:$PATH"' > "$3/bin/activate"; touch "$3/bin/python"; chmod +x "$3/bin/python"; fi
'''


def _venv_calls(tmp_path, *args: str) -> list[str]:
    """The python calls `venv ARGS...` (.ci/lib.sh) makes, with pip stubbed out."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        (fake / name).write_text(FAKE_PYTHON)
        (fake / name).chmod(0o755)
    (tmp_path / "constraints-torch.txt").write_text("torch==2.13.0\n")
    calls = tmp_path / "calls.log"
    calls.write_text("")
    script = f'. {ROOT / ".ci" / "lib.sh"} && venv {" ".join(args)}'
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{fake}:/usr/bin:/bin", "CALLS": str(calls), "FAKE_BIN": str(fake),
                              "CI_PIP_LOCK": str(tmp_path / "lock")})
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in calls.read_text().splitlines() if "pip install" in line and "--upgrade pip" not in line]


def test_a_venv_takes_its_torch_from_a_torch_argument(tmp_path) -> None:
    """`venv NAME torch==V ...` installs torch V and pins V for the rest (not constraints-torch.txt's 2.13.0, which
    would make pip swap the floor's torch for 2.13.0); without one, torch 2.13.0 under constraints-torch.txt."""
    floor = _venv_calls(tmp_path, "torch24", "torch==2.4.0", "tensordict==0.8.3", "-e", ".")
    assert floor[0] == "-m pip install -q torch==2.4.0", floor
    assert all("-c .venv-torch24/constraints-torch.txt" in line for line in floor[1:]) and len(floor) == 3, floor
    assert (tmp_path / ".venv-torch24" / "constraints-torch.txt").read_text() == "torch==2.4.0\n"
    plain = _venv_calls(tmp_path, "other", "verl==0.9.1")
    assert plain == ["-m pip install -q torch==2.13.0", "-m pip install -q -c constraints-torch.txt verl==0.9.1"]


MUTATE_NIGHTLY = (ROOT / ".github" / "workflows" / "mutate-nightly.yml").read_text()


def _step_text(command: str) -> str:
    """A step's command, and for an engine's step script its text and the files it sources (its setup lives there)."""
    found = re.fullmatch(r"bash (spec/engines/\S+\.sh)", command)
    if not found:
        return command
    script = ROOT / found.group(1)
    text = script.read_text()
    sourced = re.findall(r'^\. "\$\(dirname "\$0"\)/([^"]+)"', text, re.M)
    return "\n".join([text] + [(script.parent / path).read_text() for path in sourced])


def test_the_mutation_nightly_mutates_every_registered_engine_in_its_steps_venv() -> None:
    """.github/workflows/mutate-nightly.yml has one job per registered engine (the registry, not a list written out
    again), each in the venv of the CI step that runs its `spec verify` (installed by that step's setup), on a seeded
    sample of 200 gated at 90%, resumed from the newest earlier report."""
    from spec.run.registry import ENGINES

    matrix = re.findall(r"^\s+- \{engine: (\S+), step: (\S+), venv: (\S+)\}$", MUTATE_NIGHTLY, re.M)
    assert sorted(engine for engine, _, _ in matrix) == sorted(ENGINES), matrix
    listed = dict(docs.ci_steps())
    for engine, step, venv in matrix:
        assert step in listed, (engine, step)
        text = _step_text(listed[step])
        assert re.search(rf"spec verify --engine {re.escape(engine)}(\s|$)", text, re.M), (engine, step)
        assert re.search(rf"\bvenv(_ready)? {re.escape(venv)}(?=\s)", text), (engine, step, venv)
    assert '.ci/steps.sh --setup "${{ matrix.step }}"' in MUTATE_NIGHTLY
    command = MUTATE_NIGHTLY.split("- name: Mutate ", 1)[1].split("- name:", 1)[0]
    assert '".venv-${{ matrix.venv }}/bin/python" -m spec mutate --engine "${{ matrix.engine }}"' in command
    for part in ("|| '200' }}\" --seed 0", "--profile dev --confirm ci", "--min-score 0.9", '"${resume[@]}"'):
        assert part in command, part
    assert "--resume" in command and "gh run download" in MUTATE_NIGHTLY
