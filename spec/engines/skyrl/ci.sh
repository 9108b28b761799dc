#!/usr/bin/env bash
# CI step: skyrl
# skyrl-train 0.3.1 (`spec verify --engine skyrl-train`) and skyrl 0.4.0 (`--engine skyrl`), Python 3.12 wheels
# installed `--no-deps --ignore-requires-python` in one venv, then tests/test_skyrl.py
#
# SkyRL's CI step (.ci/steps.sh finds it here, in the engine's folder): engines skyrl-train and skyrl in one venv
# .venv-skyrl (spec/engines/skyrl/README.md). `spec verify` exits 1 on any failure that is not one of the engine's documented
# known-failure records (spec/engines/skyrl/records.py). `--setup`: only install the venv.
#
# Both wheels declare Requires-Python ==3.12.* and this CI runs Python 3.11: they are installed with
# `--no-deps --ignore-requires-python` (their code parses and runs on 3.11: the adapter imports only the preparation
# modules), and of their dependency sets only what those modules import at module level, pure Python and small
# (numpy, jaxtyping, loguru, packaging, omegaconf; einops and flash-attn 2.8.3's pure-torch bert_padding.py for
# the unpadded path, .ci/steps/bert_padding.py). transformers, peft, ray, datasets, skyrl-gym
# and flash-attn's CUDA package are not installed: spec/engines/skyrl/adapter.py stubs those imports (they load models and
# start clusters; the preparation never calls them); skyrl 0.4.0's skyrl/backends/__init__.py (the Tinker API: pydantic
# models that need Python 3.12) is not run. The two packages install side by side (skyrl_train, skyrl).
set -euo pipefail
cd "$(dirname "$0")/../../.."
export CI="${CI:-true}" PYTHONWARNINGS=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# shellcheck source=.ci/lib.sh
. .ci/lib.sh   # venv_ready, venv_installed, _ci_venv_key (a venv installed already is reused)

WHEELS=(skyrl-train==0.3.1 skyrl==0.4.0)
IMPORTED=(numpy==2.4.6 jaxtyping==0.3.11 loguru==0.7.3 packaging==26.4 omegaconf==2.4.0 einops==0.8.2)

setup() {
    local key; key=$(_ci_venv_key "${WHEELS[@]}" --no-deps "${IMPORTED[@]}" -e '.[test]' "$(cat .ci/steps/bert_padding.py)")
    if ! venv_ready skyrl "$key"; then
        python -m pip install -q --upgrade pip
        python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple}
        python -m pip install -q --no-deps --ignore-requires-python "${WHEELS[@]}"
        pip install -q -c constraints-torch.txt "${IMPORTED[@]}" -e '.[test]'
        python .ci/steps/bert_padding.py
        venv_installed skyrl "$key"
    fi
    deactivate
}

setup
if [ "${1:-}" = "--setup" ]; then exit 0; fi
.venv-skyrl/bin/python -m spec verify --engine skyrl-train --profile ci --out reports/skyrl-train
.venv-skyrl/bin/python -m spec verify --engine skyrl --profile ci --out reports/skyrl
.venv-skyrl/bin/python -m pytest -p no:cacheprovider tests/test_skyrl.py tests/test_step_engines.py
# a branch of an engine's surface unreached without a reason fails (docs/engine-coverage.md)
ENGINE_COVERAGE_REPORTS="reports/skyrl-train/verify-skyrl-train.json reports/skyrl/verify-skyrl.json" \
    .venv-skyrl/bin/python -m pytest -p no:cacheprovider tests/test_engine_coverage.py -k 'report or equivalent'
