#!/usr/bin/env bash
# CI step: TRL 1.16.0 (engines trl, trl-fused) and OpenRLHF 0.11.2 (engine openrlhf), each in its own venv
# (docs/engines/trl.md, docs/engines/openrlhf.md). Run from the repository root with CI=true. `spec verify` exits 1
# on any failure that is not one of the engine's documented known-failure records (spec/engines/*_records.py).
# The `trl-openrlhf` step of .ci/steps.sh (tox -e trl-openrlhf runs it too).
set -euo pipefail
cd "$(dirname "$0")/../.."
export CI="${CI:-true}" PYTHONWARNINGS=ignore

python3 -m venv .venv-trl
.venv-trl/bin/python -m pip install -q --upgrade pip
.venv-trl/bin/pip install -q torch==2.13.0
.venv-trl/bin/pip install -q -c constraints-torch.txt trl==1.16.0
.venv-trl/bin/pip install -q -c constraints-torch.txt -e '.[test]'
for engine in trl trl-fused; do
    .venv-trl/bin/python -m spec verify --engine "$engine" --profile ci --out "reports/$engine"
done
.venv-trl/bin/python -m pytest -p no:cacheprovider tests/test_hf_engines.py

# OpenRLHF without its dependency set (deepspeed, flash-attn, vllm, ray: CUDA builds); the adapter stubs the
# module-level imports that do not import here (spec/engines/openrlhf.py). Its preparation code needs einops and
# flash-attn's pure-torch bert_padding.py (.ci/steps/bert_padding.py).
python3 -m venv .venv-openrlhf
.venv-openrlhf/bin/python -m pip install -q --upgrade pip
.venv-openrlhf/bin/pip install -q torch==2.13.0
.venv-openrlhf/bin/pip install -q --no-deps openrlhf==0.11.2
.venv-openrlhf/bin/pip install -q -c constraints-torch.txt einops==0.8.2 -e '.[test]'
.venv-openrlhf/bin/python .ci/steps/bert_padding.py
.venv-openrlhf/bin/python -m spec verify --engine openrlhf --profile ci --out reports/openrlhf
.venv-openrlhf/bin/python -m pytest -p no:cacheprovider tests/test_hf_engines.py
