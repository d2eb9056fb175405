#!/usr/bin/env bash
# Builds what the GPU machine runs (it has no Rust toolchain) into stage/ (git-ignored):
#   stage/bin/<binary>           every binary target of the workspace, release
#   stage/bin/graft-baselines    graft-cli's bench target: `graft` with the raw-graph
#                                baselines (graft-core's token for tests and benchmarks)
#   stage/tests/<pkg>.<target>   every test executable of the workspace, release
#                                (<pkg>.lib = a library's unit tests, <pkg>.bin-<name> = a
#                                binary's unit tests, <pkg>.<name> = tests/<name>.rs)
#   stage/MANIFEST               git revision, toolchain and what was staged
# New crates, binaries and tests are picked up by themselves (cargo's JSON messages list them).
# Debug info is left out and symbols kept (panics still name functions), and every executable
# is xz-packed (as <name>.xz; gpu-run.sh unpacks them), so that stage/ stays well under the
# 64 MiB a device run may carry. Then, on the GPU machine: scripts/gpu-run.sh
# (with "stage" in the run's carry list).
#
# With --candle-cuda (or GRAFT_STAGE_CANDLE_CUDA=1) it also builds the candle crates
# (graft-candle, graft-candle-models, graft-candle-train, graft-candle-bench,
# graft-candle-kernels, graft-serve) with their `cuda`
# feature (candle's CUDA backend, linked against CUDA at build time) in a separate cargo
# invocation, after sourcing scripts/cuda-build-env.sh (first run: pip wheels and stubs into
# its cache), in that cache's target folder (GRAFT_CUDA_TARGET, shared with CI's
# scripts/check-candle-cuda.sh, same release profile: nvcc compiles candle's kernels once per
# machine, ~15 min cold on 2 cores), and stages those executables (the GPU tests of each crate,
# stage/tests/graft-candle_cuda.gpu, graft-candle-models_cuda.gpu, graft-candle-train_cuda.gpu
# and graft-candle-kernels_cuda.gpu, and graft-candle-bench's binaries, stage/bin/graft-candle-bench_cuda,
# stage/bin/graft-candle-ports_cuda and so on, and graft-serve's server,
# stage/bin/graft-serve_cuda) with "_cuda" added, xz-compressed (each
# is 48 to 62 MiB, mostly candle's PTX, and packs to about 5 MiB; gpu-run.sh unpacks them).
# Each is checked to carry no RUNPATH into the stub folder. Every candle binary at once packs
# to more than a device run carries beside the rest: --candle-bins NAMES (comma-separated
# binary names, or GRAFT_STAGE_CANDLE_BINS) stages only those.
#
# usage: scripts/stage.sh [--candle-cuda] [--candle-bins NAMES]   (CARGO_BUILD_JOBS etc. are honoured)
set -euo pipefail
cd "$(dirname "$0")/.."

candle_cuda=${GRAFT_STAGE_CANDLE_CUDA:-0}
candle_bins=${GRAFT_STAGE_CANDLE_BINS:-}
while (($#)); do
    case $1 in
        --candle-cuda) candle_cuda=1 ;;
        --candle-bins) candle_bins=$2; candle_cuda=1; shift ;;
        -h | --help) sed -n '2,29p' "$0"; exit 0 ;;
        *) echo "stage.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

export CARGO_PROFILE_RELEASE_DEBUG=0
export CARGO_PROFILE_RELEASE_STRIP=debuginfo
export CARGO_TERM_COLOR=never

rm -rf stage
mkdir -p stage/bin stage/tests
bin_json=$(mktemp)
test_json=$(mktemp)
bench_json=$(mktemp)
cuda_bin_json=$(mktemp)
cuda_test_json=$(mktemp)
stager=$(mktemp)
trap 'rm -f "$bin_json" "$test_json" "$bench_json" "$cuda_bin_json" "$cuda_test_json" "$stager"' EXIT

