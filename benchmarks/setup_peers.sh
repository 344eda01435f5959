#!/usr/bin/env bash
# Build the peers' virtual environment benchmarks/.venv-peers (gitignored).
#
# Only PyPI is reachable, so:
#   * torch 2.9.1 is PyPI's CUDA build (~7 GB; it runs on the CPU here);
#   * fast_rnnt and optimized_transducer are built from their PyPI sdists. Their
#     CMake downloads pybind11 at configure time and requires CUDA when torch is
#     a CUDA build; we patch both out in a temp dir (pybind11 comes from the
#     PyPI `pybind11` package, CUDA is switched off) and build CPU-only.
#   * nemo-toolkit is installed with --no-deps: peers.py imports only
#     nemo.collections.asr.parts.numba.rnnt_loss (needs torch, numpy, numba), bypassing
#     the parent packages' __init__ files that import the whole ASR collection.
#   * step nemo_full adds what `import nemo.collections.asr` needs (lightning, hydra, lhotse,
#     transformers, ...), with torch/numpy/numba held at the versions already installed:
#     benchmarks/check_nemo_install.py (NeMo's own RNNTLoss through
#     rnnt_lattice.compat.nemo.install()) and NeMo's test files need the full import.
# Nothing of the peers' code is written into the repository; the script only builds, in
# a temp dir under /tmp (removed after a successful build, kept after a failed one).
#
# Usage: bash benchmarks/setup_peers.sh [step ...]
#   steps: venv torch peers nemo_full fast_rnnt optimized_transducer self check  (default: all)
#   Re-running is cheap: pip skips what is installed; a built peer that imports is not
#   rebuilt unless FORCE_BUILD=1.
# Log: appended to benchmarks/.venv-peers/setup_peers.log (and printed).
# Takes ~10 min on the project machine (downloads ~3 GB, two C++ builds of ~2 min each).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
VENV="${PEERS_VENV:-$HERE/.venv-peers}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
BUILD_JOBS="${BUILD_JOBS:-2}"

TORCH_VER=2.9.1
TORCHVISION_VER=0.24.1
TORCHAUDIO_SPEC='torchaudio==2.9.*'
WARP_NUMBA_VER=0.4.1
FAST_RNNT_VER=1.3
OPT_TRANSDUCER_VER=1.4
NEMO_SPEC='nemo-toolkit==3.0.0'
# nemo.collections.asr.parts.numba.rnnt_loss itself imports only torch, numpy and numba.
# Its parents' __init__ files import the whole ASR collection (hydra, lightning, lhotse, ...),
# so peers.py imports the loss module with bare parent packages instead of installing those.
NEMO_DEPS=(numpy numba)
# `import nemo.collections.asr` (NeMo's RNNTLoss, its configs and test files): NeMo 3.0's
# runtime requirements that this import reaches, found by importing it with --no-deps.
NEMO_FULL_DEPS=("lightning<=2.4.0,>2.2.1" "hydra-core<=1.3.2,>1.3" "omegaconf<=2.3" torchmetrics
  nv-one-logger-core nv-one-logger-pytorch-lightning-integration
  nv-one-logger-training-telemetry lhotse urllib3 einops transformers sentencepiece pandas
  kaldialign librosa braceexpand webdataset text-unidecode tensorboard datasets wrapt onnx
  pytest)

STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(venv torch peers nemo_full fast_rnnt optimized_transducer self check)
want() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
log() { echo "[setup_peers $(date -u +%H:%M:%S)] $*"; }

mkdir -p "$VENV"
exec > >(tee -a "$VENV/setup_peers.log") 2>&1
log "steps: ${STEPS[*]}"

if want venv; then
  if [ ! -x "$PY" ]; then    # the folder may exist already (it holds the log)
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
  "${PIP[@]}" install -q --upgrade pip setuptools wheel
fi

if want torch; then
  log "torch $TORCH_VER + torchvision $TORCHVISION_VER (two steps, as machines/python.md says)"
  "${PIP[@]}" install "torch==$TORCH_VER" "torchvision==$TORCHVISION_VER"
  log "torchaudio"
  "${PIP[@]}" install "torch==$TORCH_VER" "$TORCHAUDIO_SPEC"
fi

if want peers; then
  log "warprnnt-numba, nemo (no deps) + minimal deps, build tools"
  "${PIP[@]}" install "torch==$TORCH_VER" "warprnnt-numba==$WARP_NUMBA_VER" "${NEMO_DEPS[@]}" \
      'pybind11<3' psutil
  "${PIP[@]}" install --no-deps "$NEMO_SPEC"
fi

if want nemo_full; then
  log "NeMo's full ASR import: ${NEMO_FULL_DEPS[*]}"
  # Hold what the other peers were built or measured with (the CUDA torch wheel, numpy, numba).
  cons="$(mktemp /tmp/nemo-constraints-XXXX.txt)"
  "$PY" - > "$cons" <<'PYCONS'
