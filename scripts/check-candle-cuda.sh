#!/usr/bin/env bash
# Type-checks the `cuda` feature of every candle crate (graft-candle's src/cuda, the models,
# training, the fused kernels (graft-candle-kernels) and their GPU tests, graft-candle-bench's
# binaries, over candle's CUDA backend) with
# clippy, in one cargo invocation, on a machine with no CUDA toolkit and no GPU; .ci/run runs
# it after the workspace clippy. The toolkit pieces come from
# scripts/cuda-build-env.sh (pinned nvcc wheels and link stubs in a cache outside the clone).
#
# Its own cargo invocation: candle's CUDA backend needs cudarc's dynamic-linking, the rest of
# the workspace its dynamic-loading, and cargo unifies features over one build. It builds in
# the cache's target folder (GRAFT_CUDA_TARGET), so candle's kernels (minutes of nvcc) compile
# once per machine, and with the release profile exactly as scripts/stage.sh --candle-cuda
# builds it (no debuginfo, stripped): cargo keeps a build script's output per profile
# (debuginfo and strip included), so any difference would compile the kernels a second time.
#
# usage: scripts/check-candle-cuda.sh      (prints how long it took; GRAFT_CUDA_CACHE honoured)
set -euo pipefail
cd "$(dirname "$0")/.."

start=$(date +%s)
# shellcheck source=scripts/cuda-build-env.sh
source scripts/cuda-build-env.sh
export CARGO_TARGET_DIR=$GRAFT_CUDA_TARGET
# scripts/stage.sh's release profile.
export CARGO_PROFILE_RELEASE_DEBUG=0
export CARGO_PROFILE_RELEASE_STRIP=debuginfo
# graft-candle-bench turns on graft-candle's `nccl` (tensor parallelism) for this build.
cargo clippy -p graft-candle -p graft-candle-models -p graft-candle-train -p graft-candle-bench \
    -p graft-candle-kernels -p graft-serve \
    --features cuda,graft-candle-models/nccl --all-targets --release -- -D warnings
# The server alone: CUDA without NCCL (tensor parallelism's stand-in under CUDA).
cargo clippy -p graft-serve --features cuda --all-targets --release -- -D warnings
echo "check-candle-cuda: clippy of the candle crates --features cuda took $(($(date +%s) - start)) s" \
    "(target folder $CARGO_TARGET_DIR)"
