#!/usr/bin/env bash
# CI step: verl091
# verl 0.9.1 conformance (`spec verify --engine verl`, tests/test_verl_conformance.py) and impl's padding helpers and
# micro-batch layer against verl's, bit for bit (tests/test_dropin.py, tests/test_dropin_microbatch.py)
#
# verl 0.9.1's CI step (.ci/steps.sh finds it here, in the engine's folder; tox -e verl091 runs it too), in the venv
# .venv-verl (spec/engines/verl/README.md): `spec verify --engine verl --profile ci` exits 0 (documented known failures
# do not count) and tests/test_verl_conformance.py checks the same report. `--setup`: only install the venv.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export CI="${CI:-true}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" PIP_DISABLE_PIP_VERSION_CHECK=1

# shellcheck source=.ci/lib.sh
. .ci/lib.sh   # venv (a venv installed already is reused)

venv verl verl==0.9.1 -e '.[test]'
if [ "${1:-}" = "--setup" ]; then exit 0; fi
python -m spec verify --engine verl --profile ci --out reports/verl
VERL_EXPECT_VERSION=0.9.1 VERL_EXPECT_MASK_BUG=0 VERL_CONFORMANCE_REPORT=reports/verl/verify-verl.json \
    pytest -p no:cacheprovider tests/test_verl_conformance.py
# a branch of the engine's surface unreached without a reason fails (docs/engine-coverage.md)
ENGINE_COVERAGE_REPORTS=reports/verl/verify-verl.json \
    pytest -p no:cacheprovider tests/test_engine_coverage.py -k 'report or equivalent'
pytest -p no:cacheprovider tests/test_dropin.py tests/test_dropin_microbatch.py tests/test_step_engines.py
