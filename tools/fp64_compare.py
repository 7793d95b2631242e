#!/usr/bin/env python3
"""Compares a golden's prefill logits with the fp32 engine's and the fp64 evaluation of the same formulas
(dumps written by tools/fp64_check.sh), judged by golden.json's tolerance |a - b| <= atol + rtol * |b|.

    fp64_compare.py DUMPS GOLDEN_DIR...      (DUMPS/<golden name>/{32,64}/prompt<i>.f32)

Prints, per prompt, max |a - b| and how many logits break the tolerance for golden vs fp64, fp32 vs fp64 and
fp32 vs golden. Where the golden is within tolerance of fp64, the fp32 engine must be too (else precision
was lost in the engine: exit 1). Where even the golden is outside it, the prompt is ill-conditioned: fp32
rounding alone moves it by about the tolerance (BLAS summation order does), so it is reported, not judged
here; k3serve-conformance --noise-floor judges it.
"""
import json
import os
import struct
import sys


def read_golden(path):
    with open(path, "rb") as f:
        blob = f.read()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_len])
    base = 8 + header_len

    def tensor(name):
        meta = header[name]
        if meta["dtype"] != "F32":
            raise ValueError(f"{path}: {name} is {meta['dtype']}, expected F32")
        start, end = meta["data_offsets"]
        return struct.unpack(f"<{(end - start) // 4}f", blob[base + start:base + end])

    return tensor


def read_dump(path, n):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) == 4 * n:
        return struct.unpack(f"<{n}f", blob)
    if len(blob) == 8 * n:
        return struct.unpack(f"<{n}d", blob)
    raise ValueError(f"{path}: {len(blob)} bytes for {n} logits")


def compare(a, b, atol, rtol):
    worst, out = 0.0, 0
    for x, y in zip(a, b):
        d = abs(x - y)
        worst = max(worst, d)
        out += not d <= atol + rtol * abs(y)
    return worst, out


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    dumps, goldens = sys.argv[1], sys.argv[2:]
    failed = False
    print(f"{'golden':24s} {'prompt':>6s} {'T':>4s}   {'golden vs fp64':>18s}   {'fp32 vs fp64':>18s}   "
          f"{'fp32 vs golden':>18s}   (max |diff|, logits out of tolerance)")
    for gdir in goldens:
        name = os.path.basename(os.path.normpath(gdir))
        with open(os.path.join(gdir, "golden.json")) as f:
            meta = json.load(f)
        atol, rtol = meta["atol"], meta["rtol"]
        tensor = read_golden(os.path.join(gdir, "golden.safetensors"))
        for i, ids in enumerate(meta["prompts"]):
            golden = tensor(f"prompt{i}.prefill_logits")
            n = len(golden)
            f32 = read_dump(os.path.join(dumps, name, "32", f"prompt{i}.f32"), n)
            f64 = read_dump(os.path.join(dumps, name, "64", f"prompt{i}.f32"), n)
            cols = [compare(golden, f64, atol, rtol), compare(f32, f64, atol, rtol), compare(f32, golden, atol, rtol)]
            g_out, e_out = cols[0][1], cols[1][1]
            verdict = "ok" if e_out == 0 else "ill-conditioned (golden outside too)" if g_out > 0 else "FAIL"
            failed |= verdict == "FAIL"
            cells = "   ".join(f"{m:10.3g} {o:7d}" for m, o in cols)
            print(f"{name:24s} {i:6d} {len(ids):4d}   {cells}   {verdict}")
        print(f"{'':24s} tolerance: atol {atol:g}, rtol {rtol:g}")
    print("PASS: the fp32 engine is within tolerance of the fp64 evaluation wherever the golden is"
          if not failed else "FAIL: the fp32 engine is outside tolerance of the fp64 evaluation where the golden is not")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