echo "== cargo build --release --workspace --bins" >&2
cargo build --release --workspace --bins --message-format=json-render-diagnostics >"$bin_json"
# The candle crates' plain build is candle on the CPU, tested by CI: nothing in it needs a GPU
# (their GPU tests are the --candle-cuda build's), and its executables would only add megabytes.
candle_crates=(graft-candle graft-candle-models graft-candle-train graft-candle-bench graft-candle-kernels graft-serve)
excluded=()
for crate in "${candle_crates[@]}"; do excluded+=(--exclude "$crate"); done
echo "== cargo test --release --workspace ${excluded[*]} --no-run" >&2
cargo test --release --workspace "${excluded[@]}" --no-run \
    --message-format=json-render-diagnostics >"$test_json"
# The raw-graph baselines live only where graft-core's token for tests and benchmarks may be
# made: graft-cli's bench target (bench profile = release).
echo "== cargo bench -p graft-cli --bench graft-baselines --no-run" >&2
cargo bench -p graft-cli --bench graft-baselines --no-run \
    --message-format=json-render-diagnostics >"$bench_json"

# Package names by manifest path, so executables are named after their package.
metadata=$(cargo metadata --no-deps --format-version 1)

# Copies the executables of one build (its two JSON message files) into stage/, named after
# their package plus a suffix, and lists them in stage/MANIFEST.
cat >"$stager" <<'PY'
import json
import os
import shutil
import sys

bin_json, test_json, metadata = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
suffix = sys.argv[4]
staged_list = sys.argv[5] if len(sys.argv) > 5 else None
pkg_by_manifest = {p["manifest_path"]: p["name"] for p in metadata["packages"]}


def artifacts(path):
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if msg.get("reason") == "compiler-artifact" and msg.get("executable"):
                yield msg


staged = []
for msg in artifacts(bin_json):
    if "bin" in msg["target"]["kind"] and not msg["profile"]["test"]:
        dst = os.path.join("stage/bin", msg["target"]["name"] + suffix)
        shutil.copy2(msg["executable"], dst)
        staged.append(dst)

names = set()
for msg in artifacts(test_json):
    if not msg["profile"]["test"]:
        continue
    pkg = pkg_by_manifest.get(msg["manifest_path"], "unknown") + suffix
    kind, target = msg["target"]["kind"], msg["target"]["name"]
    if "lib" in kind or "rlib" in kind or "cdylib" in kind or "proc-macro" in kind:
        name = f"{pkg}.lib"
    elif "bin" in kind:
        name = f"{pkg}.bin-{target}"
    else:
        name = f"{pkg}.{target}"
    if name in names:
        sys.exit(f"stage.sh: two test executables would be named {name}")
    names.add(name)
    if os.path.exists(os.path.join("stage/tests", name)):
        sys.exit(f"stage.sh: a test executable named {name} was staged already")
    dst = os.path.join("stage/tests", name)
    shutil.copy2(msg["executable"], dst)
    staged.append(dst)

with open("stage/MANIFEST", "a") as f:
    for path in sorted(staged):
        f.write(f"{path} {os.path.getsize(path)}\n")
if staged_list:
    with open(staged_list, "w") as f:
        f.writelines(path + "\n" for path in staged)
print(f"staged {len(staged)} executables", file=sys.stderr)
PY
plain_staged=$(mktemp)
python3 "$stager" "$bin_json" "$test_json" "$metadata" "" "$plain_staged"
# graft-baselines beside the binaries (its --procs ranks are copies of itself).
python3 - "$bench_json" "$plain_staged" <<'PY'
import json
import os
import shutil
import sys

for line in open(sys.argv[1]):
    msg = json.loads(line) if line.startswith("{") else {}
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") \
            and "bench" in msg["target"]["kind"]:
        dst = os.path.join("stage/bin", msg["target"]["name"])
        shutil.copy2(msg["executable"], dst)
        with open("stage/MANIFEST", "a") as f:
            f.write(f"{dst} {os.path.getsize(dst)}\n")
        with open(sys.argv[2], "a") as f:
            f.write(dst + "\n")
PY
# Every executable is xz-packed (about 4x smaller; gpu-run.sh unpacks them on the GPU machine),
# so that the workspace's ~50 MiB of executables and candle's CUDA build fit in one carry.
while IFS= read -r exe; do
    xz -T0 -6 -f "$exe"
    echo "$exe.xz $(stat -c %s "$exe.xz")" >>stage/MANIFEST
done <"$plain_staged"
rm -f "$plain_staged"

