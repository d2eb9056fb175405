#!/usr/bin/env bash
# Builds what the GPU machine runs (it has no Rust toolchain) into stage/ (git-ignored):
#   stage/bin/<binary>           every binary target of the workspace, release
#   stage/tests/<pkg>.<target>   every test executable of the workspace, release
#                                (<pkg>.lib = a library's unit tests, <pkg>.bin-<name> = a
#                                binary's unit tests, <pkg>.<name> = tests/<name>.rs)
#   stage/MANIFEST               git revision, toolchain and what was staged
# New crates, binaries and tests are picked up by themselves (cargo's JSON messages list them).
# Debug info is left out and symbols kept (panics still name functions), so that stage/ stays
# well under the 64 MiB a device run may carry. Then, on the GPU machine: scripts/gpu-run.sh
# (with "stage" in the run's carry list).
#
# usage: scripts/stage.sh            (CARGO_BUILD_JOBS etc. are honoured)
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_PROFILE_RELEASE_DEBUG=0
export CARGO_PROFILE_RELEASE_STRIP=debuginfo
export CARGO_TERM_COLOR=never

rm -rf stage
mkdir -p stage/bin stage/tests
bin_json=$(mktemp)
test_json=$(mktemp)
trap 'rm -f "$bin_json" "$test_json"' EXIT

echo "== cargo build --release --workspace --bins" >&2
cargo build --release --workspace --bins --message-format=json-render-diagnostics >"$bin_json"
echo "== cargo test --release --workspace --no-run" >&2
cargo test --release --workspace --no-run --message-format=json-render-diagnostics >"$test_json"

# Package names by manifest path, so executables are named after their package.
metadata=$(cargo metadata --no-deps --format-version 1)

python3 - "$bin_json" "$test_json" "$metadata" <<'PY'
import json
import os
import shutil
import sys

bin_json, test_json, metadata = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
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
        dst = os.path.join("stage/bin", msg["target"]["name"])
        shutil.copy2(msg["executable"], dst)
        staged.append(dst)

names = set()
for msg in artifacts(test_json):
    if not msg["profile"]["test"]:
        continue
    pkg = pkg_by_manifest.get(msg["manifest_path"], "unknown")
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
    dst = os.path.join("stage/tests", name)
    shutil.copy2(msg["executable"], dst)
    staged.append(dst)

with open("stage/MANIFEST", "a") as f:
    for path in sorted(staged):
        f.write(f"{path} {os.path.getsize(path)}\n")
print(f"staged {len(staged)} executables", file=sys.stderr)
PY

{
    if rev=$(git rev-parse HEAD 2>/dev/null); then
        git diff --quiet HEAD 2>/dev/null || rev="$rev (with uncommitted changes)"
    else
        rev=unknown
    fi
    echo "revision $rev"
    echo "toolchain $(rustc --version)"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on glibc $(ldd --version | head -1 | awk '{print $NF}')"
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
