#!/usr/bin/env bash
# The CI steps: ONE list, run in order by .ci/run (the 2-core machine) and one GitHub job each by
# .github/workflows/ci.yml (its `steps` job reads this list: `.ci/steps.sh --list`).
#
#   .ci/steps.sh --list          the step names, as a JSON array (--names: one a line)
#   .ci/steps.sh --show STEP     the bash a step runs
#   .ci/steps.sh STEP            run one step (from the repository root, CI=true)
#   .ci/steps.sh --show-setup STEP   the bash of its setup
#   .ci/steps.sh --setup STEP    only install what the step needs (its leading venv/with_redis/pip commands, or
#                                `SCRIPT --setup` for a step that is one script); .ci/run installs the later
#                                steps this way in the background while the first one runs
#
# The list: the core steps below (STEPS: the suite itself, `tests`, first; the torch floor), then every engine's
# own steps, each a script in the engine's folder, spec/engines/<folder>/ci*.sh, found here (in the byte order of
# their paths): its line `# CI step: NAME` names the step, the comment lines after it say what it checks (the README's
# table of CI), and `SCRIPT --setup` only installs. So adding an engine's CI is one script in its folder
# (docs/writing-an-adapter.md); nothing here changes. A core step is one line in STEPS: a name and the bash it runs.
# `venv NAME [PIP ARGS...]` (.ci/lib.sh) makes (or reuses) the virtual environment .venv-NAME, activates it and
# pip-installs the arguments into it, so a step is self-contained on a fresh GitHub runner and shares nothing with
# the other steps' environments (unless two steps ask for the same venv NAME and arguments: installed once).
# A step starts with what it installs (venv, with_redis, pip install: its setup), then what it runs.
# torch 2.13.0 goes in first (the CPU build here; the workflow installs it from the CPU index), then every
# package under constraints-torch.txt so pip cannot swap torch for a CUDA build. The torch24 step is the floor:
# its venv's torch is 2.4.0 (`venv NAME torch==V ...` pins V instead), with tensordict 0.8.3 as in tox -e torch24.
set -euo pipefail
cd "$(dirname "$0")/.."
export CI="${CI:-true}"          # selects the `ci` hypothesis profile (derandomized)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
# shellcheck source=.ci/lib.sh
. .ci/lib.sh   # venv NAME [PIP ARGS...] (reused when installed already), pip (editable builds one at a time)

# name            the bash it runs (one line each; `tests` first: .ci/run installs the later steps while it runs)
STEPS=(
"tests            venv ci && with_redis && pip install torch==2.13.0 -e '.[test]' && pytest -n auto"
"torch24          venv torch24 torch==2.4.0 tensordict==0.8.3 -e '.[test]' && SPEC_EXPECT_TORCH=2.4.0 SPEC_EXPECT_TENSORDICT=0.8.3 pytest -p no:cacheprovider tests/test_environment.py tests/test_microbatch.py tests/test_dense_kernels.py tests/test_examples.py tests/test_errors.py tests/test_examples_mutation.py && python -m spec verify --engine impl --profile dev --out reports/torch24 && ENGINE_COVERAGE_REPORTS=reports/torch24/verify-impl.json pytest -p no:cacheprovider tests/test_engine_coverage.py -k report"
)

# every engine folder's CI steps: spec/engines/<folder>/ci*.sh, named by its line `# CI step: NAME`
shopt -s nullglob
mapfile -t ENGINE_STEP_SCRIPTS < <(printf '%s\n' spec/engines/*/ci*.sh | LC_ALL=C sort)
shopt -u nullglob
for script in "${ENGINE_STEP_SCRIPTS[@]}"; do
    if [ -z "$script" ]; then continue; fi   # no engine step at all
    name=$(sed -n 's/^# CI step: \([A-Za-z0-9_.-]\{1,\}\)$/\1/p' "$script")
    if [ -z "$name" ] || [ "$(printf '%s\n' "$name" | wc -l)" != 1 ]; then
        echo "$script: an engine's CI step script names its step in one line '# CI step: NAME'" >&2; exit 2
    fi
    STEPS+=("$name  bash $script")
done

# Advisory steps: run by .ci/run and the workflow alike, reported, but not failing CI. A step is advisory only while
# it has not been re-verified on the current tree; each entry says why (README "CI" names them too).
ADVISORY=(  # none: every step was re-verified on the tree of 2026-12-01 (the session's closing note)
)

advisory_reason() { local s; for s in "${ADVISORY[@]}"; do if [ "${s%% *}" = "$1" ]; then s="${s#* }"; echo "${s#"${s%%[![:space:]]*}"}"; return 0; fi; done; return 1; }

with_redis() {  # a redis-server binary for tests/test_example_db.py's Redis run, unless CI gives a server
    # The test starts its own server (a fresh port, retried if taken) when $SPEC_TEST_REDIS_URL is unset;
    # the workflow sets that URL to its Redis service container. policy-rc.d keeps the OS package from
    # starting (and leaving behind) a system service. Without either, the Redis run skips and says so.
    if [ -n "${SPEC_TEST_REDIS_URL:-}" ] || command -v redis-server >/dev/null 2>&1; then return 0; fi
    local made_policy=0
    if [ -w /usr/sbin ] && [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
        || echo "redis-server could not be installed: the Redis run of tests/test_example_db.py will skip"
    if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
    return 0
}

setup_of() {  # the setup part of a step's command (see --setup)
    local cmd part out=() ; cmd=$(command_of "$1") || return 2
    if [[ "$cmd" =~ ^bash\ (spec/engines/[A-Za-z0-9_.-]+/ci[A-Za-z0-9_.-]*\.sh)$ ]]; then echo "bash ${BASH_REMATCH[1]} --setup"; return 0; fi
    while [ -n "$cmd" ]; do
        part=${cmd%% && *}
        case "$part" in venv\ *|with_redis|pip\ install\ *) out+=("$part") ;; *) break ;; esac
        if [ "$part" = "$cmd" ]; then break; fi
        cmd=${cmd#* && }
    done
    local joined=""
    for part in "${out[@]}"; do joined+="${joined:+ && }$part"; done
    echo "$joined"
}

names() { local s; for s in "${STEPS[@]}"; do echo "${s%% *}"; done; }
if [ -n "$(names | sort | uniq -d)" ]; then echo "two CI steps have one name: $(names | sort | uniq -d | tr '\n' ' ')" >&2; exit 2; fi

command_of() {
    local s
    for s in "${STEPS[@]}"; do
        if [ "${s%% *}" = "$1" ]; then s="${s#* }"; echo "${s#"${s%%[![:space:]]*}"}"; return 0; fi
    done
    echo "unknown CI step '$1'; the steps: $(names | tr '\n' ' ')" >&2
    return 2
}

case "${1:-}" in
    --list) names | python3 -c 'import json, sys; print(json.dumps(sys.stdin.read().split()))' ;;
    --names) names ;;
    --advisory) if advisory_reason "$2" >/dev/null; then advisory_reason "$2"; else exit 1; fi ;;
    --show) command_of "$2" ;;
    --show-setup) setup_of "$2" ;;
    --setup)
        cmd=$(setup_of "$2")
        echo "=== CI setup $2: ${cmd:-(nothing to install)}"
        if [ -n "$cmd" ]; then eval "$cmd"; fi
        ;;
    ""|-h|--help) sed -n '2,17p' "$0"; echo "steps: $(names | tr '\n' ' ')" ;;
    *)
        cmd=$(command_of "$1")
        echo "=== CI step $1: $cmd"
        eval "$cmd"
        ;;
esac