import importlib.metadata as md
for dist in ("torch", "torchvision", "torchaudio", "numpy", "numba", "llvmlite"):
    try:
        print(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        pass
PYCONS
  "${PIP[@]}" install -c "$cons" "${NEMO_FULL_DEPS[@]}"
  rm -f "$cons"
  "$PY" -c "import nemo.collections.asr.losses.rnnt as r; print('nemo.collections.asr imports:', r.__name__)"
fi

# Build one sdist CPU-only against the venv's torch. $1 = pip name, $2 = version, $3 = patch function
build_sdist() {
  local name="$1" ver="$2" patchfn="$3"
  if [ "${FORCE_BUILD:-0}" != 1 ] && "$PY" -c "import $name" 2>/dev/null; then
    log "$name already imports; skipping the build (FORCE_BUILD=1 to rebuild)"
    return 0
  fi
  local tmp; tmp="$(mktemp -d "/tmp/peer-$name-XXXX")"
  log "building $name==$ver in $tmp"
  "${PIP[@]}" download --no-binary :all: --no-deps -d "$tmp" "$name==$ver"
  (cd "$tmp" && tar xzf ./*.tar.gz)
  local src; src="$(find "$tmp" -maxdepth 1 -mindepth 1 -type d | head -1)"
  "$patchfn" "$src"
  # setup.py runs cmake through os.system: no ';' in these arguments.
  local pybind_cmake
  pybind_cmake="$("$PY" -c 'import pybind11;print(pybind11.get_cmake_dir())')"
  (cd "$src" && \
    FT_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DFT_WITH_CUDA=OFF -DFT_BUILD_TESTS=OFF -DCMAKE_CXX_STANDARD=17 -Dpybind11_DIR=$pybind_cmake" \
    OT_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DOT_WITH_CUDA=OFF -DOT_BUILD_TESTS=OFF -DCMAKE_CXX_STANDARD=17 -Dpybind11_DIR=$pybind_cmake" \
    MAKEFLAGS="-j$BUILD_JOBS" CMAKE_BUILD_PARALLEL_LEVEL="$BUILD_JOBS" \
    "${PIP[@]}" install --no-build-isolation --no-deps -v . ) || { log "FAILED to build $name (see log above)"; return 1; }
  log "built $name"
  rm -rf "$tmp"
}

# Both sdists share k2-fsa's CMake layout: cmake/pybind11.cmake fetches pybind11 from
# GitHub (unreachable here) and cmake/torch.cmake calls find_package(Torch), which for a
# CUDA torch wheel goes looking for a matching CUDA toolkit (the machine's nvcc is a
# different major version). Replace both with CPU-only equivalents:
#   C++14 -> C++17 (torch >= 2.1 headers need it), via -DCMAKE_CXX_STANDARD=17;
#   pybind11 -> find_package(pybind11 CONFIG) from the PyPI pybind11 package;
#   torch    -> the wheel's include dirs and libc10/libtorch_cpu/libtorch set directly,
#               with the wheel's C++ ABI flag and version. CUDA is off via {FT,OT}_WITH_CUDA=OFF.
write_cpu_cmake() {
  local src="$1"
  cat > "$src/cmake/pybind11.cmake" <<'CMAKE'
# Patched by rnnt_lattice/benchmarks/setup_peers.sh: use the installed PyPI pybind11.
set(PYBIND11_FINDPYTHON OFF)
find_package(pybind11 CONFIG REQUIRED)
message(STATUS "pybind11 from ${pybind11_DIR}; Python ${PYTHON_EXECUTABLE}")
CMAKE
  cat > "$src/cmake/torch.cmake" <<'CMAKE'
# Patched by rnnt_lattice/benchmarks/setup_peers.sh: CPU-only link against the torch wheel
# without find_package(Torch) (which probes CUDA for a CUDA wheel).
execute_process(
  COMMAND "${PYTHON_EXECUTABLE}" -c "import os,torch; print(os.path.dirname(torch.__file__))"
  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE TORCH_DIR)
execute_process(
  COMMAND "${PYTHON_EXECUTABLE}" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE TORCH_CXX11_ABI)
execute_process(
  COMMAND "${PYTHON_EXECUTABLE}" -c "import torch; print(torch.__version__)"
  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE TORCH_VERSION)
# optimized_transducer writes TORCH_VERSION into torch_version.py and checks it on import.
set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI}")
set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} ${TORCH_CXX_FLAGS}")
set(TORCH_INCLUDE_DIRS "${TORCH_DIR}/include" "${TORCH_DIR}/include/torch/csrc/api/include")
set(TORCH_LIBRARIES "${TORCH_DIR}/lib/libc10.so" "${TORCH_DIR}/lib/libtorch_cpu.so" "${TORCH_DIR}/lib/libtorch.so")
include_directories(${TORCH_INCLUDE_DIRS})
link_directories("${TORCH_DIR}/lib")
message(STATUS "torch ${TORCH_VERSION} at ${TORCH_DIR}, CXX11 ABI ${TORCH_CXX11_ABI} (CPU-only link)")
CMAKE
}
patch_fast_rnnt() { write_cpu_cmake "$1"; }
patch_optimized_transducer() {
  write_cpu_cmake "$1"
  # Its top CMakeLists pins C++14 with a plain set(), which -D cannot override.
  sed -i 's/^set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$1/CMakeLists.txt"
}

if want fast_rnnt; then
  build_sdist fast_rnnt "$FAST_RNNT_VER" patch_fast_rnnt || true
fi
if want optimized_transducer; then
  build_sdist optimized_transducer "$OPT_TRANSDUCER_VER" patch_optimized_transducer || true
fi

if want self; then
  log "rnnt_lattice (editable, no deps) + numba"
  "${PIP[@]}" install "torch==$TORCH_VER" numpy numba
  "${PIP[@]}" install --no-deps -e "$ROOT"
fi

if want check; then
  log "import check"
  (cd "$HERE" && "$PY" peers.py --list) || true
fi
log "done"
