#!/usr/bin/env bash
# Runs on the GPU machine (no Rust toolchain there), from the repository root, over what
# scripts/stage.sh built into stage/:
#   1. prints the GPUs (nvidia-smi -L) and the driver version;
#   2. runs every staged test executable with --include-ignored (the GPU tests are #[ignore]d
#      for CI) and --test-threads=1;
#   3. with --sanitize, runs them again under compute-sanitizer, memcheck then racecheck, with
#      GRAFT_UNDER_SANITIZER=1 in their environment: the long GPU tests then loop only a few
#      times (graft_testkit::steps; the candle crates' tests/gpu.rs have their own), since the
#      sanitizer slows every launch down by orders of magnitude;
#   4. runs each bench command given as an argument (one shell command per argument).
# Everything runs even after a failure; the exit status is non-zero if anything failed. A
# summary table comes last. If $OUT is set, the whole log goes to $OUT/gpu-run.log and the
# summary to $OUT/summary.txt.
#
# usage: scripts/gpu-run.sh [--sanitize] [--tests REGEX] [--timeout SECS] [--skip NAME] [BENCH_COMMAND...]
#   --tests REGEX    only test executables whose name matches (default: all)
#   --timeout SECS   per executable and per bench command (default 300)
#   --skip NAME      passed to every test executable as libtest's --skip (repeatable)
# e.g.   scripts/gpu-run.sh --sanitize --tests 'graft-cuda' 'stage/bin/graft bench --quick'
#        scripts/gpu-run.sh --tests 'graft-cli' 'stage/bin/graft-baselines bench micro'
# (stage/bin/graft-baselines: `graft` with the raw-graph baselines, staged by stage.sh)
set -uo pipefail
cd "$(dirname "$0")/.."

sanitize=0
tests_re='.'
timeout_s=300
skips=()
benches=()
while (($#)); do
    case $1 in
        --sanitize) sanitize=1 ;;
        --tests) tests_re=$2; shift ;;
        --timeout) timeout_s=$2; shift ;;
        --skip) skips+=(--skip "$2"); shift ;;
        --) shift; benches+=("$@"); break ;;
        -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
        *) benches+=("$1") ;;
    esac
    shift
done

log=/dev/null
summary_file=/dev/null
if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    log=$OUT/gpu-run.log
    summary_file=$OUT/summary.txt
    : >"$log"
fi
say() { echo "$@" | tee -a "$log"; }

