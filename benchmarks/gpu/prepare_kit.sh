#!/usr/bin/env bash
# Build the offline wheel kit for the lent GPU machine (run on a machine that reaches PyPI).
#
#   bash benchmarks/gpu/prepare_kit.sh
#
# The GPU machine (CPython 3.12, torch+CUDA, fsspec, numpy, typing-extensions, pytest) has no
# network and lacks ckptmgr's other runtime dependencies: pydantic (with pydantic-core,
# annotated-types, typing-inspection), tenacity, pyyaml and zlib-ng. This script downloads their
# wheels for CPython 3.12 / manylinux x86_64 into .gpu-kit/wheels/ (ignored by git), which the GPU call
# carries along (carry: [".gpu-kit"]) and benchmarks/gpu/run_checks.sh installs with --no-index.
#
# typing-extensions is in the kit although the GPU image has it: pydantic pins a recent minimum
# (typing-extensions>=4.16 for pydantic 2.14), and `pip install --target` ignores what is already
# installed, so an offline install into a target folder fails without it (~45 KB).
# torch, fsspec and numpy are never downloaded: the image has them.
#
# Then, when a CPython 3.12 is found (PYTHON312, or pyenv's 3.12.x), it proves the kit complete:
# a throwaway venv installs pydantic, tenacity, pyyaml and zlib-ng from the kit alone and imports
# them, pydantic's compiled core included.
#
# Environment: PIP_PYTHON (the python whose pip downloads; default python3), PYTHON312,
# KIT_DIR (default .gpu-kit). Exits non-zero when the download or the check fails.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
KIT_DIR="${KIT_DIR:-.gpu-kit}"
WHEELS="$KIT_DIR/wheels"
PIP_PYTHON="${PIP_PYTHON:-python3}"
# What ckptmgr needs at run time beyond torch, fsspec and numpy (pyproject.toml's ranges).
REQUIREMENTS=("pydantic>=2.5" "tenacity>=8.2" "pyyaml>=6.0" "zlib-ng>=0.5")

rm -rf "$WHEELS"
mkdir -p "$WHEELS"

# --only-binary + --python-version/--implementation/--abi/--platform: pip resolves for the GPU
# machine's interpreter, not this one, so a cp311 wheel from a local find-links folder or mirror
# cannot slip in (the file-name check below makes sure). The local pip config's constraint file
# only caps torch, which is not downloaded.
echo "downloading wheels for CPython 3.12 manylinux x86_64 into $WHEELS ..."
if ! timeout 300 "$PIP_PYTHON" -m pip download --disable-pip-version-check --no-input \
    --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
    --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$WHEELS" "${REQUIREMENTS[@]}"; then
    echo "ERROR: pip download failed" >&2
    exit 1
fi

# Every file must be a wheel for any Python (py3-none-any) or for cp312 on manylinux x86_64.
status=0
shopt -s nullglob
wheels=("$WHEELS"/*)
for path in "${wheels[@]}"; do
    name="$(basename "$path")"
    case "$name" in
        *-py3-none-any.whl | *-py2.py3-none-any.whl) ;;
        *-cp312-cp312-manylinux*x86_64*.whl | *-cp312-abi3-manylinux*x86_64*.whl) ;;
        *)
            echo "ERROR: not a wheel for CPython 3.12 manylinux x86_64: $name" >&2
            status=1
            ;;
    esac
    case "$name" in
        torch-* | fsspec-* | numpy-* | nvidia_*)
            echo "ERROR: the GPU image has this one already; it must not be in the kit: $name" >&2
            status=1
            ;;
    esac
done
for needed in pydantic- pydantic_core- tenacity- pyyaml- zlib_ng- annotated_types- typing_inspection-; do
    matches=("$WHEELS"/"$needed"*)
    if [ "${#matches[@]}" -eq 0 ]; then
        echo "ERROR: no ${needed%-} wheel in the kit" >&2
        status=1
    fi
done
[ "$status" -eq 0 ] || exit "$status"

echo
echo "kit: $WHEELS"
ls -l "$WHEELS"
echo "kit size: $(du -sh "$KIT_DIR" | cut -f1) ($(du -sb "$KIT_DIR" | cut -f1) bytes)"

# -- completeness check with a real CPython 3.12 (optional: skipped when none is found) -------
PY312="${PYTHON312:-}"
if [ -z "$PY312" ]; then
    for candidate in "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        [ -x "$candidate" ] && PY312="$candidate"
    done
fi
if [ -z "$PY312" ]; then
    echo "no CPython 3.12 here (set PYTHON312): the kit's offline install was not checked"
    exit 0
fi
VENV="$(mktemp -d "${TMPDIR:-/tmp}/ckptmgr-kit-check.XXXXXX")"
trap 'rm -rf "$VENV"' EXIT
echo
echo "checking the kit with $PY312 in a throwaway venv ($VENV) ..."
# No constraint file, find-links or index of this machine's pip config (file or PIP_* variables)
# may help: the kit alone must do.
if ! timeout 120 "$PY312" -m venv "$VENV" ||
    ! env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT \
        PIP_CONFIG_FILE=/dev/null timeout 120 "$VENV/bin/python" -m pip install \
        --disable-pip-version-check --no-input --no-index --find-links "$WHEELS" \
        pydantic tenacity pyyaml zlib-ng; then
    echo "ERROR: the kit does not install offline on CPython 3.12" >&2
    exit 1
fi
if ! timeout 60 "$VENV/bin/python" - <<'EOF'; then
import sys
from importlib.metadata import version

import pydantic, pydantic_core, tenacity, yaml
from zlib_ng import zlib_ng  # compiled too
from pydantic_core import _pydantic_core  # the compiled extension module

class Probe(pydantic.BaseModel):
    n: int

assert Probe(n="3").n == 3  # validation runs in the compiled core
print("kit OK on Python", sys.version.split()[0] + ":",
      ", ".join(f"{name} {version(name)}" for name in
                ("pydantic", "pydantic-core", "tenacity", "pyyaml", "zlib-ng", "typing-extensions")),
      "; compiled core:", _pydantic_core.__file__.rsplit("/", 1)[-1])
EOF
    echo "ERROR: the kit installed but does not import on CPython 3.12" >&2
    exit 1
fi