if ((candle_cuda)); then
    # A separate invocation: candle's CUDA backend needs cudarc's dynamic-linking, the rest of
    # the workspace its dynamic-loading, and cargo unifies features over one build.
    # shellcheck source=scripts/cuda-build-env.sh
    source scripts/cuda-build-env.sh
    [[ -n ${GRAFT_CUDA_STUBS:-} ]] || { echo "stage.sh: the CUDA build environment failed" >&2; exit 1; }
    # The cache's target folder, where scripts/check-candle-cuda.sh (CI) checks the same build
    # with this script's release profile (exported above): candle's kernels are compiled once.
    export CARGO_TARGET_DIR=$GRAFT_CUDA_TARGET
    bins=(--bins)
    if [[ -n $candle_bins ]]; then
        bins=()
        IFS=, read -ra names <<<"$candle_bins"
        for name in "${names[@]}"; do bins+=(--bin "$name"); done
    fi
    echo "== cargo build --release -p graft-candle-bench -p graft-serve --features cuda ${bins[*]}" >&2
    cargo build --release -p graft-candle-bench -p graft-serve --features cuda "${bins[@]}" \
        --message-format=json-render-diagnostics >"$cuda_bin_json"
    # Only the GPU tests (each crate's tests/gpu.rs, which also run the guide's examples): the
    # crates' other test executables run on the CPU in CI, and each CUDA executable carries
    # ~40 MiB of candle's PTX.
    tested=(-p graft-candle -p graft-candle-models -p graft-candle-train -p graft-candle-kernels)
    # graft-candle-models' tensor-parallel GPU tests need its `nccl` feature.
    echo "== cargo test --release ${tested[*]} --features cuda,graft-candle-models/nccl --test gpu --no-run" >&2
    cargo test --release "${tested[@]}" --features cuda,graft-candle-models/nccl --test gpu --no-run \
        --message-format=json-render-diagnostics >"$cuda_test_json"
    cuda_staged=$(mktemp)
    python3 "$stager" "$cuda_bin_json" "$cuda_test_json" "$metadata" "_cuda" "$cuda_staged"
    # The stubs serve the linker only: no executable may carry a RUNPATH/RPATH (or any path)
    # into the stub folder, which would shadow the real libraries on the GPU machine.
    while IFS= read -r exe; do
        dynamic=$(readelf -d "$exe")
        if grep -E 'RPATH|RUNPATH' <<<"$dynamic" | grep -qF "$GRAFT_CUDA_STUBS"; then
            echo "stage.sh: $exe has a RUNPATH into the stub folder $GRAFT_CUDA_STUBS" >&2
            exit 1
        fi
        needed=$(sed -nE 's/.*\(NEEDED\).*\[(.*)\]/\1/p' <<<"$dynamic" | tr '\n' ' ')
        echo "$exe needs: $needed" >&2
        echo "$exe: $(($(stat -c %s "$exe") / 1024 / 1024)) MiB, packing with xz" >&2
        xz -T0 -6 -f "$exe"
        echo "$exe.xz $(stat -c %s "$exe.xz")" >>stage/MANIFEST
    done <"$cuda_staged"
    rm -f "$cuda_staged"
fi

{
    if rev=$(git rev-parse HEAD 2>/dev/null); then
        git diff --quiet HEAD 2>/dev/null || rev="$rev (with uncommitted changes)"
    else
        rev=unknown
    fi
    echo "revision $rev"
    echo "toolchain $(rustc --version)"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on glibc $(ldd --version | head -1 | awk '{print $NF}')"
    if ((candle_cuda)); then
        echo "candle-cuda $(nvcc --version | grep -o 'release [0-9.]*'), CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
    fi
} >stage/MANIFEST.head
cat stage/MANIFEST.head stage/MANIFEST >stage/MANIFEST.tmp
mv stage/MANIFEST.tmp stage/MANIFEST
rm stage/MANIFEST.head

size_kib=$(du -sk stage | cut -f1)
echo "stage/: $((size_kib / 1024)) MiB" >&2
if ((size_kib > 60 * 1024)); then
    echo "stage.sh: stage/ is over 60 MiB; a device run carries at most 64 MiB in all" >&2
    exit 1
fi
