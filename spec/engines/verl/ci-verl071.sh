#!/usr/bin/env bash
# CI step: verl071
# verl 0.7.1 must fail, and only on the attention-mask invariants (tests/test_verl_conformance.py)
#
# verl 0.7.1's CI step (.ci/steps.sh finds it here, in the engine's folder; tox -e verl071 runs it too), in the venv
# .venv-verl071 (spec/engines/verl/README.md): verl 0.7.1 has the loss-mask attention bug (verl issue #6278), so its
# verify run MUST FAIL, and only on the mask invariants that apply; the step exits 0 exactly when that holds.
# 0.7.1 needs 'numpy<2' 'pyarrow>=19,<20' 'datasets<4' (without them pip resolves versions it cannot import).
# `--setup`: only install the venv.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export CI="${CI:-true}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" PIP_DISABLE_PIP_VERSION_CHECK=1

# shellcheck source=.ci/lib.sh
. .ci/lib.sh   # venv (a venv installed already is reused)

venv verl071 verl==0.7.1 'numpy<2' 'pyarrow>=19,<20' 'datasets<4' -e '.[test]'
if [ "${1:-}" = "--setup" ]; then exit 0; fi
VERL_EXPECT_VERSION=0.7.1 VERL_EXPECT_MASK_BUG=1 pytest -p no:cacheprovider tests/test_verl_conformance.py