# The CUDA libraries: libcuda from the driver, libnvrtc from the toolkit. cudarc looks for
# libnvrtc.so (and .so.12/.11/...); graft-cuda falls back to shipped PTX if it is missing.
for dir in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [[ -d $dir ]] && export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# NCCL (graft-cuda's `nccl` feature): cudarc opens libnccl.so, but pip's wheel (what PyTorch
# brings) ships only libnccl.so.2, so link one in a scratch folder on LD_LIBRARY_PATH.
# NVLink multicast stays off: on shared hosts it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0
# graft's NcclComm requires ranks connected at init (see NcclComm::init_all).
export NCCL_RUNTIME_CONNECT=0
nccl_so=$( (ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnccl\.so\.2$'; \
    find /usr/local /usr/lib /opt -name 'libnccl.so.2' 2>/dev/null) | head -1)
if [[ -n $nccl_so ]]; then
    nccl_dir=$(mktemp -d)
    ln -s "$nccl_so" "$nccl_dir/libnccl.so"
    export LD_LIBRARY_PATH="$nccl_dir:$(dirname "$nccl_so")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

rows=()
failed=0
# run PHASE NAME COMMAND...: runs one step, logs it, records a summary row.
run() {
    local phase=$1 name=$2
    shift 2
    say ""
    say "===== [$phase] $name: $*"
    local start end rc out
    start=$(date +%s.%N)
    out=$(mktemp)
    timeout --kill-after=10 "$timeout_s" "$@" 2>&1 | tee -a "$log" | tee "$out"
    rc=${PIPESTATUS[0]}
    end=$(date +%s.%N)
    local secs counts status
    secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
    # libtest's closing line: "test result: ok. 12 passed; 0 failed; 3 ignored; ..."
    counts=$(grep -E '^test result:' "$out" | tail -1 |
        sed -E 's/.* ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1\/\2\/\3/')
    [[ -z $counts ]] && counts=-
    if ((rc == 0)); then
        status=ok
    elif [[ $phase != test ]] && grep -q 'terminated before first instrumented API call' "$out"; then
        # The executable never called CUDA (simulator-only tests): nothing to sanitize.
        status=no-cuda
    elif ((rc == 124 || rc == 137)); then
        status=TIMEOUT
        failed=1
    else
        status="FAIL($rc)"
        failed=1
    fi
    rows+=("$(printf '%-10s %-40s %-10s %-12s %8s' "$phase" "$name" "$status" "$counts" "$secs")")
    rm -f "$out"
}

say "===== gpu-run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ)"
[[ -f stage/MANIFEST ]] && head -3 stage/MANIFEST | tee -a "$log"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L 2>&1 | tee -a "$log"
    say "driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -1)"
else
    say "nvidia-smi not found"
fi
say "libnvrtc: $( (ldconfig -p 2>/dev/null | grep -o 'libnvrtc\.so[^ ]*' | sort -u | tr '\n' ' ') || true)"
say "libnccl: ${nccl_so:-NOT FOUND} (NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE NCCL_RUNTIME_CONNECT=$NCCL_RUNTIME_CONNECT)"
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
# The candle crates' CUDA executables (stage.sh --candle-cuda) link these by soname (CUDA 13).
if compgen -G 'stage/*/*_cuda*' >/dev/null; then
    for lib in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13; do
        where=$( (IFS=:; for dir in ${LD_LIBRARY_PATH:-}; do [[ -e $dir/$lib ]] && echo "$dir" && break; done) )
        [[ -z $where ]] && where=$(ldconfig -p 2>/dev/null | grep -F "$lib " | head -1 | sed 's/.*=> //')
        say "candle CUDA build needs $lib: ${where:-NOT FOUND}"
    done
fi

# scripts/stage.sh --candle-cuda stages the large candle CUDA executables xz-compressed.
for packed in stage/bin/*.xz stage/tests/*.xz; do
    [[ -e $packed ]] || continue
    if xz -d -f "$packed"; then say "unpacked $packed"; else say "could not unpack $packed (xz)"; fi
done

tests=()
if [[ -d stage/tests ]]; then
    while IFS= read -r exe; do
        [[ $(basename "$exe") =~ $tests_re ]] && tests+=("$exe")
    done < <(find stage/tests -maxdepth 1 -type f -perm -u+x | sort)
fi
if ((${#tests[@]} == 0)); then
    say "no staged test executables (run scripts/stage.sh here first, and carry stage/)"
    failed=1
fi

for exe in "${tests[@]}"; do
    run test "$(basename "$exe")" "$exe" --include-ignored --test-threads=1 "${skips[@]}"
done

if ((sanitize)); then
    if [[ -x $sanitizer ]]; then
        # --report-api-errors no: the tests provoke CUDA API errors on purpose (capture
        # violations); only memory errors and races should fail the run.
        for tool in memcheck racecheck; do
            for exe in "${tests[@]}"; do
                run "$tool" "$(basename "$exe")" env GRAFT_UNDER_SANITIZER=1 "$sanitizer" \
                    --tool "$tool" --error-exitcode 1 --report-api-errors no \
                    "$exe" --include-ignored --test-threads=1 "${skips[@]}"
            done
        done
    else
        say "compute-sanitizer not found; --sanitize skipped"
        rows+=("$(printf '%-10s %-40s %-10s' sanitize compute-sanitizer MISSING)")
        failed=1
    fi
fi

i=0
for cmd in "${benches[@]}"; do
    i=$((i + 1))
    run bench "bench$i: ${cmd:0:33}" bash -c "$cmd"
done

{
    echo ""
    echo "===== summary (passed/failed/ignored)"
    printf '%-10s %-40s %-10s %-12s %8s\n' phase name result p/f/i secs
    for row in "${rows[@]}"; do echo "$row"; done
    if ((failed)); then echo "RESULT: FAILED"; else echo "RESULT: ok"; fi
} | tee -a "$log" | tee "$summary_file"
exit "$failed"
