#!/usr/bin/env bash
# CI step: verl-megatron
# verl 0.9.1's Megatron packing and engine object: `spec verify --engine verl-megatron`
#
# verl's Megatron packing engine's CI step (.ci/steps.sh finds it here, in the engine's folder), in the venv
# .venv-verl-engines that verl 0.9.1's four native engines share (spec/engines/verl/native-step.sh: installed once,
# found installed by the other three steps). `spec verify` exits 1 on any failure that is not a documented
# known-failure record. `--setup`: only install the venv.
# shellcheck source=spec/engines/verl/native-step.sh
. "$(dirname "$0")/../verl/native-step.sh"   # set -euo pipefail, the root, .ci/lib.sh, verl_engines_venv
verl_engines_venv "$@"   # on --setup: only install the venv
python -m spec verify --engine verl-megatron --profile ci --out reports/verl-megatron
# a branch of the engine's surface unreached without a reason fails (docs/engine-coverage.md)
ENGINE_COVERAGE_REPORTS=reports/verl-megatron/verify-verl-megatron.json \
    pytest -p no:cacheprovider tests/test_engine_coverage.py -k report
