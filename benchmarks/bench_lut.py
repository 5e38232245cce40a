"""A q1 mat-vec by table lookups, measured beside the runtime's q1 kernel: how fast one-bit weights
multiply on AVX2 when 32 rows are stored side by side and each group of four inputs is looked up
instead of multiplied. A prototype for a future layout of q1; nothing in the runtime uses it.

    python benchmarks/bench_lut.py [--shapes 2048x7168,7168x2048,576x7168] [--threads 1,2] [--seconds 1.5]
                                   [--working-set 512]

Why: the runtime's q1 kernel multiplies each span of 32 weights by its 32 inputs (a mask, a
`vpmaddubsw`, a `vpmaddwd` by the span's scale, a sum), about 100 core cycles per 1 024 weights on a
Zen 3, far more than the 10-20 its bytes need at the memory's speed. A table lookup does four
weights' work per byte instead (the idea of T-MAC and bitnet.cpp's kernels, written here anew):

- per call, the inputs are rounded to integers -31 .. 31 per 128 (so that the sum of four fits a
  byte), and for every group of four inputs a table of its 16 signed sums +-x0 +-x1 +-x2 +-x3 (one
  byte each) is built: 16 bytes per four columns;
- the weights are stored in tiles of 32 rows; in a tile, a 32-byte register holds for each row a
  4-bit index (its four one-bit codes) of one group in span s in its low nibble and of the same
  group in span s + 1 in its high nibble. One `vpshufb` per nibble looks up 32 rows' sums at once;
- the two spans' lookups, interleaved byte by byte (`vpunpcklbw`/`vpunpckhbw`), go through one
  `vpmaddubsw` whose unsigned operand is the two spans' 4-bit scales (stored interleaved the same
  way): the scale is applied inside the product that widens the sums, for free. Eight groups of two
  spans stay below 2^15 (8 x 2 x 15 x 124), then two `vpmaddwd` by 0/1 words widen them per row;
- per 128 columns one conversion and one fused multiply-add by d x the inputs' step; per 256 the
  offset m times the inputs' exact sum.

Per 64 columns of a tile (2 048 weights): 8 code loads, 24 index operations, 16 lookups, 16 byte
interleaves, 16 `vpmaddubsw` and 16 sums, against 64 spans of the runtime's kernel. The bytes per
weight are q1's without outliers (1.25 bits; the runtime's q1 adds outliers up to 1.34).

The table reports, per shape and thread count, GB/s of packed bytes for both kernels, the memory read
bandwidth measured next to them, and the error of each against the float64 product of the decoded
weights (relative RMS over the rows; both round the inputs, to 127 and to 31 per 128 values), and for
scale the error q1 itself makes (the runtime's weight, decoded, against its float32 original); the
lookup kernel is also checked against its own integer arithmetic done in float64 (it must match to
float32 rounding, or the benchmark stops). Both kernels' timings include rounding the inputs (and the
lookup's, building its tables). The C is written to a temporary directory and built with the system's
gcc (-O2 -fopenmp; its functions carry AVX2/FMA/F16C target attributes).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

C_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

/* bytes of one tile (32 rows) per 256 columns: d and m (32 binary16 each, rows in the kernel's
   order), then for each of the four pairs of spans 32 scale bytes and 8 x 32 code bytes */
#define SB_BYTES (128 + 4 * (32 + 256))

/* x rounded to -31 .. 31 per 128 (q, step), sums per 256 (xs), tables of 16 sums per 4 columns */
__attribute__((target("avx2,fma,f16c"))) void lut_prepare(const float *x, int64_t cols, int8_t *q, float *step,
                                                        float *xs, int8_t *tab) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t c0 = 0; c0 < cols; c0 += 128) {
        __m256 mx = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int j = 0; j < 128; j += 8) {
            __m256 v = _mm256_loadu_ps(x + c0 + j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
            sum = _mm256_add_ps(sum, v);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        float amax = _mm_cvtss_f32(m4);
        if (c0 % 256 == 0) xs[c0 / 256] = 0;
        xs[c0 / 256] += _mm_cvtss_f32(s4);
        step[c0 / 128] = amax / 31.0f;
        __m256 inv = _mm256_set1_ps(amax > 0 ? 31.0f / amax : 0.0f);
        for (int j = 0; j < 128; j += 32) {
            const float *v = x + c0 + j;
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), inv));
            __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), inv));
            __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), inv));
            __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), inv));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
            _mm256_storeu_si256((__m256i *)(q + c0 + j), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
    }
    /* two groups a register: each input of a group spread over its lane (vpshufb), signed by bit i of
       the entry's index (vpsignb by a +-1 pattern), four of them summed */
    const __m256i s0 = _mm256_setr_epi8(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1,
                                        -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1);
    const __m256i s1 = _mm256_setr_epi8(-1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1,
                                        -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1);
    const __m256i s2 = _mm256_setr_epi8(-1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1,
                                        -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1);
    const __m256i s3 = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1,
                                        -1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_set1_epi8(1), b2 = _mm256_set1_epi8(2), b3 = _mm256_set1_epi8(3);
    for (int64_t g = 0; g < cols / 4; g += 2) {
        int32_t w0, w1;
        memcpy(&w0, q + 4 * g, 4);
        memcpy(&w1, q + 4 * g + 4, 4);
        __m256i v = _mm256_setr_epi32(w0, 0, 0, 0, w1, 0, 0, 0);
        __m256i t = _mm256_add_epi8(_mm256_add_epi8(_mm256_sign_epi8(_mm256_shuffle_epi8(v, b0), s0),
                                                    _mm256_sign_epi8(_mm256_shuffle_epi8(v, b1), s1)),
                                    _mm256_add_epi8(_mm256_sign_epi8(_mm256_shuffle_epi8(v, b2), s2),
                                                    _mm256_sign_epi8(_mm256_shuffle_epi8(v, b3), s3)));
        _mm256_storeu_si256((__m256i *)(tab + 16 * g), t);
    }
}

/* tiles t0 .. t1 - 1; y in the kernel's row order within each tile (see the packer) */
__attribute__((target("avx2,fma,f16c"))) static void tiles(const uint8_t *w, int64_t t0, int64_t t1, int64_t cols,
                                                         const float *step, const float *xs, const int8_t *tab, float *y) {
    const int64_t nsb = cols / 256;
    const __m256i k15 = _mm256_set1_epi8(15), even = _mm256_set1_epi32(1), odd = _mm256_set1_epi32(1 << 16);
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *p = w + t * nsb * SB_BYTES;
        __m256 f[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nsb; b++, p += SB_BYTES) {
            __m256 d[4], m[4];
            for (int k = 0; k < 4; k++) {
                d[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * k)));
                m[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 64 + 16 * k)));
                f[k] = _mm256_fmadd_ps(m[k], _mm256_set1_ps(xs[b]), f[k]);
            }
            const uint8_t *sp = p + 128;
            for (int h = 0; h < 2; h++) {               /* the super-block's two blocks of 128 columns */
                __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int pr = 0; pr < 2; pr++, sp += 32 + 256) {      /* a pair of spans: 64 columns */
                    const int64_t col = 256 * b + 128 * h + 64 * pr;
                    __m256i sv = _mm256_loadu_si256((const __m256i *)sp);
                    __m256i slo = _mm256_and_si256(sv, k15), shi = _mm256_and_si256(_mm256_srli_epi16(sv, 4), k15);
                    __m256i sA = _mm256_unpacklo_epi8(slo, shi), sB = _mm256_unpackhi_epi8(slo, shi);
                    __m256i accA = _mm256_setzero_si256(), accB = _mm256_setzero_si256();
                    const int8_t *ta = tab + 4 * col, *tb = tab + 4 * (col + 32);
                    for (int g = 0; g < 8; g++) {
                        __m256i cv = _mm256_loadu_si256((const __m256i *)(sp + 32 + 32 * g));
                        __m256i ia = _mm256_and_si256(cv, k15), ib = _mm256_and_si256(_mm256_srli_epi16(cv, 4), k15);
                        __m256i la = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(ta + 16 * g))), ia);
                        __m256i lb = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(tb + 16 * g))), ib);
                        accA = _mm256_add_epi16(accA, _mm256_maddubs_epi16(sA, _mm256_unpacklo_epi8(la, lb)));
                        accB = _mm256_add_epi16(accB, _mm256_maddubs_epi16(sB, _mm256_unpackhi_epi8(la, lb)));
                    }
                    a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(accA, even));
                    a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(accA, odd));
                    a[2] = _mm256_add_epi32(a[2], _mm256_madd_epi16(accB, even));
                    a[3] = _mm256_add_epi32(a[3], _mm256_madd_epi16(accB, odd));
                }
                __m256 s = _mm256_set1_ps(step[2 * b + h]);
                for (int k = 0; k < 4; k++) f[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[k]), _mm256_mul_ps(d[k], s), f[k]);
            }
        }
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(y + 32 * t + 8 * k, f[k]);
    }
}

void lut_matvec(const uint8_t *w, int64_t rows, int64_t cols, const float *step, const float *xs,
                const int8_t *tab, float *y, int threads) {
    int64_t nt = rows / 32;
    #pragma omp parallel num_threads(threads)
    {
        int n = omp_get_num_threads(), i = omp_get_thread_num();
        tiles(w, nt * i / n, nt * (i + 1) / n, cols, step, xs, tab, y);
    }
}
"""

