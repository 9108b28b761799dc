#!/usr/bin/env bash
# CI step: trl
# TRL 1.16.0 (`spec verify --engine trl`, `trl-fused`) in its own venv, then tests/test_hf_engines.py,
# tests/test_engine_switches.py and tests/test_step_engines.py
#
# TRL's CI step (.ci/steps.sh finds it here, in the engine's folder): engines trl and trl-fused in the venv .venv-trl
# (spec/engines/trl/README.md). `spec verify` exits 1 on any failure that is not one of the engine's documented known-failure
# records (spec/engines/trl/records.py). `--setup`: only install the venv.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export CI="${CI:-true}" PYTHONWARNINGS=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# shellcheck source=.ci/lib.sh
. .ci/lib.sh   # venv (a venv installed already is reused)

venv trl trl==1.16.0 -e '.[test]'
deactivate
if [ "${1:-}" = "--setup" ]; then exit 0; fi
.venv-trl/bin/python -m spec verify --engine trl --profile ci --out reports/trl
.venv-trl/bin/python -m spec verify --engine trl-fused --profile ci --out reports/trl-fused
.venv-trl/bin/python -m pytest -p no:cacheprovider tests/test_hf_engines.py tests/test_engine_switches.py tests/test_step_engines.py
# a branch of an engine's surface unreached without a reason fails (docs/engine-coverage.md)
ENGINE_COVERAGE_REPORTS="reports/trl/verify-trl.json reports/trl-fused/verify-trl-fused.json" \
    .venv-trl/bin/python -m pytest -p no:cacheprovider tests/test_engine_coverage.py -k 'report or equivalent'
