#!/usr/bin/env bash
# The build environment for the candle crates' `cuda` feature (candle's CUDA backend) on a machine
# with no CUDA toolkit, no driver and no GPU, such as CI or the staging machine:
#   source scripts/cuda-build-env.sh
#   cargo build -p graft-candle-bench --features cuda
# Run (not sourced) it prints the environment as `export` lines instead.
#
# candle-core's `cuda` feature needs, at build time:
#   - nvcc (candle-kernels compiles its PTX and a static kernel library through cudaforge),
#     with its cicc/ptxas, the CUDA headers (runtime, crt, cccl) and libcudart;
#   - the libraries cudarc links with `dynamic-linking`: libcuda, libcublas, libcublasLt,
#     libcurand, libnvrtc and libcudart, and libnccl (graft-cuda's `nccl`, for graft-candle's
#     tensor parallelism).
# This script installs NVIDIA's pip wheels of CUDA 13.0 (every version pinned below) and makes
# link-time stubs of the other libraries, all in a cache folder outside the clone:
#   ${GRAFT_CUDA_CACHE:-$HOME/.cache/graft-cuda-build}/
#     wheels-<key>/nvidia/cu13/   the toolkit pieces (CUDA_ROOT: bin/nvcc, include/, lib/)
#     stubs-<key>/                libcuda.so.1, libcublas.so.13, libcublasLt.so.13,
#                                 libcurand.so.10, libnvrtc.so.13, libnccl.so.2 (stubs with the real sonames,
#                                 every function cudarc declares, each aborting if ever called),
#                                 the unversioned .so links, and libcudart.so -> the wheel's
#     target/                     the cargo target folder of this build (GRAFT_CUDA_TARGET),
#                                 which scripts/check-candle-cuda.sh and scripts/stage.sh
#                                 --candle-cuda share, so candle's kernels compile once
# where <key> changes with the pins (and, for the stubs, with cudarc's version), so a second
# run only exports. The stubs are found through LIBRARY_PATH, i.e. by the linker only: nothing
# puts them in an executable's RUNPATH, so on a GPU machine the loader finds the real libraries
# (driver folder, /usr/local/cuda/lib64 or LD_LIBRARY_PATH) by their sonames.
#
# Needs: python3 with pip (network to PyPI on the first run), cc, cargo (to locate cudarc's
# sources, fetched if missing). Environment it reads: GRAFT_CUDA_CACHE, CUDA_COMPUTE_CAP
# (default 90, the H100/H200), PYTHON (default python3).

