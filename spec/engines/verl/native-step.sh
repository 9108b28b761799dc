#!/usr/bin/env bash
# The start of the CI steps of verl 0.9.1's native engines, VeOmni, Megatron packing, TorchTitan and Automodel
# (spec/engines/{veomni,megatron,torchtitan,automodel}/ci.sh source it first; never run, and not a CI step itself:
# .ci/steps.sh takes spec/engines/*/ci*.sh): from the repository root, with .ci/lib.sh, the venv the four share,
# .venv-verl-engines, made or found installed by `verl_engines_venv "$@"`, which stops the step there on `--setup`.
# One definition, so one key: the first of the four steps installs the venv, the other three find it installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
export CI="${CI:-true}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" PIP_DISABLE_PIP_VERSION_CHECK=1

# shellcheck source=.ci/lib.sh
. .ci/lib.sh   # venv, pip

verl_engines_venv() {  # verl_engines_venv [--setup]: .venv-verl-engines (verl 0.9.1; VeOmni, Megatron-Core --no-deps)
    venv verl-engines verl==0.9.1 -e '.[test]'
    pip install -q --no-deps veomni==0.1.12 megatron-core==0.16.1
    if [ "${1:-}" = "--setup" ]; then exit 0; fi
}
