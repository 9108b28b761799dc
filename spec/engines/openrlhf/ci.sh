#!/usr/bin/env bash
# CI step: openrlhf
# OpenRLHF 0.11.2 (`spec verify --engine openrlhf`) in its own venv, then tests/test_hf_engines.py,
# tests/test_engine_switches.py and tests/test_step_engines.py
#
# OpenRLHF's CI step (.ci/steps.sh finds it here, in the engine's folder): engine openrlhf in the venv .venv-openrlhf
# (spec/engines/openrlhf/README.md). `spec verify` exits 1 on any failure that is not one of the engine's documented
# known-failure records (spec/engines/openrlhf/records.py). `--setup`: only install the venv.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export CI="${CI:-true}" PYTHONWARNINGS=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# shellcheck source=.ci/lib.sh
. .ci/lib.sh   # venv_ready, venv_installed, _ci_venv_key (a venv installed already is reused)

setup() {
    # OpenRLHF without its dependency set (deepspeed, flash-attn, vllm, ray: CUDA builds); the adapter stubs the
    # module-level imports that do not import here (spec/engines/openrlhf/adapter.py). Its preparation code needs einops
    # and flash-attn's pure-torch bert_padding.py (.ci/steps/bert_padding.py).
    local key; key=$(_ci_venv_key openrlhf==0.11.2 --no-deps einops==0.8.2 -e '.[test]' "$(cat .ci/steps/bert_padding.py)")
    if ! venv_ready openrlhf "$key"; then
        python -m pip install -q --upgrade pip
        python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple}
        python -m pip install -q --no-deps openrlhf==0.11.2
        pip install -q -c constraints-torch.txt einops==0.8.2 -e '.[test]'
        python .ci/steps/bert_padding.py
        venv_installed openrlhf "$key"
    fi
    deactivate
}

setup
if [ "${1:-}" = "--setup" ]; then exit 0; fi
.venv-openrlhf/bin/python -m spec verify --engine openrlhf --profile ci --out reports/openrlhf
# a branch of an engine's surface unreached without a reason fails (docs/engine-coverage.md)
ENGINE_COVERAGE_REPORTS="reports/openrlhf/verify-openrlhf.json" \
    .venv-openrlhf/bin/python -m pytest -p no:cacheprovider tests/test_engine_coverage.py -k 'report or equivalent'
.venv-openrlhf/bin/python -m pytest -p no:cacheprovider tests/test_hf_engines.py tests/test_engine_switches.py tests/test_step_engines.py
