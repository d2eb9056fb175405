#!/usr/bin/env python3
"""Regenerates crates/graft-cuda/src/kernels.ptx from kernels.cu with NVRTC (no GPU needed).

graft-cuda compiles kernels.cu with NVRTC at run time; the PTX checked in here is its fallback
when libnvrtc cannot be loaded (or its PTX is too new for the driver). Run this after editing
kernels.cu. It needs a libnvrtc: a CUDA toolkit's, or the one in PyPI's nvidia-cuda-nvrtc-cu12
wheel (unzip it anywhere and pass --lib .../nvidia/cuda_nvrtc/lib/libnvrtc.so.12).

The target is compute_75 (the oldest architecture CUDA 13 still builds for); the driver JIT
compiles it for the GPU at hand. Use an NVRTC no newer than the oldest driver you support: the
PTX ISA version it writes must be one the driver knows (NVRTC 12.4 writes ISA 8.4, driver >= 550).
"""
import argparse
import ctypes
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "crates/graft-cuda/src/kernels.cu"
OUT = ROOT / "crates/graft-cuda/src/kernels.ptx"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default="libnvrtc.so", help="path or name of libnvrtc")
    ap.add_argument("--arch", default="compute_75")
    ap.add_argument("--check", action="store_true", help="fail if kernels.ptx is out of date")
    args = ap.parse_args()

    nvrtc = ctypes.CDLL(args.lib)
    prog = ctypes.c_void_p()
    src = SRC.read_bytes()

    def ok(rc: int, what: str) -> None:
        if rc != 0:
            nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise SystemExit(f"{what} failed: {nvrtc.nvrtcGetErrorString(rc).decode()}")

    ok(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"graft_kernels.cu", 0, None, None),
       "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={args.arch}".encode()]
    c_opts = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), c_opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    ok(rc, "nvrtcCompileProgram")
    ok(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
    ptx = ctypes.create_string_buffer(size.value)
    ok(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))

    text = ptx.value.decode()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date; run {pathlib.Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
