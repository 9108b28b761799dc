#!/usr/bin/env bash
# CI step: TRL 1.16.0 (engines trl, trl-fused) and OpenRLHF 0.11.2 (engine openrlhf), each in its own venv
# (docs/engines/trl.md, docs/engines/openrlhf.md). Run from the repository root with CI=true. `spec verify` exits 1
# on any failure that is not one of the engine's documented known-failure records (spec/engines/*_records.py).
# The `trl-openrlhf` step of .ci/steps.sh (tox -e trl-openrlhf runs it too). `--setup`: only install the two venvs.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CI="${CI:-true}" PYTHONWARNINGS=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# shellcheck source=.ci/lib.sh
. .ci/lib.sh   # venv, venv_ready, venv_installed (a venv installed already is reused)

setup() {
    venv trl trl==1.16.0 -e '.[test]'
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
for engine in trl trl-fused; do
    .venv-trl/bin/python -m spec verify --engine "$engine" --profile ci --out "reports/$engine"
done
.venv-trl/bin/python -m pytest -p no:cacheprovider tests/test_hf_engines.py tests/test_engine_switches.py tests/test_step_engines.py
# a branch of an engine's surface unreached without a reason fails (docs/engine-coverage.md)
ENGINE_COVERAGE_REPORTS="reports/trl/verify-trl.json reports/trl-fused/verify-trl-fused.json" \
    .venv-trl/bin/python -m pytest -p no:cacheprovider tests/test_engine_coverage.py -k 'report or equivalent'
.venv-openrlhf/bin/python -m spec verify --engine openrlhf --profile ci --out "reports/openrlhf"
ENGINE_COVERAGE_REPORTS="reports/openrlhf/verify-openrlhf.json" \
    .venv-openrlhf/bin/python -m pytest -p no:cacheprovider tests/test_engine_coverage.py -k 'report or equivalent'
.venv-openrlhf/bin/python -m pytest -p no:cacheprovider tests/test_hf_engines.py tests/test_engine_switches.py tests/test_step_engines.py