_graft_cuda_env() {
    local repo
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
    local cache=${GRAFT_CUDA_CACHE:-$HOME/.cache/graft-cuda-build}
    local python=${PYTHON:-python3}
    # CUDA 13.0 (the GPU machines' driver is CUDA 13.0: PTX of a newer nvcc would not load
    # there). nvidia-nvvm is pinned too: the nvcc wheel alone would pull the newest nvvm, whose
    # PTX the 13.0 ptxas rejects. Installed with --no-deps, so this list is the whole set.
    local wheels=(
        nvidia-cuda-nvcc==13.0.88
        nvidia-nvvm==13.0.88
        nvidia-cuda-crt==13.0.88
        nvidia-cuda-runtime==13.0.96
        nvidia-cuda-cccl==13.0.85
    )
    local key
    key=$(printf '%s\n' "${wheels[@]}" | sha256sum | cut -c1-12)
    local wheel_dir=$cache/wheels-$key
    local cuda_root=$wheel_dir/nvidia/cu13

    if [[ ! -f $wheel_dir/.complete ]]; then
        echo "cuda-build-env: installing ${wheels[*]} into $wheel_dir" >&2
        rm -rf "$wheel_dir" "$wheel_dir.tmp"
        mkdir -p "$cache"
        "$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
            --target "$wheel_dir.tmp" "${wheels[@]}" >&2 || return 1
        mv "$wheel_dir.tmp" "$wheel_dir" || return 1
        touch "$wheel_dir/.complete"
    fi
    if [[ ! -x $cuda_root/bin/nvcc ]]; then
        echo "cuda-build-env: no nvcc at $cuda_root/bin/nvcc (the wheels' layout changed?)" >&2
        return 1
    fi

    # The stubs: every function cudarc's sys modules declare for each library, taken from
    # the cudarc the lock file selects (so the list follows a cudarc upgrade by itself).
    local cudarc_src
    cudarc_src=$(cd "$repo" && cargo metadata --format-version 1 |
        "$python" -c 'import json, os, sys
m = json.load(sys.stdin)
print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"] == "cudarc"))') ||
        { echo "cuda-build-env: cannot locate cudarc's sources (cargo metadata)" >&2; return 1; }
    # library, soname, cudarc sys module, symbol prefix (a regex); libnccl for graft-cuda's
    # `nccl` feature, which graft-candle's `cuda` feature turns on (tensor parallelism).
    local specs=(
        "cuda libcuda.so.1 driver cu[A-Z]"
        "cublas libcublas.so.13 cublas cublas[^L]"
        "cublasLt libcublasLt.so.13 cublaslt cublasLt"
        "curand libcurand.so.10 curand curand"
        "nvrtc libnvrtc.so.13 nvrtc nvrtc"
        "nccl libnccl.so.2 nccl nccl"
    )
    local stub_key
    stub_key=$(printf '%s\n' "$key" "$cudarc_src" "${specs[@]}" | sha256sum | cut -c1-12)
    local stub_dir=$cache/stubs-$stub_key
    if [[ ! -f $stub_dir/.complete ]]; then
        echo "cuda-build-env: generating link-time stubs from $cudarc_src into $stub_dir" >&2
        rm -rf "$stub_dir"
        mkdir -p "$stub_dir" || return 1
        local spec lib soname sys prefix
        for spec in "${specs[@]}"; do
            read -r lib soname sys prefix <<<"$spec"
            {
                echo '/* Link-time stub generated by scripts/cuda-build-env.sh: never load it. */'
                echo '#include <stdio.h>'
                echo '#include <stdlib.h>'
                echo 'static void stub_called(const char *name) {'
                echo "    fprintf(stderr, \"$soname: %s called in graft's link-time stub; \""
                echo '            "the real CUDA library must be found at run time\n", name);'
                echo '    abort();'
                echo '}'
                grep -ohE "^[[:space:]]+fn ${prefix}[A-Za-z0-9_]*\(" "$cudarc_src/src/$sys/sys/mod.rs" |
                    sed -E 's/^[[:space:]]+fn //; s/\($//' | sort -u |
                    sed -E 's/.*/void &(void) { stub_called("&"); }/'
            } >"$stub_dir/$lib.c" || return 1
            if ! grep -q '(void) { stub_called' "$stub_dir/$lib.c"; then
                echo "cuda-build-env: found no $lib functions in $cudarc_src/src/$sys/sys/mod.rs" >&2
                return 1
            fi
            cc -shared -fPIC -O1 -Wl,-soname,"$soname" -o "$stub_dir/$soname" "$stub_dir/$lib.c" ||
                return 1
            ln -sf "$soname" "$stub_dir/lib$lib.so"
        done
        # libcudart is real (candle's static kernels call it), from the runtime wheel.
        if [[ ! -f $cuda_root/lib/libcudart.so.13 ]]; then
            echo "cuda-build-env: no libcudart.so.13 in $cuda_root/lib" >&2
            return 1
        fi
        ln -sf "$cuda_root/lib/libcudart.so.13" "$stub_dir/libcudart.so"
        touch "$stub_dir/.complete"
    fi

    export CUDA_ROOT=$cuda_root
    export CUDA_HOME=$cuda_root
    export NVCC=$cuda_root/bin/nvcc
    export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
    case ":$PATH:" in *":$cuda_root/bin:"*) ;; *) export PATH=$cuda_root/bin:$PATH ;; esac
    case ":${LIBRARY_PATH:-}:" in
        *":$stub_dir:"*) ;;
        *) export LIBRARY_PATH=$stub_dir${LIBRARY_PATH:+:$LIBRARY_PATH} ;;
    esac
    # Where the stubs are, for scripts that check what an executable links (scripts/stage.sh).
    export GRAFT_CUDA_STUBS=$stub_dir
    # The target folder the scripts build this in (not set as CARGO_TARGET_DIR here, so that
    # sourcing this leaves a shell's other builds where they were).
    export GRAFT_CUDA_TARGET=$cache/target
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    # Run, not sourced: print the environment to eval or copy.
    set -euo pipefail
    _graft_cuda_env
    for var in CUDA_ROOT CUDA_HOME NVCC CUDA_COMPUTE_CAP PATH LIBRARY_PATH GRAFT_CUDA_STUBS \
        GRAFT_CUDA_TARGET; do
        printf 'export %s=%q\n' "$var" "${!var}"
    done
else
    _graft_cuda_env || {
        echo "cuda-build-env: failed; the environment is not (fully) set" >&2
        return 1
    }
fi
