#!/usr/bin/env bash
# Build grpo_kernels._C against a CUDA build of PyTorch, on a machine that has nvcc but only a CPU torch (and no GPU).
#
#   bash csrc/check_build.sh [OUTDIR]        # OUTDIR: where _C.so and the objects go (default: a temp dir, removed)
#
# 1. Fetches the CUDA wheel of the installed torch version: pip download "torch===<version>" (=== skips the local
#    +cpu wheel) for manylinux x86_64 and this Python, into $GRPO_KERNELS_CACHE/wheels (default ~/.cache/grpo-kernels),
#    and unpacks its torch/include, torch/lib and torch/version.py beside it, once. GRPO_KERNELS_OFFLINE=1 fails
#    instead of downloading (exit 3).
# 2. Runs setup.py itself (`setup.py build_ext`, GRPO_KERNELS_BUILD_CUDA=1) on a copy of the sources in OUTDIR, with
#    torch.utils.cpp_extension pointed at the CUDA wheel (its include/ and lib/, its torch.version.cuda) and at the
#    local CUDA toolkit: the same BuildExtension, flags (-std=c++20, -O3, TORCH_CUDA_ARCH_LIST default "8.0;9.0",
#    the -D__CUDA_NO_HALF_* defines, ...), ninja and link line as `pip install --no-build-isolation .` on a CUDA machine.
#    CUDA_HOME: as set, else /usr/local/cuda, else above the real nvcc (torch's own guess, `which nvcc`, is misled by
#    a wrapper script such as /usr/local/bin/nvcc).
# 3. Checks the result: _C.so carries SASS for every requested arch (cuobjdump --list-elf), and every symbol it leaves
#    undefined is defined by a library it names or is Python's (an ABI or API mismatch with torch would show here,
#    not first at import on a GPU machine).
# Prints the compile commands, warnings, time and sizes. Needs: python with torch, pip, nvcc, unzip, g++, binutils
# (nm, readelf, c++filt), cuobjdump (the toolkit's or triton's); ninja is used when present, as by setup.py.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
[[ "$PYTHON" != */* ]] || PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"  # absolute, not resolved
CACHE=${GRPO_KERNELS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-kernels}
START=$(date +%s)

read -r TORCH_VERSION PY_VERSION PY_TAG < <("$PYTHON" -c '
import sys, torch
v = sys.version_info
print(torch.__version__.split("+")[0], f"{v.major}.{v.minor}", f"cp{v.major}{v.minor}")')
# torch finds CUDA_HOME from `which nvcc`, which a wrapper script in /usr/local/bin misleads: prefer CUDA_HOME,
# then /usr/local/cuda, then the directory above the real nvcc.
if [[ -z "${CUDA_HOME:-}" ]]; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then CUDA_HOME=/usr/local/cuda; else CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); fi
fi
export CUDA_HOME
CUOBJDUMP=$(command -v cuobjdump || { [[ -x "$CUDA_HOME/bin/cuobjdump" ]] && echo "$CUDA_HOME/bin/cuobjdump"; } ||
  "$PYTHON" -c 'from triton import knobs; print(knobs.nvidia.cuobjdump.path)')
WHEELS=$CACHE/wheels
TORCH_CUDA=$CACHE/torch-$TORCH_VERSION-$PY_TAG-cuda  # the unpacked torch/ of the CUDA wheel

wheel_path() { compgen -G "$WHEELS/torch-$TORCH_VERSION-$PY_TAG-$PY_TAG-manylinux*_x86_64.whl" | head -n1 || true; }

if [[ -z "$(wheel_path)" ]]; then
  if [[ "${GRPO_KERNELS_OFFLINE:-0}" == 1 ]]; then
    echo "check_build: no CUDA torch $TORCH_VERSION wheel in $WHEELS and GRPO_KERNELS_OFFLINE=1" >&2
    exit 3
  fi
  echo "== fetching the CUDA wheel of torch $TORCH_VERSION (~0.5 GB) into $WHEELS"
  "$PYTHON" -m pip download "torch===$TORCH_VERSION" --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version "$PY_VERSION" -d "$WHEELS"
fi
WHEEL=$(wheel_path)
if [[ ! -f "$TORCH_CUDA/.unpacked" ]]; then
  echo "== unpacking torch/include, torch/lib of $(basename "$WHEEL")"
  rm -rf "$TORCH_CUDA"
  mkdir -p "$TORCH_CUDA"
  unzip -q "$WHEEL" 'torch/include/*' 'torch/lib/*' 'torch/version.py' -d "$TORCH_CUDA"
  touch "$TORCH_CUDA/.unpacked"
fi
WHEEL_CUDA=$(sed -n "s/^cuda: .*= '\(.*\)'$/\1/p" "$TORCH_CUDA/torch/version.py")
if [[ -z "$WHEEL_CUDA" ]]; then
  echo "check_build: $(basename "$WHEEL") is not a CUDA build (torch/version.py has no cuda version)" >&2
  exit 1
fi

OUT=${1:-}
if [[ -z "$OUT" ]]; then
  OUT=$(mktemp -d -t grpo-kernels-build.XXXXXX)
  trap 'rm -rf "$OUT"' EXIT
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
case "$OUT/" in "$ROOT"/*) echo "check_build: OUTDIR must be outside the source tree ($ROOT)" >&2; exit 2 ;; esac
rm -rf "$OUT/src" "$OUT/build" "$OUT/lib"
mkdir -p "$OUT/src"
cp -r "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/csrc" "$OUT/src/"
(cd "$ROOT" && find grpo_kernels -name '*.py' -o -name '*.yaml') | (cd "$ROOT" && xargs cp --parents -t "$OUT/src")

echo "== building grpo_kernels._C: torch $TORCH_VERSION+cu${WHEEL_CUDA//./}, CUDA_HOME=$CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*')), \
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-<setup.py default>}"
BUILD_START=$(date +%s)
(
  cd "$OUT/src"
  GRPO_KERNELS_BUILD_CUDA=1 TORCH_CUDA="$TORCH_CUDA/torch" WHEEL_CUDA="$WHEEL_CUDA" "$PYTHON" - build_ext \
    --build-temp "$OUT/build" --build-lib "$OUT/lib" <<'EOF'
import os, runpy, sys
import torch
import torch.utils.cpp_extension as ext

# A CUDA build of torch as far as building an extension goes: its headers and libraries, its CUDA version.
ext._TORCH_PATH = os.environ["TORCH_CUDA"]
ext.TORCH_LIB_PATH = os.path.join(ext._TORCH_PATH, "lib")
ext.CUDA_HOME = ext._find_cuda_home()
torch.version.cuda = os.environ["WHEEL_CUDA"]
sys.argv = ["setup.py", *sys.argv[1:]]
runpy.run_path("setup.py", run_name="__main__")
EOF
) 2>&1 | tee "$OUT/build.log"
BUILD_SECONDS=$(($(date +%s) - BUILD_START))

SO=$(compgen -G "$OUT/lib/grpo_kernels/_C*.so" | head -n1 || true)
if [[ -z "$SO" ]]; then
  echo "check_build: no _C*.so under $OUT/lib/grpo_kernels" >&2
  exit 1
fi

echo "== checking $(basename "$SO")"
ARCHS=$("$CUOBJDUMP" --list-elf "$SO" | grep -o 'sm_[0-9]*a\?' | sort -u | tr '\n' ' ')
echo "SASS for: $ARCHS"
WANT=${TORCH_CUDA_ARCH_LIST:-$(sed -n 's/^DEFAULT_ARCHS = "\(.*\)"$/\1/p' "$ROOT/setup.py")}
for arch in ${WANT//;/ }; do
  sm=sm_${arch%%+*}
  sm=${sm//./}
  [[ " $ARCHS " == *" $sm "* ]] || { echo "check_build: no $sm code in $(basename "$SO")" >&2; exit 1; }
done

# Every symbol _C.so leaves undefined must be defined by a library it names (DT_NEEDED: the wheel's torch libraries,
# cudart, the C++ runtime) or be Python's (resolved at import): an ABI or API mismatch with torch would show here.
NEEDED=$(readelf -d "$SO" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p')
LIBDIRS=("$TORCH_CUDA/torch/lib" "$CUDA_HOME/lib64" $(g++ -print-search-dirs | sed -n 's/^libraries: =//p' | tr ':' ' ')
  /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64)
for lib in $NEEDED; do
  found=""
  for dir in "${LIBDIRS[@]}"; do
    [[ -e "$dir/$lib" ]] && { found="$dir/$lib"; break; }
  done
  [[ -n "$found" ]] || { echo "check_build: $(basename "$SO") needs $lib, found in none of ${LIBDIRS[*]}" >&2; exit 1; }
  nm -D --defined-only "$found" | awk '{print $3}'
done | sed 's/@.*//' | sort -u >"$OUT/defined.txt"
nm -D "$SO" | awk '$1 == "U" {print $2}' | sed 's/@.*//' | grep -v '^_\?Py' | sort -u >"$OUT/undefined.txt"
comm -23 "$OUT/undefined.txt" "$OUT/defined.txt" >"$OUT/unresolved.txt"
if [[ -s "$OUT/unresolved.txt" ]]; then
  echo "check_build: $(wc -l <"$OUT/unresolved.txt") symbol(s) of $(basename "$SO") defined by none of its libraries:" >&2
  head -n 20 "$OUT/unresolved.txt" | c++filt >&2
  exit 1
fi
echo "undefined symbols: $(wc -l <"$OUT/undefined.txt") (besides Python's), all defined by its libraries"
echo "NEEDED: $(echo $NEEDED)"

WARNINGS=$(grep -ci 'warning' "$OUT/build.log" || true)
OBJECTS=$(find "$OUT/build" -name '*.o' -printf '%f %s\n' | awk '{printf "%s%s %.1f MB", sep, $1, $2 / 1e6; sep = ", "}')
echo "== ok: $(basename "$SO") $(du -h "$SO" | cut -f1) ($OBJECTS), build ${BUILD_SECONDS}s, \
total $(($(date +%s) - START))s, $WARNINGS build-log line(s) mentioning a warning"
