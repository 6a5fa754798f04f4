#!/usr/bin/env bash
# Build a NeMo Gym venv: infra/gym-venv.sh VENV VERSION [PYTHON]   (make setup runs it)
#
# NeMo Gym runs each server in an environment of its own, beside rollsafe's Python 3.11 venv.
# Which Python a release needs (docs/nemo-gym.md, "Versions"):
#   0.4.x        Python 3.12 (>= 3.12)
#   0.5 and up   Python 3.13, and its wheels declare Requires-Python >= 3.13.14: a CVE floor
#                (tarfile, http) rather than an API need. Where only an older 3.13 exists (this
#                kind of machine has pyenv's 3.13.0), it installs with --ignore-requires-python
#                and says so once; run 3.13.14 or later in production.
# The Python: PYTHON if given, else the newest X.Y.Z of pythonX.Y on PATH (if it runs: pyenv's
# shims fail unless PYENV_VERSION is set) and pyenv's X.Y builds. The venv is made again when its
# Python's X.Y or its nemo-gym version is not the one asked for.
set -euo pipefail

venv=${1:?usage: gym-venv.sh VENV VERSION [PYTHON]}
version=${2:?usage: gym-venv.sh VENV VERSION [PYTHON]}
py=${3:-}

case "$version" in
    0.4.*) want=3.12 floor= ;;
    0.[5-9].* | 0.[1-9][0-9].* | [1-9]*) want=3.13 floor=3.13.14 ;;
    *) echo "gym-venv.sh: no Python known for nemo-gym $version (0.4.x: 3.12; 0.5+: 3.13)" >&2; exit 2 ;;
esac

# Already there (its Python's X.Y and nemo-gym's version): nothing to do.
have=$("$venv/bin/python" -c "import sys, importlib.metadata as m; assert sys.version_info[:2] == tuple(map(int, '$want'.split('.'))); print(m.version('nemo-gym'))" 2>/dev/null || true)
if [ "$have" = "$version" ]; then
    exit 0
fi

runs() { "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; }

# The newest X.Y.Z among the candidates that run (3.13.14 over 3.13.0 wherever each is).
if [ -z "$py" ]; then
    root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
    py=$(for candidate in "$(command -v "python$want" || true)" "$root"/versions/"$want".*/bin/python"$want"; do
             [ -n "$candidate" ] && runs "$candidate" || continue
             echo "$("$candidate" -c 'import platform; print(platform.python_version())') $candidate"
         done | sort -V | tail -n 1 | cut -d' ' -f2-)
fi
if [ -z "$py" ] || ! runs "$py"; then
    echo "nemo-gym $version needs Python $want and none was found (tried: GYM_PYTHON, python$want on PATH," >&2
    echo "pyenv's versions/$want.*). Install it ('pyenv install $want'), or name one:" >&2
    echo "make setup GYM_PYTHON=/path/to/python$want" >&2
    exit 1
fi

found=$("$py" -c 'import platform; print(platform.python_version())')
pip_flags=()
if [ -n "$floor" ] && [ "$(printf '%s\n%s\n' "$floor" "$found" | sort -V | head -n 1)" != "$floor" ]; then
    echo "WARNING: nemo-gym $version declares Python >= $floor; $py is $found. Installing it with" >&2
    echo "  --ignore-requires-python (the floor is a CVE fix in tarfile/http, not an API need)." >&2
    echo "  Run NeMo Gym on Python >= $floor in production (docs/nemo-gym.md, \"Versions\")." >&2
    pip_flags=(--ignore-requires-python)
fi

echo "creating $venv: nemo-gym $version on Python $found ($py)"
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "${pip_flags[@]}" "nemo-gym==$version"
