#!/usr/bin/env bash
# Shared by .ci/steps.sh and the engines' CI step scripts, spec/engines/*/ci*.sh (sourced, never run): the virtual environments of the CI steps.
#
#   venv NAME [PIP ARGS...]   make (or reuse) .venv-NAME, activate it, pip-install torch and the arguments
#                             (torch 2.13.0, else $TORCH_SPEC; an argument torch==V: that torch, and V pins it)
#   pip ...                   pip, with the project's editable builds one at a time (see below)
#
# A venv is reused without calling pip when its marker (.venv-NAME/.ci-installed) holds the key of what was
# asked: the arguments, the torch spec and index, pyproject.toml and constraints-torch.txt. So .ci/run can
# install a later step's venv in the background while an earlier step runs (`.ci/steps.sh --setup STEP`), and
# the step then starts at once; a changed pyproject.toml or argument list installs again.
#
# Two pip processes may run at once then (the background one and a step's own), and each `-e .` builds the
# project in this one source tree (rl_ioprep.egg-info): those builds take the lock .ci-pip.lock in turn. The
# downloads and the other packages' installs are not locked (pip's cache writes are atomic).

CI_PIP_LOCK="${CI_PIP_LOCK:-$PWD/.ci-pip.lock}"

_ci_locked() {  # _ci_locked CMD...: CMD under the editable-build lock (flock, where util-linux has it)
    if command -v flock >/dev/null 2>&1; then flock "$CI_PIP_LOCK" "$@"; else "$@"; fi
}

pip() {  # pip ARGS...: python -m pip; an install that builds the project (-e) holds the lock
    local a
    for a in "$@"; do
        if [ "$a" = "-e" ] || [ "$a" = "--editable" ]; then _ci_locked python -m pip "$@"; return; fi
    done
    python -m pip "$@"
}

_ci_venv_key() {  # the key of a venv's install: its arguments and the files that decide what they install
    { printf '%s\n' "$@" "${TORCH_SPEC:-torch==2.13.0}" "${TORCH_INDEX:-}"
      cat pyproject.toml constraints-torch.txt 2>/dev/null; } | sha256sum | cut -d' ' -f1
}

venv_ready() {  # venv_ready NAME KEY: activate .venv-NAME and succeed when its marker holds KEY
    [ -x ".venv-$1/bin/python" ] || python3 -m venv ".venv-$1"
    # shellcheck disable=SC1090
    . ".venv-$1/bin/activate"
    [ -f ".venv-$1/.ci-installed" ] && [ "$(cat ".venv-$1/.ci-installed")" = "$2" ]
}

venv_installed() {  # venv_installed NAME KEY: record that .venv-NAME holds what KEY names
    echo "$2" > ".venv-$1/.ci-installed"
}

venv() {  # venv NAME [PIP ARGS...]: .venv-NAME with torch 2.13.0 (CPU) and the arguments, activated
    local name=$1; shift
    local key; key=$(_ci_venv_key "$@")
    if venv_ready "$name" "$key"; then echo "venv $name: installed already (.venv-$name/.ci-installed)"; return 0; fi
    rm -f ".venv-$name/.ci-installed"
    # an argument torch==V (the torch24 step: the floor) is the venv's torch, and the constraint the rest is
    # installed under instead of constraints-torch.txt (which pins 2.13.0)
    local a torch_spec="${TORCH_SPEC:-torch==2.13.0}" constraints=constraints-torch.txt
    for a in "$@"; do
        if [[ "$a" == torch==* ]]; then torch_spec=$a; constraints=".venv-$name/constraints-torch.txt"; fi
    done
    if [ "$constraints" != constraints-torch.txt ]; then echo "$torch_spec" > "$constraints"; fi
    python -m pip install -q --upgrade pip
    python -m pip install -q "$torch_spec" ${TORCH_INDEX:+--index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple}
    # the packages first, then the project's editable build (under the lock), against what is installed
    local packages=() editable=() next_editable=0
    for a in "$@"; do
        if [ "$next_editable" = 1 ]; then editable+=(-e "$a"); next_editable=0
        elif [ "$a" = "-e" ] || [ "$a" = "--editable" ]; then next_editable=1
        else packages+=("$a"); fi
    done
    if [ "${#packages[@]}" -gt 0 ]; then python -m pip install -q -c "$constraints" "${packages[@]}"; fi
    if [ "${#editable[@]}" -gt 0 ]; then _ci_locked python -m pip install -q -c "$constraints" "${packages[@]}" "${editable[@]}"; fi
    venv_installed "$name" "$key"
}