# Row order of the kernel's four float registers in a tile: vpunpck{l,h}bw keep each 128-bit lane
# (rows 0-7 / 16-23 low, 8-15 / 24-31 high), and the two vpmaddwd by 0/1 words take even and odd rows.
ORDER = np.array([r + lane for half in (0, 8) for parity in (0, 1) for lane in (0, 16)
                  for r in range(half + parity, half + 8, 2)])


def build(tmp: str):
    src, lib = os.path.join(tmp, "lut.c"), os.path.join(tmp, "lut.so")
    with open(src, "w") as f:
        f.write(C_SOURCE)
    try:
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-fopenmp", src, "-o", lib], check=True,
                       capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit("bench_lut: gcc not found (the prototype is C, built at run time)")
    except subprocess.CalledProcessError as e:
        last = (e.stderr.strip().splitlines() or ["no message"])[-1]
        sys.exit(f"bench_lut: building the C prototype failed: {last}")
    so = ctypes.CDLL(lib)
    P = ctypes.c_void_p
    so.lut_prepare.argtypes = [P, ctypes.c_int64, P, P, P, P]
    so.lut_matvec.argtypes = [P, ctypes.c_int64, ctypes.c_int64, P, P, P, P, ctypes.c_int]
    return so


def random_q1(rng, rows: int, cols: int):
    """A q1 weight's parts (codes 0/1, 4-bit scales per 32, binary16 d and m per 256) and its decoded
    float64 values, as formats/SPEC.md defines q1: (d sc) (2c - 1) + m."""
    c = rng.integers(0, 2, (rows, cols), dtype=np.uint8)
    sc = rng.integers(1, 16, (rows, cols // 32), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (rows, cols // 256)) * 0.02 / 15).astype(np.float16)
    m = (rng.standard_normal((rows, cols // 256)) * 0.002).astype(np.float16)
    w = (d.astype(np.float64).repeat(256, 1) * sc.astype(np.float64).repeat(32, 1) * (2.0 * c - 1)
         + m.astype(np.float64).repeat(256, 1))
    return c, sc, d, m, w


def pack(c, sc, d, m) -> np.ndarray:
    """The tiled layout the C kernel reads (see its comments), rows in ORDER within each tile."""
    rows, cols = c.shape
    nt, nsb = rows // 32, cols // 256
    out = np.empty((nt, nsb, 128 + 4 * (32 + 256)), np.uint8)
    for t in range(nt):
        rs = slice(32 * t, 32 * t + 32)
        ct, st, dt, mt = c[rs], sc[rs], d[rs], m[rs]
        for b in range(nsb):
            o = out[t, b]
            o[:64] = dt[ORDER, b].view(np.uint8)
            o[64:128] = mt[ORDER, b].view(np.uint8)
            for pr in range(4):
                s0 = 8 * b + 2 * pr                                        # spans s0, s0 + 1
                base = 128 + pr * 288
                o[base:base + 32] = st[:, s0] | (st[:, s0 + 1] << 4)
                for g in range(8):
                    nib = [(ct[:, 32 * s + 4 * g: 32 * s + 4 * g + 4] << np.arange(4, dtype=np.uint8)).sum(1)
                           for s in (s0, s0 + 1)]
                    o[base + 32 + 32 * g: base + 64 + 32 * g] = nib[0] | (nib[1] << 4)
    return out.reshape(-1)


def lut_call(so, packed, rows, cols, x, threads, scratch) -> None:
    """One product as a caller would make it: the inputs rounded and their tables built, then the
    tiles; y in the kernel's row order."""
    q, step, xs, tab, y = scratch
    so.lut_prepare(x.ctypes.data, cols, q.ctypes.data, step.ctypes.data, xs.ctypes.data, tab.ctypes.data)
    so.lut_matvec(packed.ctypes.data, rows, cols, step.ctypes.data, xs.ctypes.data, tab.ctypes.data,
                  y.ctypes.data, threads)


def lut_product(so, packed, rows, cols, x, threads, scratch) -> np.ndarray:
    lut_call(so, packed, rows, cols, x, threads, scratch)
    y = scratch[4]
    out = np.empty(rows, np.float32)
    out.reshape(-1, 32)[:, ORDER] = y.reshape(-1, 32)
    return out


def rel_rms(a, ref) -> float:
    return float(np.sqrt(np.mean((a - ref) ** 2) / np.mean(ref ** 2)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2048x7168,7168x2048,576x7168")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    ap.add_argument("--working-set", type=int, default=512, help="MiB of weight copies cycled through")
    args = ap.parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        sys.exit("bench_lut: AVX2 only (x86-64)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import encode, read_gbps

    from kimistream.formats.codecs import get_codec
    from kimistream.runtime import kernels
    if kernels.isa() != "avx2":
        sys.exit(f"bench_lut: needs AVX2 (the kernels run {kernels.isa()} code here)")
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    buf = np.ones(args.working_set << 20, np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        so = build(tmp)
        print(f"kernel instruction set {kernels.isa()}, cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, "
              f"working set {args.working_set} MiB\n")
        print("| shape | threads | read GB/s | runtime q1 GB/s | ratio | lookup q1 GB/s | ratio | lookup / runtime "
              "| rel. error runtime | rel. error lookup | lookup's own check | q1's own error |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for spec in args.shapes.split(","):
            rows, cols = (int(v) for v in spec.split("x"))
            if rows % 32 or cols % 256:
                sys.exit(f"bench_lut: {spec}: rows must be a multiple of 32 and columns of 256")
            c, sc, d, m, w = random_q1(rng, rows, cols)
            packed = pack(c, sc, d, m)
            x = rng.standard_normal(cols).astype(np.float32)
            ref = w @ x.astype(np.float64)
            scratch = (np.empty(cols, np.int8), np.empty(cols // 128, np.float32), np.empty(cols // 256, np.float32),
                       np.empty(4 * cols, np.int8), np.empty(rows, np.float32))
            got = lut_product(so, packed, rows, cols, x, 1, scratch)
            # the same integers in float64: x rounded as the kernel rounds it
            q, step = scratch[0].astype(np.float64), np.repeat(scratch[1].astype(np.float64), 128)
            dw = d.astype(np.float64).repeat(256, 1) * sc.astype(np.float64).repeat(32, 1) * (2.0 * c - 1)
            own = dw @ (q * step) + m.astype(np.float64).repeat(256, 1) @ x.astype(np.float64)
            own_err = float(np.max(np.abs(got - own)) / np.max(np.abs(own)))
            if own_err > 1e-5:
                sys.exit(f"bench_lut: {spec}: the lookup kernel disagrees with its own arithmetic ({own_err:.2e})")
            # the runtime's kernel on a q1 weight of the same shape (its own random values)
            wr = (rng.standard_t(4, size=(rows, cols)) * 0.02).astype(np.float32)
            raw = encode(get_codec("q1"), wr)
            kernels.set_activations("int8")
            dec = get_codec("q1").decode(raw, (rows, cols)).astype(np.float64)
            rt_err = rel_rms(kernels.linear(x, "q1", raw, (rows, cols)).astype(np.float64), dec @ x.astype(np.float64))
            q1_err = rel_rms(dec @ x.astype(np.float64), wr.astype(np.float64) @ x.astype(np.float64))
            lut_err = rel_rms(got.astype(np.float64), ref)
            rcopies = [raw.copy() for _ in range(max(1, buf.nbytes // raw.nbytes))]
            lcopies = [packed.copy() for _ in range(max(1, buf.nbytes // packed.nbytes))]
            for t in threads:
                kernels.set_threads(t)
                rd = read_gbps(buf, args.seconds / 2, t)
                rt = timed(lambda r: kernels.linear(x, "q1", r, (rows, cols)), rcopies, args.seconds)
                lt = timed(lambda p: lut_call(so, p, rows, cols, x, t, scratch), lcopies, args.seconds)
                rd = (rd + read_gbps(buf, args.seconds / 2, t)) / 2
                rg, lg = raw.nbytes / rt / 1e9, packed.nbytes / lt / 1e9
                print(f"| {rows}x{cols} | {t} | {rd:.1f} | {rg:.2f} | {rg / rd:.3f} | {lg:.2f} | {lg / rd:.3f} | "
                      f"{rt / lt:.2f}x | {rt_err:.4f} | {lut_err:.4f} | {own_err:.1e} | {q1_err:.3f} |", flush=True)


def timed(call, copies, seconds: float) -> float:
    """Seconds per call, cycling through the copies (so the bytes come from memory, not a cache)."""
    call(copies[0])
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for cp in copies:
            call(cp)
        n += len(copies)
    return (time.perf_counter() - t0) / n


if __name__ == "__main__":
    main()
