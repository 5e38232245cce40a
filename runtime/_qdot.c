/* The decode mat-vec kernel in C: y[r] = x . W[r] straight from a block codec's packed bytes
 * (layout in formats/SPEC.md), with integer dot products.
 *
 * x is quantised once per call to int16 per 32 values (x ~ xsc[s] * xq on span s, exact float sum
 * xs[s] kept). A row whose weights are A[s] * (mul * digit - z) + B[s] on span s then gives
 *     sum_s  A[s] * mul * xsc[s] * isum[s] + (B[s] - z * A[s]) * xs[s],   isum[s] = sum digit * xq
 * The portable path computes isum per span and then the sum. The AVX2 path first decodes every span's
 * coefficients 8 at a time, then runs one loop per codec: 32 code bytes per load, digits in int16
 * lanes multiplied pairwise with x into int32 lanes (vpmaddwd), turned to float and scaled per span
 * into a float accumulator (see "AVX2 kernels" below). Columns past the last whole code chunk (the tail) are dotted in float, and each
 * outlier adds its stored correction times x (the sums above already hold its digit's value).
 *
 * Work comes as a list of jobs (tensor offset, geometry, row range, input, output offset), shared
 * out through a small pool of threads the caller also works in: a job is taken with one atomic
 * add, so a thread that loses its core holds nobody up. The GIL is released while it runs.
 * A portable C path (no intrinsics) is kept for CPUs without AVX2 and for tests.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "_ggml.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif
/* AMX tiles (several tokens through sixteen rows; the prompt's float products): x86-64 Linux, whose
   kernel hands out the tile state on request, and a compiler that knows the instructions */
#if HAVE_X86 && defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

/* the geometry vector built by kernels._geometry_cached */
enum { G_ROWS, G_COLS, G_NSUB, G_NBLK, G_K, G_PARROW, G_SUBROW, G_CODEROW, G_OFFPAR, G_OFFOCOL, G_OFFOVAL,
       G_OFFSUB, G_OFFCODE, G_NBYTES, G_KIND, G_S, G_P, G_NPAR, G_BITS0, G_PB0, G_BITS1, G_PB1, G_LEN };
/* codec kinds, as in formats/quants.py */
enum { K_Q8, K_Q6, K_Q4, K_Q2, K_Q2RTN, K_T1, K_Q1, K_Q1T };
#define JOB_LEN 6
/* how far ahead of the kernels' reads a row's code bytes are prefetched: the hardware prefetcher alone
   left a one-token product waiting on them (q2 2048x7168 on one thread: 6.4-6.8 GB/s without, 7.8-8.3
   with 2 KiB; q6 on two threads 13.6 GB/s at 2 KiB, 18.9 at 4 KiB, q2 and q4 even) */
#define CODE_PREFETCH 4096
#define TOKEN_TILE 32     /* tokens per pass of the several-token kernel */
/* from this many tokens a tile, rows of the bytes-of-digit-x-scale kinds go eight or sixteen at a time
   (tiled_rows) in jobs of 32 rows or more (1024 wide; against one row at a time, q2: 0.97x at 3 tokens,
   1.19x at 5, 1.3x at 24); shorter jobs (2048 and 7168 wide) from 8 (at 6: 0.93x and 1.02x) */
#define TILED_MIN_TOKENS 5
#define TILED_MIN_TOKENS_SHORT_JOB 8
#define XQ_MAX 32767.0f

/* ------------------------------------------------------------------------------------------- scalars */

static float pow2_f16[32];

static void init_tables(void) {
    pow2_f16[0] = ldexpf(1.0f, -24);
    for (int e = 1; e < 31; e++) pow2_f16[e] = ldexpf(1.0f, e - 25);
    pow2_f16[31] = INFINITY;
}

/* the little-endian binary16 at p, exactly (the encoder never writes NaN) */
static inline float f16_at(const uint8_t *p) {
    int h = p[0] | (p[1] << 8);
    int e = (h >> 10) & 31;
    float mag = (float)((h & 1023) | ((e != 0) << 10)) * pow2_f16[e];
    return (h & 0x8000) ? -mag : mag;
}

static inline void digit_form(int kind, float *mul, float *z) {
    *mul = kind == K_Q1 ? 2.0f : 1.0f;
    *z = kind == K_Q6 ? 32.0f : (kind == K_T1 || kind == K_Q1) ? 1.0f : 0.0f;
}

/* columns covered by whole code chunks; the rest is the tail */
static inline int64_t full_cols(const int64_t *g) {
    if (g[G_KIND] == K_Q6) return (g[G_COLS] / 128) * 128;
    return (g[G_COLS] / (32 * g[G_PB0])) * 32 * g[G_PB0];
}

static inline int64_t q6_lo_bytes(int64_t cols) { return (cols / 64) * 32 + ((cols % 64) + 1) / 2; }

/* What the per-codec code paths below assume of each codec's layout (formats/quants.py defines it):
   sub-block and parameter-block weights, f16 parameters per block, then (bits, fields per byte) of
   the two code planes (bits 0: trits; a codec with one plane has (0, 1) as the second). Every call
   checks the geometry it is given against this table (known_layout), so a codec redefined on the
   Python side fails loudly here instead of being decoded with stale constants. */
static const int64_t LAYOUT[7][7] = {
    [K_Q8] = {32, 32, 1, 8, 1, 0, 1},   [K_Q6] = {32, 256, 1, 4, 2, 2, 4}, [K_Q4] = {32, 256, 2, 4, 2, 0, 1},
    [K_Q2] = {32, 256, 2, 2, 4, 0, 1},  [K_Q2RTN] = {64, 64, 2, 2, 4, 0, 1}, [K_T1] = {32, 256, 1, 0, 5, 0, 1},
    [K_Q1] = {32, 256, 2, 1, 8, 0, 1},
};

static int known_layout(const int64_t *g) {
    int64_t kind = g[G_KIND];
    if (kind < K_Q8 || kind > K_Q1) return 0;
    const int64_t *l = LAYOUT[kind];
    return g[G_S] == l[0] && g[G_P] == l[1] && g[G_NPAR] == l[2] && g[G_BITS0] == l[3] && g[G_PB0] == l[4] &&
           g[G_BITS1] == l[5] && g[G_PB1] == l[6];
}

/* (A, B) of span s of row r: weight = A * level + B */
static void span_ab(const uint8_t *t, const int64_t *g, int64_t r, int64_t s, float *A, float *B) {
    int kind = (int)g[G_KIND];
    const uint8_t *po = t + g[G_OFFPAR] + r * g[G_PARROW];
    const uint8_t *so = t + g[G_OFFSUB] + r * g[G_SUBROW];
    if (kind == K_Q8) { *A = f16_at(po + 2 * s); *B = 0; return; }
    if (kind == K_Q2RTN) {                       /* (s, o) per sub-block of G_S weights */
        int64_t b = s >> __builtin_ctzll(g[G_S] >> 5);      /* known_layout: powers of two, no division */
        *A = f16_at(po + 4 * b); *B = f16_at(po + 4 * b + 2);
        return;
    }
    int64_t npar = g[G_NPAR];
    const uint8_t *q = po + 2 * npar * (s >> __builtin_ctzll(g[G_P] >> 5));   /* the span's parameter block */
    float d = f16_at(q), m = npar == 2 ? f16_at(q + 2) : 0.0f;
    switch (kind) {
    case K_Q2: *A = d * (float)(so[s] & 15); *B = m * (float)(so[s] >> 4); return;
    case K_Q4: *A = d * (float)so[2 * s]; *B = m * (float)so[2 * s + 1]; return;
    case K_Q6: *A = d * (float)so[s]; *B = 0; return;
    default: *A = d * (float)((so[s >> 1] >> (4 * (s & 1))) & 15); *B = m; return;   /* t1, q1 */
    }
}

/* digit idx of a plane of n codes packed p per byte (bits 0: base-3 trits) starting at base */
static inline int plane_digit(const uint8_t *base, int64_t n, int64_t p, int64_t bits, int64_t idx) {
    static const int pow3[5] = {1, 3, 9, 27, 81};
    int64_t chunk = 32 * p, full = n / chunk, c = idx / chunk, k, b;
    if (c < full) {
        int64_t w = idx - c * chunk;
        k = w / 32;
        b = base[c * 32 + w - k * 32];
    } else {
        int64_t lane = (n - full * chunk + p - 1) / p, w = idx - full * chunk;
        k = w / lane;
        b = base[full * 32 + w - k * lane];
    }
    if (bits == 0) return (int)((((b * pow3[k]) & 255) * 3) >> 8);
    return (int)((b >> (k * bits)) & ((1 << bits) - 1));
}

/* the level (mul * digit - z) of column col of a row's codes */
static inline int level_at(const uint8_t *codes, const int64_t *g, int64_t col) {
    int kind = (int)g[G_KIND];
    int64_t cols = g[G_COLS];
    int d = plane_digit(codes, cols, g[G_PB0], g[G_BITS0], col);
    switch (kind) {
    case K_Q8: return d - ((d & 128) << 1);
    case K_Q6: return (d | (plane_digit(codes + q6_lo_bytes(cols), cols, g[G_PB1], g[G_BITS1], col) << 4)) - 32;
    case K_T1: return d - 1;
    case K_Q1: return 2 * d - 1;
    default: return d;
    }
}

/* the stored digit of column col, col inside the whole chunks: shifts by constants, no division
   by a variable (this runs for every outlier) */
static inline int digit_full(int kind, const uint8_t *codes, int64_t col, int64_t cols) {
    int64_t lane = col & 31;
    switch (kind) {
    case K_Q2: case K_Q2RTN: return (codes[((col >> 7) << 5) | lane] >> (2 * ((col >> 5) & 3))) & 3;
    case K_Q4: return (codes[((col >> 6) << 5) | lane] >> (4 * ((col >> 5) & 1))) & 15;
    case K_Q8: return (int8_t)codes[col];
    case K_Q1: return (codes[((col >> 8) << 5) | lane] >> ((col >> 5) & 7)) & 1;
    case K_Q6: {
        int lo = (codes[((col >> 6) << 5) | lane] >> (4 * ((col >> 5) & 1))) & 15;
        int hi = (codes[q6_lo_bytes(cols) + (((col >> 7) << 5) | lane)] >> (2 * ((col >> 5) & 3))) & 3;
        return lo | (hi << 4);
    }
    default: {                                   /* t1: 160 weights per 32 bytes */
        static const int pow3[5] = {1, 3, 9, 27, 81};
        int64_t ch = col / 160;
        int k = (int)((col - 160 * ch) >> 5);
        return ((((int)codes[32 * ch + lane] * pow3[k]) & 255) * 3) >> 8;
    }
    }
}

/* The AVX2 kernels take digits out with masks where the portable code shifts, so span s's digits come
   out multiplied by this power of two (the mask's position); the span's coefficient divides it out, and
   both steps are exact in float. */
static inline float digit_scale(int kind, int64_t s) {
    switch (kind) {
    case K_Q2: case K_Q2RTN: return (float)(1 << (2 * (s & 3)));
    case K_Q4: return (float)(1 << (4 * (s & 1)));
    case K_Q1: return (float)(1 << (s & 7));
    case K_T1: return 256.0f;
    default: return 1.0f;
    }
}

static int use_avx2;

#if HAVE_X86
/* tail_levels for trits on AVX2: each field's 32 bytes (lane <= 32 of them used) in 16-bit lanes, the
   trit taken as ((b * 3^k mod 256) * 3) >> 8, converted and stored 32 at a time; a field's extra
   values land in the next field's place and are overwritten by it (lev has room for 5 * 32) */
__attribute__((target("avx2,fma"))) static void tail_trits_avx2(const uint8_t *tail, int64_t lane, int over,
                                                              float mul, float z, float *lev) {
    uint8_t b[32] = {0};
    const uint8_t *p = tail;
    if (!over) {                                   /* the tensor's last row: never read past its bytes */
        memcpy(b, tail, lane);
        p = b;
    }
    __m128i lo = _mm_loadu_si128((const __m128i *)p), hi = _mm_loadu_si128((const __m128i *)(p + 16));
    __m256i v[2] = {_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi)};
    const __m256i m255 = _mm256_set1_epi16(255);
    const __m256 vm = _mm256_set1_ps(mul), vz = _mm256_set1_ps(z);
    for (int k = 0, m3 = 1; k < 5; k++, m3 *= 3) {
        for (int h = 0; h < 2; h++) {
            __m256i t = _mm256_and_si256(_mm256_mullo_epi16(v[h], _mm256_set1_epi16((short)m3)), m255);
            __m256i d = _mm256_srli_epi16(_mm256_add_epi16(t, _mm256_add_epi16(t, t)), 8);
            __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(d)));
            __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(d, 1)));
            _mm256_storeu_ps(lev + k * lane + 16 * h, _mm256_fmsub_ps(vm, f0, vz));
            _mm256_storeu_ps(lev + k * lane + 16 * h + 8, _mm256_fmsub_ps(vm, f1, vz));
        }
    }
}
#endif

/* levels of the tail (columns start .. cols-1, fewer than one chunk) into lev (room for 256):
   field k of the tail bytes holds columns k * lane .. k * lane + lane - 1, lane = ceil(n / per_byte).
   over: a 32-byte read from the tail stays inside the tensor (the row is not its last) */
#if HAVE_X86
__attribute__((target_clones("avx2", "default")))
#endif
static void tail_levels(const uint8_t *codes, const int64_t *g, int64_t start, int over, float *lev) {
    static const int pow3[5] = {1, 3, 9, 27, 81};
    int kind = (int)g[G_KIND];
    int64_t cols = g[G_COLS], n = cols - start, p = g[G_PB0], bits = g[G_BITS0];
    if (kind == K_Q6) {
        for (int64_t i = 0; i < n; i++) lev[i] = (float)level_at(codes, g, start + i);
        return;
    }
    float mul, z;
    digit_form(kind, &mul, &z);
    int64_t lane = (n + p - 1) / p;
    const uint8_t *tail = codes + (start / (32 * p)) * 32;
#if HAVE_X86
    if (bits == 0 && use_avx2) {
        tail_trits_avx2(tail, lane, over, mul, z, lev);
        return;
    }
#endif
    for (int64_t k = 0; k < p; k++) {
        int64_t o = k * lane, jn = n - o < lane ? n - o : lane;
        if (bits == 0) {
            int m3 = pow3[k];
            for (int64_t j = 0; j < jn; j++) lev[o + j] = mul * (float)(((((int)tail[j] * m3) & 255) * 3) >> 8) - z;
        } else if (kind == K_Q8) {
            for (int64_t j = 0; j < jn; j++) lev[o + j] = (float)(int8_t)tail[j];
        } else {
            int sh = (int)(k * bits), mask = (1 << bits) - 1;
            for (int64_t j = 0; j < jn; j++) lev[o + j] = mul * (float)((tail[j] >> sh) & mask) - z;
        }
    }
}

/* ------------------------------------------------------------------------------- portable digit sums */
/* isum[s] for every span of the whole chunks, n chunks */

static void isum_q2_c(const uint8_t *c, const int16_t *x, int64_t n, int32_t *isum) {
    for (int64_t i = 0; i < n; i++, c += 32, x += 128) {
        int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (int j = 0; j < 32; j++) {
            int b = c[j];
            s0 += (b & 3) * x[j]; s1 += ((b >> 2) & 3) * x[32 + j];
            s2 += ((b >> 4) & 3) * x[64 + j]; s3 += (b >> 6) * x[96 + j];
        }
        isum[4 * i] = s0; isum[4 * i + 1] = s1; isum[4 * i + 2] = s2; isum[4 * i + 3] = s3;
    }
}

static void isum_q4_c(const uint8_t *c, const int16_t *x, int64_t n, int32_t *isum) {
    for (int64_t i = 0; i < n; i++, c += 32, x += 64) {
        int32_t s0 = 0, s1 = 0;
        for (int j = 0; j < 32; j++) { s0 += (c[j] & 15) * x[j]; s1 += (c[j] >> 4) * x[32 + j]; }
        isum[2 * i] = s0; isum[2 * i + 1] = s1;
    }
}

static void isum_q8_c(const uint8_t *c, const int16_t *x, int64_t n, int32_t *isum) {
    for (int64_t i = 0; i < n; i++, c += 32, x += 32) {
        int32_t s0 = 0;
        for (int j = 0; j < 32; j++) s0 += (int8_t)c[j] * x[j];
        isum[i] = s0;
    }
}

static void isum_q6_c(const uint8_t *c, const int16_t *x, int64_t n, int64_t lo_bytes, int32_t *isum) {
    for (int64_t i = 0; i < n; i++, x += 128) {
        const uint8_t *lo = c + 64 * i, *hi = c + lo_bytes + 32 * i;
        int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (int j = 0; j < 32; j++) {
            int h = hi[j], l0 = lo[j], l1 = lo[32 + j];
            s0 += ((l0 & 15) | ((h & 3) << 4)) * x[j];
            s1 += ((l0 >> 4) | (((h >> 2) & 3) << 4)) * x[32 + j];
            s2 += ((l1 & 15) | (((h >> 4) & 3) << 4)) * x[64 + j];
            s3 += ((l1 >> 4) | ((h >> 6) << 4)) * x[96 + j];
        }
        isum[4 * i] = s0; isum[4 * i + 1] = s1; isum[4 * i + 2] = s2; isum[4 * i + 3] = s3;
    }
}

/* trit k of byte q is ((q * 3^k) mod 256) * 3 >> 8: u = 3 * t gives the digit u >> 8, next t = u & 255 */
static void isum_t1_c(const uint8_t *c, const int16_t *x, int64_t n, int32_t *isum) {
    for (int64_t i = 0; i < n; i++, c += 32, x += 160) {
        int32_t s[5] = {0, 0, 0, 0, 0};
        for (int j = 0; j < 32; j++) {
            int t = c[j];
            for (int k = 0; k < 5; k++) { int u = 3 * t; s[k] += (u >> 8) * x[32 * k + j]; t = u & 255; }
        }
        for (int k = 0; k < 5; k++) isum[5 * i + k] = s[k];
    }
}

static void isum_q1_c(const uint8_t *c, const int16_t *x, int64_t n, int32_t *isum) {
    for (int64_t i = 0; i < n; i++, c += 32, x += 256) {
        int32_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j = 0; j < 32; j++)
            for (int k = 0; k < 8; k++) s[k] += ((c[j] >> k) & 1) * x[32 * k + j];
        for (int k = 0; k < 8; k++) isum[8 * i + k] = s[k];
    }
}

static void isum_c(const uint8_t *codes, const int64_t *g, const int16_t *xq, int64_t done, int32_t *isum) {
    switch ((int)g[G_KIND]) {
    case K_Q2: case K_Q2RTN: isum_q2_c(codes, xq, done / 128, isum); break;
    case K_Q4: isum_q4_c(codes, xq, done / 64, isum); break;
    case K_Q8: isum_q8_c(codes, xq, done / 32, isum); break;
    case K_Q6: isum_q6_c(codes, xq, done / 128, q6_lo_bytes(g[G_COLS]), isum); break;
    case K_T1: isum_t1_c(codes, xq, done / 160, isum); break;
    default: isum_q1_c(codes, xq, done / 256, isum); break;
    }
}

/* sum over spans s0 .. nfs-1 of A * mul * xsc * isum + (B - z * A) * xs, span by span */
static float combine_c(const uint8_t *t, const int64_t *g, int64_t r, const float *xsc, const float *xs,
                       const int32_t *isum, int64_t s0, int64_t nfs) {
    float mul, z, tot = 0;
    digit_form((int)g[G_KIND], &mul, &z);
    for (int64_t s = s0; s < nfs; s++) {
        float A, B;
        span_ab(t, g, r, s, &A, &B);
        tot += A * mul * (xsc[s] * (float)isum[s]) + (B - z * A) * xs[s];
    }
    return tot;
}

/* ------------------------------------------------------------------------------------ AVX2 kernels */
/* No shuffles in the hot loop (one shuffle port on most x86 cores): digits are taken from the even
 * and the odd bytes of a 32-byte load into 16-bit lanes with shifts and masks, and x is stored
 * de-interleaved per span (xp: the 16 even positions, then the 16 odd ones) to match. Each span's
 * int32 lanes are turned to float and scaled by the span's coefficient c[s] = A * mul * xsc (a
 * broadcast from memory) into one float accumulator: nothing is summed across lanes until the row
 * ends. */
static int use_vnni;     /* see vnni_dot */
#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define LOAD32(p) _mm256_loadu_si256((const __m256i *)(p))

/* The VNNI instructions where the CPU has them (use_vnni: 0 none, 1 AVX-VNNI's VEX form, 2 AVX512-VNNI's
   EVEX form on 256-bit registers, 3 the same and 512-bit registers for several tokens' rows side by
   side, tiled_tokens_z). The one-row kernels reach them through inline assembly, so that one AVX2
   build serves every CPU (no target attribute to keep apart), and are instantiated for each level. The results are the same integers as the AVX2 sequences they replace: vpmaddubsw's pair
   sums never saturate here (digits and digit x scale bytes are at most 45) and vpmaddwd's never
   overflow, so the three paths agree bit for bit (tests/test_kernels.py).
   vnni_dot: acc + a x b with VNNI where vn says so: words 0 multiplies bytes (a unsigned, b signed) and sums four
   adjacent products into each int32 lane (vpdpbusd), words 1 int16s and sums two (vpdpwssd); vn 0 is
   the AVX2 sequence with the same result */
AVX2 static inline __attribute__((always_inline)) __m256i vnni_dot(const int vn, const int words, __m256i acc,
                                                                  __m256i a, __m256i b) {
    if (vn == 1 && words) __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
    else if (vn == 1) __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
    else if (vn >= 2 && words) __asm__("vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
    else if (vn >= 2) __asm__("vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
    else if (words) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
    else acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
    return acc;
}
#define dp_bytes(vn, acc, u, s) vnni_dot(vn, 0, acc, u, s)
#define dp_words(vn, acc, a, b) vnni_dot(vn, 1, acc, a, b)

AVX2 static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x quantised straight into the de-interleaved order xp[32s + i] = q(x[32s + 2i]),
   xp[32s + 16 + i] = q(x[32s + 2i + 1]), with the span scales and float sums */
AVX2 static void quantize_avx2(const float *x, int64_t cols, int16_t *xp, float *xsc, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i ev = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t s = 0; s < cols / 32; s++) {
        const float *v = x + 32 * s;
        __m256 f0 = _mm256_loadu_ps(v), f1 = _mm256_loadu_ps(v + 8), f2 = _mm256_loadu_ps(v + 16),
               f3 = _mm256_loadu_ps(v + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, f0), _mm256_andnot_ps(sign, f1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, f2), _mm256_andnot_ps(sign, f3)));
        float amax = hmax8(mx);
        xs[s] = hsum8(_mm256_add_ps(_mm256_add_ps(f0, f1), _mm256_add_ps(f2, f3)));
        xsc[s] = amax / XQ_MAX;
        __m256 inv = _mm256_set1_ps(amax > 0 ? XQ_MAX / amax : 0.0f);
        /* [0 2 4 6 | 1 3 5 7] of each 8, then evens and odds of 16 */
        __m256 p0 = _mm256_permutevar8x32_ps(f0, ev), p1 = _mm256_permutevar8x32_ps(f1, ev);
        __m256 p2 = _mm256_permutevar8x32_ps(f2, ev), p3 = _mm256_permutevar8x32_ps(f3, ev);
        __m256i e0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permute2f128_ps(p0, p1, 0x20), inv));
        __m256i o0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permute2f128_ps(p0, p1, 0x31), inv));
        __m256i e1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permute2f128_ps(p2, p3, 0x20), inv));
        __m256i o1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permute2f128_ps(p2, p3, 0x31), inv));
        _mm256_storeu_si256((__m256i *)(xp + 32 * s), _mm256_permute4x64_epi64(_mm256_packs_epi32(e0, e1), 0xD8));
        _mm256_storeu_si256((__m256i *)(xp + 32 * s + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(o0, o1), 0xD8));
    }
}

/* one span: even and odd digits (int16 lanes) times x, scaled by c into acc */
AVX2 static inline __m256 span(__m256 acc, __m256i even, __m256i odd, const int16_t *xp, const float *c) {
    __m256i v = _mm256_add_epi32(_mm256_madd_epi16(even, LOAD32(xp)), _mm256_madd_epi16(odd, LOAD32(xp + 16)));
    return _mm256_fmadd_ps(_mm256_broadcast_ss(c), _mm256_cvtepi32_ps(v), acc);
}

/* span with the VNNI level vn: the odd digits' products added as they are made (vpdpwssd), one
   instruction fewer; the same integers */
AVX2 static inline __attribute__((always_inline)) __m256 span_vn(const int vn, __m256 acc, __m256i even, __m256i odd,
                                                               const int16_t *xp, const float *c) {
    if (!vn) return span(acc, even, odd, xp, c);
    __m256i v = dp_words(vn, _mm256_madd_epi16(even, LOAD32(xp)), odd, LOAD32(xp + 16));
    return _mm256_fmadd_ps(_mm256_broadcast_ss(c), _mm256_cvtepi32_ps(v), acc);
}

/* The digits of chunk ch as int16 vectors: ev[k], od[k] for its spans k (the even and the odd bytes),
   each times digit_scale(kind, k): one shift per chunk brings the odd bytes down, then a mask per span
   (masks run on more ports than shifts). */
#define MASK(v, m) _mm256_and_si256(v, _mm256_set1_epi16(m))
AVX2 static inline __attribute__((always_inline)) void chunk_digits(const int kind, const uint8_t *codes, int64_t ch,
                                                                  int64_t lo_bytes, __m256i *ev, __m256i *od) {
    switch (kind) {
    case K_Q2: case K_Q2RTN: {
        __m256i v = LOAD32(codes + 32 * ch), vo = _mm256_srli_epi16(v, 8);
        for (int k = 0; k < 4; k++) { ev[k] = MASK(v, 3 << (2 * k)); od[k] = MASK(vo, 3 << (2 * k)); }
        break;
    }
    case K_Q4: {
        __m256i v = LOAD32(codes + 32 * ch), vo = _mm256_srli_epi16(v, 8);
        ev[0] = MASK(v, 15); od[0] = MASK(vo, 15);
        ev[1] = MASK(v, 240); od[1] = MASK(vo, 240);
        break;
    }
    case K_Q8: {
        __m256i v = LOAD32(codes + 32 * ch);
        ev[0] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8); od[0] = _mm256_srai_epi16(v, 8);
        break;
    }
    case K_Q6: {
        const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48), lo8 = _mm256_set1_epi16(255);
        __m256i l0 = LOAD32(codes + 64 * ch), l1 = LOAD32(codes + 64 * ch + 32), h = LOAD32(codes + lo_bytes + 32 * ch);
        __m256i d[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_and_si256(_mm256_slli_epi16(h, 4), m48)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15), _mm256_and_si256(_mm256_slli_epi16(h, 2), m48)),
            _mm256_or_si256(_mm256_and_si256(l1, m15), _mm256_and_si256(h, m48)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), _mm256_and_si256(_mm256_srli_epi16(h, 2), m48)),
        };
        for (int k = 0; k < 4; k++) { ev[k] = _mm256_and_si256(d[k], lo8); od[k] = _mm256_srli_epi16(d[k], 8); }
        break;
    }
    case K_T1: {   /* trit k of byte b is the high byte of 3 * (b * 3^k mod 256) */
        __m256i v = LOAD32(codes + 32 * ch), te = MASK(v, 255), to = _mm256_srli_epi16(v, 8);
        for (int k = 0; k < 5; k++) {
            __m256i ue = _mm256_add_epi16(te, _mm256_add_epi16(te, te)), uo = _mm256_add_epi16(to, _mm256_add_epi16(to, to));
            ev[k] = MASK(ue, 0xFF00); od[k] = MASK(uo, 0xFF00);
            te = MASK(ue, 255); to = MASK(uo, 255);
        }
        break;
    }
    default: {
        __m256i v = LOAD32(codes + 32 * ch), vo = _mm256_srli_epi16(v, 8);
        for (int k = 0; k < 8; k++) { ev[k] = MASK(v, 1 << k); od[k] = MASK(vo, 1 << k); }
    }
    }
}

/* the whole chunks of one row for one token: spc spans per chunk (a constant, so the span loop
   unrolls), four independent accumulators (one fma chain would wait on its own latency) */
AVX2 static inline __attribute__((always_inline)) __m256 dot_body(const int kind, const int vn, const int spc, const uint8_t *codes, int64_t nch, int64_t lo_bytes,
                                   const int16_t *x, const float *c, __m256 acc) {
    __m256i ev[8], od[8];
    __m256 a[4] = {acc, _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int k = 0; k < 8; k++) ev[k] = od[k] = _mm256_setzero_si256();
    for (int64_t ch = 0; ch < nch; ch++, x += 32 * spc, c += spc) {
        if (!(ch & 1)) {                         /* a chunk is 32 bytes of codes (q6: 64 + 32) */
            __builtin_prefetch(codes + (kind == K_Q6 ? 64 : 32) * ch + CODE_PREFETCH);
            if (kind == K_Q6) {
                __builtin_prefetch(codes + 64 * ch + 64 + CODE_PREFETCH);
                __builtin_prefetch(codes + lo_bytes + 32 * ch + CODE_PREFETCH);
            }
        }
        chunk_digits(kind, codes, ch, lo_bytes, ev, od);
        for (int k = 0; k < spc; k++) a[k & 3] = span_vn(vn, a[k & 3], ev[k], od[k], x + 32 * k, c + k);
    }
    return _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
}


/* (A, B) of spans 8b .. 8b+7 as vectors: F16C for the binary16 parameters, one layout per codec */
AVX2 static inline __attribute__((always_inline)) void params8(const int kind, const uint8_t *po, const uint8_t *so,
                                                             int64_t b, __m256 *A, __m256 *B) {
    const __m256i m15 = _mm256_set1_epi32(15);
    __m128 dm;
    switch (kind) {
    case K_Q8:
        *A = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(po + 16 * b)));
        *B = _mm256_setzero_ps();
        return;
    case K_Q2RTN: {
        __m256 p = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(po + 16 * b)));
        *A = _mm256_permutevar8x32_ps(p, _mm256_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6));
        *B = _mm256_permutevar8x32_ps(p, _mm256_setr_epi32(1, 1, 3, 3, 5, 5, 7, 7));
        return;
    }
    case K_Q6: case K_T1: {   /* d per super-block */
        uint16_t h;
        memcpy(&h, po + 2 * b, 2);
        __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
        __m256i v;
        if (kind == K_Q6) {
            v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(so + 8 * b)));
        } else {              /* eight 4-bit scales in 4 bytes */
            uint32_t w;
            memcpy(&w, so + 4 * b, 4);
            v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), m15);
        }
        *A = _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
        *B = _mm256_setzero_ps();
        return;
    }
    default: {                /* q2, q4, q1: d, m per super-block */
        uint32_t w;
        memcpy(&w, po + 4 * b, 4);
        dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)w));
        __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        if (kind == K_Q2) {
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(so + 8 * b)));
            *A = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v, m15)));
            *B = _mm256_mul_ps(m, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
        } else if (kind == K_Q4) {
            __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(so + 16 * b)));
            *A = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(255))));
            *B = _mm256_mul_ps(m, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 8)));
        } else {              /* q1 */
            uint32_t w4;
            memcpy(&w4, so + 4 * b, 4);
            __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w4), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), m15);
            *A = _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
            *B = m;
        }
    }
    }
}

/* c[s] = A * mul * xsc[s] / scale(s) and c[nfs + s] = B - z * A for spans 0 .. nfs-1, and the sum of
   (B - z * A) * xs as the return value; scale(s) is digit_scale (the AVX2 digits' power of two) if
   `scaled`, else 1. Eight spans per step. */
AVX2 static inline __attribute__((always_inline)) float coefs_kind(const int kind, const uint8_t *t, const int64_t *g,
                                                                 int64_t r, const float *xsc, const float *xs,
                                                                 int64_t nfs, float *c, int scaled) {
    float mul, z;
    digit_form(kind, &mul, &z);
    const uint8_t *po = t + g[G_OFFPAR] + r * g[G_PARROW];
    const uint8_t *so = t + g[G_OFFSUB] + r * g[G_SUBROW];
    int64_t nb = nfs / 8;
    __m256 acc = _mm256_setzero_ps(), vz = _mm256_set1_ps(z), vm = _mm256_set1_ps(mul);
    if (scaled) {
        float inv[8];
        for (int k = 0; k < 8; k++) inv[k] = 1.0f / digit_scale(kind, k);
        vm = _mm256_mul_ps(vm, _mm256_loadu_ps(inv));
    }
    for (int64_t b = 0; b < nb; b++) {
        __m256 A, B;
        params8(kind, po, so, b, &A, &B);
        __m256 e = _mm256_fnmadd_ps(vz, A, B);
        _mm256_storeu_ps(c + 8 * b, _mm256_mul_ps(_mm256_mul_ps(A, vm), _mm256_loadu_ps(xsc + 8 * b)));
        _mm256_storeu_ps(c + nfs + 8 * b, e);
        acc = _mm256_fmadd_ps(e, _mm256_loadu_ps(xs + 8 * b), acc);
    }
    float tot = hsum8(acc);
    if (8 * nb < nfs) {       /* the last spans: their group's parameters exist (the row goes on past them) */
        float As[8], Bs[8];
        __m256 A, B;
        params8(kind, po, so, nb, &A, &B);
        _mm256_storeu_ps(As, A);
        _mm256_storeu_ps(Bs, B);
        for (int64_t s = 8 * nb; s < nfs; s++) {
            float a = As[s - 8 * nb], e = Bs[s - 8 * nb] - z * a;
            c[s] = a * (mul / (scaled ? digit_scale(kind, s) : 1.0f)) * xsc[s];
            c[nfs + s] = e;
            tot += e * xs[s];
        }
    }
    return tot;
}

AVX2 static float coefs_avx2(const uint8_t *t, const int64_t *g, int64_t r, const float *xsc, const float *xs,
                             int64_t nfs, float *c, int scaled) {
    switch ((int)g[G_KIND]) {
    case K_Q8: return coefs_kind(K_Q8, t, g, r, xsc, xs, nfs, c, scaled);
    case K_Q6: return coefs_kind(K_Q6, t, g, r, xsc, xs, nfs, c, scaled);
    case K_Q4: return coefs_kind(K_Q4, t, g, r, xsc, xs, nfs, c, scaled);
    case K_Q2: return coefs_kind(K_Q2, t, g, r, xsc, xs, nfs, c, scaled);
    case K_Q2RTN: return coefs_kind(K_Q2RTN, t, g, r, xsc, xs, nfs, c, scaled);
    case K_T1: return coefs_kind(K_T1, t, g, r, xsc, xs, nfs, c, scaled);
    default: return coefs_kind(K_Q1, t, g, r, xsc, xs, nfs, c, scaled);
    }
}

/* Several tokens through the same rows (prefill): each chunk's digits are taken out of the codes once
 * and multiplied by every token's activations.
 * acc[r * ntok + t] += the whole chunks of rows 0 .. nr-1 (codes of row r at codes + r * row_bytes)
   for tokens 0 .. ntok-1 (x of token t at xp + t * cols), C[(r * ntok + t) * nsp + s] the span
   coefficients. Chunk by chunk over the whole block of rows: one chunk of every token's x (a few KiB)
   stays in L1 while all the rows use it. */
AVX2 static inline __attribute__((always_inline)) void multi_body(const int kind, const int spc, const uint8_t *codes, int64_t row_bytes, int nr,
                                   int64_t nch, int64_t lo_bytes, const int16_t *xp, int64_t cols, int ntok,
                                   const float *C, int64_t nsp, __m256 *acc) {
    __m256i ev[8], od[8];
    for (int k = 0; k < 8; k++) ev[k] = od[k] = _mm256_setzero_si256();
    for (int64_t ch = 0; ch < nch; ch++) {
        int64_t s0 = ch * spc;
        for (int r = 0; r < nr; r++) {
            chunk_digits(kind, codes + r * row_bytes, ch, lo_bytes, ev, od);
            __m256 *ar = acc + r * ntok;
            const float *cr = C + (int64_t)r * ntok * nsp + s0;
            for (int t = 0; t < ntok; t++) {
                const int16_t *x = xp + t * cols + 32 * s0;
                const float *c = cr + t * nsp;
                __m256 a = ar[t];
                for (int k = 0; k < spc; k++) a = span(a, ev[k], od[k], x + 32 * k, c + k);
                ar[t] = a;
            }
        }
    }
}

AVX2 static void multi_avx2(int kind, const uint8_t *codes, int64_t row_bytes, int nr, int64_t done, int64_t cols,
                            const int16_t *xp, int ntok, const float *C, int64_t nsp, __m256 *acc) {
    int64_t lb = q6_lo_bytes(cols);
    switch (kind) {   /* constant spans per chunk: the span loop unrolls */
    case K_Q2: case K_Q2RTN: multi_body(K_Q2, 4, codes, row_bytes, nr, done / 128, lb, xp, cols, ntok, C, nsp, acc); break;
    case K_Q4: multi_body(K_Q4, 2, codes, row_bytes, nr, done / 64, lb, xp, cols, ntok, C, nsp, acc); break;
    case K_Q8: multi_body(K_Q8, 1, codes, row_bytes, nr, done / 32, lb, xp, cols, ntok, C, nsp, acc); break;
    case K_Q6: multi_body(K_Q6, 4, codes, row_bytes, nr, done / 128, lb, xp, cols, ntok, C, nsp, acc); break;
    case K_T1: multi_body(K_T1, 5, codes, row_bytes, nr, done / 160, lb, xp, cols, ntok, C, nsp, acc); break;
    default: multi_body(K_Q1, 8, codes, row_bytes, nr, done / 256, lb, xp, cols, ntok, C, nsp, acc); break;
    }
}
#endif

static int use_avx2;
/* the codec kinds (bit 1 << kind) whose one-token products take int8 activations (set_x8); row_x8
   serves q2, q4, q6 and q1 */
#define X8_CAPABLE ((1 << K_Q2) | (1 << K_Q4) | (1 << K_Q6) | (1 << K_Q1) | (1 << K_T1))  /* t1: see rows_t1_xt */
static int x8_kinds = 1 << K_Q2;
static inline int x8_kind(int kind) { return kind >= 0 && kind < 31 && ((x8_kinds >> kind) & 1); }
extern int ggml_avx2;

/* ---------------------------------------------------------------------------------------- one row */

static const float ones32[32] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

/* a . b over 32 floats in eight independent partial sums (one running sum would wait on the
   latency of every add) */
static inline float dot32(const float *a, const float *b) {
    float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < 32; j += 8)
        for (int i = 0; i < 8; i++) p[i] += a[j + i] * b[j + i];      /* one vector of lanes in AVX2 builds */
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

#if HAVE_X86
AVX2 static float dot32_avx2(const float *a, const float *b) {
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int j = 8; j < 32; j += 8) p = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), p);
    return hsum8(p);
}
#endif

/* how many of row r's outliers apply: all k, or those before the first column that is out of range
   or not increasing, which flags corrupt data unless the row's columns are all zero (a sparse hole
   of a synthetic file) */
static int64_t outliers_valid(const uint8_t *t, const int64_t *g, int64_t r, atomic_int *bad) {
    int64_t k = g[G_K], cols = g[G_COLS], prev = -1;
    const uint8_t *oc = t + g[G_OFFOCOL] + 2 * r * k;
    for (int64_t i = 0; i < k; i++) {
        int64_t col = oc[2 * i] | (oc[2 * i + 1] << 8);
        if (col >= cols || col <= prev) {
            for (int64_t i2 = 0; i2 < k; i2++)
                if (oc[2 * i2] || oc[2 * i2 + 1]) atomic_store(bad, 1);
            return i;
        }
        prev = col;
    }
    return k;
}

/* the tail of row r (columns past the whole chunks) times x, in float */
#if HAVE_X86
__attribute__((target_clones("avx2", "default")))
#endif
static float tail_sum(const uint8_t *t, const int64_t *g, int64_t r, const uint8_t *codes, const float *x) {
    int64_t cols = g[G_COLS], done = full_cols(g);
    float tot = 0;
    float lev[256];                                             /* a tail is shorter than a chunk */
    if (done < cols) {
        tail_levels(codes, g, done, r + 1 < g[G_ROWS], lev);
        for (int64_t s = done / 32; s < cols / 32; s++) {
            float A, B;
            span_ab(t, g, r, s, &A, &B);
#if HAVE_X86
            if (use_avx2) {
                tot += A * dot32_avx2(lev + 32 * s - done, x + 32 * s) + (B != 0 ? B * dot32_avx2(ones32, x + 32 * s) : 0);
                continue;
            }
#endif
            tot += A * dot32(lev + 32 * s - done, x + 32 * s) + B * dot32(ones32, x + 32 * s);
        }
    }
    return tot;
}

/* the tail and the outlier corrections of row r for input x: what to add to the whole chunks' sum. An
   outlier's stored value is its correction to the value its digit decodes to, so it only adds
   correction * x: the sums already hold the digit's part. */
static float row_fixups(const uint8_t *t, const int64_t *g, int64_t r, const uint8_t *codes, const float *x,
                        atomic_int *bad) {
    int64_t k = g[G_K];
    float tot = tail_sum(t, g, r, codes, x);
    const uint8_t *oc = t + g[G_OFFOCOL] + 2 * r * k, *ov = t + g[G_OFFOVAL] + 2 * r * k;
    int64_t n = outliers_valid(t, g, r, bad);
    for (int64_t i = 0; i < n; i++)
        tot += f16_at(ov + 2 * i) * x[oc[2 * i] | (oc[2 * i + 1] << 8)];
    return tot;
}

static inline void prefetch_lines(const uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i);
}

static inline void prefetch_next_row(const uint8_t *t, const int64_t *g, int64_t r) {
    /* all of the next row's small streams (parameters, scales, outliers): too short and too many for
       the hardware prefetcher to pick up in time, and a row's set-up reads each of them whole before
       its first product (q2 at 7168 columns: 224 bytes of scales, 112 of parameters). Not where a
       row's scales take less than a cache line: the next row's then mostly lie in lines this one
       brought in, and the prefetches cost more than they saved (q2 1024x1024 on a Zen 4: 1.03x
       without them, 7168x2048 and 2048x7168 even) */
    if (r + 1 < g[G_ROWS] && g[G_SUBROW] >= 64) {
        int64_t n = r + 1;
        prefetch_lines(t + g[G_OFFPAR] + n * g[G_PARROW], g[G_PARROW]);
        prefetch_lines(t + g[G_OFFSUB] + n * g[G_SUBROW], g[G_SUBROW]);
        prefetch_lines(t + g[G_OFFOCOL] + 2 * n * g[G_K], 2 * g[G_K]);
        prefetch_lines(t + g[G_OFFOVAL] + 2 * n * g[G_K], 2 * g[G_K]);
    }
}

#if HAVE_X86
#define OUTLIERS_SCALAR 8          /* see outlier_sum */

/* the outliers' corrections times x on the AVX2 paths, checked in the same pass (outliers_valid's rule):
   eight at a time, binary16 through F16C, x gathered (a scalar loop per outlier was a sixth of a q2
   row's time: its sums went through the stack); a row of OUTLIERS_SCALAR or fewer, and a last
   OUTLIERS_SCALAR / 2 or fewer past the groups of eight, one at a time (the masked gather of eight
   lanes and its sum took a q2 row of 1024 columns with two outliers 12 % of its time, as long as its
   scales' set-up) */
AVX2 static inline __attribute__((always_inline)) float outlier_sum(const uint8_t *t, const int64_t *g, int64_t r,
                                                                  const float *x, atomic_int *bad) {
    int64_t k = g[G_K], cols = g[G_COLS], i = 0;
    const uint8_t *oc = t + g[G_OFFOCOL] + 2 * r * k, *ov = t + g[G_OFFOVAL] + 2 * r * k;
    __m256 acc = _mm256_setzero_ps();
    const int gathered = k > OUTLIERS_SCALAR;
    if (gathered) {
        __m256i prev = _mm256_set1_epi32(-1), lim = _mm256_set1_epi32((int)cols);
        /* eight at a time: the columns checked (increasing, inside the row) with two compares, x gathered */
        for (; i + 8 <= k; i += 8) {
            __m256i c = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(oc + 2 * i)));
            /* each column's predecessor: the previous eight's last, then these shifted up by one */
            __m256i before = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(7, 0, 1, 2, 3, 4, 5, 6));
            before = _mm256_blend_epi32(before, prev, 1);
            __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(c, before), _mm256_cmpgt_epi32(lim, c));
            if (_mm256_movemask_ps(_mm256_castsi256_ps(ok)) != 0xFF) break;
            __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ov + 2 * i)));
            acc = _mm256_fmadd_ps(v, _mm256_i32gather_ps(x, c, 4), acc);
            prev = _mm256_permutevar8x32_epi32(c, _mm256_set1_epi32(7));
        }
        /* a last five to seven the same way, masked, where sixteen bytes from each array's next one are
           still inside the tensor (after a scalar loop's sum they had waited on each other row by row) */
        const uint8_t *end = t + g[G_NBYTES];
        if (k - i > OUTLIERS_SCALAR / 2 && oc + 2 * i + 16 <= end && ov + 2 * i + 16 <= end) {
            __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(k - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            __m256i c = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(oc + 2 * i)));
            __m256i before = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(7, 0, 1, 2, 3, 4, 5, 6));
            before = _mm256_blend_epi32(before, prev, 1);
            __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(c, before), _mm256_cmpgt_epi32(lim, c));
            if (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_or_si256(ok, _mm256_xor_si256(live, _mm256_set1_epi32(-1))))) == 0xFF) {
                /* the lanes past the row's outliers: no load, and 0 x 0 (their bytes may decode to NaN) */
                __m256 v = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ov + 2 * i))), _mm256_castsi256_ps(live));
                acc = _mm256_fmadd_ps(v, _mm256_mask_i32gather_ps(_mm256_setzero_ps(), x, c, _mm256_castsi256_ps(live), 4), acc);
                i = k;
            }
        }
    }
    int64_t last = i ? (int64_t)(oc[2 * i - 2] | (oc[2 * i - 1] << 8)) : -1;
    float tot = 0;
    for (; i < k; i++) {
        int64_t col = oc[2 * i] | (oc[2 * i + 1] << 8);
        if (col >= cols || col <= last) {
            outliers_valid(t, g, r, bad);             /* flags corrupt data as the general path does */
            break;
        }
        last = col;
        uint16_t vw;
        memcpy(&vw, ov + 2 * i, 2);
        tot += _cvtsh_ss(vw) * x[col];
    }
    return gathered ? hsum8(acc) + tot : tot;
}

/* the rows of one job for one token, the codec a constant: coefficients, the whole chunks, then the
   outliers (or the general fix-ups for a row with a tail), all inlined into one loop */
AVX2 static inline __attribute__((always_inline)) void rows_kind(const int kind, const int vn, const int spc, const int64_t chunk,
                                                               const uint8_t *t, const int64_t *g, int64_t r0,
                                                               int64_t r1, const float *x, const int16_t *xq,
                                                               const int16_t *xp, const float *xsc, const float *xs,
                                                               float *c, float *out, atomic_int *bad) {
    int64_t cols = g[G_COLS], done = full_cols(g), nfs = done / 32, lb = q6_lo_bytes(cols);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *codes = t + g[G_OFFCODE] + r * g[G_CODEROW];
        prefetch_next_row(t, g, r);
        float tot = coefs_kind(kind, t, g, r, xsc, xs, nfs, c, 1);
        tot += hsum8(dot_body(kind == K_Q2RTN ? K_Q2 : kind, vn, spc, codes, done / chunk, lb, xp, c, _mm256_setzero_ps()));
        tot += outlier_sum(t, g, r, x, bad) + (done < cols ? tail_sum(t, g, r, codes, x) : 0.0f);
        out[r - r0] = tot;
    }
}

AVX2 static inline __attribute__((always_inline)) void rows_avx2_vn(const int vn, const uint8_t *t, const int64_t *g,
                                                                  int64_t r0, int64_t r1, const float *x, const int16_t *xq,
                                                                  const int16_t *xp, const float *xsc, const float *xs,
                                                                  float *c, float *out, atomic_int *bad) {
    switch ((int)g[G_KIND]) {
    case K_Q2: rows_kind(K_Q2, vn, 4, 128, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    case K_Q2RTN: rows_kind(K_Q2RTN, vn, 4, 128, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    case K_Q4: rows_kind(K_Q4, vn, 2, 64, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    case K_Q8: rows_kind(K_Q8, vn, 1, 32, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    case K_Q6: rows_kind(K_Q6, vn, 4, 128, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    case K_T1: rows_kind(K_T1, vn, 5, 160, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    default: rows_kind(K_Q1, vn, 8, 256, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    }
}

AVX2 static void rows_avx2(const uint8_t *t, const int64_t *g, int64_t r0, int64_t r1, const float *x, const int16_t *xq,
                           const int16_t *xp, const float *xsc, const float *xs, float *c, float *out, atomic_int *bad) {
    switch (use_vnni) {
    case 1: rows_avx2_vn(1, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    case 2: case 3: rows_avx2_vn(2, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    default: rows_avx2_vn(0, t, g, r0, r1, x, xq, xp, xsc, xs, c, out, bad); break;
    }
}
#endif

#if HAVE_X86
/* -------------------------------------------------------------- q2, q4, q6 times 8-bit activations */
/* x as int8 with one float scale per 128 values (one q2 chunk, two q4 chunks, one q6 chunk). The four
 * spans of 128 columns are multiplied as bytes (vpmaddubsw: the unsigned digits times the signed
 * inputs), each span's int16 pairs are scaled by its integer sub-block scale in the same step that
 * widens them (vpmaddwd), and 128 weights end in one conversion and one fused multiply-add by
 * d * step(x) (x8d holds quarter steps: q2's digits of spans 1 and 3 are masked in place as 4x the
 * digit, and the other spans' scales are multiplied by 4 to match). The offsets (m * mc for q2 and
 * q4, -32 * d * sc for q6) multiply the sums per span of the rounded inputs (not the exact ones: so
 * each weight as a whole, not only its distance from the offset, multiplies the rounded input, and
 * the rounding error is sum_j w_j (x^_j - x_j), as small as that of signed codes), and each outlier
 * replaces what the sums took for its column. */
/* x rounded to -top .. top per 128 values into q, with qd[block] = amax / qdiv and qs[span] the rounded
   values' sum times the step (amax / top) */
AVX2 static inline __attribute__((always_inline)) void quantize_blocks(const float *x, int64_t cols, int8_t *q, float *qd,
                                                                     float *qs, const float top, const float qdiv) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t c0 = 0; c0 < cols; c0 += 128) {
        int64_t n = cols - c0 < 128 ? cols - c0 : 128;          /* a multiple of 32 */
        __m256 mx = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + c0 + j)));
        float amax = hmax8(mx);
        qd[c0 / 128] = amax / qdiv;
        __m256 inv = _mm256_set1_ps(amax > 0 ? top / amax : 0.0f);
        for (int64_t j = 0; j < n; j += 32) {
            const float *v = x + c0 + j;
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), inv));
            __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), inv));
            __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), inv));
            __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), inv));
            /* the rounded values' sum over the 32 (exact in float: at most 32 * 127) times the step */
            qs[(c0 + j) / 32] = hsum8(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d)))) *
                                (amax / top);
            /* packs interleave the 128-bit lanes: one permute puts the 32 bytes back in order */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
            _mm256_storeu_si256((__m256i *)(q + c0 + j), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
    }
}

/* the largest int8 input magnitude (set_x8_levels; 127 but in measurements of what coarser inputs,
   such as a table-lookup kernel's, would cost) */
static float x8_levels = 127.0f;

/* int8 inputs: qd holds a quarter of the step (see row_x8) */
AVX2 static void quantize_x8(const float *x, int64_t cols, int8_t *q, float *qd, float *qs) {
    quantize_blocks(x, cols, q, qd, qs, x8_levels, 4.0f * x8_levels);
}

/* The four spans of 128 columns as bytes: q2's digits masked in place (spans 1 and 3 come out 4x, their
   scales are not multiplied by 4 as those of spans 0 and 2 are), q4's nibbles, q6's six bits. */
AVX2 static inline __attribute__((always_inline)) void digits128(const int kind, const uint8_t *codes, int64_t q,
                                                               const int odd, int64_t lo_bytes, __m256i *d) {
    const __m256i k3 = _mm256_set1_epi8(3), k12 = _mm256_set1_epi8(12), k15 = _mm256_set1_epi8(15);
    if (kind == K_T1) {                           /* codes: the row's digits as bytes (t1_row_digits) */
        for (int k = 0; k < 4; k++) d[k] = LOAD32(codes + 128 * q + 32 * k);
    } else if (kind == K_Q1) {                           /* bits 4 odd .. 4 odd + 3 of a 256-column chunk, in place */
        __m256i v = LOAD32(codes + 32 * (q >> 1));
        for (int k = 0; k < 4; k++) d[k] = _mm256_and_si256(v, _mm256_set1_epi8((char)(1 << (4 * odd + k))));
    } else if (kind == K_Q2) {
        __m256i v = LOAD32(codes + 32 * q), vs = _mm256_srli_epi16(v, 4);
        d[0] = _mm256_and_si256(v, k3); d[1] = _mm256_and_si256(v, k12);
        d[2] = _mm256_and_si256(vs, k3); d[3] = _mm256_and_si256(vs, k12);
    } else if (kind == K_Q4) {
        __m256i v0 = LOAD32(codes + 64 * q), v1 = LOAD32(codes + 64 * q + 32);
        d[0] = _mm256_and_si256(v0, k15); d[1] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), k15);
        d[2] = _mm256_and_si256(v1, k15); d[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), k15);
    } else {                                      /* q6: low nibbles | high two bits << 4 */
        const __m256i k48 = _mm256_set1_epi8(48);
        __m256i l0 = LOAD32(codes + 64 * q), l1 = LOAD32(codes + 64 * q + 32), h = LOAD32(codes + lo_bytes + 32 * q);
        d[0] = _mm256_or_si256(_mm256_and_si256(l0, k15), _mm256_and_si256(_mm256_slli_epi16(h, 4), k48));
        d[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), k15), _mm256_and_si256(_mm256_slli_epi16(h, 2), k48));
        d[2] = _mm256_or_si256(_mm256_and_si256(l1, k15), _mm256_and_si256(h, k48));
        d[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), k15), _mm256_and_si256(_mm256_srli_epi16(h, 2), k48));
    }
}

/* 128 weights times their int8 inputs, each span's byte products widened and scaled by its integer
   scale in one vpmaddwd (with VNNI: vpdpwssd, which adds as it goes), as 8 floats */
AVX2 static inline __attribute__((always_inline)) __m256 block128_x8(const int kind, const int vn, const uint8_t *codes,
                                                                   int64_t q, const int odd, int64_t lo_bytes,
                                                                   const int8_t *xc, const int32_t *sw) {
    __m256i d[4];
    digits128(kind, codes, q, odd, lo_bytes, d);
    if (vn) {
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(d[0], LOAD32(xc)), _mm256_set1_epi32(sw[0]));
        p = dp_words(vn, p, _mm256_maddubs_epi16(d[1], LOAD32(xc + 32)), _mm256_set1_epi32(sw[1]));
        __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(d[2], LOAD32(xc + 64)), _mm256_set1_epi32(sw[2]));
        p2 = dp_words(vn, p2, _mm256_maddubs_epi16(d[3], LOAD32(xc + 96)), _mm256_set1_epi32(sw[3]));
        return _mm256_cvtepi32_ps(_mm256_add_epi32(p, p2));
    }
    __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(d[0], LOAD32(xc)), _mm256_set1_epi32(sw[0]));
    __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(d[1], LOAD32(xc + 32)), _mm256_set1_epi32(sw[1]));
    __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(d[2], LOAD32(xc + 64)), _mm256_set1_epi32(sw[2]));
    __m256i p3 = _mm256_madd_epi16(_mm256_maddubs_epi16(d[3], LOAD32(xc + 96)), _mm256_set1_epi32(sw[3]));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
}

/* prefetch the code bytes CODE_PREFETCH ahead of blocks q and q + 1, as one stream: a row's bytes in
   the order they are read (q6's high bits after its nibbles, then the next row's), one cache line for
   every 64 bytes the two blocks consume (per 128 columns: q1 16, q2 32, q4 64, q6 96) */
AVX2 static inline __attribute__((always_inline)) void x8_prefetch(const int kind, const uint8_t *codes, int64_t q) {
    const uint8_t *p = codes + CODE_PREFETCH;
    if (kind == K_Q1) {
        if (!(q & 3)) __builtin_prefetch(p + 16 * q);
    } else if (kind == K_Q2) {
        __builtin_prefetch(p + 32 * q);
    } else if (kind == K_Q4) {
        __builtin_prefetch(p + 64 * q);
        __builtin_prefetch(p + 64 * q + 64);
    } else {
        __builtin_prefetch(p + 96 * q);
        __builtin_prefetch(p + 96 * q + 64);
        __builtin_prefetch(p + 96 * q + 128);
    }
}

/* what row_x8 multiplies span s's stored digit and int8 input by, cc aside: the integer scale times
   the digit's factor in the byte (q2's spans 1 and 3, q1's bit positions) and the step's (4) */
static inline int x8_scale(int kind, const uint8_t *so, int64_t s) {
    switch (kind) {
    case K_Q1: return ((so[s >> 1] >> (4 * (s & 1))) & 15) * 128;
    case K_T1: return ((so[s >> 1] >> (4 * (s & 1))) & 15) * 4;
    case K_Q2: return (so[s] & 15) * 4;
    case K_Q4: return so[2 * s] * 4;
    default: return so[s] * 4;
    }
}

/* Row r's constants for int8 inputs (cols a multiple of 128; q2, q4, q6, q1, or t1 whose digits are taken
   out beforehand): each span's integer scale in both int16 halves (scw [nfs]), its offset coefficient
   (bs [nfs]: the weight at digit 0, to multiply the sums of x per span), and per 128 columns the float
   factor dq [nfs / 4] = d / (the scales' factor), to multiply by each input's quarter step. With one
   token's x8d and sums xs (not NULL: a constant in each inlined copy) dq comes out times x8d and the
   offsets' sum is returned instead of bs (only a last, shorter super-block's bs are written). */
AVX2 static inline __attribute__((always_inline)) float row_x8_setup(const int kind, const uint8_t *t, const int64_t *g,
                                                                   int64_t r, int32_t *scw, float *dq, float *bs,
                                                                   const float *x8d, const float *xs) {
    int64_t nfs = g[G_COLS] / 32, nsb = nfs / 8;
    const uint8_t *po = t + g[G_OFFPAR] + r * g[G_PARROW], *so = t + g[G_OFFSUB] + r * g[G_SUBROW];
    const __m256i m15 = _mm256_set1_epi32(15), m255 = _mm256_set1_epi32(255);
    /* x8d is a quarter step; q2's scales carry 4 (digits 4x), q1's 128 (each bit in place, its scale
       shifted to match) and its levels are 2c - 1 */
    const float four = kind == K_Q2 ? 1.0f : kind == K_Q1 ? 1.0f / 16 : 4.0f;
    __m256 off = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m256i sc;
        __m256 B;
        float d;
        if (kind == K_Q1) {
            uint32_t w, w4;
            memcpy(&w, po + 4 * b, 4);
            memcpy(&w4, so + 4 * b, 4);
            __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)w));
            d = _mm_cvtss_f32(dm);
            __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w4), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), m15);
            sc = _mm256_sllv_epi32(v, _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0));
            B = _mm256_fnmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(v), _mm256_broadcastss_ps(_mm_movehdup_ps(dm)));   /* m - A */
        } else if (kind == K_Q6) {
            uint16_t h;
            memcpy(&h, po + 2 * b, 2);
            d = _cvtsh_ss(h);
            sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(so + 8 * b)));
            B = _mm256_mul_ps(_mm256_set1_ps(-32.0f * d), _mm256_cvtepi32_ps(sc));
        } else if (kind == K_T1) {                /* levels c - 1: the weight at digit 0 is -d * sc */
            uint16_t h;
            uint32_t w4;
            memcpy(&h, po + 2 * b, 2);
            memcpy(&w4, so + 4 * b, 4);
            d = _cvtsh_ss(h);
            sc = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w4), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), m15);
            B = _mm256_mul_ps(_mm256_set1_ps(-d), _mm256_cvtepi32_ps(sc));
        } else {
            uint32_t w;
            memcpy(&w, po + 4 * b, 4);
            __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)w));
            d = _mm_cvtss_f32(dm);
            __m256i v, mc;
            if (kind == K_Q2) {
                v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(so + 8 * b)));
                sc = _mm256_sllv_epi32(_mm256_and_si256(v, m15), _mm256_setr_epi32(2, 0, 2, 0, 2, 0, 2, 0));
                mc = _mm256_srli_epi32(v, 4);
            } else {
                v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(so + 16 * b)));
                sc = _mm256_and_si256(v, m255);
                mc = _mm256_srli_epi32(v, 8);
            }
            B = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)), _mm256_cvtepi32_ps(mc));
        }
        _mm256_storeu_si256((__m256i *)(scw + 8 * b), _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)));
        if (xs) {                                 /* one token: the offsets summed here, bs not kept */
            off = _mm256_fmadd_ps(B, _mm256_loadu_ps(xs + 8 * b), off);
            __m128 q2x = _mm_castpd_ps(_mm_load_sd((const double *)(x8d + 2 * b)));
            _mm_store_sd((double *)(dq + 2 * b), _mm_castps_pd(_mm_mul_ps(_mm_set1_ps(d * four), q2x)));
        } else {
            _mm256_storeu_ps(bs + 8 * b, B);
            dq[2 * b] = dq[2 * b + 1] = d * four;
        }
    }
    float tot = xs ? hsum8(off) : 0.0f;
    for (int64_t s = 8 * nsb; s < nfs; s++) {          /* a last, shorter super-block */
        float A, B;
        span_ab(t, g, r, s, &A, &B);
        int sc = kind == K_Q1 ? x8_scale(kind, so, s) >> (s & 7) : x8_scale(kind, so, s) / 4;
        if (kind == K_Q2 && !(s & 1)) sc *= 4;
        scw[s] = sc | (sc << 16);
        bs[s] = kind == K_Q6 ? -32.0f * A : kind == K_Q1 ? B - A : kind == K_T1 ? -A : B;
        if (xs) tot += bs[s] * xs[s];
        if ((s & 3) == 0)
            dq[s / 4] = (kind == K_Q6 || kind == K_T1 ? f16_at(po + 2 * nsb) : f16_at(po + 4 * nsb)) * four *
                        (xs ? x8d[s / 4] : 1.0f);
    }
    return tot;
}

/* Row r (no tail, cols a multiple of 128) of a q2, q4, q6 or q1 tensor times x (x8, x8d: int8 per 128;
   xs: the rounded inputs' sums per 32), with row_x8_setup's constants. Scratch: scw [nfs], cc [nfs / 4], bs [nfs]. */
AVX2 static inline __attribute__((always_inline)) float row_x8(const int kind, const int vn, const uint8_t *t, const int64_t *g, int64_t r,
                                                             const float *x, const int8_t *x8, const float *x8d,
                                                             const float *xs, int32_t *scw, float *cc, float *bs,
                                                             atomic_int *bad) {
    int64_t cols = g[G_COLS], nq = cols / 128, lb = q6_lo_bytes(cols);
    const uint8_t *codes = t + g[G_OFFCODE] + r * g[G_CODEROW];
    float off = row_x8_setup(kind, t, g, r, scw, cc, bs, x8d, xs);      /* cc: each block's factor */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t q = 0;
    for (; q + 1 < nq; q += 2) {              /* two blocks per step: two independent accumulators */
        x8_prefetch(kind, codes, q);
        acc0 = _mm256_fmadd_ps(block128_x8(kind, vn, codes, q, 0, lb, x8 + 128 * q, scw + 4 * q), _mm256_broadcast_ss(cc + q), acc0);
        acc1 = _mm256_fmadd_ps(block128_x8(kind, vn, codes, q + 1, 1, lb, x8 + 128 * q + 128, scw + 4 * q + 4),
                               _mm256_broadcast_ss(cc + q + 1), acc1);
    }
    if (q < nq)
        acc0 = _mm256_fmadd_ps(block128_x8(kind, vn, codes, q, 0, lb, x8 + 128 * q, scw + 4 * q), _mm256_broadcast_ss(cc + q), acc0);
    float sum = hsum8(_mm256_add_ps(acc0, acc1)) + off;
    return g[G_K] >= 8 ? sum : sum + outlier_sum(t, g, r, x, bad);    /* eight or more: rows_x8's second pass */
}

AVX2 static inline __attribute__((always_inline)) void rows_x8_vn(const int vn, const uint8_t *t, const int64_t *g,
                                                               int64_t r0, int64_t r1, const float *x, const int8_t *x8,
                                                               const float *x8d, const float *xs, float *scratch,
                                                               float *out, atomic_int *bad) {
    int64_t nfs = g[G_COLS] / 32;
    int32_t *scw = (int32_t *)scratch;
    float *cc = scratch + nfs + 8, *bs = cc + nfs / 4 + 8;
    for (int64_t r = r0; r < r1; r++) {
        prefetch_next_row(t, g, r);
        switch ((int)g[G_KIND]) {
        case K_Q2: out[r - r0] = row_x8(K_Q2, vn, t, g, r, x, x8, x8d, xs, scw, cc, bs, bad); break;
        case K_Q4: out[r - r0] = row_x8(K_Q4, vn, t, g, r, x, x8, x8d, xs, scw, cc, bs, bad); break;
        case K_Q1: out[r - r0] = row_x8(K_Q1, vn, t, g, r, x, x8, x8d, xs, scw, cc, bs, bad); break;
        default: out[r - r0] = row_x8(K_Q6, vn, t, g, r, x, x8, x8d, xs, scw, cc, bs, bad); break;
        }
    }
    /* rows of eight outliers or more: their corrections in a pass of their own, so that no row waits
       on its gathers (their latency had stalled the next row's loop behind them; measured 2048x7168:
       q1 1.09-1.14x, q2 even) and those of several rows are in flight at once */
    if (g[G_K] >= 8)
        for (int64_t r = r0; r < r1; r++) out[r - r0] += outlier_sum(t, g, r, x, bad);
}

AVX2 static void rows_x8(const uint8_t *t, const int64_t *g, int64_t r0, int64_t r1, const float *x,
                         const int8_t *x8, const float *x8d, const float *xs, float *scratch, float *out,
                         atomic_int *bad) {
    switch (use_vnni) {                  /* (level 3's 512-bit registers serve several tokens only) */
    case 1: rows_x8_vn(1, t, g, r0, r1, x, x8, x8d, xs, scratch, out, bad); break;
    case 2: case 3: rows_x8_vn(2, t, g, r0, r1, x, x8, x8d, xs, scratch, out, bad); break;
    default: rows_x8_vn(0, t, g, r0, r1, x, x8, x8d, xs, scratch, out, bad); break;
    }
}
#endif

#if HAVE_X86
/* ------------------------------------------------------------------ t1 times 5-bit activations, one token */
/* A t1 byte q holds five trits: with y_0 = q and y_{f+1} = 3 y_f mod 256 (byte arithmetic), trit f is
 * d_f = floor(3 y_f / 256) (formats/SPEC.md), so 256 d_f = 3 y_f - y_{f+1} exactly. A span's integer dot
 * product is then sum_j d_f(j) x_j = sum_j (y_f(j) 3 x_j - y_{f+1}(j) x_j) / 256, and no trit is ever taken
 * out: a field costs two byte adds (y_{f+1} = y_f + y_f + y_f) and two products, one by -3x and one by x
 * (their sum is -256 times the span's sum; the factors per 128 inputs carry the sign back).
 * y reaches 255, so x is rounded to -21 .. 21 per 128 values (quantize_xt; -3x is kept beside it):
 * neither product's pair sums saturate (2 x 255 x 63 < 2^15), and their sum, -256 times a pair of
 * digit x input (at most 256 x 2 x 2 x 21 in magnitude), is exact in 16-bit words. Without VNNI one
 * vpmaddwd per span applies the span's scale to those words; with VNNI two vpdpbusd make int32 sums
 * of four products straight away and one vpmulld applies the scale: four operations a span where
 * AVX2 takes five (the add of the two products' words is gone), measured 1.04-1.10x on a Zen 5
 * (bench_kernel_ab, 2048x7168, one and two threads). VNNI's vpdpwssd in place of vpmaddwd + add was
 * 0.87-0.95x on a Zen 4 and 0.89-0.94x on a Zen 5: its latency on the accumulator held the loop.
 * Spans add up in int32 until their 128 inputs' step and the super-block's d apply, once per 128
 * weights. The offsets (-d sc per span) multiply the rounded inputs' sums, as with int8 inputs. (x at
 * -63 .. 63 took a product by y_f and one by y_{f+1} as 32-bit sums, 3 P - Q: four multiplies a span
 * where this takes three, measured 1.08-1.13x; the coarser rounding left the bundled models' KL unchanged,
 * benchmarks/RESULTS.md.) */
AVX2 static void quantize_xt(const float *x, int64_t cols, int8_t *q, float *qd, float *qs) {
    quantize_blocks(x, cols, q, qd, qs, 21.0f, 21.0f);
    for (int64_t j = 0; j < cols; j++) q[cols + j] = (int8_t)(-3 * q[j]);
}

/* One field's bytes y (y1 = 3 y) times a span's inputs x and n3 = -3 x, scaled by the span's scale sc:
   eight int32 sums of -256 x sc x digit x input. AVX2: the two products' pair sums as words, then one
   vpmaddwd by sc in both halves of a word (scw = sc | sc << 16). VNNI: two vpdpbusd, each adding
   four products to the int32 lanes, then one vpmulld by sc (scw = sc). */
AVX2 static inline __attribute__((always_inline)) __m256i t1_field(const int vn, __m256i y, __m256i y1, __m256i x,
                                                                  __m256i n3, int32_t scw) {
    if (!vn)
        return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(y, n3), _mm256_maddubs_epi16(y1, x)),
                                 _mm256_set1_epi32(scw));
    __m256i p = dp_bytes(vn, _mm256_setzero_si256(), y, n3);
    return _mm256_mullo_epi32(dp_bytes(vn, p, y1, x), _mm256_set1_epi32(scw));
}

/* chunks ch .. ch + n - 1 (n = 1 or 2; spans 5 ch .. 5 ch + 5 n - 1) into the int32 sums acc; a span
   ending a block of 128 inputs (s % 4 == 3: known from ph = ch % 4) turns them to float into fa by
   that block's factor. Each span's sums u = -256 x scale x digit x input come first (int32), the two
   chunks' byte chains side by side: emitted chunk after chunk, each chunk's chain of ten dependent byte
   adds held the loop back (measured: 1.05x on one thread). */
AVX2 static inline __attribute__((always_inline)) void t1_chunks(const int vn, const int n, const int ph, const uint8_t *codes,
                                                               int64_t ch, const int8_t *xt, const int8_t *x3,
                                                               const int32_t *sw, const float *cf, __m256i *acc,
                                                               __m256 *fa) {
    __m256i y[2], u[10];
    for (int c = 0; c < n; c++) y[c] = LOAD32(codes + 32 * (ch + c));
    for (int f = 0; f < 5; f++)
        for (int c = 0; c < n; c++) {
            const int64_t s = 5 * (ch + c) + f;
            __m256i y1 = _mm256_add_epi8(y[c], _mm256_add_epi8(y[c], y[c]));
            u[5 * c + f] = t1_field(vn, y[c], y1, LOAD32(xt + 32 * s), LOAD32(x3 + 32 * s), sw[s]);
            y[c] = y1;
        }
    for (int k = 0; k < 5 * n; k++) {
        const int64_t s = 5 * ch + k;
        acc[k & 1] = _mm256_add_epi32(acc[k & 1], u[k]);
        if (((5 * ph + k) & 3) == 3) {
            fa[k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[0], acc[1])),
                                        _mm256_broadcast_ss(cf + (s >> 2)), fa[k & 1]);
            acc[0] = acc[1] = _mm256_setzero_si256();
        }
    }
}

/* A t1 row's tail chunk when its columns are a multiple of 128: R = 32, 64, 96 or 128 columns, field f
   of its bytes y holding columns f L .. f L + L - 1 (L = (R + 4) / 5, the last field cut at R). Each
   field's bytes times the inputs of their columns (x, x3: the tail's first input and -3 times it;
   unaligned loads, the buffers padded past the row) by the whole chunks' identity, split by masks at
   the span boundary the field may cross, each part by its span's scale words (sw: the tail's first
   span's). p[k] = -256 x span k's sum of scale x digit x input (zero past R). */
AVX2 static inline __attribute__((always_inline)) void t1_tail_sums(const int vn, const int R, __m256i y, const int8_t *x,
                                                                  const int8_t *x3, const int32_t *sw, __m256i *p) {
    const int L = (R + 4) / 5;
    const __m256i iota = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                          21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; k++) p[k] = _mm256_setzero_si256();
    for (int f = 0; f < 5; f++) {
        const int lo = f * L, hi = lo + L < R ? lo + L : R, k0 = lo / 32, split = 32 * (k0 + 1) - lo;
        if (lo >= R) break;
        __m256i y1 = _mm256_add_epi8(y, _mm256_add_epi8(y, y)), xv = LOAD32(x + lo), x3v = LOAD32(x3 + lo);
        __m256i live = _mm256_cmpgt_epi8(_mm256_set1_epi8((char)(hi - lo)), iota);
        __m256i m0 = _mm256_and_si256(live, _mm256_cmpgt_epi8(_mm256_set1_epi8((char)split), iota));
        p[k0] = _mm256_add_epi32(p[k0], t1_field(vn, _mm256_and_si256(y, m0), _mm256_and_si256(y1, m0), xv, x3v, sw[k0]));
        if (hi > 32 * (k0 + 1)) {                     /* the field's columns from the next span on */
            __m256i m1 = _mm256_andnot_si256(m0, live);
            p[k0 + 1] = _mm256_add_epi32(p[k0 + 1], t1_field(vn, _mm256_and_si256(y, m1), _mm256_and_si256(y1, m1), xv,
                                                             x3v, sw[k0 + 1]));
        }
        y = y1;
    }
}

/* Row r of a t1 tensor (cols a multiple of 128) times one token's xt (its rounded x, then -3x at xt +
   cols; xtd: steps per 128, xts: the rounded inputs' sums per 32). Scratch: nsp + 8 int32 words, then
   nsp / 4 + nsp / 8 + 24 floats. */
AVX2 static inline __attribute__((always_inline)) float row_t1_xt(const int vn, const uint8_t *t, const int64_t *g,
                                                                int64_t r, const float *x, const int8_t *xt,
                                                                const float *xtd, const float *xts, float *scratch,
                                                                atomic_int *bad) {
    /* spans and blocks counted over the whole row: the tail's take their scales and factors as the
       whole chunks' do */
    int64_t cols = g[G_COLS], done = full_cols(g), nfs = done / 32, nch = done / 160;
    int64_t nsp = cols / 32, nsb = nsp / 8, nsup = (nsp + 7) / 8, nq = (nsp + 3) / 4;
    const uint8_t *po = t + g[G_OFFPAR] + r * g[G_PARROW], *so = t + g[G_OFFSUB] + r * g[G_SUBROW];
    const uint8_t *codes = t + g[G_OFFCODE] + r * g[G_CODEROW];
    const int8_t *x3 = xt + cols;
    int32_t *sw = (int32_t *)scratch;
    float *cf = (float *)(sw + nsp + 8), *D = cf + nq + 8;
    /* every super-block's d, then each block of 128 inputs' factor d step / 256 (eight at a time: xtd
       and D run on past their ends into memory of the same buffers) */
    int64_t b = 0;
    for (; b + 8 <= nsup; b += 8) _mm256_storeu_ps(D + b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(po + 2 * b))));
    for (; b < nsup; b++) {
        uint16_t h;
        memcpy(&h, po + 2 * b, 2);
        D[b] = _cvtsh_ss(h);
    }
    const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    for (int64_t q = 0; q < nq; q += 8) {
        __m256 d2 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(D + q / 2)), pairs);
        _mm256_storeu_ps(cf + q, _mm256_mul_ps(_mm256_mul_ps(d2, _mm256_loadu_ps(xtd + q)), _mm256_set1_ps(-1.0f / 256.0f)));
    }
    const __m256i m15 = _mm256_set1_epi32(15), shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    /* each span's scale in both 16-bit halves of a word, and the offsets' sum (-d sc per span times the
       rounded inputs' sum; two chains) */
    __m256 off0 = _mm256_setzero_ps(), off1 = off0;
#define T1_SCALES(b, off)                                                                                   \
    {                                                                                                       \
        uint32_t w4;                                                                                        \
        memcpy(&w4, so + 4 * (b), 4);                                                                       \
        __m256i sc = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w4), shifts), m15);          \
        _mm256_storeu_si256((__m256i *)(sw + 8 * (b)), vn ? sc : _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16))); \
        off = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_broadcast_ss(D + (b)), _mm256_cvtepi32_ps(sc)),         \
                               _mm256_loadu_ps(xts + 8 * (b)), off);                                        \
    }
    for (b = 0; b + 2 <= nsb; b += 2) {
        T1_SCALES(b, off0)
        T1_SCALES(b + 1, off1)
    }
    if (b < nsb) T1_SCALES(b, off0)
#undef T1_SCALES
    float tot = hsum8(_mm256_add_ps(off0, off1));
    for (int64_t s = 8 * nsb; s < nsp; s++) {       /* a last, shorter super-block */
        int sc = (so[s >> 1] >> (4 * (s & 1))) & 15;
        sw[s] = vn ? sc : sc | (sc << 16);
        tot -= D[nsb] * (float)sc * xts[s];
    }
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};    /* even and odd spans */
    __m256 fa[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t ch = 0;
    for (; ch + 4 <= nch; ch += 4) {
        __builtin_prefetch(codes + 32 * ch + CODE_PREFETCH);
        __builtin_prefetch(codes + 32 * ch + 64 + CODE_PREFETCH);
        t1_chunks(vn, 2, 0, codes, ch, xt, x3, sw, cf, acc, fa);
        t1_chunks(vn, 2, 2, codes, ch + 2, xt, x3, sw, cf, acc, fa);
    }
    if (ch + 2 <= nch) {
        t1_chunks(vn, 2, 0, codes, ch, xt, x3, sw, cf, acc, fa);
        ch += 2;
    }
    if (ch < nch && (ch & 2)) t1_chunks(vn, 1, 2, codes, ch, xt, x3, sw, cf, acc, fa);
    else if (ch < nch) t1_chunks(vn, 1, 0, codes, ch, xt, x3, sw, cf, acc, fa);
    if (nfs & 3)                   /* the spans of a block cut short by the tail */
        fa[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[0], acc[1])), _mm256_broadcast_ss(cf + nfs / 4), fa[0]);
    if (done < cols) {              /* the tail chunk: 32, 64, 96 or 128 columns, one to four spans */
        __m256i y, p[4];
        const uint8_t *tc = codes + 32 * nch;
        if (tc + 32 <= t + g[G_NBYTES]) {
            y = LOAD32(tc);              /* the bytes past the tail (the next row's) are masked off */
        } else {                         /* the tensor's last row: no read past its end */
            _Alignas(32) uint8_t tb[32] = {0};
            memcpy(tb, tc, (size_t)((cols - done + 4) / 5));
            y = _mm256_load_si256((const __m256i *)tb);
        }
        switch (cols - done) {           /* each length's fields and span boundaries as constants */
        case 32: t1_tail_sums(vn, 32, y, xt + done, x3 + done, sw + nfs, p); break;
        case 64: t1_tail_sums(vn, 64, y, xt + done, x3 + done, sw + nfs, p); break;
        case 96: t1_tail_sums(vn, 96, y, xt + done, x3 + done, sw + nfs, p); break;
        default: t1_tail_sums(vn, 128, y, xt + done, x3 + done, sw + nfs, p); break;
        }
        for (int k = 0; k < 4; k++)      /* (a constant k: fa stays in registers) */
            if (nfs + k < nsp)
                fa[k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[k]), _mm256_broadcast_ss(cf + ((nfs + k) >> 2)), fa[k & 1]);
    }
    return tot + hsum8(_mm256_add_ps(fa[0], fa[1])) + outlier_sum(t, g, r, x, bad);
}

AVX2 static inline __attribute__((always_inline)) void rows_t1_xt_vn(const int vn, const uint8_t *t, const int64_t *g,
                                                                     int64_t r0, int64_t r1, const float *x,
                                                                     const int8_t *xt, const float *xtd,
                                                                     const float *xts, float *scratch, float *out,
                                                                     atomic_int *bad) {
    for (int64_t r = r0; r < r1; r++) {
        prefetch_next_row(t, g, r);
        out[r - r0] = row_t1_xt(vn, t, g, r, x, xt, xtd, xts, scratch, bad);
    }
}

AVX2 static void rows_t1_xt(const uint8_t *t, const int64_t *g, int64_t r0, int64_t r1, const float *x,
                            const int8_t *xt, const float *xtd, const float *xts, float *scratch, float *out,
                            atomic_int *bad) {
    switch (use_vnni) {
    case 1: rows_t1_xt_vn(1, t, g, r0, r1, x, xt, xtd, xts, scratch, out, bad); break;
    case 2: case 3: rows_t1_xt_vn(2, t, g, r0, r1, x, xt, xtd, xts, scratch, out, bad); break;
    default: rows_t1_xt_vn(0, t, g, r0, r1, x, xt, xtd, xts, scratch, out, bad); break;
    }
}
#endif

static float row_dot(const uint8_t *t, const int64_t *g, int64_t r, const float *x, const int16_t *xq,
                     const int16_t *xp, const float *xsc, const float *xs, int32_t *isum, atomic_int *bad) {
    int64_t done = full_cols(g);
    const uint8_t *codes = t + g[G_OFFCODE] + r * g[G_CODEROW];
    prefetch_next_row(t, g, r);
    isum_c(codes, g, xq, done, isum);
    float tot = combine_c(t, g, r, xsc, xs, isum, 0, done / 32);
    return tot + row_fixups(t, g, r, codes, x, bad);
}

/* ------------------------------------------------------------------------------------ dequantize */
/* Row r into out (float32 [cols]) bit for bit as the reference decoder (formats/quants.py): each
 * weight is A * level + B in two float32 roundings (the extension is built without FMA contraction),
 * A * level alone where the codec has no offset (that keeps -0.0), outliers stored as they are.
 * target_clones: one build for AVX2 (the loops vectorize) and one for any x86-64. */
#if HAVE_X86
__attribute__((target_clones("avx2", "default")))
#endif
static void q1t_deq_row(const uint8_t *t, const int64_t *g, int64_t r, float *out);

static void deq_row(const uint8_t *t, const int64_t *g, int64_t r, float *out, float *AB) {
    int kind = (int)g[G_KIND];
    if (kind == K_Q1T) {
        q1t_deq_row(t, g, r, out);
        return;
    }
    int64_t cols = g[G_COLS], nsp = cols / 32, done = full_cols(g), k = g[G_K];
    float *As = AB, *Bs = AB + nsp;
    for (int64_t s = 0; s < nsp; s++) span_ab(t, g, r, s, As + s, Bs + s);
    const uint8_t *codes = t + g[G_OFFCODE] + r * g[G_CODEROW];
    int hasb = !(kind == K_Q8 || kind == K_Q6 || kind == K_T1);
    float lv[32];
    for (int64_t s = 0; s < done / 32; s++) {
        const uint8_t *c;
        int sh;
        switch (kind) {
        case K_Q2: case K_Q2RTN:
            c = codes + 32 * (s >> 2); sh = 2 * (int)(s & 3);
            for (int j = 0; j < 32; j++) lv[j] = (float)((c[j] >> sh) & 3);
            break;
        case K_Q4:
            c = codes + 32 * (s >> 1); sh = 4 * (int)(s & 1);
            for (int j = 0; j < 32; j++) lv[j] = (float)((c[j] >> sh) & 15);
            break;
        case K_Q8:
            c = codes + 32 * s;
            for (int j = 0; j < 32; j++) lv[j] = (float)(int8_t)c[j];
            break;
        case K_Q1:
            c = codes + 32 * (s >> 3); sh = (int)(s & 7);
            for (int j = 0; j < 32; j++) lv[j] = (float)(2 * ((c[j] >> sh) & 1) - 1);
            break;
        case K_Q6: {
            const uint8_t *lo = codes + 32 * (s >> 1), *hi = codes + q6_lo_bytes(cols) + 32 * (s >> 2);
            int sl = 4 * (int)(s & 1), shh = 2 * (int)(s & 3);
            for (int j = 0; j < 32; j++) lv[j] = (float)((((lo[j] >> sl) & 15) | (((hi[j] >> shh) & 3) << 4)) - 32);
            break;
        }
        default: {   /* t1 */
            static const int pow3[5] = {1, 3, 9, 27, 81};
            int64_t ch = s / 5;
            int m3 = pow3[s - 5 * ch];
            c = codes + 32 * ch;
            for (int j = 0; j < 32; j++) lv[j] = (float)(((((int)c[j] * m3) & 255) * 3 >> 8) - 1);
        }
        }
        float a = As[s], b = Bs[s], *o = out + 32 * s;
        if (hasb) for (int j = 0; j < 32; j++) o[j] = a * lv[j] + b;
        else for (int j = 0; j < 32; j++) o[j] = a * lv[j];
    }
    if (done < cols) {
        float lev[256];
        tail_levels(codes, g, done, r + 1 < g[G_ROWS], lev);
        for (int64_t col = done; col < cols; col++) {
            float a = As[col >> 5], b = Bs[col >> 5];
            out[col] = hasb ? a * lev[col - done] + b : a * lev[col - done];
        }
    }
    const uint8_t *oc = t + g[G_OFFOCOL] + 2 * r * k, *ov = t + g[G_OFFOVAL] + 2 * r * k;
    for (int64_t i = 0; i < k; i++) {
        int64_t col = oc[2 * i] | (oc[2 * i + 1] << 8);
        if (col < cols) out[col] += f16_at(ov + 2 * i);    /* never outside the row, whatever the bytes say */
    }
}

/* ------------------------------------------------------------------------------------ jobs, threads */

typedef struct task task_t;
/* A task's jobs are cut into one contiguous range per thread: a thread takes its own range's jobs in
   order, then helps with the others'. So the rows a thread multiplies run on from one job to its next,
   as its prefetch of the bytes ahead assumed (one shared counter interleaved the threads' jobs: q2
   2048x7168 on two threads read 13.5 GB/s in jobs of 8 rows, 15.4 with each job's first bytes
   prefetched at its start, 19-20 in ranges). Each range's counter has a cache line of its own. */
#define MAX_RANGES 16
typedef struct {
    _Alignas(64) atomic_long next;
    int64_t end;
} range_t;
/* a decode attention call (see "decode attention" below) */
typedef struct {
    const float *q, *qr;                                  /* [nh, r], [nh, dr] */
    const void *C, *K;                                    /* cache rows [S, r], [S, dr] */
    int half;                                             /* binary16 caches */
    int64_t S, r, dr, nh;
    float scale;
    float *o;                                             /* [nh, r] */
    float *part;                                          /* the mix jobs' partial sums */
} att_t;
struct task {
    void (*job)(task_t *t, int64_t j, float *scratch);   /* runs job j */
    const uint8_t *raw;
    const int64_t *geoms;
    const float *xf, *xsc, *xs;
    const int16_t *xq, *xp;
    const int8_t *x8;                                     /* rows jobs: x as int8 per 128 values (or NULL) */
    const float *x8d;                                     /* ... and their scales (quarter steps) */
    const float *x8s;                                     /* ... and the rounded values' sums per 32 */
    const int8_t *xt;                                     /* one t1 token: x as -21 .. 21 per 128 values, then 3x (or NULL) */
    const float *xtd, *xts;                               /* ... their steps and the rounded values' sums per 32 */
    const int8_t *lt;                                     /* q1t: every input's lookup tables (q1t_inputs), or NULL */
    const float *ltd;                                     /* ... their steps and sums */
    const float *xT;                                      /* several tokens, int8: xf transposed [cols][nxT] */
    int64_t nxT;
    int64_t cols, nspan, n, stride;
    int64_t ntok, ostride;                                /* rows jobs: tokens per job, output stride */
    int64_t njobs_rows;                                   /* ggml jobs: rows of the tensor */
    int64_t head_rows;                                    /* ggml heads: rows per input (0: every row, every input) */
    const float *fix;                                     /* ggml: Q8_1 sum corrections per input (or NULL) */
    const ggml_q8k_t *q8;                                 /* ggml: inputs as Q8_K codes, for integer products */
    int64_t scratch_floats;                               /* per thread */
    const int64_t *jobs;
    int64_t njobs;
    float *out;
    atomic_long done;
    atomic_int bad, joined;
    int nranges;
    range_t ranges[MAX_RANGES];
    atomic_ullong sum;                                    /* read_sum's result */
    const att_t *att;
    void *ctx;                                            /* moe_launch's driver jobs: their call */
};

#if HAVE_X86
/* A t1 row's digits (0, 1, 2) as bytes in column order, for the several-token int8 kernel: five
   fields per 32-byte chunk in 16-bit lanes (d_f = ((q * 3^f) mod 256) * 3 >> 8, formats/SPEC.md), the
   tail chunk (columns past the last whole one, laid out with a shorter stride) one by one. Taken out
   once per row and token tile, they then cost one load per 32 weights and token group. */
AVX2 static void t1_row_digits(const uint8_t *codes, const int64_t *g, uint8_t *dig) {
    int64_t cols = g[G_COLS], full = cols / 160;
    const __m256i zero = _mm256_setzero_si256(), m255 = _mm256_set1_epi16(255);
    static const short pow3[5] = {1, 3, 9, 27, 81};
    for (int64_t n = 0; n < full; n++) {
        __m256i v = LOAD32(codes + 32 * n);
        __m256i lo = _mm256_unpacklo_epi8(v, zero), hi = _mm256_unpackhi_epi8(v, zero);
        for (int f = 0; f < 5; f++) {
            __m256i m = _mm256_set1_epi16(pow3[f]);
            __m256i tl = _mm256_and_si256(_mm256_mullo_epi16(lo, m), m255), th = _mm256_and_si256(_mm256_mullo_epi16(hi, m), m255);
            tl = _mm256_srli_epi16(_mm256_add_epi16(_mm256_add_epi16(tl, tl), tl), 8);
            th = _mm256_srli_epi16(_mm256_add_epi16(_mm256_add_epi16(th, th), th), 8);
            /* the unpacks and the pack both work within 128-bit lanes: the bytes come back in order */
            _mm256_storeu_si256((__m256i *)(dig + 160 * n + 32 * f), _mm256_packus_epi16(tl, th));
        }
    }
    for (int64_t col = 160 * full; col < cols; col++) dig[col] = (uint8_t)plane_digit(codes, cols, 5, 0, col);
}

/* The offsets' sums of nt tokens (xs, nsp apart) over a row's whole groups of eight spans, as the
   starting lanes of each token's sums: one chain per token (a single one waited on the multiply-add's
   latency at every step) */
#define X8_OFFSETS(nt, bs, xs, nsp, nfs, a0, a1, a2, a3)                                                      \
    for (int64_t i = 0; i + 8 <= (nfs); i += 8) {                                                              \
        __m256 b = _mm256_loadu_ps((bs) + i);                                                                  \
        a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps((xs) + i), a0);                                                \
        if ((nt) > 1) a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps((xs) + (nsp) + i), a1);                         \
        if ((nt) > 2) a2 = _mm256_fmadd_ps(b, _mm256_loadu_ps((xs) + 2 * (nsp) + i), a2);                     \
        if ((nt) > 3) a3 = _mm256_fmadd_ps(b, _mm256_loadu_ps((xs) + 3 * (nsp) + i), a3);                     \
    }

/* nt tokens' inputs (xb, cols apart) times one row's 128-column blocks, the digits of each block taken
   out once for all of them: acc[j] = token j's 8 partial sums (cc [nt][nq]: each block's factor), the
   offsets' sums over whole groups of eight spans included (q4, q6 with --activations int8) */
AVX2 static inline __attribute__((always_inline)) void x8_tokens(const int kind, const int vn, const int nt, const uint8_t *codes,
                                                                int64_t nq, int64_t lb, const __m256i *scv,
                                                                const int8_t *xb, int64_t cols, const float *cc,
                                                                const float *bs, const float *xs, int64_t nsp,
                                                                __m256 *acc) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    X8_OFFSETS(nt, bs, xs, nsp, 4 * nq, a0, a1, a2, a3)
    for (int64_t q = 0; q < nq; q++) {
        __m256i d[4];
        digits128(kind, codes, q, (int)(q & 1), lb, d);
        const __m256i *sq = scv + 4 * q;    /* each span's scale words, read from L1 by the multiply-adds */
#define X8_TOKEN(j, a)                                                                                            \
        if (nt > j) {                                                                                             \
            const int8_t *xc = xb + j * cols + 128 * q;                                                           \
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(d[0], LOAD32(xc)), _mm256_load_si256(sq));        \
            p = dp_words(vn, p, _mm256_maddubs_epi16(d[1], LOAD32(xc + 32)), _mm256_load_si256(sq + 1));          \
            p = dp_words(vn, p, _mm256_maddubs_epi16(d[2], LOAD32(xc + 64)), _mm256_load_si256(sq + 2));          \
            p = dp_words(vn, p, _mm256_maddubs_epi16(d[3], LOAD32(xc + 96)), _mm256_load_si256(sq + 3));          \
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(cc + j * nq + q), a);                 \
        }
        X8_TOKEN(0, a0) X8_TOKEN(1, a1) X8_TOKEN(2, a2) X8_TOKEN(3, a3)
#undef X8_TOKEN
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
}

/* Whether the several-token kernel multiplies a kind's row as bytes of digit x span scale (q2: at most
   3 x 15, t1: 2 x 15, q1: 1 x 15): their byte products' pair sums stay far inside int16, so the scales
   leave the token loop, and two spans' (q2) or four spans' (t1, q1) pair sums add up in int16 before
   one vpmaddwd widens them */
#define X8_SCALED(kind) ((kind) == K_Q2 || (kind) == K_T1 || (kind) == K_Q1)

/* A row's digits times their spans' integer scales, as bytes in column order (wb: cols bytes, 32-byte
   aligned), from the stored codes (q2, q1) or t1_row_digits' bytes, and scw as row_x8_setup wrote it.
   The scale words carry the factors of digits kept in place (q2's spans 1 and 3 are 4x the digit, q1's
   bits sit at their position): each product comes out as digit x scale. Returns what the integer sums
   of these bytes must be multiplied by to equal those of the stored digits and scale words. */
AVX2 static inline __attribute__((always_inline)) float x8_scaled_row(const int kind, const uint8_t *digits, int64_t nq,
                                                                    const int32_t *scw, uint8_t *wb) {
    const __m256i k1 = _mm256_set1_epi8(1), k63 = _mm256_set1_epi8(63);
    for (int64_t q = 0; q < nq; q++) {
        __m256i d[4];
        if (kind == K_Q1) {
            __m256i v = LOAD32(digits + 32 * (q >> 1));
            for (int k = 0; k < 4; k++) {
                int pos = 4 * (int)(q & 1) + k;           /* span 4q + k's bit in each byte; its scale v << (7 - pos) */
                d[k] = _mm256_mullo_epi16(_mm256_and_si256(_mm256_srli_epi16(v, pos), k1),
                                          _mm256_set1_epi16((short)((scw[4 * q + k] & 0xffff) >> (7 - pos))));
            }
        } else {
            digits128(kind, digits, q, (int)(q & 1), 0, d);
            for (int k = 0; k < 4; k++) {
                /* 16-bit lanes of two bytes: each byte's product stays below 256, so none carries */
                __m256i m = _mm256_mullo_epi16(d[k], _mm256_set1_epi16((short)(scw[4 * q + k] & 0xffff)));
                d[k] = kind == K_Q2 ? _mm256_and_si256(_mm256_srli_epi16(m, 2), k63) : m;   /* q2: 4 digit x scale */
            }
        }
        for (int k = 0; k < 4; k++) _mm256_store_si256((__m256i *)(wb + 128 * q + 32 * k), d[k]);
    }
    return kind == K_Q2 ? 4.0f : kind == K_Q1 ? 128.0f : 1.0f;
}

/* x8_tokens for X8_SCALED kinds, over x8_scaled_row's bytes: per token and 128 columns four
   vpmaddubsw, the spans' pair sums added in int16, then one (t1, q1) or two (q2) vpmaddwd by ones */
AVX2 static inline __attribute__((always_inline)) void x8s_tokens(const int kind, const int vn, const int nt, const uint8_t *wb,
                                                                 int64_t nq, const int8_t *xb, int64_t cols,
                                                                 const float *cc, const float *bs, const float *xs,
                                                                 int64_t nsp, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    X8_OFFSETS(nt, bs, xs, nsp, 4 * nq, a0, a1, a2, a3)
    for (int64_t q = 0; q < nq; q++) {
        const __m256i *w = (const __m256i *)(wb + 128 * q);
        const __m256i w0 = _mm256_load_si256(w), w1 = _mm256_load_si256(w + 1), w2 = _mm256_load_si256(w + 2),
                      w3 = _mm256_load_si256(w + 3);
#define X8S_TOKEN(j, a)                                                                                           \
        if (nt > j) {                                                                                             \
            const int8_t *xc = xb + j * cols + 128 * q;                                                           \
            __m256i p;                                                                                            \
            if (vn) {                          /* four vpdpbusd: the pair sums and their widening in one */       \
                p = dp_bytes(vn, dp_bytes(vn, _mm256_setzero_si256(), w0, LOAD32(xc)), w1, LOAD32(xc + 32));     \
                p = dp_bytes(vn, dp_bytes(vn, p, w2, LOAD32(xc + 64)), w3, LOAD32(xc + 96));                     \
            } else {                                                                                              \
                __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, LOAD32(xc)), _mm256_maddubs_epi16(w1, LOAD32(xc + 32))); \
                __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(w2, LOAD32(xc + 64)), _mm256_maddubs_epi16(w3, LOAD32(xc + 96))); \
                p = kind == K_Q2 ? _mm256_add_epi32(_mm256_madd_epi16(s01, ones), _mm256_madd_epi16(s23, ones))     \
                                 : _mm256_madd_epi16(_mm256_add_epi16(s01, s23), ones);                           \
            }                                                                                                     \
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(cc + j * nq + q), a);                 \
        }
        X8S_TOKEN(0, a0) X8S_TOKEN(1, a1) X8S_TOKEN(2, a2) X8S_TOKEN(3, a3)
#undef X8S_TOKEN
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
}

/* The outliers' corrections of row r for tokens t0 .. t1-1 (at most TOKEN_TILE) into ocorr: each outlier's
   column of inputs is one contiguous run in xT (a token's row apiece, in L2 or beyond, cost a miss per
   token); lanes past the tile read padding or other tokens and are not used */
AVX2 static void tile_outliers(task_t *t, const uint8_t *tensor, const int64_t *g, int64_t r, int64_t t0, int64_t t1,
                               float *ocorr) {
    int64_t k = g[G_K], n = outliers_valid(tensor, g, r, &t->bad), ntile = t1 - t0;
    const uint8_t *pc = tensor + g[G_OFFOCOL] + 2 * r * k, *pv = tensor + g[G_OFFOVAL] + 2 * r * k;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t i = 0; i < n; i++) {
        const float *p = t->xT + (pc[2 * i] | (pc[2 * i + 1] << 8)) * t->nxT + t0;
        __m256 v = _mm256_set1_ps(f16_at(pv + 2 * i));
        c0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(p), c0);
        if (ntile > 8) c1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(p + 8), c1);
        if (ntile > 16) c2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(p + 16), c2);
        if (ntile > 24) c3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(p + 24), c3);
    }
    _mm256_storeu_ps(ocorr, c0); _mm256_storeu_ps(ocorr + 8, c1);
    _mm256_storeu_ps(ocorr + 16, c2); _mm256_storeu_ps(ocorr + 24, c3);
}

/* Several tokens through eight rows at once (the bytes-of-digit-x-scale kinds): the rows' bytes are
 * interleaved four columns at a time (pw: eight rows' dwords per four columns, as one vector), so one
 * load of them serves every token, and each token's four inputs are one broadcast: a vpdpbusd per
 * token and four columns adds eight rows' products, lane by lane, with no horizontal sums. Per 128
 * columns each lane's integer sum turns to float once, times its row's factor and the token's step;
 * the offsets (BST: [span][8 rows]) times the rounded inputs' sums per 32 start the sums.
 * One copy per VNNI level, each with its own target so that the compiler sees the instruction (the
 * inline assembly of vnni_dot cost a register copy on each side of every vpdpbusd here); nt tokens, a
 * constant in each copy of the body (their sums stay in registers). */
static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
/* M(0) .. M(nt - 1) (nt a constant: the untaken ones fold away), M a macro pasting its digit into names */
#define TILED_EACH(nt, M)                                                                                       \
    if (nt > 0) { M(0); } if (nt > 1) { M(1); } if (nt > 2) { M(2); } if (nt > 3) { M(3); }                     \
    if (nt > 4) { M(4); } if (nt > 5) { M(5); } if (nt > 6) { M(6); } if (nt > 7) { M(7); }
#define T_OFFSET(J) f##J = _mm256_fmadd_ps(b, _mm256_broadcast_ss(xs + J * nsp + s), f##J)
#define T_DOT(J) a##J = TILED_DP(a##J, wv, _mm256_set1_epi32(load_i32(xq + J * cols + 4 * kq)))
#define T_SCALE(J) f##J = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##J), _mm256_mul_ps(d, _mm256_broadcast_ss(x8d + J * nq + q)), f##J)
#define TILED_TOKENS(NAME, TARGET)                                                                          \
__attribute__((target(TARGET))) static inline __attribute__((always_inline)) void NAME##_nt(                   \
        const int nt, const uint8_t *pw, int64_t nq, const int8_t *xb, int64_t cols, const float *D,            \
        const float *x8d, const float *BST, const float *xs, int64_t nfs, int64_t nsp, __m256 *acc) {           \
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0;             \
    for (int64_t s = 0; s < nfs; s++) {              /* the offsets: one chain per token */                    \
        __m256 b = _mm256_loadu_ps(BST + 8 * s);                                                                \
        TILED_EACH(nt, T_OFFSET)                                                                                \
    }                                                                                                           \
    for (int64_t q = 0; q < nq; q++) {                                                                          \
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;     \
        const uint8_t *w = pw + 1024 * q;                 /* 32 steps of four columns x eight rows */           \
        const int8_t *xq = xb + 128 * q;                                                                        \
        for (int kq = 0; kq < 32; kq++) {                                                                       \
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * kq));                                   \
            TILED_EACH(nt, T_DOT)                                                                               \
        }                                                                                                       \
        __m256 d = _mm256_loadu_ps(D + 8 * q);                                                                  \
        TILED_EACH(nt, T_SCALE)                                                                                 \
    }                                                                                                           \
    acc[0] = f0; acc[1] = f1; acc[2] = f2; acc[3] = f3; acc[4] = f4; acc[5] = f5; acc[6] = f6; acc[7] = f7;     \
}                                                                                                               \
__attribute__((target(TARGET))) static void NAME(int nt, const uint8_t *pw, int64_t nq, const int8_t *xb,       \
                                                 int64_t cols, const float *D, const float *x8d, const float *BST, \
                                                 const float *xs, int64_t nfs, int64_t nsp, __m256 *acc) {       \
    switch (nt) {                                                                                               \
    case 8: NAME##_nt(8, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc); break;                              \
    case 7: NAME##_nt(7, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc); break;                              \
    case 6: NAME##_nt(6, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc); break;                              \
    case 5: NAME##_nt(5, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc); break;                              \
    case 4: NAME##_nt(4, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc); break;                              \
    case 3: NAME##_nt(3, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc); break;                              \
    case 2: NAME##_nt(2, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc); break;                              \
    default: NAME##_nt(1, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc); break;                             \
    }                                                                                                           \
}
/* TILED_DP(acc, u, s): acc + u x s by bytes, four products a lane (T_DOT; defined at each copy) */
#define TILED_DP(a, u, s) _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
TILED_TOKENS(tiled_tokens_avx2, "avx2,fma,f16c")
#undef TILED_DP
#define TILED_DP _mm256_dpbusd_avx_epi32
TILED_TOKENS(tiled_tokens_vex, "avx2,fma,f16c,avxvnni")
#undef TILED_DP
#define TILED_DP _mm256_dpbusd_epi32
TILED_TOKENS(tiled_tokens_evex, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#undef TILED_DP

/* tiled_tokens on 512-bit registers (use_vnni 3): sixteen rows a vector, so each vpdpbusd adds twice the
   products of the 256-bit form (the VNNI instruction, not the loads, limits these loops) */
#define TILED_Z 16
#undef T_OFFSET
#undef T_DOT
#undef T_SCALE
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))) static inline
__attribute__((always_inline)) void tiled_tokens_z_nt(const int nt, const uint8_t *pw, int64_t nq, const int8_t *xb,
                                                      int64_t cols, const float *D, const float *x8d,
                                                      const float *BST, const float *xs, int64_t nfs, int64_t nsp,
                                                      float *y) {
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0;
#define T_OFFSET(J) f##J = _mm512_fmadd_ps(b, _mm512_set1_ps(xs[J * nsp + s]), f##J)
#define T_DOT(J) a##J = _mm512_dpbusd_epi32(a##J, wv, _mm512_set1_epi32(load_i32(xq + J * cols + 4 * kq)))
#define T_SCALE(J) f##J = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##J), _mm512_mul_ps(d, _mm512_set1_ps(x8d[J * nq + q])), f##J)
    for (int64_t s = 0; s < nfs; s++) {
        __m512 b = _mm512_loadu_ps(BST + TILED_Z * s);
        TILED_EACH(nt, T_OFFSET)
    }
    for (int64_t q = 0; q < nq; q++) {
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        const uint8_t *w = pw + 32 * 64 * q;             /* 32 steps of four columns x sixteen rows */
        const int8_t *xq = xb + 128 * q;
        for (int kq = 0; kq < 32; kq++) {
            __m512i wv = _mm512_loadu_si512(w + 64 * kq);
            TILED_EACH(nt, T_DOT)
        }
        __m512 d = _mm512_loadu_ps(D + TILED_Z * q);
        TILED_EACH(nt, T_SCALE)
    }
    _mm512_storeu_ps(y, f0); _mm512_storeu_ps(y + 16, f1); _mm512_storeu_ps(y + 32, f2); _mm512_storeu_ps(y + 48, f3);
    _mm512_storeu_ps(y + 64, f4); _mm512_storeu_ps(y + 80, f5); _mm512_storeu_ps(y + 96, f6); _mm512_storeu_ps(y + 112, f7);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))) static void
tiled_tokens_z(int nt, const uint8_t *pw, int64_t nq, const int8_t *xb, int64_t cols, const float *D,
               const float *x8d, const float *BST, const float *xs, int64_t nfs, int64_t nsp, float *y) {
    switch (nt) {
    case 8: tiled_tokens_z_nt(8, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y); break;
    case 7: tiled_tokens_z_nt(7, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y); break;
    case 6: tiled_tokens_z_nt(6, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y); break;
    case 5: tiled_tokens_z_nt(5, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y); break;
    case 4: tiled_tokens_z_nt(4, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y); break;
    case 3: tiled_tokens_z_nt(3, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y); break;
    case 2: tiled_tokens_z_nt(2, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y); break;
    default: tiled_tokens_z_nt(1, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y); break;
    }
}
#undef TILED_TOKENS
#undef TILED_EACH
#undef T_OFFSET
#undef T_DOT
#undef T_SCALE

/* tiled_tokens_z on AMX tiles (use_amx): up to sixteen tokens a pass. The sixteen rows' interleaved
 * bytes are already the tile layout of the right-hand operand (a tile row: four columns of every row),
 * so 64 columns of them load as one tile, the tokens' int8 inputs as another (a row per token, cols
 * apart), and one TDPBSUD makes every token's integer sums of the sixteen rows over the 64 columns.
 * Per 128 columns the sums are stored and turned to float exactly as tiled_tokens_z does (same order,
 * same bits). */
static int use_amx;        /* 0: off, 1: on (the CPU and the OS allow it; amx_available) */
#define AMX_MIN_TOKENS 12  /* tokens left for a pass on tiles (fewer: the 512-bit loop) */
#if HAVE_AMX
typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_config_t;
static __thread int amx_ready;         /* the thread's tile configuration is loaded */

/* every AMX kernel here uses the same configuration: eight tiles of sixteen rows of 64 bytes */
__attribute__((target("amx-tile"))) static inline void amx_configure(void) {
    if (amx_ready) return;
    amx_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
    amx_ready = 1;
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,amx-tile,amx-int8"))) static void
tiled_tokens_amx(int nt, const uint8_t *pw, int64_t nq, const int8_t *xb, int64_t cols, const float *D,
                 const float *x8d, const float *BST, const float *xs, int64_t nfs, int64_t nsp, float *y) {
    amx_configure();                 /* tiles 0, 1: sums; 2, 3: sixteen tokens' inputs; 4, 5: the rows' bytes */
    __m512 f[16];
    for (int j = 0; j < nt; j++) f[j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nfs; s++) {
        __m512 b = _mm512_loadu_ps(BST + TILED_Z * s);
        for (int j = 0; j < nt; j++) f[j] = _mm512_fmadd_ps(b, _mm512_set1_ps(xs[j * nsp + s]), f[j]);
    }
    /* sixteen input rows always (past nt: quantize_rows' zero padding, their sums unused), one tile
       configuration for every call; two sums tiles in turn, so one block's products need not wait for
       the last block's sums to be read */
    int32_t sums[2][16 * 16] __attribute__((aligned(64)));
    for (int64_t q = 0; q < nq; q++) {
        const uint8_t *w = pw + 32 * 64 * q;
        const int8_t *xq = xb + 128 * q;
        int32_t *sq = sums[q & 1];
/* 128 columns into sums tile C (a constant: tile numbers are immediates), stored at sq */
#define AMX_BLOCK(C)                                                                                            \
        do {                                                                                                  \
            _tile_zero(C);                                                                                    \
            _tile_loadd(2, xq, cols);                                                                         \
            _tile_loadd(4, w, 64);                                                                            \
            _tile_dpbsud(C, 2, 4);                                                                            \
            _tile_loadd(3, xq + 64, cols);                                                                    \
            _tile_loadd(5, w + 1024, 64);                                                                     \
            _tile_dpbsud(C, 3, 5);                                                                            \
            _tile_stored(C, sq, 64);                                                                          \
        } while (0)
        if (q & 1) AMX_BLOCK(1);
        else AMX_BLOCK(0);
#undef AMX_BLOCK
        __m512 d = _mm512_loadu_ps(D + TILED_Z * q);
        for (int j = 0; j < nt; j++)
            f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sq + 16 * j)),
                                   _mm512_mul_ps(d, _mm512_set1_ps(x8d[j * nq + q])), f[j]);
    }
    for (int j = 0; j < nt; j++) _mm512_storeu_ps(y + 16 * j, f[j]);
}

/* AMX-INT8 in the CPU and the tile state granted by the kernel (once per process, before any thread uses
   it; children inherit it) */
static int amx_available(void) {
    static int known = -1;
    if (known < 0) {
        unsigned a, b, c, d;
        known = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) && (d >> 22 & 1) &&
                __builtin_cpu_supports("avx512bf16") &&
                __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    return known;
}
#else
static int amx_available(void) { return 0; }
#endif

/* an 8 x 8 block of x (rows cols apart) into xT transposed (rows nx apart) */
AVX2 static inline __attribute__((always_inline)) void transpose8(const float *x, int64_t cols, float *xT, int64_t nx) {
    __m256 r[8], t[8];
    for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps(x + k * cols);
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4)
        for (int m = 0; m < 2; m++) {
            r[k + m] = _mm256_shuffle_ps(t[k + m], t[k + m + 2], 0x44);
            r[k + m + 2] = _mm256_shuffle_ps(t[k + m], t[k + m + 2], 0xEE);
        }
    /* r[0] columns 0 | 4, r[2] 1 | 5, r[1] 2 | 6, r[3] 3 | 7 of rows 0-3 (low halves) and 4-7 (high) */
    static const int order[4] = {0, 2, 1, 3};
    for (int m = 0; m < 4; m++) {
        __m256 a = r[order[m]], b = r[4 + order[m]];
        _mm256_storeu_ps(xT + m * nx, _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(xT + (m + 4) * nx, _mm256_permute2f128_ps(a, b, 0x31));
    }
}

/* multi_x8_kind's tile of tokens t0 .. t1-1 over the job's rows, eight rows at a time (tiled_tokens);
   scratch as multi_x8_kind's, then pw [8 cols bytes], D [8 nq], BS [8 nfs], OC [8 TOKEN_TILE] */
AVX2 static inline __attribute__((always_inline)) void tiled_rows(const int kind, const int vn, task_t *t,
                                                                const int64_t *job, int64_t t0, int64_t t1,
                                                                int32_t *scw, float *dq, float *bs, uint8_t *dig,
                                                                float *more) {
    const int64_t *g = t->geoms + G_LEN * job[1];
    const uint8_t *tensor = t->raw + job[0];
    int64_t cols = t->cols, nfs = cols / 32, nq = cols / 128, nsp = t->nspan;
    /* rows a vector: sixteen on 512-bit registers where the job has as many (a job of eight rows, 7168
       columns wide, ran 1.5x slower on half-empty vectors than on 256-bit ones) */
    const int G = vn == 3 && job[3] - job[2] >= TILED_Z ? TILED_Z : 8;
    uint8_t *pw = (uint8_t *)more;
    float *D = more + G * cols / 4, *BST = D + G * nq, *OC = BST + G * nfs;
    float *DR = OC + G * TOKEN_TILE, *BSR = DR + G * nq;         /* D and BST row by row, before transposing */
    /* the rows' bytes one after another (32-byte aligned: x8_scaled_row's stores), then interleaved */
    uint8_t *rb = (uint8_t *)(((uintptr_t)(BSR + G * nfs) + 31) & ~(uintptr_t)31);
    for (int64_t r0 = job[2]; r0 < job[3]; r0 += G) {
        int nr = job[3] - r0 < G ? (int)(job[3] - r0) : G;
        /* the group's outliers' runs of inputs, asked for before the rows' set-up: xT was written by the
           calling thread, so on the other core each run is a miss to the shared cache, and taken row by
           row they had waited one after another (6 % of a prefill) */
        for (int i = 0; i < nr; i++) {
            const uint8_t *pc = tensor + g[G_OFFOCOL] + 2 * (r0 + i) * g[G_K];
            for (int64_t o = 0; o < g[G_K]; o++) {
                int64_t col = pc[2 * o] | (pc[2 * o + 1] << 8);
                if (col < cols) {
                    const float *p = t->xT + col * t->nxT + t0;
                    __builtin_prefetch(p);
                    if (t1 - t0 > 16) __builtin_prefetch(p + 16);
                }
            }
        }
        for (int i = 0; i < G; i++) {
            if (i >= nr) {                       /* rows past the job: zero bytes, zero factors */
                memset(rb + i * cols, 0, cols);
                memset(DR + nq * i, 0, sizeof(float) * nq);
                memset(BSR + nfs * i, 0, sizeof(float) * nfs);
                continue;
            }
            int64_t r = r0 + i;
            const uint8_t *codes = tensor + g[G_OFFCODE] + r * g[G_CODEROW];
            row_x8_setup(kind, tensor, g, r, scw, dq, BSR + nfs * i, NULL, NULL);
            const uint8_t *digits = codes;
            if (kind == K_T1) {
                t1_row_digits(codes, g, dig);
                digits = dig;
            }
            float fac = x8_scaled_row(kind, digits, nq, scw, rb + i * cols);
            for (int64_t q = 0; q < nq; q++) DR[nq * i + q] = dq[q] * fac;
            tile_outliers(t, tensor, g, r, t0, t1, OC + TOKEN_TILE * i);
        }
        for (int h = 0; h < G; h += 8) {                 /* (bit patterns moved as floats: no arithmetic) */
            for (int64_t c = 0; c < cols / 4; c += 8)
                transpose8((const float *)(rb + h * cols) + c, cols / 4, (float *)pw + G * c + h, G);
            int64_t c = 0;
            for (; c + 8 <= nfs; c += 8) transpose8(BSR + nfs * h + c, nfs, BST + G * c + h, G);
            for (; c < nfs; c++)
                for (int i = h; i < h + 8; i++) BST[G * c + i] = BSR[nfs * i + c];
            for (c = 0; c + 8 <= nq; c += 8) transpose8(DR + nq * h + c, nq, D + G * c + h, G);
            for (; c < nq; c++)
                for (int i = h; i < h + 8; i++) D[G * c + i] = DR[nq * i + c];
        }
        /* tokens per pass: their integer and float sums in registers, with the rows' vector and a broadcast
           (16 vector registers hold six tokens' two sums; AVX-512's 32 hold eight) */
        const int amx = G == TILED_Z && use_amx;
        for (int64_t x0 = t0; x0 < t1;) {
            /* sixteen tokens a pass on AMX tiles, where as many are left (a tile pass costs the same for
               fewer), else eight (six on 16 vector registers) */
            const int per = amx && t1 - x0 >= AMX_MIN_TOKENS ? 16 : vn >= 2 ? 8 : 6;
            int nt = t1 - x0 < per ? (int)(t1 - x0) : per;
            const int8_t *xb = t->x8 + x0 * cols;
            const float *x8d = t->x8d + x0 * nq, *xs = t->x8s + x0 * nsp;
            float y[16 * TILED_Z];                       /* token j's sums of row i at y[G j + i] */
#if HAVE_AMX
            if (amx && nt >= AMX_MIN_TOKENS)
                tiled_tokens_amx(nt, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y);
            else
#endif
            if (G == TILED_Z) {
                tiled_tokens_z(nt, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, y);
            } else {
                __m256 acc[8];
                if (vn == 1) tiled_tokens_vex(nt, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc);
                else if (vn >= 2) tiled_tokens_evex(nt, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc);
                else tiled_tokens_avx2(nt, pw, nq, xb, cols, D, x8d, BST, xs, nfs, nsp, acc);
                for (int j = 0; j < nt; j++) _mm256_storeu_ps(y + 8 * j, acc[j]);
            }
            for (int j = 0; j < nt; j++) {
                float *dst = t->out + job[5] + (x0 + j - job[4]) * t->ostride + (r0 - job[2]);
                for (int i = 0; i < nr; i++) dst[i] = y[G * j + i] + OC[TOKEN_TILE * i + (x0 + j - t0)];
            }
            x0 += nt;
        }
    }
}

/* rows_job for several tokens with int8 inputs, TOKEN_TILE tokens at a time: row_x8_setup once per row
   and tile, then the tokens four at a time through each 128-column block (its digits taken out once
   for the four), then per token the offsets' sum and the outliers' corrections (read once per row). */
AVX2 static inline __attribute__((always_inline)) void multi_x8_kind(const int kind, const int vn, task_t *t, const int64_t *job,
                                                                    float *scratch) {
    const int64_t *g = t->geoms + G_LEN * job[1];
    int64_t cols = t->cols, nfs = cols / 32, nq = cols / 128, nsp = t->nspan, lb = q6_lo_bytes(cols);
    const uint8_t *tensor = t->raw + job[0];
    /* scratch: scv [nfs] 32-byte vectors (the scratch is 32-byte aligned), scw [nfs], dq, bs, cc [4][nq] */
    __m256i *scv = (__m256i *)scratch;
    int32_t *scw = (int32_t *)(scratch + 8 * nfs);
    float *dq = scratch + 9 * nfs + 8, *bs = dq + nq + 8, *cc = bs + nfs + 8;
    uint8_t *dig = (uint8_t *)(cc + 4 * nq + 8);              /* t1: the row's digits as bytes */
    /* TOKEN_TILE tokens' inputs at a time (they stay in L2 while every row of the job passes over them) */
    for (int64_t t0 = job[4]; t0 < job[4] + t->ntok; t0 += TOKEN_TILE) {
        int64_t t1 = t0 + TOKEN_TILE < job[4] + t->ntok ? t0 + TOKEN_TILE : job[4] + t->ntok;
        /* measured: the bytes of digit x scale pay from three tokens a row (t1 from two: it takes its
           digits out of the chunks anyway) */
        const int scaled = X8_SCALED(kind) && (kind == K_T1 || t1 - t0 >= 3);
        if (X8_SCALED(kind) && t1 - t0 >= (job[3] - job[2] >= 32 ? TILED_MIN_TOKENS : TILED_MIN_TOKENS_SHORT_JOB)) {
            tiled_rows(kind, vn, t, job, t0, t1, scw, dq, bs, dig, (float *)(dig + cols));
            continue;
        }
        for (int64_t r = job[2]; r < job[3]; r++) {
            const uint8_t *codes = tensor + g[G_OFFCODE] + r * g[G_CODEROW];
            prefetch_next_row(tensor, g, r);
            if (r + 1 < job[3])                  /* the next row's codes, read while this one serves every token */
                for (int64_t i = 0; i < g[G_CODEROW]; i += 64) __builtin_prefetch(codes + g[G_CODEROW] + i);
            row_x8_setup(kind, tensor, g, r, scw, dq, bs, NULL, NULL);
            const uint8_t *digits = codes;
            if (kind == K_T1) {
                t1_row_digits(codes, g, dig);
                digits = dig;
            }
            if (scaled) {                    /* the row's bytes of digit x scale, where scv would be */
                float f = x8_scaled_row(kind, digits, nq, scw, (uint8_t *)scv);
                for (int64_t q = 0; q < nq; q++) dq[q] *= f;
            } else {
                for (int64_t i = 0; i < nfs; i++) _mm256_store_si256(scv + i, _mm256_set1_epi32(scw[i]));
            }
            float ocorr[TOKEN_TILE];
            tile_outliers(t, tensor, g, r, t0, t1, ocorr);
            float *dst = t->out + job[5] + r - job[2];
            for (int64_t x0 = t0; x0 < t1; x0 += 4) {
                int nt = t1 - x0 < 4 ? (int)(t1 - x0) : 4;
                const int8_t *xb = t->x8 + x0 * cols;
                for (int j = 0; j < nt; j++) {
                    const float *x8d = t->x8d + (x0 + j) * nq;
                    for (int64_t q = 0; q < nq; q++) cc[j * nq + q] = dq[q] * x8d[q];
                }
                __m256 acc[4];
                const float *xs = t->x8s + x0 * nsp;
                const uint8_t *wb = (const uint8_t *)scv;
#define X8_CALL(n) (scaled ? x8s_tokens(kind, vn, n, wb, nq, xb, cols, cc, bs, xs, nsp, acc)               \
                                    : x8_tokens(kind, vn, n, digits, nq, lb, scv, xb, cols, cc, bs, xs, nsp, acc))
                switch (nt) {     /* the token count a constant in each copy: the sums stay in registers */
                case 4: X8_CALL(4); break;
                case 3: X8_CALL(3); break;
                case 2: X8_CALL(2); break;
                default: X8_CALL(1); break;
                }
#undef X8_CALL
                float sums[4];
                if (nfs & 7)                            /* the offsets past the last whole group of eight */
                    for (int j = 0; j < nt; j++) {
                        float rest = 0;
                        for (int64_t i = nfs & ~(int64_t)7; i < nfs; i++) rest += bs[i] * xs[j * nsp + i];
                        acc[j] = _mm256_add_ps(acc[j], _mm256_setr_ps(rest, 0, 0, 0, 0, 0, 0, 0));
                    }
                for (int j = nt; j < 4; j++) acc[j] = _mm256_setzero_ps();
                /* four horizontal sums at once, and the tokens' outlier corrections */
                __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
                _mm_storeu_ps(sums, _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)),
                                               _mm_loadu_ps(ocorr + (x0 - t0))));
                for (int j = 0; j < nt; j++) dst[(x0 + j - job[4]) * t->ostride] = sums[j];
            }
        }
    }
}

AVX2 static inline __attribute__((always_inline)) void multi_x8_vn(const int vn, task_t *t, const int64_t *job,
                                                                  float *scratch) {
    switch ((int)t->geoms[G_LEN * job[1] + G_KIND]) {
    case K_Q2: multi_x8_kind(K_Q2, vn, t, job, scratch); break;
    case K_Q4: multi_x8_kind(K_Q4, vn, t, job, scratch); break;
    case K_Q1: multi_x8_kind(K_Q1, vn, t, job, scratch); break;
    case K_T1: multi_x8_kind(K_T1, vn, t, job, scratch); break;
    default: multi_x8_kind(K_Q6, vn, t, job, scratch); break;
    }
}

AVX2 static void multi_x8(task_t *t, const int64_t *job, float *scratch) {
    switch (use_vnni) {
    case 1: multi_x8_vn(1, t, job, scratch); break;
    case 2: multi_x8_vn(2, t, job, scratch); break;
    case 3: multi_x8_vn(3, t, job, scratch); break;
    default: multi_x8_vn(0, t, job, scratch); break;
    }
}

/* rows_job for several tokens on AVX2: multi_avx2 over each row's whole chunks, then per token the
   offsets' sum, the tail and the outliers */
AVX2 static void multi_job_avx2(task_t *t, const int64_t *job, float *scratch) {
    const int64_t *g = t->geoms + G_LEN * job[1];
    int kind = (int)g[G_KIND];
    int64_t ntok = t->ntok, cols = t->cols, nsp = t->nspan, k = g[G_K], r0 = job[2], nr = job[3] - job[2];
    const uint8_t *tensor = t->raw + job[0];
    int64_t done = full_cols(g), nfs = done / 32, nb = nfs / 8;
    int64_t tt = ntok < TOKEN_TILE ? ntok : TOKEN_TILE;
    /* scratch: acc [nr * tt] vectors (32-byte aligned), ce [nr][2 nsp], ones, zeros, C [nr * tt][nsp] */
    __m256 *acc = (__m256 *)scratch;
    float *ce = scratch + 8 * nr * tt, *ones = ce + 2 * nsp * nr, *zeros = ones + nsp, *C = zeros + nsp;
    float ov[256];
    int64_t oc[256];
    for (int64_t s = 0; s < nsp; s++) { ones[s] = 1.0f; zeros[s] = 0.0f; }
    for (int64_t i = 0; i < nr; i++)      /* ce[i][s] = A * mul, ce[i][nfs + s] = B - z * A */
        coefs_avx2(tensor, g, r0 + i, ones, zeros, nfs, ce + 2 * nsp * i, 1);
    for (int64_t x0 = job[4]; x0 < job[4] + ntok; x0 += tt) {
        int64_t nt = job[4] + ntok - x0 < tt ? job[4] + ntok - x0 : tt;
        for (int64_t i = 0; i < nr; i++) {
            const float *cei = ce + 2 * nsp * i;
            for (int64_t tk = 0; tk < nt; tk++) {              /* C = A * mul * xsc; the offsets' sum */
                const float *xsc = t->xsc + (x0 + tk) * nsp, *xs = t->xs + (x0 + tk) * nsp;
                float *Ct = C + (i * nt + tk) * nsp;
                __m256 b = _mm256_setzero_ps();
                for (int64_t q = 0; q < nb; q++) {
                    _mm256_storeu_ps(Ct + 8 * q, _mm256_mul_ps(_mm256_loadu_ps(cei + 8 * q), _mm256_loadu_ps(xsc + 8 * q)));
                    b = _mm256_fmadd_ps(_mm256_loadu_ps(cei + nfs + 8 * q), _mm256_loadu_ps(xs + 8 * q), b);
                }
                float rest = 0;
                for (int64_t s = 8 * nb; s < nfs; s++) { Ct[s] = cei[s] * xsc[s]; rest += cei[nfs + s] * xs[s]; }
                acc[i * nt + tk] = _mm256_add_ps(b, _mm256_setr_ps(rest, 0, 0, 0, 0, 0, 0, 0));
            }
        }
        multi_avx2(kind, tensor + g[G_OFFCODE] + r0 * g[G_CODEROW], g[G_CODEROW], (int)nr, done, cols,
                   t->xp + x0 * cols, (int)nt, C, nsp, acc);
        for (int64_t i = 0; i < nr; i++) {
            int64_t r = r0 + i;
            const uint8_t *codes = tensor + g[G_OFFCODE] + r * g[G_CODEROW];
            float *dst = t->out + job[5] + (x0 - job[4]) * t->ostride + i;
            if (k > 256) {                                     /* more outliers than the buffers: the general path */
                for (int64_t tk = 0; tk < nt; tk++)
                    dst[tk * t->ostride] = hsum8(acc[i * nt + tk]) + row_fixups(tensor, g, r, codes, t->xf + (x0 + tk) * cols,
                                                                                &t->bad);
                continue;
            }
            /* the tail's levels and span parameters, and the outliers, read once per row */
            float lev[256], tA[8], tB[8];
            if (done < cols) {
                tail_levels(codes, g, done, r + 1 < g[G_ROWS], lev);
                for (int64_t s = nfs; s < nsp; s++) span_ab(tensor, g, r, s, tA + s - nfs, tB + s - nfs);
            }
            const uint8_t *pc = tensor + g[G_OFFOCOL] + 2 * r * k, *pv = tensor + g[G_OFFOVAL] + 2 * r * k;
            int64_t n = outliers_valid(tensor, g, r, &t->bad);
            for (int64_t q = 0; q < n; q++) {
                oc[q] = pc[2 * q] | (pc[2 * q + 1] << 8);
                ov[q] = f16_at(pv + 2 * q);
            }
            for (int64_t tk = 0; tk < nt; tk++) {
                const float *x = t->xf + (x0 + tk) * cols;
                const float *xs = t->xs + (x0 + tk) * nsp;
                float corr = 0;
                for (int64_t s = nfs; s < nsp; s++)              /* the tail, in float: A * sum(lev x) + B * sum(x) */
                    corr += tA[s - nfs] * dot32(lev + 32 * (s - nfs), x + 32 * s) + tB[s - nfs] * xs[s];
                for (int64_t q = 0; q < n; q++) corr += ov[q] * x[oc[q]];
                dst[tk * t->ostride] = hsum8(acc[i * nt + tk]) + corr;
            }
        }
    }
}
#endif

/* ---------------------------------------------------------------------- q1t: one-bit weights by lookups */
/* q1t (formats/quants.py TiledQ1Codec, SPEC.md) holds q1's values with 32 rows side by side. Its inputs
 * are rounded to -Q1T_LEVELS .. Q1T_LEVELS per 128 values (so that four of them sum within a byte), and
 * for every four columns a table of their 16 signed sums is built once per input: entry e is the sum of
 * +x_i where bit i of e is set and -x_i where it is not. A byte of a tile's codes is one row's four
 * codes of four columns, so `vpshufb` looks up 32 rows' sums of four weights times four inputs at once;
 * two sub-blocks' lookups, interleaved, go through `vpmaddubsw` with their 4-bit scales, which widens
 * and scales them in one instruction. Per 128 columns one float multiply-add by d times the step; per
 * 256 the offset m times the inputs' exact sum. Outlier corrections are added in float as in q1. */
#define Q1T_LEVELS 31
#define Q1T_SB (128 + 4 * (32 + 256))          /* a tile's bytes per super-block */
static int q1t_order[32];                      /* the row at each position of a tile's d, m and outputs */

static void q1t_init(void) {
    int i = 0;
    for (int half = 0; half < 16; half += 8)
        for (int parity = 0; parity < 2; parity++)
            for (int lane = 0; lane < 32; lane += 16)
                for (int r = half + parity; r < half + 8; r += 2) q1t_order[i++] = r + lane;
}

static int q1t_layout(const int64_t *g) {
    return g[G_KIND] == K_Q1T && g[G_S] == 32 && g[G_P] == 256 && g[G_NPAR] == 2 && g[G_BITS0] == 1 &&
           g[G_PB0] == 8 && g[G_COLS] > 0 && g[G_COLS] % 256 == 0 && g[G_CODEROW] == g[G_COLS] / 256 * (Q1T_SB / 32) &&
           g[G_OFFCODE] + (g[G_ROWS] + 31) / 32 * 32 * g[G_CODEROW] == g[G_NBYTES] && g[G_OFFCODE] >= 4 * g[G_ROWS] * g[G_K];
}

/* one input's tables (4 cols bytes), steps (cols / 128) and exact sums per 256 (cols / 256 after them) */
static void q1t_input_c(const float *x, int64_t cols, int8_t *tab, float *sd) {
    float *step = sd, *xs = sd + cols / 128;
    for (int64_t c0 = 0; c0 < cols; c0 += 128) {
        float amax = 0, sum = 0;
        for (int j = 0; j < 128; j++) { amax = fmaxf(amax, fabsf(x[c0 + j])); sum += x[c0 + j]; }
        if (c0 % 256 == 0) xs[c0 / 256] = 0;
        xs[c0 / 256] += sum;
        step[c0 / 128] = amax / Q1T_LEVELS;
        float inv = amax > 0 ? Q1T_LEVELS / amax : 0.0f;
        for (int j = 0; j < 128; j += 4) {
            int q[4];
            for (int i = 0; i < 4; i++) q[i] = (int)nearbyintf(x[c0 + j + i] * inv);
            int8_t *e = tab + 4 * (c0 + j);
            for (int v = 0; v < 16; v++)
                e[v] = (int8_t)(((v & 1) ? q[0] : -q[0]) + ((v & 2) ? q[1] : -q[1]) + ((v & 4) ? q[2] : -q[2]) +
                                ((v & 8) ? q[3] : -q[3]));
        }
    }
}

/* one tile's 32 rows times one input, in row order, without outliers */
static void q1t_tile_c(const uint8_t *p, int64_t nsb, const float *step, const float *xs, const int8_t *tab, float *y) {
    int pos[32];
    for (int i = 0; i < 32; i++) pos[q1t_order[i]] = i;
    for (int r = 0; r < 32; r++) {
        float f = 0;
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *sb = p + b * Q1T_SB;
            float d = f16_at(sb + 2 * pos[r]), m = f16_at(sb + 64 + 2 * pos[r]);
            f += m * xs[b];
            for (int h = 0; h < 2; h++) {
                int32_t acc = 0;
                for (int pr = 2 * h; pr < 2 * h + 2; pr++) {
                    const uint8_t *base = sb + 128 + pr * 288;
                    int slo = base[r] & 15, shi = base[r] >> 4;
                    const int8_t *ta = tab + 4 * (256 * b + 64 * pr), *tb = ta + 4 * 32;
                    for (int gi = 0; gi < 8; gi++) {
                        int c = base[32 + 32 * gi + r];
                        acc += slo * ta[16 * gi + (c & 15)] + shi * tb[16 * gi + (c >> 4)];
                    }
                }
                f += (float)acc * (d * step[2 * b + h]);
            }
        }
        y[r] = f;
    }
}

#if HAVE_X86
AVX2 static void q1t_input_avx2(const float *x, int64_t cols, int8_t *tab, float *sd, int8_t *q) {
    float *step = sd, *xs = sd + cols / 128;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t c0 = 0; c0 < cols; c0 += 128) {
        __m256 mx = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int j = 0; j < 128; j += 8) {
            __m256 v = _mm256_loadu_ps(x + c0 + j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
            sum = _mm256_add_ps(sum, v);
        }
        float amax = hmax8(mx);
        if (c0 % 256 == 0) xs[c0 / 256] = 0;
        xs[c0 / 256] += hsum8(sum);
        step[c0 / 128] = amax / Q1T_LEVELS;
        __m256 inv = _mm256_set1_ps(amax > 0 ? Q1T_LEVELS / amax : 0.0f);
        for (int j = 0; j < 128; j += 32) {
            const float *v = x + c0 + j;
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), inv));
            __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), inv));
            __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), inv));
            __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), inv));
            __m256i pk = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
            _mm256_storeu_si256((__m256i *)(q + c0 + j), _mm256_permutevar8x32_epi32(pk, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
    }
    /* two groups of four a register: each input spread over its 16-byte lane (vpshufb), signed by bit i
       of the entry's index (vpsignb by a +-1 pattern), the four summed */
    const __m256i s0 = _mm256_setr_epi8(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1,
                                        -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1);
    const __m256i s1 = _mm256_setr_epi8(-1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1,
                                        -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1);
    const __m256i s2 = _mm256_setr_epi8(-1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1,
                                        -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1);
    const __m256i s3 = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1,
                                        -1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_set1_epi8(1), b2 = _mm256_set1_epi8(2), b3 = _mm256_set1_epi8(3);
    for (int64_t gi = 0; gi < cols / 4; gi += 2) {
        int32_t w0, w1;
        memcpy(&w0, q + 4 * gi, 4);
        memcpy(&w1, q + 4 * gi + 4, 4);
        __m256i v = _mm256_setr_epi32(w0, 0, 0, 0, w1, 0, 0, 0);
        __m256i e = _mm256_add_epi8(_mm256_add_epi8(_mm256_sign_epi8(_mm256_shuffle_epi8(v, b0), s0),
                                                    _mm256_sign_epi8(_mm256_shuffle_epi8(v, b1), s1)),
                                    _mm256_add_epi8(_mm256_sign_epi8(_mm256_shuffle_epi8(v, b2), s2),
                                                    _mm256_sign_epi8(_mm256_shuffle_epi8(v, b3), s3)));
        _mm256_storeu_si256((__m256i *)(tab + 16 * gi), e);
    }
}

/* one tile's 32 rows times one input, in the tile's position order (q1t_order), without outliers */
AVX2 static void q1t_tile_avx2(const uint8_t *p, int64_t nsb, const float *step, const float *xs, const int8_t *tab,
                               float *y) {
    const __m256i k15 = _mm256_set1_epi8(15), even = _mm256_set1_epi32(1), odd = _mm256_set1_epi32(1 << 16);
    __m256 f[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nsb; b++, p += Q1T_SB) {
        __m256 d[4];
        for (int k = 0; k < 4; k++) {
            d[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * k)));
            f[k] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 64 + 16 * k))),
                                   _mm256_set1_ps(xs[b]), f[k]);
        }
        const uint8_t *sp = p + 128;
        for (int h = 0; h < 2; h++) {                             /* the super-block's two halves of 128 */
            __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int pr = 0; pr < 2; pr++, sp += 288) {           /* a pair of sub-blocks: 64 columns */
                const int64_t col = 256 * b + 128 * h + 64 * pr;
                __m256i sv = _mm256_loadu_si256((const __m256i *)sp);
                __m256i slo = _mm256_and_si256(sv, k15), shi = _mm256_and_si256(_mm256_srli_epi16(sv, 4), k15);
                __m256i sA = _mm256_unpacklo_epi8(slo, shi), sB = _mm256_unpackhi_epi8(slo, shi);
                __m256i accA = _mm256_setzero_si256(), accB = _mm256_setzero_si256();
                const int8_t *ta = tab + 4 * col, *tb = tab + 4 * (col + 32);
                for (int gi = 0; gi < 8; gi++) {       /* |sums| <= 8 x 2 x 15 x 124 < 2^15: no saturation */
                    __m256i cv = _mm256_loadu_si256((const __m256i *)(sp + 32 + 32 * gi));
                    __m256i ia = _mm256_and_si256(cv, k15), ib = _mm256_and_si256(_mm256_srli_epi16(cv, 4), k15);
                    __m256i la = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(ta + 16 * gi))), ia);
                    __m256i lb = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(tb + 16 * gi))), ib);
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
    for (int k = 0; k < 4; k++) _mm256_storeu_ps(y + 8 * k, f[k]);
}
#endif

#if HAVE_X86
AVX2 static float q1t_outliers_avx2(const uint8_t *t, const int64_t *g, int64_t r, const float *x, atomic_int *bad) {
    return outlier_sum(t, g, r, x, bad);
}
#endif

/* a q1t job: rows [job[2], job[3]) (whole tiles, the last one possibly cut by the tensor's end) for each
   of the job's inputs, outlier corrections added */
static void q1t_job(task_t *t, const int64_t *job, const int64_t *g) {
    const uint8_t *tensor = t->raw + job[0];
    int64_t cols = g[G_COLS], nsb = cols / 256, per = cols / 128 + cols / 256, k = g[G_K];
    const uint8_t *tiles = tensor + g[G_OFFCODE];
    float y[32], yo[32];
    for (int64_t tk = 0; tk < t->ntok; tk++) {
        int64_t xi = job[4] + tk;
        const int8_t *tab = t->lt + 4 * xi * cols;
        const float *step = t->ltd + xi * per, *xs = step + cols / 128, *x = t->xf + xi * cols;
        float *dst = t->out + job[5] + tk * t->ostride - job[2];
        for (int64_t r0 = job[2]; r0 < job[3]; r0 += 32) {
            const uint8_t *p = tiles + r0 * g[G_CODEROW];
#if HAVE_X86
            if (use_avx2) {
                q1t_tile_avx2(p, nsb, step, xs, tab, yo);
                for (int i = 0; i < 32; i++) y[q1t_order[i]] = yo[i];
                for (int64_t r = r0; r < job[3] && r < r0 + 32; r++)
                    dst[r] = y[r - r0] + q1t_outliers_avx2(tensor, g, r, x, &t->bad);
                continue;
            }
#endif
            q1t_tile_c(p, nsb, step, xs, tab, y);
            for (int64_t r = r0; r < job[3] && r < r0 + 32; r++) {
                const uint8_t *oc = tensor + g[G_OFFOCOL] + 2 * r * k, *ov = tensor + g[G_OFFOVAL] + 2 * r * k;
                int64_t no = outliers_valid(tensor, g, r, &t->bad);
                float corr = 0;
                for (int64_t q = 0; q < no; q++) corr += f16_at(ov + 2 * q) * x[oc[2 * q] | (oc[2 * q + 1] << 8)];
                dst[r] = y[r - r0] + corr;
            }
        }
    }
}

/* row r of a q1t tensor decoded (outliers corrected), as formats/quants.py's reference decoder */
static void q1t_deq_row(const uint8_t *t, const int64_t *g, int64_t r, float *out) {
    int64_t cols = g[G_COLS], nsb = cols / 256, k = g[G_K];
    int pos = 0;
    while (q1t_order[pos] != (int)(r % 32)) pos++;
    const uint8_t *p = t + g[G_OFFCODE] + (r / 32) * 32 * g[G_CODEROW];
    int rr = (int)(r % 32);
    for (int64_t b = 0; b < nsb; b++, p += Q1T_SB) {
        float d = f16_at(p + 2 * pos), m = f16_at(p + 64 + 2 * pos);
        for (int pr = 0; pr < 4; pr++) {
            const uint8_t *base = p + 128 + pr * 288;
            for (int half = 0; half < 2; half++) {
                float A = d * (float)((base[rr] >> (4 * half)) & 15);
                float *o = out + 256 * b + 64 * pr + 32 * half;
                for (int gi = 0; gi < 8; gi++) {
                    int nib = (base[32 + 32 * gi + rr] >> (4 * half)) & 15;
                    for (int i = 0; i < 4; i++) o[4 * gi + i] = A * (float)(2 * ((nib >> i) & 1) - 1) + m;
                }
            }
        }
    }
    const uint8_t *oc = t + g[G_OFFOCOL] + 2 * r * k, *ov = t + g[G_OFFOVAL] + 2 * r * k;
    atomic_int bad = 0;
    int64_t no = outliers_valid(t, g, r, &bad);
    for (int64_t q = 0; q < no; q++) out[oc[2 * q] | (oc[2 * q + 1] << 8)] += f16_at(ov + 2 * q);
}

/* a mat-vec job: rows [job[2], job[3]) of the tensor at raw + job[0] times inputs job[4] ..
   job[4] + ntok - 1, written to out[job[5] + t * ostride + row - job[2]] */
static void rows_job(task_t *t, int64_t j, float *scratch) {
    const int64_t *job = t->jobs + JOB_LEN * j;
    const int64_t *g = t->geoms + G_LEN * job[1];
    int64_t x0 = job[4], ntok = t->ntok, cols = t->cols, nsp = t->nspan;
    const uint8_t *tensor = t->raw + job[0];
    if (g[G_KIND] == K_Q1T) {
        q1t_job(t, job, g);
        return;
    }
#if HAVE_X86
    if (use_avx2 && ntok == 2 && t->x8 && x8_kind((int)g[G_KIND]) && g[G_KIND] != K_T1 && g[G_COLS] % 128 == 0 &&
        full_cols(g) == g[G_COLS]) {
        /* two tokens: the one-token kernel twice (measured: q1 2048x7168 0.85 ms against 1.3, q2 even) */
        for (int64_t tk = 0; tk < 2; tk++)
            rows_x8(tensor, g, job[2], job[3], t->xf + (x0 + tk) * cols, t->x8 + (x0 + tk) * cols,
                    t->x8d + (x0 + tk) * ((cols + 127) / 128), t->x8s + (x0 + tk) * nsp, scratch,
                    t->out + job[5] + tk * t->ostride, &t->bad);
        return;
    }
    if (use_avx2 && ntok > 1) {
        /* t1's rows take their digits out first, so a tail chunk is no obstacle there */
        if (t->x8 && x8_kind((int)g[G_KIND]) && g[G_COLS] % 128 == 0 && g[G_K] <= 256 &&
            (full_cols(g) == g[G_COLS] || g[G_KIND] == K_T1))
            multi_x8(t, job, scratch);
        else
            multi_job_avx2(t, job, scratch);
        return;
    }
    if (use_avx2 && t->xt && g[G_KIND] == K_T1 && g[G_COLS] % 128 == 0) {     /* one t1 token */
        rows_t1_xt(tensor, g, job[2], job[3], t->xf + x0 * cols, t->xt + 2 * x0 * cols, t->xtd + x0 * ((cols + 127) / 128),
                   t->xts + x0 * nsp, scratch, t->out + job[5], &t->bad);
        return;
    }
    if (use_avx2 && t->x8 && x8_kind((int)g[G_KIND]) && g[G_KIND] != K_T1 && g[G_COLS] % 128 == 0 &&
        full_cols(g) == g[G_COLS]) {
        rows_x8(tensor, g, job[2], job[3], t->xf + x0 * cols, t->x8 + x0 * cols, t->x8d + x0 * ((cols + 127) / 128),
                   t->x8s + x0 * nsp, scratch, t->out + job[5], &t->bad);
        return;
    }
    if (use_avx2) {
        rows_avx2(tensor, g, job[2], job[3], t->xf + x0 * cols, t->xq + x0 * cols, t->xp + x0 * cols, t->xsc + x0 * nsp,
                  t->xs + x0 * nsp, scratch, t->out + job[5], &t->bad);
        return;
    }
#endif
    for (int64_t tk = 0; tk < ntok; tk++) {
        int64_t xi = x0 + tk;
        for (int64_t r = job[2]; r < job[3]; r++)
            t->out[job[5] + tk * t->ostride + r - job[2]] =
                row_dot(tensor, g, r, t->xf + xi * cols, t->xq + xi * cols, t->xp + xi * cols, t->xsc + xi * nsp,
                        t->xs + xi * nsp, (int32_t *)scratch, &t->bad);
    }
}

#define DEQ_ROWS 8
/* a dequantize job: rows r0 + DEQ_ROWS * j .. of the tensor at raw into out (t->n rows from r0) */
static void deq_job(task_t *t, int64_t j, float *scratch) {
    int64_t lo = DEQ_ROWS * j, hi = lo + DEQ_ROWS < t->n ? lo + DEQ_ROWS : t->n;
    for (int64_t i = lo; i < hi; i++) deq_row(t->raw, t->geoms, t->stride + i, t->out + i * t->cols, scratch);
}

/* llama.cpp blocks (runtime/_ggml.c): t->n is the GGML type, t->stride a row's bytes, t->nspan its
   blocks, t->ntok the inputs (rows of xf, cols apart), out [ntok, t->cols_out]: rows of job j */
#define GGML_JOB_WEIGHTS (1 << 15)
static void ggml_rows_job(task_t *t, int64_t j, float *scratch) {
    int64_t per = t->ostride, lo = j * per, hi = lo + per < t->njobs_rows ? lo + per : t->njobs_rows;
    float *acc = scratch, *buf = scratch + t->ntok + 8;
    for (int64_t r = lo; r < hi; r++) {
        for (int64_t k = 0; k < t->ntok; k++) acc[k] = 0.0f;
        int64_t in = t->head_rows ? r / t->head_rows : 0;
        if (t->q8)
            ggml_row_dot_q8k((int)t->n, t->raw + r * t->stride, t->nspan, t->q8 + in * t->nspan, t->ntok, acc);
        else
            ggml_row_dot((int)t->n, t->raw + r * t->stride, t->nspan, t->xf + in * t->cols, t->cols, t->ntok, acc, buf,
                         t->fix ? t->fix + in * t->nspan : NULL);
        for (int64_t k = 0; k < t->ntok; k++) t->out[k * t->njobs_rows + r] = acc[k];
    }
}

static void ggml_deq_job(task_t *t, int64_t j, float *scratch) {
    int64_t lo = DEQ_ROWS * j, hi = lo + DEQ_ROWS < t->njobs_rows ? lo + DEQ_ROWS : t->njobs_rows;
    for (int64_t i = lo; i < hi; i++)
        ggml_decode((int)t->n, t->raw + i * t->stride, t->nspan, t->out + i * t->cols);
}

/* llama.cpp blocks in a MoE call: job rows [job[2], job[3]) of the tensor at raw + job[0], whose
   (type, row bytes, blocks per row) are t->geoms[3 * job[1] ..], times input row job[4] of xf (t->cols
   wide), into out[job[5] + row - job[2]] */
static void ggml_moe_job(task_t *t, int64_t j, float *scratch) {
    const int64_t *job = t->jobs + JOB_LEN * j, *ty = t->geoms + 3 * job[1];
    const float *x = t->xf + job[4] * t->cols;
    for (int64_t r = job[2]; r < job[3]; r++) {
        float acc = 0.0f;
        if (t->q8)
            ggml_row_dot_q8k((int)ty[0], t->raw + job[0] + r * ty[1], ty[2], t->q8 + job[4] * ty[2], 1, &acc);
        else
            ggml_row_dot((int)ty[0], t->raw + job[0] + r * ty[1], ty[2], x, t->cols, 1, &acc, scratch,
                         t->fix ? t->fix + job[4] * ty[2] : NULL);
        t->out[job[5] + r - job[2]] = acc;
    }
}

#define SUM_BYTES (1 << 20)
/* a read job: the sum of one MiB of the buffer as uint64 words (the memory read bandwidth probe) */
#if HAVE_X86
__attribute__((target_clones("avx2", "default")))
#endif
static void sum_job(task_t *t, int64_t j, float *scratch) {
    int64_t lo = j * SUM_BYTES, hi = lo + SUM_BYTES < t->n ? lo + SUM_BYTES : t->n;
    const uint64_t *w = (const uint64_t *)(t->raw + lo);
    uint64_t acc = 0;
    for (int64_t i = 0; i < (hi - lo) / 8; i++) acc += w[i];
    atomic_fetch_add_explicit(&t->sum, acc, memory_order_relaxed);
}

/* digit j of span s (whole chunks only), for every j: a plain loop per codec that the compiler
   vectorizes */
static void span_digits(int kind, const uint8_t *codes, int64_t s, int64_t cols, float *d) {
    switch (kind) {
    case K_Q2: case K_Q2RTN: {
        const uint8_t *c = codes + 32 * (s >> 2);
        int sh = 2 * (int)(s & 3);
        for (int j = 0; j < 32; j++) d[j] = (float)((c[j] >> sh) & 3);
        break;
    }
    case K_Q4: {
        const uint8_t *c = codes + 32 * (s >> 1);
        int sh = 4 * (int)(s & 1);
        for (int j = 0; j < 32; j++) d[j] = (float)((c[j] >> sh) & 15);
        break;
    }
    case K_Q8:
        for (int j = 0; j < 32; j++) d[j] = (float)(int8_t)codes[32 * s + j];
        break;
    case K_Q1: {
        const uint8_t *c = codes + 32 * (s >> 3);
        int sh = (int)(s & 7);
        for (int j = 0; j < 32; j++) d[j] = (float)((c[j] >> sh) & 1);
        break;
    }
    default:
        for (int j = 0; j < 32; j++) d[j] = (float)digit_full(kind, codes, 32 * s + j, cols);
    }
}

#if HAVE_X86
/* The whole chunks of a transposed job, chunk by chunk: the chunk's output columns stay in registers
   while every row of the head adds its digits times a[j * nsp + s] (its scaled span coefficient times
   v[j]). Digits come de-interleaved (even bytes, odd bytes), so the accumulators are too; they are
   put back in column order once per chunk. */
AVX2 static inline __attribute__((always_inline)) void heads_t_body(const int kind, const int spc, const uint8_t *codes0,
                                                                  int64_t code_row, int64_t n, const float *a, int64_t nsp,
                                                                  int64_t nch, int64_t lo_bytes, float *out) {
    __m256i ev[8], od[8];
    for (int k = 0; k < 8; k++) ev[k] = od[k] = _mm256_setzero_si256();
    for (int64_t ch = 0; ch < nch; ch++) {
        __m256 o[8][4];
        for (int k = 0; k < spc; k++) o[k][0] = o[k][1] = o[k][2] = o[k][3] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            chunk_digits(kind, codes0 + j * code_row, ch, lo_bytes, ev, od);
            const float *aj = a + j * nsp + ch * spc;
            for (int k = 0; k < spc; k++) {
                __m256 w = _mm256_broadcast_ss(aj + k);
                o[k][0] = _mm256_fmadd_ps(w, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(ev[k]))), o[k][0]);
                o[k][1] = _mm256_fmadd_ps(w, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(ev[k], 1))), o[k][1]);
                o[k][2] = _mm256_fmadd_ps(w, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(od[k]))), o[k][2]);
                o[k][3] = _mm256_fmadd_ps(w, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(od[k], 1))), o[k][3]);
            }
        }
        for (int k = 0; k < spc; k++) {
            /* o[k][0] holds columns 0, 2, .., 14 of the span, o[k][2] columns 1, 3, .., 15; [1], [3] the next 16 */
            float *dst = out + 32 * (ch * spc + k);
            for (int half = 0; half < 2; half++) {
                __m256 lo = _mm256_unpacklo_ps(o[k][half], o[k][half + 2]);   /* 0 1 2 3 | 8 9 10 11 */
                __m256 hi = _mm256_unpackhi_ps(o[k][half], o[k][half + 2]);   /* 4 5 6 7 | 12 13 14 15 */
                _mm256_storeu_ps(dst + 16 * half, _mm256_permute2f128_ps(lo, hi, 0x20));
                _mm256_storeu_ps(dst + 16 * half + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
            }
        }
    }
}

/* span k of chunk ch of two rows (r0, r1) times their pair of 16-bit coefficients p, into the even
   columns' sums (el, eh) and the odd ones' (ol, oh): the two rows' digits interleaved column by column */
AVX2 static inline __attribute__((always_inline)) void row_pair(const int kind, const int vn, const int k,
                                                               const uint8_t *r0, const uint8_t *r1, int64_t ch,
                                                               int64_t lo_bytes, int32_t p, __m256i *el, __m256i *eh,
                                                               __m256i *ol, __m256i *oh) {
    __m256i ev[8], od[8], ev1[8], od1[8];
    chunk_digits(kind, r0, ch, lo_bytes, ev, od);
    chunk_digits(kind, r1, ch, lo_bytes, ev1, od1);
    __m256i c = _mm256_set1_epi32(p);
    *el = dp_words(vn, *el, _mm256_unpacklo_epi16(ev[k], ev1[k]), c);
    *eh = dp_words(vn, *eh, _mm256_unpackhi_epi16(ev[k], ev1[k]), c);
    *ol = dp_words(vn, *ol, _mm256_unpacklo_epi16(od[k], od1[k]), c);
    *oh = dp_words(vn, *oh, _mm256_unpackhi_epi16(od[k], od1[k]), c);
}

/* The same with the span coefficients as 16-bit integers (heads_t_int): pairs of rows at a time,
   their digits interleaved column by column so that one vpmaddwd by the pair's coefficients adds both
   rows into 32-bit sums; span by span, so four accumulators are all the registers a span needs. The
   float form above costs two conversions per weight; this one about a quarter of the instructions. */
AVX2 static inline __attribute__((always_inline)) void heads_t_int_body(const int kind, const int spc, const int vn,
                                                                      const uint8_t *codes0, int64_t code_row,
                                                                      int64_t n, const int32_t *P, const float *alpha,
                                                                      int64_t nsp, int64_t nch, int64_t lo_bytes,
                                                                      float *out) {
    for (int64_t ch = 0; ch < nch; ch++) {
#pragma GCC unroll 8
        for (int k = 0; k < spc; k++) {       /* unrolled: k constant, so only span k's digits are taken out */
            int64_t s = ch * spc + k;
            /* two sets of sums, pairs of rows alternating between them: each vpdpwssd waits on its own
               accumulator's last one, so one set would run at the instruction's latency, not its
               throughput (integer sums: the order does not change them) */
            __m256i e_lo = _mm256_setzero_si256(), e_hi = e_lo, o_lo = e_lo, o_hi = e_lo;
            __m256i f_lo = e_lo, f_hi = e_lo, p_lo = e_lo, p_hi = e_lo;
            const uint8_t *rj = codes0;
            const int32_t *Pj = P + s;
            int64_t j = 0;
            for (; j + 4 <= n; j += 4, rj += 4 * code_row, Pj += 2 * nsp) {
                row_pair(kind, vn, k, rj, rj + code_row, ch, lo_bytes, Pj[0], &e_lo, &e_hi, &o_lo, &o_hi);
                row_pair(kind, vn, k, rj + 2 * code_row, rj + 3 * code_row, ch, lo_bytes, Pj[nsp], &f_lo, &f_hi, &p_lo, &p_hi);
            }
            for (; j < n; j += 2, rj += 2 * code_row, Pj += nsp)
                row_pair(kind, vn, k, rj, j + 1 < n ? rj + code_row : rj, ch, lo_bytes, Pj[0], &e_lo, &e_hi, &o_lo, &o_hi);
            e_lo = _mm256_add_epi32(e_lo, f_lo); e_hi = _mm256_add_epi32(e_hi, f_hi);
            o_lo = _mm256_add_epi32(o_lo, p_lo); o_hi = _mm256_add_epi32(o_hi, p_hi);
            /* e_lo: columns 0 2 4 6 | 16 18 20 22, e_hi 8 .. 14 | 24 .. 30, o_*: the odd ones */
            __m256 a = _mm256_set1_ps(alpha[s]);
            __m256 El = _mm256_mul_ps(a, _mm256_cvtepi32_ps(e_lo)), Eh = _mm256_mul_ps(a, _mm256_cvtepi32_ps(e_hi));
            __m256 Ol = _mm256_mul_ps(a, _mm256_cvtepi32_ps(o_lo)), Oh = _mm256_mul_ps(a, _mm256_cvtepi32_ps(o_hi));
            __m256 X = _mm256_unpacklo_ps(El, Ol), Y = _mm256_unpackhi_ps(El, Ol);   /* 0-3 | 16-19, 4-7 | 20-23 */
            __m256 Z = _mm256_unpacklo_ps(Eh, Oh), W = _mm256_unpackhi_ps(Eh, Oh);   /* 8-11 | 24-27, 12-15 | 28-31 */
            float *dst = out + 32 * s;
            _mm256_storeu_ps(dst, _mm256_permute2f128_ps(X, Y, 0x20));
            _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(Z, W, 0x20));
            _mm256_storeu_ps(dst + 16, _mm256_permute2f128_ps(X, Y, 0x31));
            _mm256_storeu_ps(dst + 24, _mm256_permute2f128_ps(Z, W, 0x31));
        }
    }
}

/* Whether a codec's transposed products take integer coefficients: its digits come out of a chunk by
   masks alone (t1's take a chain of multiplies per digit, which span by span would repeat) */
static inline int heads_t_int_kind(int kind) { return kind != K_T1; }

/* a[j * nsp + s] (n rows, the nfs whole spans) as 16-bit integers times one scale per span, in pairs of rows for
   heads_t_int_body: P[(j / 2) * nsp + s] holds row j's integer in its low half, row j + 1's in its high
   half (0 past the last row). The largest magnitude of a span is A = min(32767, (2^31 - 1) / (n' 512)),
   n' = n rounded up to even, so no 32-bit sum can overflow (a digit in its lane is below 512). */
AVX2 static void heads_t_int_coefs(const float *a, int64_t n, int64_t nsp, int64_t nfs, int32_t *P, float *alpha) {
    int64_t ne = (n + 1) & ~(int64_t)1;
    double lim = 2147483647.0 / ((double)ne * 512.0);
    float A = lim < 32767.0 ? (float)floor(lim) : 32767.0f;
    float *inv = alpha + nsp;                       /* (scratch: nsp more floats) */
    /* each span's largest magnitude, eight spans at a time in a register (through memory, every row's
       maximum had waited on the last row's store) */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t s8 = nfs / 8 * 8;
    for (int64_t s = 0; s < s8; s += 8) {
        __m256 m0 = _mm256_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;     /* four chains: a max waits 4 cycles */
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            const float *r = a + j * nsp + s;
            m0 = _mm256_max_ps(m0, _mm256_and_ps(_mm256_loadu_ps(r), absmask));
            m1 = _mm256_max_ps(m1, _mm256_and_ps(_mm256_loadu_ps(r + nsp), absmask));
            m2 = _mm256_max_ps(m2, _mm256_and_ps(_mm256_loadu_ps(r + 2 * nsp), absmask));
            m3 = _mm256_max_ps(m3, _mm256_and_ps(_mm256_loadu_ps(r + 3 * nsp), absmask));
        }
        for (; j < n; j++) m0 = _mm256_max_ps(m0, _mm256_and_ps(_mm256_loadu_ps(a + j * nsp + s), absmask));
        _mm256_storeu_ps(alpha + s, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    }
    for (int64_t s = s8; s < nfs; s++) {
        float m = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            float v = fabsf(a[j * nsp + s]);
            m = v > m ? v : m;
        }
        alpha[s] = m;
    }
    for (int64_t s = 0; s < nfs; s++) {
        float m = alpha[s];
        inv[s] = m > 0 ? A / m : 0.0f;
        alpha[s] = m > 0 ? m / A : 0.0f;
    }
    const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
    for (int64_t j = 0; j < ne; j += 2) {
        const float *r0 = a + j * nsp, *r1 = j + 1 < n ? r0 + nsp : NULL;
        int32_t *dst = P + (j >> 1) * nsp;
        int64_t s = 0;
        for (; s + 8 <= nfs; s += 8) {
            __m256 iv = _mm256_loadu_ps(inv + s);
            __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r0 + s), iv));
            __m256i q1 = r1 ? _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r1 + s), iv)) : _mm256_setzero_si256();
            _mm256_storeu_si256((__m256i *)(dst + s), _mm256_or_si256(_mm256_and_si256(q0, lo16), _mm256_slli_epi32(q1, 16)));
        }
        for (; s < nfs; s++) {
            int32_t q0 = (int32_t)lrintf(r0[s] * inv[s]), q1 = r1 ? (int32_t)lrintf(r1[s] * inv[s]) : 0;
            dst[s] = (int32_t)(((uint32_t)(uint16_t)(int16_t)q1 << 16) | (uint16_t)(int16_t)q0);
        }
    }
}

AVX2 static void heads_t_int_avx2(int kind, const uint8_t *codes0, int64_t code_row, int64_t n, const int32_t *P,
                                  const float *alpha, int64_t nsp, int64_t done, int64_t cols, float *out) {
    int64_t lb = q6_lo_bytes(cols);
    /* vpdpwssd where the CPU has it: the same integers as vpmaddwd + add (tests/test_kernels.py) */
#define HEADS_T_INT(vn)                                                                                        \
    switch (kind) {                                                                                         \
    case K_Q2: case K_Q2RTN: heads_t_int_body(K_Q2, 4, vn, codes0, code_row, n, P, alpha, nsp, done / 128, lb, out); break; \
    case K_Q4: heads_t_int_body(K_Q4, 2, vn, codes0, code_row, n, P, alpha, nsp, done / 64, lb, out); break;   \
    case K_Q8: heads_t_int_body(K_Q8, 1, vn, codes0, code_row, n, P, alpha, nsp, done / 32, lb, out); break;   \
    case K_Q6: heads_t_int_body(K_Q6, 4, vn, codes0, code_row, n, P, alpha, nsp, done / 128, lb, out); break;  \
    default: heads_t_int_body(K_Q1, 8, vn, codes0, code_row, n, P, alpha, nsp, done / 256, lb, out); break;    \
    }
    switch (use_vnni) {
    case 0: HEADS_T_INT(0) break;
    case 1: HEADS_T_INT(1) break;
    default: HEADS_T_INT(2) break;
    }
#undef HEADS_T_INT
}

AVX2 static void heads_t_avx2(int kind, const uint8_t *codes0, int64_t code_row, int64_t n, const float *a,
                              int64_t nsp, int64_t done, int64_t cols, float *out) {
    int64_t lb = q6_lo_bytes(cols);
    switch (kind) {   /* constant spans per chunk: the span loop unrolls */
    case K_Q2: case K_Q2RTN: heads_t_body(K_Q2, 4, codes0, code_row, n, a, nsp, done / 128, lb, out); break;
    case K_Q4: heads_t_body(K_Q4, 2, codes0, code_row, n, a, nsp, done / 64, lb, out); break;
    case K_Q8: heads_t_body(K_Q8, 1, codes0, code_row, n, a, nsp, done / 32, lb, out); break;
    case K_Q6: heads_t_body(K_Q6, 4, codes0, code_row, n, a, nsp, done / 128, lb, out); break;
    case K_T1: heads_t_body(K_T1, 5, codes0, code_row, n, a, nsp, done / 160, lb, out); break;
    default: heads_t_body(K_Q1, 8, codes0, code_row, n, a, nsp, done / 256, lb, out); break;
    }
}
#endif

/* scratch floats of a transposed job of n rows and nsp spans: the span coefficients, their integer
   pairs and scales (heads_t_int_coefs), a row's coefficients and sums */
#define HEADS_T_SCRATCH(n, nsp) (((n) + 5) * (nsp) + ((n) + 1) / 2 * (nsp) + 2 * (nsp) + 16)

#if HAVE_X86
static void heads_t_rest(task_t *t, int64_t r, float cj, float *acc, float *lev);

AVX2 static void heads_t_job_avx2(task_t *t, int64_t h, float *scratch) {
    const int64_t *g = t->geoms;
    int kind = (int)g[G_KIND];
    int64_t cols = g[G_COLS], done = full_cols(g), nsp = cols / 32, nfs = done / 32, n = t->n;
    float *acc = t->out + h * cols, *a = scratch, *ce = a + n * nsp, *bacc = ce + 2 * nsp,
          *ones = bacc + nsp, *zeros = ones + nsp, lev[256];
    for (int64_t s = 0; s < nsp; s++) { ones[s] = 1.0f; zeros[s] = 0.0f; bacc[s] = 0.0f; }
    int64_t s8 = nfs / 8 * 8;
    const uint8_t *codes0 = t->raw + g[G_OFFCODE] + h * t->stride * g[G_CODEROW];
    for (int64_t j = 0; j < n; j++) {           /* span coefficients, digits' powers of two divided out */
        /* the head's code rows are read column by column below, a stride the hardware prefetcher
           follows badly from DRAM: fetch each row while its coefficients are worked out */
        for (int64_t b = 0; b < g[G_CODEROW]; b += 64) __builtin_prefetch(codes0 + j * g[G_CODEROW] + b);
        if (j + 8 < n) {                        /* and the scales coefs_avx2 reads eight rows on */
            int64_t rr = h * t->stride + j + 8;
            __builtin_prefetch(t->raw + g[G_OFFPAR] + rr * g[G_PARROW]);
            __builtin_prefetch(t->raw + g[G_OFFSUB] + rr * g[G_SUBROW]);
        }
        float cj = t->xf[h * n + j];
        coefs_avx2(t->raw, g, h * t->stride + j, ones, zeros, nfs, ce, 1);
        __m256 c8 = _mm256_set1_ps(cj);
        for (int64_t s = 0; s < s8; s += 8) {
            _mm256_storeu_ps(a + j * nsp + s, _mm256_mul_ps(c8, _mm256_loadu_ps(ce + s)));
            _mm256_storeu_ps(bacc + s, _mm256_add_ps(_mm256_loadu_ps(bacc + s), _mm256_mul_ps(c8, _mm256_loadu_ps(ce + nfs + s))));
        }
        for (int64_t s = s8; s < nfs; s++) {
            a[j * nsp + s] = cj * ce[s];
            bacc[s] += cj * ce[nfs + s];
        }
    }
    memset(acc + done, 0, sizeof(float) * (cols - done));
    if (heads_t_int_kind(kind)) {
        int32_t *P = (int32_t *)(zeros + nsp);
        float *alpha = (float *)(P + ((n + 1) / 2) * nsp);
        heads_t_int_coefs(a, n, nsp, nfs, P, alpha);
        heads_t_int_avx2(kind, codes0, g[G_CODEROW], n, P, alpha, nsp, done, cols, acc);
    } else {
        heads_t_avx2(kind, codes0, g[G_CODEROW], n, a, nsp, done, cols, acc);
    }
    for (int64_t s = 0; s < nfs; s++)
        for (int i = 0; i < 32; i++) acc[32 * s + i] += bacc[s];
    if (g[G_K] || done < cols)                  /* (a row without tail or outliers has nothing left) */
        for (int64_t j = 0; j < n; j++)
            heads_t_rest(t, h * t->stride + j, t->xf[h * n + j], acc, lev);
}
#endif

/* row r's tail columns and outliers, times cj, into acc */
static void heads_t_rest(task_t *t, int64_t r, float cj, float *acc, float *lev) {
    const int64_t *g = t->geoms;
    int64_t cols = g[G_COLS], done = full_cols(g), k = g[G_K];
    const uint8_t *codes = t->raw + g[G_OFFCODE] + r * g[G_CODEROW];
    if (done < cols) {
        tail_levels(codes, g, done, r + 1 < g[G_ROWS], lev);
        for (int64_t col = done; col < cols; col++) {
            float A, B;
            span_ab(t->raw, g, r, col >> 5, &A, &B);
            acc[col] += cj * (A * lev[col - done] + B);
        }
    }
    const uint8_t *oc = t->raw + g[G_OFFOCOL] + 2 * r * k, *ov = t->raw + g[G_OFFOVAL] + 2 * r * k;
    int64_t no = outliers_valid(t->raw, g, r, &t->bad);
    for (int64_t i = 0; i < no; i++) {
        int64_t col = oc[2 * i] | (oc[2 * i + 1] << 8);
        acc[col] += cj * f16_at(ov + 2 * i);
    }
}

/* a transposed job: out[h] = sum_j v[h, j] * W[h * stride + j] for head h = j, each row taken as
   A * (mul * digit - z) + B span by span, plus its outliers' corrections. With AVX2 the whole chunks run span-major
   (heads_t_avx2); the tail and the outliers row by row. */
static void heads_t_job(task_t *t, int64_t h, float *scratch) {
#if HAVE_X86
    if (use_avx2) {
        heads_t_job_avx2(t, h, scratch);
        return;
    }
#endif
    const int64_t *g = t->geoms;
    int kind = (int)g[G_KIND];
    int64_t cols = g[G_COLS], done = full_cols(g), nsp = cols / 32, nfs = done / 32;
    float mul, z, d[32], lev[256];
    digit_form(kind, &mul, &z);
    float *acc = t->out + h * cols, *bacc = scratch;
    memset(acc, 0, sizeof(float) * cols);
    memset(bacc, 0, sizeof(float) * nsp);
    for (int64_t j = 0; j < t->n; j++) {
        float cj = t->xf[h * t->n + j];
        int64_t r = h * t->stride + j;
        const uint8_t *codes = t->raw + g[G_OFFCODE] + r * g[G_CODEROW];
        for (int64_t s = 0; s < nfs; s++) {      /* weight = A * (mul * digit - z) + B on span s */
            float A, B;
            span_ab(t->raw, g, r, s, &A, &B);
            float a = cj * A * mul;
            bacc[s] += cj * (B - z * A);
            span_digits(kind, codes, s, cols, d);
            float *o = acc + 32 * s;
            for (int i = 0; i < 32; i++) o[i] += a * d[i];
        }
        heads_t_rest(t, r, cj, acc, lev);
    }
    for (int64_t s = 0; s < nfs; s++)      /* the tail added its offsets in heads_t_rest */
        for (int i = 0; i < 32; i++) acc[32 * s + i] += bacc[s];
}

/* ------------------------------------------------------------------------------ decode attention */
/* One token's absorbed attention over the cache, per layer: scores[h, p] = scale * (q[h] . C[p] +
 * qr[h] . K[p]), a softmax per head, out[h] = sum_p probs[h, p] C[p]. C (the latent, [S, r]) and K
 * (the rotated keys, [S, dr]) are float32 or binary16 rows. Three passes through the pool: scores by
 * blocks of positions (every head against each row while it is in L1: the cache is read once, not
 * once per head as a batched mat-vec does), softmax by heads, the weighted sum by blocks of positions
 * (rows of C read in order, each block into its own partial sums), then the partials added up. */
#define ATT_POS 32          /* positions per scores job */
#define ATT_MIX_POS 256     /* at least this many positions per mix job (each has its own partial sums) */

/* row p of a cache (float32 or binary16) as float32: the row itself, or converted into buf */
static inline const float *cache_row(const void *base, int half, int64_t n, int64_t p, float *buf) {
    if (!half) return (const float *)base + p * n;
    const uint16_t *h = (const uint16_t *)base + p * n;
    for (int64_t i = 0; i < n; i++) buf[i] = f16_at((const uint8_t *)(h + i));
    return buf;
}

#if HAVE_X86
/* a . b over n floats, eight lanes and a scalar tail */
AVX2 static inline float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float tot = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++) tot += a[i] * b[i];
    return tot;
}

#endif

static float dot_c(const float *a, const float *b, int64_t n) {
    float p[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) p[k] += a[i + k] * b[i + k];
    float tot = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    for (; i < n; i++) tot += a[i] * b[i];
    return tot;
}

/* y[e] = W[e] . x for a float32 matrix W [E, cols] (a router): one row at a time, in a fixed order
   whatever the threads, so a decode step's routing is the same however the call is reached */
#if HAVE_X86
AVX2 static void matvec_avx2(const float *W, int64_t E, int64_t cols, const float *x, float *y) {
    for (int64_t e = 0; e < E; e++) y[e] = dot_avx2(W + e * cols, x, cols);
}
#endif

static void matvec_f32(const float *W, int64_t E, int64_t cols, const float *x, float *y) {
#if HAVE_X86
    if (use_avx2) { matvec_avx2(W, E, cols, x, y); return; }
#endif
    for (int64_t e = 0; e < E; e++) y[e] = dot_c(W + e * cols, x, cols);
}

#if HAVE_X86
/* eight values of a cache row (binary16 converted on the way) */
AVX2 static inline __attribute__((always_inline)) __m256 row8(const int half, const void *base, int64_t i) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
                : _mm256_loadu_ps((const float *)base + i);
}

/* the four lanes' sums of a0..a3, as one vector */
AVX2 static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* acc[i][k] += the first n8 of n dimensions of query i (q + i * n) times those of cache row p + k */
AVX2 static inline __attribute__((always_inline)) void tile_dims(const int half, const int NH, const int NP,
                                                                const void *base, const float *q, int64_t n,
                                                                int64_t n8, int64_t p, __m256 acc[4][3]) {
    for (int64_t d = 0; d < n8; d += 8) {
        __m256 x[3];
        for (int k = 0; k < NP; k++) x[k] = row8(half, base, (p + k) * n + d);
        for (int i = 0; i < NH; i++) {
            __m256 w = _mm256_loadu_ps(q + i * n + d);
            for (int k = 0; k < NP; k++) acc[i][k] = _mm256_fmadd_ps(w, x[k], acc[i][k]);
        }
    }
}

/* Scores of NP cache rows (positions p..) for NH heads (h..), NH x NP sums in registers: per eight
   dimensions NH query loads and NP row loads (converted once, used by every head) feed NH x NP
   multiply-adds, the latent's dimensions and then the rotated key's into the same sums. */
AVX2 static inline __attribute__((always_inline)) void att_tile(const int half, const int NH, const int NP,
                                                               const att_t *a, int64_t h, int64_t p, float *out) {
    int64_t r = a->r, dr = a->dr, S = a->S, r8 = r / 8 * 8, dr8 = dr / 8 * 8;
    __m256 acc[4][3];
    for (int i = 0; i < NH; i++)
        for (int k = 0; k < NP; k++) acc[i][k] = _mm256_setzero_ps();
    const float *q = a->q + h * r, *qr = a->qr + h * dr;
    tile_dims(half, NH, NP, a->C, q, r, r8, p, acc);
    tile_dims(half, NH, NP, a->K, qr, dr, dr8, p, acc);
    for (int k = 0; k < NP; k++) {
        float sums[4];
        if (NH == 4) _mm_storeu_ps(sums, hsum4x8(acc[0][k], acc[1][k], acc[2][k], acc[3][k]));
        else for (int i = 0; i < NH; i++) sums[i] = hsum8(acc[i][k]);
        for (int i = 0; i < NH; i++) {
            float v = sums[i];
            for (int64_t d = r8; d < r; d++) v += q[i * r + d] * (half ? _cvtsh_ss(((const uint16_t *)a->C)[(p + k) * r + d]) : ((const float *)a->C)[(p + k) * r + d]);
            for (int64_t d = dr8; d < dr; d++) v += qr[i * dr + d] * (half ? _cvtsh_ss(((const uint16_t *)a->K)[(p + k) * dr + d]) : ((const float *)a->K)[(p + k) * dr + d]);
            out[(h + i) * S + p + k] = a->scale * v;
        }
    }
}

/* rows p .. p + n - 1 of both caches into the cache hierarchy (those before p1) */
static inline void att_fetch(const att_t *a, int64_t p, int64_t n, int64_t p1) {
    int64_t es = a->half ? 2 : 4, e = p + n < p1 ? p + n : p1;
    if (p >= e) return;
    const uint8_t *c = (const uint8_t *)a->C + es * p * a->r, *k = (const uint8_t *)a->K + es * p * a->dr;
    for (int64_t b = 0; b < es * (e - p) * a->r; b += 64) __builtin_prefetch(c + b);
    for (int64_t b = 0; b < es * (e - p) * a->dr; b += 64) __builtin_prefetch(k + b);
}

/* att_scores_job on AVX2: four heads at a time (their queries stay in L1) over the job's rows three at
   a time (from L2 after the first four heads; those fetch the rows two tiles ahead, a layer's cache
   having been last read a token ago) */
AVX2 static inline __attribute__((always_inline)) void att_scores_kind(const int half, const att_t *a, int64_t p0,
                                                                     int64_t p1, float *out) {
    int64_t nh = a->nh, h = 0;
    att_fetch(a, p0, 6, p1);
    for (; h + 4 <= nh; h += 4) {
        int64_t p = p0;
        for (; p + 3 <= p1; p += 3) {
            if (h == 0) att_fetch(a, p + 6, 3, p1);         /* two tiles ahead, while the first heads read them */
            att_tile(half, 4, 3, a, h, p, out);
        }
        for (; p < p1; p++) att_tile(half, 4, 1, a, h, p, out);
    }
    for (; h < nh; h++) {
        int64_t p = p0;
        for (; p + 3 <= p1; p += 3) att_tile(half, 1, 3, a, h, p, out);
        for (; p < p1; p++) att_tile(half, 1, 1, a, h, p, out);
    }
}

AVX2 static void att_scores_avx2(task_t *t, int64_t j, float *scratch) {
    (void)scratch;
    const att_t *a = t->att;
    int64_t p0 = ATT_POS * j, p1 = p0 + ATT_POS < a->S ? p0 + ATT_POS : a->S;
    if (a->half) att_scores_kind(1, a, p0, p1, t->out);
    else att_scores_kind(0, a, p0, p1, t->out);
}
#endif

/* scores of positions ATT_POS * j .. for every head, into t->out [nh, S] */
static void att_scores_job(task_t *t, int64_t j, float *scratch) {
    const att_t *a = t->att;
    int64_t p0 = ATT_POS * j, p1 = p0 + ATT_POS < a->S ? p0 + ATT_POS : a->S, r = a->r, dr = a->dr, nh = a->nh;
    float *cb = scratch, *kb = scratch + 2 * r;       /* converted rows (binary16 caches) */
    int64_t p = p0;
#if HAVE_X86
    if (use_avx2) { att_scores_avx2(t, j, scratch); return; }
#endif
    for (; p < p1; p++) {
        const float *c0 = cache_row(a->C, a->half, r, p, cb), *k0 = cache_row(a->K, a->half, dr, p, kb);
        for (int64_t h = 0; h < nh; h++)
            t->out[h * a->S + p] = a->scale * (dot_c(a->q + h * r, c0, r) + dot_c(a->qr + h * dr, k0, dr));
    }
}

#if HAVE_X86
/* e^x for x <= 0 in eight lanes (softmax's shifted scores): x = n ln2 + r with |r| <= ln2 / 2, e^r by
   Cephes' degree-6 polynomial (relative error about 2e-7, as expf's rounding), 2^n put into the
   exponent; below -87.3 (under float's smallest normal) the result is 0. */
AVX2 static inline __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* silu(g) * u eight at a time: g / (1 + e^-g) with e^-|g| only (exp_neg8's range), as 1 / (1 + a) for
   g >= 0 and a / (1 + a) below; returns how many it did (the rest are the caller's) */
AVX2 static int64_t swiglu_avx2(const float *g, const float *u, float *y, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 a = exp_neg8(_mm256_or_ps(x, sign));                          /* e^-|x| */
        __m256 num = _mm256_blendv_ps(one, a, x);                            /* sign bit set: x < 0 */
        __m256 sg = _mm256_div_ps(num, _mm256_add_ps(one, a));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(x, sg), _mm256_loadu_ps(u + i)));
    }
    return i;
}

/* att_softmax_job on AVX2: the maximum, e^(s - max) and their sum eight scores at a time */
AVX2 static void att_softmax_avx2(float *s, int64_t S) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t p = 0;
    for (; p + 8 <= S; p += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + p));
    float mx = hmax8(m8);
    for (; p < S; p++) mx = s[p] > mx ? s[p] : mx;
    __m256 mv = _mm256_set1_ps(mx), t8 = _mm256_setzero_ps();
    for (p = 0; p + 8 <= S; p += 8) {
        __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + p), mv));
        _mm256_storeu_ps(s + p, e);
        t8 = _mm256_add_ps(t8, e);
    }
    float tot = hsum8(t8);
    for (; p < S; p++) { s[p] = expf(s[p] - mx); tot += s[p]; }
    __m256 inv = _mm256_set1_ps(1.0f / tot);
    for (p = 0; p + 8 <= S; p += 8) _mm256_storeu_ps(s + p, _mm256_mul_ps(_mm256_loadu_ps(s + p), inv));
    for (; p < S; p++) s[p] *= 1.0f / tot;
}
#endif

/* a prompt's attention rows, in place (att_t: nh rows of S scores, r = rows per sequence block T,
   dr = the block's first position, scale): row t of each block keeps its first dr + t + 1 scores
   (causal), times scale, as a softmax; the rest become 0. CAUSAL_ROWS rows per job. */
#define CAUSAL_ROWS 16
static void causal_softmax_job(task_t *t, int64_t j, float *scratch) {
    (void)scratch;
    const att_t *a = t->att;
    int64_t S = a->S, i1 = (j + 1) * CAUSAL_ROWS < a->nh ? (j + 1) * CAUSAL_ROWS : a->nh;
    for (int64_t i = j * CAUSAL_ROWS; i < i1; i++) {
        float *s = t->out + i * S;
        int64_t n = a->dr + i % a->r + 1;
        n = n < S ? n : S;
        for (int64_t p = 0; p < n; p++) s[p] *= a->scale;
#if HAVE_X86
        if (use_avx2) att_softmax_avx2(s, n);
        else
#endif
        {
            float mx = -INFINITY, tot = 0;
            for (int64_t p = 0; p < n; p++) mx = s[p] > mx ? s[p] : mx;
            for (int64_t p = 0; p < n; p++) { s[p] = expf(s[p] - mx); tot += s[p]; }
            float inv = 1.0f / tot;
            for (int64_t p = 0; p < n; p++) s[p] *= inv;
        }
        memset(s + n, 0, sizeof(float) * (S - n));
    }
}

/* softmax of head j's scores, in place */
static void att_softmax_job(task_t *t, int64_t j, float *scratch) {
    (void)scratch;
    const att_t *a = t->att;
#if HAVE_X86
    if (use_avx2) { att_softmax_avx2(t->out + j * a->S, a->S); return; }
#endif
    float *s = t->out + j * a->S, mx = -INFINITY, tot = 0;
    for (int64_t p = 0; p < a->S; p++) mx = s[p] > mx ? s[p] : mx;
    for (int64_t p = 0; p < a->S; p++) { s[p] = expf(s[p] - mx); tot += s[p]; }
    float inv = 1.0f / tot;
    for (int64_t p = 0; p < a->S; p++) s[p] *= inv;
}

#if HAVE_X86
/* att_mix_job on AVX2 as a small matrix product, o [nh, r] = P [nh, S] x C [S, r] over the job's
   positions: a tile of four heads x 16 columns stays in eight registers while every position adds its
   row (two loads, binary16 converted on the way) times four probabilities (broadcasts) into it, so
   each multiply-add costs under one load; the rows are read once per four heads, from L2. */
AVX2 static void att_mix_tiles_avx2(const att_t *a, const float *P, int64_t p0, int64_t p1, float *o) {
    int64_t r = a->r, S = a->S, nh = a->nh;
    for (int64_t h = 0; h < nh; h += 4) {
        const float *w0 = P + h * S, *w1 = w0 + S, *w2 = w1 + S, *w3 = w2 + S;
        for (int64_t c = 0; c < r; c += 16) {
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
            for (int64_t p = p0; p < p1; p++) {
                __m256 x0, x1;
                if (a->half) {
                    const uint16_t *hp = (const uint16_t *)a->C + p * r + c;
                    x0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hp));
                    x1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hp + 8)));
                } else {
                    const float *fp = (const float *)a->C + p * r + c;
                    x0 = _mm256_loadu_ps(fp);
                    x1 = _mm256_loadu_ps(fp + 8);
                }
                __m256 b0 = _mm256_broadcast_ss(w0 + p), b1 = _mm256_broadcast_ss(w1 + p);
                __m256 b2 = _mm256_broadcast_ss(w2 + p), b3 = _mm256_broadcast_ss(w3 + p);
                s0 = _mm256_fmadd_ps(b0, x0, s0); s1 = _mm256_fmadd_ps(b0, x1, s1);
                s2 = _mm256_fmadd_ps(b1, x0, s2); s3 = _mm256_fmadd_ps(b1, x1, s3);
                s4 = _mm256_fmadd_ps(b2, x0, s4); s5 = _mm256_fmadd_ps(b2, x1, s5);
                s6 = _mm256_fmadd_ps(b3, x0, s6); s7 = _mm256_fmadd_ps(b3, x1, s7);
            }
            float *oh = o + h * r + c;
            _mm256_storeu_ps(oh, s0); _mm256_storeu_ps(oh + 8, s1);
            _mm256_storeu_ps(oh + r, s2); _mm256_storeu_ps(oh + r + 8, s3);
            _mm256_storeu_ps(oh + 2 * r, s4); _mm256_storeu_ps(oh + 2 * r + 8, s5);
            _mm256_storeu_ps(oh + 3 * r, s6); _mm256_storeu_ps(oh + 3 * r + 8, s7);
        }
    }
}

/* att_mix_job on AVX2 for any head count and width: four cache rows at a time (loaded once, binary16
   converted once), added into every head's partial sums, 16 columns per step */
AVX2 static void att_mix_avx2(const att_t *a, const float *P, int64_t p0, int64_t p1, float *o) {
    int64_t r = a->r, S = a->S, nh = a->nh, r16 = r / 16 * 16, p = p0;
    for (; p + 4 <= p1; p += 4) {
        for (int64_t c = 0; c < r16; c += 16) {
            __m256 x0, x1, x2, x3, x4, x5, x6, x7;
            if (a->half) {
                const uint16_t *hp = (const uint16_t *)a->C + p * r + c;
#define H8(i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hp + (i))))
                x0 = H8(0); x1 = H8(8); x2 = H8(r); x3 = H8(r + 8); x4 = H8(2 * r); x5 = H8(2 * r + 8);
                x6 = H8(3 * r); x7 = H8(3 * r + 8);
#undef H8
            } else {
                const float *fp = (const float *)a->C + p * r + c;
                x0 = _mm256_loadu_ps(fp); x1 = _mm256_loadu_ps(fp + 8); x2 = _mm256_loadu_ps(fp + r);
                x3 = _mm256_loadu_ps(fp + r + 8); x4 = _mm256_loadu_ps(fp + 2 * r); x5 = _mm256_loadu_ps(fp + 2 * r + 8);
                x6 = _mm256_loadu_ps(fp + 3 * r); x7 = _mm256_loadu_ps(fp + 3 * r + 8);
            }
            for (int64_t h = 0; h < nh; h++) {
                const float *ph = P + h * S + p;
                float *oh = o + h * r + c;
                __m256 w0 = _mm256_broadcast_ss(ph), w1 = _mm256_broadcast_ss(ph + 1), w2 = _mm256_broadcast_ss(ph + 2),
                       w3 = _mm256_broadcast_ss(ph + 3);
                __m256 s0 = _mm256_fmadd_ps(w1, x2, _mm256_fmadd_ps(w0, x0, _mm256_loadu_ps(oh)));
                __m256 s1 = _mm256_fmadd_ps(w1, x3, _mm256_fmadd_ps(w0, x1, _mm256_loadu_ps(oh + 8)));
                s0 = _mm256_fmadd_ps(w3, x6, _mm256_fmadd_ps(w2, x4, s0));
                s1 = _mm256_fmadd_ps(w3, x7, _mm256_fmadd_ps(w2, x5, s1));
                _mm256_storeu_ps(oh, s0);
                _mm256_storeu_ps(oh + 8, s1);
            }
        }
        for (int64_t c = r16; c < r; c++)                  /* columns past the last 16 */
            for (int k = 0; k < 4; k++) {
                float v = a->half ? _cvtsh_ss(((const uint16_t *)a->C)[(p + k) * r + c]) : ((const float *)a->C)[(p + k) * r + c];
                for (int64_t h = 0; h < nh; h++) o[h * r + c] += P[h * S + p + k] * v;
            }
    }
    for (; p < p1; p++) {                                   /* the last few rows, one at a time */
        float buf[8];
        for (int64_t c = 0; c < r; c += 8) {
            int64_t n = r - c < 8 ? r - c : 8;
            for (int64_t i = 0; i < n; i++)
                buf[i] = a->half ? _cvtsh_ss(((const uint16_t *)a->C)[p * r + c + i]) : ((const float *)a->C)[p * r + c + i];
            for (int64_t h = 0; h < nh; h++)
                for (int64_t i = 0; i < n; i++) o[h * r + c + i] += P[h * S + p] * buf[i];
        }
    }
}
#endif

/* mix job j of t->n: positions of the j-th block, probabilities times cache rows, into its partials */
static void att_mix_job(task_t *t, int64_t j, float *scratch) {
    const att_t *a = t->att;
    int64_t r = a->r, S = a->S, nh = a->nh, per = (S + t->n - 1) / t->n, p0 = j * per, p1 = p0 + per < S ? p0 + per : S;
    float *o = a->part + j * nh * r;
    const float *P = t->out;
    memset(o, 0, sizeof(float) * nh * r);
#if HAVE_X86
    if (use_avx2 && a->nh % 4 == 0 && a->r % 16 == 0) { att_mix_tiles_avx2(a, P, p0, p1, o); return; }
    if (use_avx2) { att_mix_avx2(a, P, p0, p1, o); return; }
#endif
    for (int64_t p = p0; p < p1; p++) {
        const float *c = cache_row(a->C, a->half, r, p, scratch);
        for (int64_t h = 0; h < nh; h++) {
            float w = P[h * S + p], *oh = o + h * r;
            for (int64_t i = 0; i < r; i++) oh[i] += w * c[i];
        }
    }
}

/* out = the sum of the mix jobs' partials, 1024 values per job */
static void att_sum_job(task_t *t, int64_t j, float *scratch) {
    (void)scratch;
    const att_t *a = t->att;
    int64_t len = a->nh * a->r, i0 = 1024 * j, i1 = i0 + 1024 < len ? i0 + 1024 : len;
    for (int64_t i = i0; i < i1; i++) {
        float v = 0;
        for (int64_t k = 0; k < t->n; k++) v += a->part[k * len + i];
        a->o[i] = v;
    }
}

/* each thread's scratch, kept between calls (a fresh allocation of a few hundred KiB per call would
   be mapped, faulted in and unmapped every time) */
static __thread float *tls_scratch;
static __thread size_t tls_cap;

static float *thread_scratch(size_t nfloats) {
    if (nfloats > tls_cap) {
        free(tls_scratch);
        tls_cap = (nfloats + 1023) & ~(size_t)1023;
        tls_scratch = aligned_alloc(32, tls_cap * sizeof(float));
        if (!tls_scratch) tls_cap = 0;
    }
    return tls_scratch;
}

static void run_jobs(task_t *t) {
    float *scratch = thread_scratch(t->scratch_floats ? (size_t)t->scratch_floats : (size_t)(5 * t->nspan + 16));
    int64_t finished = 0;
    int home = atomic_fetch_add_explicit(&t->joined, 1, memory_order_relaxed) % t->nranges;
    for (int k = 0; k < t->nranges; k++) {
        range_t *rg = &t->ranges[(home + k) % t->nranges];
        for (;;) {
            int64_t j = atomic_fetch_add_explicit(&rg->next, 1, memory_order_relaxed);
            if (j >= rg->end) break;
            if (scratch) t->job(t, j, scratch);
            else atomic_store(&t->bad, 2);
            finished++;
        }
    }
    /* one shared write per thread and call, not per job: the counter's cache line is contended */
    atomic_fetch_add_explicit(&t->done, finished, memory_order_release);
}

#define MAX_WORKERS 255
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static task_t *pool_task;          /* guarded by pool_mu */
static atomic_long pool_gen;
static atomic_int pool_active, pool_sleepers;
static int pool_workers;           /* threads started (the caller is one more) */
static atomic_long pool_wait_ns;   /* how long callers waited, their own jobs done, for the workers' */
static long spin_ns = 1000000;     /* a worker spins this long for the next call before sleeping: a
                                      decode step calls every few hundred microseconds */

static inline void cpu_relax(void) {
#if HAVE_X86
    _mm_pause();
#endif
}

static inline long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *worker_main(void *arg) {
    long seen = (long)(intptr_t)arg;
    for (;;) {
        long t0 = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&pool_gen, memory_order_acquire) == seen) {
            cpu_relax();
            if (++spins % 64 == 0 && now_ns() - t0 > spin_ns) {
                pthread_mutex_lock(&pool_mu);
                atomic_fetch_add(&pool_sleepers, 1);
                while (atomic_load(&pool_gen) == seen) pthread_cond_wait(&pool_cv, &pool_mu);
                atomic_fetch_sub(&pool_sleepers, 1);
                pthread_mutex_unlock(&pool_mu);
            }
        }
        seen = atomic_load(&pool_gen);
        pthread_mutex_lock(&pool_mu);
        task_t *t = pool_task;
        if (t) atomic_fetch_add(&pool_active, 1);
        pthread_mutex_unlock(&pool_mu);
        if (t) {
            run_jobs(t);
            atomic_fetch_sub(&pool_active, 1);
        }
    }
    return NULL;
}

typedef struct moe_async moe_async_t;
static moe_async_t *moe_pending;       /* moe_launch's call, until collected */
static void pool_after_fork(void) {   /* in a forked child the workers do not exist */
    moe_pending = NULL;                /* (a launched call's memory is left to the parent's copy) */
    pool_workers = 0;
    pool_task = NULL;
    atomic_store(&pool_active, 0);
    atomic_store(&pool_sleepers, 0);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_cv, NULL);
}

static void pool_grow(int n) {
    pthread_mutex_lock(&pool_mu);
    while (pool_workers < n && pool_workers < MAX_WORKERS) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setstacksize(&at, 256 * 1024);
        int rc = pthread_create(&th, &at, worker_main, (void *)(intptr_t)atomic_load(&pool_gen));
        pthread_attr_destroy(&at);
        if (rc) break;
        pthread_detach(th);
        pool_workers++;
    }
    pthread_mutex_unlock(&pool_mu);
}

static void moe_settle(void);

static void run_task(task_t *t, int threads) {
    moe_settle();                  /* a launched MoE call first: the pool runs one task at a time */
    if (threads > 1 && t->njobs > 1) {
        pool_grow(threads - 1);
        pthread_mutex_lock(&pool_mu);
        pool_task = t;
        atomic_fetch_add_explicit(&pool_gen, 1, memory_order_release);
        if (atomic_load(&pool_sleepers)) pthread_cond_broadcast(&pool_cv);
        pthread_mutex_unlock(&pool_mu);
        run_jobs(t);
        long t0 = now_ns();
        while (atomic_load_explicit(&t->done, memory_order_acquire) < t->njobs) cpu_relax();
        pthread_mutex_lock(&pool_mu);
        pool_task = NULL;
        pthread_mutex_unlock(&pool_mu);
        while (atomic_load(&pool_active)) cpu_relax();
        atomic_fetch_add_explicit(&pool_wait_ns, now_ns() - t0, memory_order_relaxed);
    } else {
        run_jobs(t);
    }
}

/* ------------------------------------------------------------------------------- quantise x */

static void quantize_x(const float *x, int64_t cols, int16_t *xq, float *xsc, float *xs) {
    const float magic = 12582912.0f;       /* 1.5 * 2^23: adding and subtracting it rounds to nearest even */
    for (int64_t s = 0; s < cols / 32; s++) {
        const float *v = x + 32 * s;
        float amax = 0, tot = 0;
        for (int j = 0; j < 32; j++) {
            float a = v[j] < 0 ? -v[j] : v[j];
            amax = a > amax ? a : amax;
        }
        for (int j = 0; j < 32; j++) tot += v[j];
        xs[s] = tot;
        xsc[s] = amax / XQ_MAX;
        float inv = amax > 0 ? XQ_MAX / amax : 0.0f;
        for (int j = 0; j < 32; j++) xq[32 * s + j] = (int16_t)((v[j] * inv + magic) - magic);
    }
}

/* ------------------------------------------------------------------------------- Python interface */

typedef struct { Py_buffer b; int held; } buf_t;

static int get_buf(PyObject *o, buf_t *b, int writable, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(o, &b->b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    b->held = 1;
    if (itemsize && b->b.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: size %zd is not a multiple of %zd", what, b->b.len, itemsize);
        return -1;
    }
    return 0;
}

static void release(buf_t *bs, int n) {
    for (int i = 0; i < n; i++) if (bs[i].held) PyBuffer_Release(&bs[i].b);
}

/* a task's ranges of jobs for `threads` threads, its counters at zero */
static void task_ranges(task_t *t, int threads) {
    int64_t nr = threads < 1 ? 1 : threads;
    if (nr > MAX_RANGES) nr = MAX_RANGES;
    if (nr > t->njobs) nr = t->njobs > 0 ? t->njobs : 1;
    t->nranges = (int)nr;
    for (int64_t i = 0; i < nr; i++) {
        atomic_init(&t->ranges[i].next, i * t->njobs / nr);
        t->ranges[i].end = (i + 1) * t->njobs / nr;
    }
    atomic_init(&t->joined, 0);
    atomic_init(&t->done, 0);
    atomic_init(&t->bad, 0);
    atomic_init(&t->sum, 0);
}

/* run a task without the GIL; -1 with MemoryError set if a thread could not get its scratch,
   else the task's bad flag */
static int run_unlocked(task_t *t, int threads) {
    task_ranges(t, threads);
    Py_BEGIN_ALLOW_THREADS
    run_task(t, threads);
    Py_END_ALLOW_THREADS
    if (atomic_load(&t->bad) == 2) { PyErr_NoMemory(); return -1; }
    return atomic_load(&t->bad);
}

/* a float32 product's rows as pool jobs (a router's, one token): job j is rows j stride .. */
static void matvec_job(task_t *t, int64_t j, float *scratch) {
    (void)scratch;
    int64_t r0 = j * t->stride, r1 = r0 + t->stride < t->n ? r0 + t->stride : t->n;
    matvec_f32((const float *)t->raw + r0 * t->cols, r1 - r0, t->cols, t->xf, t->out + r0);
}

/* y [E] = W [E, cols] x on `threads` threads (one when fewer); each row's sum as matvec_f32 forms it,
   so the same bits on any number of threads. -1 with MemoryError set, else 0. */
static int matvec_on(const float *W, int64_t E, int64_t cols, const float *x, float *y, int threads) {
    const int64_t rows = 8;
    if (threads < 2 || E < 2 * rows) {
        matvec_f32(W, E, cols, x, y);
        return 0;
    }
    task_t t = {.job = matvec_job, .raw = (const uint8_t *)W, .xf = x, .cols = cols, .n = E, .stride = rows,
                .out = y, .njobs = (E + rows - 1) / rows, .scratch_floats = 1};
    return run_unlocked(&t, threads) < 0 ? -1 : 0;
}

PyDoc_STRVAR(rows_doc,
"rows(raw, geoms, xf, jobs, out, threads, ntok=1, ostride=0) -> int\n\n"
"Run mat-vec jobs: each row of jobs (int64 [n, 6]: tensor byte offset in raw, geometry index into\n"
"geoms (int64 [m, 22]), first row, end row, first input row of xf (float32 [k, cols]), output offset)\n"
"writes x_t . W[r] for its rows and its ntok inputs into out (float32) at offset + t * ostride + row.\n"
"Returns 1 if a tensor's outlier columns are corrupt.");

/* nx rows of xf [nx, cols] quantised for rows_job: *xq holds the natural order then the de-interleaved
   one (AVX2), *xsc the span scales, *xs the span sums; -1 with MemoryError set */
/* MemoryError, except on a pool thread without the GIL (quiet_oom: the caller reports it later) */
static __thread int quiet_oom;
static void no_memory(void) {
    if (!quiet_oom) PyErr_NoMemory();
}

static int quantize_rows(const float *xf, int64_t nx, int64_t cols, int16_t **xq, float **xsc, float **xs,
                         int8_t **x8, float **x8d) {
    int64_t nspan = cols / 32, n = nx * cols, nq = (cols + 127) / 128;
    *xq = malloc(sizeof(int16_t) * 2 * (n ? n : 1));
    *xsc = malloc(sizeof(float) * (nx * nspan + 1));
    *xs = malloc(sizeof(float) * (nx * nspan + 1));
    if (!*xq || !*xsc || !*xs) { no_memory(); return -1; }
#if HAVE_X86
    if (use_avx2 && x8) {
        /* sixteen rows of zeros past the last: the AMX tiles read sixteen tokens' rows at a time */
        *x8 = malloc(n + 16 * cols + 1);
        if (*x8) memset(*x8 + n, 0, 16 * cols + 1);
        *x8d = malloc(sizeof(float) * (nx * (nq + nspan) + 1));        /* the steps, then the sums */
        if (!*x8 || !*x8d) { no_memory(); return -1; }
        for (int64_t i = 0; i < nx; i++)
            quantize_x8(xf + i * cols, cols, *x8 + i * cols, *x8d + i * nq, *x8d + nx * nq + i * nspan);
    }
#endif
    for (int64_t i = 0; i < nx; i++) {
#if HAVE_X86
        if (use_avx2) {
            quantize_avx2(xf + i * cols, cols, *xq + n + i * cols, *xsc + i * nspan, *xs + i * nspan);
            continue;
        }
#endif
        quantize_x(xf + i * cols, cols, *xq + i * cols, *xsc + i * nspan, *xs + i * nspan);
    }
    return 0;
}

/* one t1 token's input (rows_t1_xt) when a call's geometries hold t1 and it takes int8 inputs: xt as
   -21 .. 21 per 128 values then -3 times those (2 cols bytes per token), *xtd their steps then the
   rounded values' sums per 32; nothing where it does not apply (*xt stays NULL); -1 with MemoryError
   set (no_memory) */
static int quantize_rows_t1(const int64_t *geoms, int64_t ng, const float *xf, int64_t nx, int64_t cols, int64_t ntok,
                            int8_t **xt, float **xtd) {
    *xt = NULL;
    *xtd = NULL;
#if HAVE_X86
    int any = 0;
    for (int64_t i = 0; i < ng; i++) any |= geoms[G_LEN * i + G_KIND] == K_T1;
    if (!use_avx2 || !any || ntok != 1 || cols % 128 || !x8_kind(K_T1)) return 0;
    int64_t n = nx * cols, nq = cols / 128, nspan = cols / 32;
    *xt = malloc(2 * n + 32);            /* t1_tail_sums reads up to 28 bytes past a row */
    *xtd = malloc(sizeof(float) * (nx * (nq + nspan) + 1));
    if (!*xt || !*xtd) { no_memory(); return -1; }
    for (int64_t i = 0; i < nx; i++)
        quantize_xt(xf + i * cols, cols, *xt + 2 * i * cols, *xtd + i * nq, *xtd + nx * nq + i * nspan);
#else
    (void)geoms; (void)ng; (void)xf; (void)nx; (void)cols; (void)ntok;
#endif
    return 0;
}

#if HAVE_X86
/* the whole 8 x 8 blocks of transpose_rows (transpose8 inlined into an AVX2 loop) */
AVX2 static void transpose_blocks(const float *x, int64_t cols, float *xT, int64_t nx, int64_t i8, int64_t c8) {
    for (int64_t c = 0; c < c8; c += 8)
        for (int64_t i = 0; i < i8; i += 8) transpose8(x + i * cols + c, cols, xT + c * nx + i, nx);
}
#endif

/* x [nx][cols] into xT [cols][nx]: 8 x 8 blocks in registers (AVX2), the edges one by one */
static void transpose_rows(const float *x, int64_t nx, int64_t cols, float *xT) {
    int64_t i8 = 0, c8 = 0;
#if HAVE_X86
    if (use_avx2) {
        i8 = nx / 8 * 8;
        c8 = cols / 8 * 8;
        transpose_blocks(x, cols, xT, nx, i8, c8);
    }
#endif
    for (int64_t c = 0; c < cols; c++)
        for (int64_t i = c < c8 ? i8 : 0; i < nx; i++) xT[c * nx + i] = x[i * cols + c];
}

/* -------------------------------------------------------------- float products on AMX tiles */
/* y = x w^T for float32 x [T, k] and w [n, k] on AMX's bf16 tiles. Each float is split into two bf16,
 * its high part and the rest rounded (together 16 significant bits), and each pair of 32-column blocks
 * takes three tile products (high x high, high x low, low x high; low x low, ~2^-18 of a product, is
 * left out), summed in float32 by the tiles. The inputs' rows are tiles as they are (sixteen tokens, 32
 * columns); each job turns sixteen rows of w into pairs of columns, a tile row holding the pair of all
 * sixteen (the layout the right-hand tile wants), and runs them by every block of sixteen tokens, two
 * blocks at a time (eight tiles: two sums, w high and low, two blocks' inputs high and low). */
#if HAVE_AMX
#define AMX_BF16 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16"

/* v as bf16 rounded to nearest even (hi) and the rest, rounded the same way (lo), 16 values */
__attribute__((target(AMX_BF16))) static inline void bf16_split(__m512 v, __m256i *hi, __m256i *lo) {
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    *hi = h;
    *lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hv));
}

/* rows r0 .. r1-1 of x [., k] split into hi and lo ([rows][k] bf16 each) */
__attribute__((target(AMX_BF16))) static void bf16_rows(const float *x, int64_t k, int64_t r0, int64_t r1,
                                                       uint16_t *hi, uint16_t *lo) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = 0; c < k; c += 16) {
            __m256i h, l;
            bf16_split(_mm512_loadu_ps(x + r * k + c), &h, &l);
            _mm256_storeu_si256((__m256i *)(hi + r * k + c), h);
            _mm256_storeu_si256((__m256i *)(lo + r * k + c), l);
        }
}

/* job j: rows 16 j .. 16 j + 15 of w (t->xf, [n = t->njobs_rows, k = t->cols]) by every token (t->xq: the
   inputs' hi parts [T rounded up to 16][k], then the lo parts); y at t->out, token i's row ostride apart.
   Scratch: the rows' pairs, hi and lo ([k/2][16] uint32 each), the rows as bf16, a tile of sums. */
__attribute__((target(AMX_BF16))) static void amx_matmul_job(task_t *t, int64_t j, float *scratch) {
    int64_t k = t->cols, r0 = 16 * j, nr = t->njobs_rows - r0 < 16 ? t->njobs_rows - r0 : 16;
    int64_t T = t->ntok, ntb = (T + 15) / 16;
    uint32_t *ph = (uint32_t *)scratch, *pl = ph + 8 * k;
    uint16_t *rh = (uint16_t *)(pl + 8 * k), *rl = rh + 16 * k;
    float *sums = (float *)(((uintptr_t)(rl + 16 * k) + 63) & ~(uintptr_t)63);
    bf16_rows(t->xf + r0 * k, k, 0, nr, rh, rl);
    const uint32_t *wh32 = (const uint32_t *)rh, *wl32 = (const uint32_t *)rl;
    for (int64_t i = 0; i < k / 2; i++)                 /* pairs: row r's columns 2i, 2i + 1 at [i][r] */
        for (int64_t r = 0; r < 16; r++) {
            ph[16 * i + r] = r < nr ? wh32[r * (k / 2) + i] : 0;
            pl[16 * i + r] = r < nr ? wl32[r * (k / 2) + i] : 0;
        }
    const uint16_t *xh = (const uint16_t *)t->xq, *xl = xh + 16 * ntb * k;
    amx_configure();
    for (int64_t tb = 0; tb < ntb; tb += 2) {
        int two = tb + 1 < ntb;
        const uint16_t *a0 = xh + 16 * tb * k, *l0 = xl + 16 * tb * k, *a1 = a0 + 16 * k, *l1 = l0 + 16 * k;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < k; c += 32) {
            _tile_loadd(2, ph + 8 * c, 64);
            _tile_loadd(3, pl + 8 * c, 64);
            _tile_loadd(4, a0 + c, 2 * k);
            _tile_loadd(5, l0 + c, 2 * k);
            _tile_dpbf16ps(0, 4, 2);
            _tile_dpbf16ps(0, 5, 2);
            _tile_dpbf16ps(0, 4, 3);
            if (two) {
                _tile_loadd(6, a1 + c, 2 * k);
                _tile_loadd(7, l1 + c, 2 * k);
                _tile_dpbf16ps(1, 6, 2);
                _tile_dpbf16ps(1, 7, 2);
                _tile_dpbf16ps(1, 6, 3);
            }
        }
        for (int64_t b = 0; b < (two ? 2 : 1); b++) {       /* sums [token][row] */
            int64_t t0 = 16 * (tb + b), nt = T - t0 < 16 ? T - t0 : 16;
            float *dst = t->out + t0 * t->ostride + r0;
            if (nt == 16 && nr == 16) {
                if (b) _tile_stored(1, dst, 4 * t->ostride);
                else _tile_stored(0, dst, 4 * t->ostride);
                continue;
            }
            if (b) _tile_stored(1, sums, 64);
            else _tile_stored(0, sums, 64);
            for (int64_t i = 0; i < nt; i++) memcpy(dst + i * t->ostride, sums + 16 * i, sizeof(float) * nr);
        }
    }
}

/* job j: inputs 16 j .. 16 j + 15 of t->ntok split into bf16 hi and lo, laid out as amx_matmul_job reads them */
__attribute__((target(AMX_BF16))) static void amx_inputs_job(task_t *t, int64_t j, float *scratch) {
    int64_t k = t->cols, ntb = (t->ntok + 15) / 16, r1 = 16 * j + 16 < t->ntok ? 16 * j + 16 : t->ntok;
    uint16_t *hi = (uint16_t *)t->out, *lo = hi + 16 * ntb * k;
    bf16_rows(t->xf, k, 16 * j, r1, hi, lo);
}
#endif

PyDoc_STRVAR(amx_matmul_doc,
"amx_matmul(x, w, out, threads) -> bool\n\n"
"out = x @ w.T for float32 x [T, k], w [n, k] (k a multiple of 32) and out [T, >= n] (its first n columns\n"
"written, rows as numpy strides them) on AMX tiles through bf16 pairs (three products per block: about\n"
"2^-16 of each product's size, summed in float32). False, with nothing written, where the CPU or OS has\n"
"no AMX (set_amx(False) included).");

static PyObject *py_amx_matmul(PyObject *self, PyObject *args) {
    PyObject *o[3];
    int threads;
    if (!PyArg_ParseTuple(args, "OOOi", &o[0], &o[1], &o[2], &threads)) return NULL;
    if (!use_amx) Py_RETURN_FALSE;
#if HAVE_AMX
    Py_buffer xb, wb, ob;
    if (PyObject_GetBuffer(o[0], &xb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND)) return NULL;
    if (PyObject_GetBuffer(o[1], &wb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND)) { PyBuffer_Release(&xb); return NULL; }
    if (PyObject_GetBuffer(o[2], &ob, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_STRIDES)) {
        PyBuffer_Release(&xb); PyBuffer_Release(&wb); return NULL;
    }
    PyObject *ret = NULL;
    uint16_t *xbf = NULL;
    int f32 = !strcmp(xb.format, "f") && !strcmp(wb.format, "f") && !strcmp(ob.format, "f");
    if (!f32 || xb.ndim != 2 || wb.ndim != 2 || ob.ndim != 2 || xb.shape[1] != wb.shape[1] || xb.shape[1] % 32 ||
        ob.shape[0] != xb.shape[0] || ob.shape[1] < wb.shape[0] || ob.strides[1] != 4 || ob.strides[0] % 4 ||
        (ob.shape[0] > 1 && ob.strides[0] < 4 * ob.shape[1])) {
        PyErr_SetString(PyExc_ValueError, "amx_matmul: float32 x [T, k], w [n, k] (k a multiple of 32), out [T, >= n] with rows of contiguous floats");
        goto done;
    }
    int64_t T = xb.shape[0], k = xb.shape[1], n = wb.shape[0], ntb = (T + 15) / 16;
    if (!T || !n) { ret = Py_NewRef(Py_True); goto done; }
    xbf = aligned_alloc(64, sizeof(uint16_t) * 2 * 16 * ntb * k);        /* hi, then lo; tokens past T zero */
    if (!xbf) { PyErr_NoMemory(); goto done; }
    memset(xbf + T * k, 0, sizeof(uint16_t) * (16 * ntb - T) * k);
    memset(xbf + 16 * ntb * k + T * k, 0, sizeof(uint16_t) * (16 * ntb - T) * k);
    task_t t0 = {.job = amx_inputs_job, .xf = xb.buf, .cols = k, .ntok = T, .out = (float *)xbf, .njobs = ntb,
                 .scratch_floats = 16};
    task_t t1 = {.job = amx_matmul_job, .xf = wb.buf, .xq = (const int16_t *)xbf, .cols = k, .njobs_rows = n, .ntok = T,
                 .out = ob.buf, .ostride = ob.strides[0] / 4, .njobs = (n + 15) / 16,
                 .scratch_floats = 32 * k + 256 + 32};
    if (run_unlocked(&t0, threads) < 0 || run_unlocked(&t1, threads) < 0) goto done;
    ret = Py_NewRef(Py_True);
done:
    free(xbf);
    PyBuffer_Release(&xb); PyBuffer_Release(&wb); PyBuffer_Release(&ob);
    return ret;
#else
    Py_RETURN_FALSE;
#endif
}

/* every input row's tables, steps and sums (q1t_input) for a call whose geometries hold q1t: *lt
   [nx][4 cols], *ltd [nx][cols / 128 + cols / 256]; nothing where none does (*lt stays NULL); -1 with
   MemoryError set (no_memory) */
static int q1t_inputs(const int64_t *geoms, int64_t ng, const float *xf, int64_t nx, int64_t cols, int8_t **lt,
                      float **ltd) {
    *lt = NULL;
    *ltd = NULL;
    int any = 0;
    for (int64_t i = 0; i < ng; i++) any |= geoms[G_LEN * i + G_KIND] == K_Q1T;
    if (!any || cols % 256) return 0;
    int64_t per = cols / 128 + cols / 256;
    *lt = malloc(4 * nx * cols + cols + 1);
    *ltd = malloc(sizeof(float) * (nx * per + 1));
    if (!*lt || !*ltd) { no_memory(); return -1; }
    for (int64_t i = 0; i < nx; i++) {
#if HAVE_X86
        if (use_avx2) {
            q1t_input_avx2(xf + i * cols, cols, *lt + 4 * i * cols, *ltd + i * per, *lt + 4 * nx * cols);
            continue;
        }
#endif
        q1t_input_c(xf + i * cols, cols, *lt + 4 * i * cols, *ltd + i * per);
    }
    return 0;
}

static inline int64_t rows_scratch(int64_t max_rows, int64_t tile, int64_t nspan) {
    /* (multi_x8: 12 nspan + 24, and t1's row of digits as bytes, 8 nspan + 8) */
    return max_rows * (8 * tile + (2 + tile) * nspan) + 25 * nspan + 40 +
           (tile >= 3 ? 300 * nspan + 16 * TOKEN_TILE + 72 : 0);      /* tiled_rows' pw, D, BST, OC, DR, BSR, rb */
}

/* rows()'s work once its buffers are held: the jobs checked against the buffers, x quantised, the task
   run; the bad flag, or -1 with an exception set */
static int run_rows(const uint8_t *raw, int64_t nraw, const int64_t *geoms, int64_t ng, const float *xf, int64_t nxf,
                    const int64_t *jobs, int64_t njobs, float *out, int64_t nout, int threads, int64_t ntok,
                    int64_t ostride) {
    int rc = -1;
    int16_t *xq = NULL;
    int8_t *x8 = NULL, *xt = NULL, *lt = NULL;
    float *xsc = NULL, *xs = NULL, *x8d = NULL, *xT = NULL, *xtd = NULL, *ltd = NULL;
    if (!ng) { PyErr_SetString(PyExc_ValueError, "no geometry"); goto done; }
    int64_t cols = geoms[G_COLS];
    if (cols <= 0 || cols % 32 || nxf % cols) { PyErr_SetString(PyExc_ValueError, "xf does not match the geometry's columns"); goto done; }
    int64_t nx = nxf / cols;
    for (int64_t i = 0; i < ng; i++) {
        const int64_t *g = geoms + G_LEN * i;
        if (g[G_COLS] != cols || !(known_layout(g) || q1t_layout(g))) {
            PyErr_SetString(PyExc_ValueError, "geometries must share one column count and a known codec");
            goto done;
        }
    }
    int64_t max_rows = 1;
    for (int64_t j = 0; j < njobs; j++) {     /* nothing is read or written outside its buffer */
        const int64_t *jb = jobs + JOB_LEN * j;
        if (jb[1] < 0 || jb[1] >= ng) { PyErr_Format(PyExc_ValueError, "job %lld: bad geometry", (long long)j); goto done; }
        const int64_t *g = geoms + G_LEN * jb[1];
        if (jb[0] < 0 || jb[0] > nraw - g[G_NBYTES] || jb[2] < 0 || jb[3] < jb[2] || jb[3] > g[G_ROWS] ||
            jb[4] < 0 || jb[4] > nx - ntok || jb[5] < 0 || jb[5] + (ntok - 1) * ostride > nout - (jb[3] - jb[2])) {
            PyErr_Format(PyExc_ValueError, "job %lld lies outside its buffers", (long long)j);
            goto done;
        }
        if (g[G_KIND] == K_Q1T && (jb[2] % 32 || (jb[3] % 32 && jb[3] != g[G_ROWS]))) {
            PyErr_Format(PyExc_ValueError, "job %lld: q1t rows go in whole tiles of 32", (long long)j);
            goto done;
        }
        if (jb[3] - jb[2] > max_rows) max_rows = jb[3] - jb[2];
    }
    int64_t nspan = cols / 32, tile = ntok < TOKEN_TILE ? ntok : TOKEN_TILE;
    int any_x8 = 0;
    for (int64_t i = 0; i < ng; i++) any_x8 |= x8_kind((int)geoms[G_LEN * i + G_KIND]);
    if (quantize_rows(xf, nx, cols, &xq, &xsc, &xs, any_x8 ? &x8 : NULL, &x8d) ||
        quantize_rows_t1(geoms, ng, xf, nx, cols, ntok, &xt, &xtd) || q1t_inputs(geoms, ng, xf, nx, cols, &lt, &ltd))
        goto done;
    if (x8 && ntok > 1) {             /* multi_x8 reads each outlier's inputs for a run of tokens at once */
        xT = malloc(sizeof(float) * (nx * cols + TOKEN_TILE));
        if (!xT) { PyErr_NoMemory(); goto done; }
        transpose_rows(xf, nx, cols, xT);
        memset(xT + nx * cols, 0, sizeof(float) * TOKEN_TILE);
    }
    task_t t = {.job = rows_job, .raw = raw, .geoms = geoms, .xf = xf, .xsc = xsc, .xs = xs,
                .xq = xq, .xp = xq + nxf, .x8 = x8, .x8d = x8d, .x8s = x8d ? x8d + nx * ((cols + 127) / 128) : NULL,
                .xT = xT, .nxT = nx, .xt = xt, .xtd = xtd, .xts = xtd ? xtd + nx * (cols / 128) : NULL, .lt = lt, .ltd = ltd,
                .cols = cols, .nspan = nspan, .jobs = jobs, .njobs = njobs, .out = out, .ntok = ntok,
                .ostride = ostride, .scratch_floats = rows_scratch(max_rows, tile, nspan)};
    rc = run_unlocked(&t, threads);
done:
    free(xq); free(xsc); free(xs); free(x8); free(x8d); free(xT); free(xt); free(xtd); free(lt); free(ltd);
    return rc;
}

static PyObject *py_rows(PyObject *self, PyObject *args) {
    PyObject *o[5];
    int threads;
    Py_ssize_t ntok = 1, ostride = 0;
    if (!PyArg_ParseTuple(args, "OOOOOi|nn", &o[0], &o[1], &o[2], &o[3], &o[4], &threads, &ntok, &ostride))
        return NULL;
    if (ntok < 1 || ostride < 0) { PyErr_SetString(PyExc_ValueError, "rows: ntok >= 1, ostride >= 0"); return NULL; }
    buf_t b[5];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 1, "raw") || get_buf(o[1], &b[1], 0, 8 * G_LEN, "geoms") ||
        get_buf(o[2], &b[2], 0, 4, "xf") || get_buf(o[3], &b[3], 0, 8 * JOB_LEN, "jobs") ||
        get_buf(o[4], &b[4], 1, 4, "out"))
        goto done;
    int bad = run_rows(b[0].b.buf, b[0].b.len, b[1].b.buf, b[1].b.len / (8 * G_LEN), b[2].b.buf, b[2].b.len / 4,
                       b[3].b.buf, b[3].b.len / (8 * JOB_LEN), b[4].b.buf, b[4].b.len / 4, threads, ntok, ostride);
    if (bad >= 0) ret = PyLong_FromLong(bad);
done:
    release(b, 5);
    return ret;
}

/* the geometry of a single-tensor call, checked against the tensor's bytes and an output of whole
   rows of cols floats; NULL with ValueError set otherwise */
static const int64_t *tensor_geometry(const buf_t *raw, const buf_t *geom, const buf_t *out, const char *what) {
    const int64_t *g = geom->b.buf;
    int64_t cols = geom->b.len == 8 * G_LEN ? g[G_COLS] : 0;
    int tiled_ok = !strcmp(what, "dequantize") && cols > 0 && q1t_layout(g);      /* q1t: routed experts only */
    if (cols <= 0 || cols % 32 || !(known_layout(g) || tiled_ok) || raw->b.len < g[G_NBYTES] ||
        out->b.len % (4 * cols)) {
        PyErr_Format(PyExc_ValueError, "%s: buffers do not match the geometry", what);
        return NULL;
    }
    return g;
}

#define MOE_JOB_WEIGHTS (1 << 15)   /* weights per job (at least 8 rows), as kernels.JOB_WEIGHTS */

static inline int64_t moe_rows_per_job(int64_t cols) {
    return MOE_JOB_WEIGHTS / cols > 8 ? MOE_JOB_WEIGHTS / cols : 8;
}

/* jobs over rows 0 .. rows-1 of one tensor, cut in blocks of at least 8 rows and about MOE_JOB_WEIGHTS
   weights; returns the number written at jb */
static int64_t moe_jobs(int64_t *jb, int64_t off, int64_t gi, int64_t rows, int64_t cols, int64_t xi, int64_t out0,
                        int tiles) {
    int64_t per = moe_rows_per_job(cols), n = 0;
    if (tiles) per = (per + 31) / 32 * 32;      /* q1t: whole tiles of 32 rows */
    for (int64_t r = 0; r < rows; r += per, n++) {
        int64_t *j = jb + JOB_LEN * n;
        j[0] = off; j[1] = gi; j[2] = r; j[3] = r + per < rows ? r + per : rows; j[4] = xi; j[5] = out0 + r;
    }
    return n;
}

/* a ggml MoE call's buffers: jobs for either pass, gate and up outputs then the activations, down
   outputs; -1 with MemoryError set */
static int moe_buffers(int64_t n, int64_t hidden, int64_t inter, int64_t **jobs, float **h, float **y) {
    int64_t per1 = moe_rows_per_job(hidden), per2 = moe_rows_per_job(inter);
    int64_t nb1 = (inter + per1 - 1) / per1, nb2 = (hidden + per2 - 1) / per2;
    *jobs = malloc(sizeof(int64_t) * JOB_LEN * (2 * n * nb1 > n * nb2 ? 2 * n * nb1 : n * nb2));
    *h = malloc(sizeof(float) * 3 * n * inter);
    *y = malloc(sizeof(float) * n * hidden);
    if (!*jobs || !*h || !*y) { PyErr_NoMemory(); return -1; }
    return 0;
}

/* every pair's SwiGLU from its gate and up outputs (h [n][2][inter]), into h + 2 n inter */
static float *swiglu_pairs(float *h, int64_t n, int64_t inter) {
    float *act = h + 2 * n * inter;
    for (int64_t i = 0; i < n; i++) {
        const float *g = h + 2 * i * inter, *u = g + inter;
        float *a = act + i * inter;
        int64_t r = 0;
#if HAVE_X86
        if (use_avx2) r = swiglu_avx2(g, u, a, inter);      /* as kernels.swiglu: the same values apart */
#endif
        for (; r < inter; r++) a[r] = g[r] / (1.0f + expf(-g[r])) * u[r];
    }
    return act;
}

/* out[tok[i]] += wts[i] * y[i], pair by pair (pairs of one token add up in order) */
static void moe_sum(float *out, const float *y, const float *wts, const int64_t *tok, int64_t n, int64_t hidden) {
    for (int64_t i = 0; i < n; i++) {
        float w = wts[i], *o = out + tok[i] * hidden;
        const float *yi = y + i * hidden;
        for (int64_t c = 0; c < hidden; c++) o[c] += w * yi[c];
    }
}

/* One MoE call (moe, moe_launch): its inputs, both passes' jobs and tasks, the buffers between them. */
typedef struct {
    const uint8_t *base;
    const int64_t *geoms, *offs, *pick, *tok;
    const float *wts, *x;
    int64_t ng, n, T, hidden, inter;
    int any_x8;
    int64_t *jobs1, *jobs2;
    float *h, *y, *xsc, *xs, *asc, *as, *x8d, *a8d, *xtd, *atd, *ltd, *altd;
    int16_t *xq, *aq;
    int8_t *x8, *a8, *xt, *atq, *lt, *alt;
    task_t t1, t2;                     /* gate and up rows of every pair; down rows */
} moe_run_t;

static void moe_free(moe_run_t *m) {
    free(m->jobs1); free(m->jobs2); free(m->h); free(m->y); free(m->xq); free(m->xsc); free(m->xs); free(m->aq);
    free(m->asc); free(m->as); free(m->x8); free(m->x8d); free(m->a8); free(m->a8d); free(m->xt); free(m->xtd);
    free(m->atq); free(m->atd); free(m->lt); free(m->ltd); free(m->alt); free(m->altd);
}

/* whether moe's arguments (m's inputs, nraw bytes of base) fit; ValueError set if not */
static int moe_fits(moe_run_t *m, int64_t nraw, int64_t npick, int64_t ntok, int64_t nwts, int64_t nx, int64_t nout) {
    const int64_t *geoms = m->geoms;
    if (m->ng < 2 || m->ng % 2) { PyErr_SetString(PyExc_ValueError, "moe: geometries come in (gate/up, down) pairs"); return 0; }
    int64_t hidden = m->hidden = geoms[G_COLS], inter = m->inter = geoms[G_ROWS];
    for (int64_t p = 0; p < m->ng; p += 2) {
        const int64_t *gu = geoms + G_LEN * p, *d = gu + G_LEN;
        if (gu[G_COLS] != hidden || gu[G_ROWS] != inter || d[G_COLS] != inter || d[G_ROWS] != hidden ||
            hidden <= 0 || hidden % 32 || inter <= 0 || inter % 32 || !(known_layout(gu) || q1t_layout(gu)) ||
            !(known_layout(d) || q1t_layout(d))) {
            PyErr_SetString(PyExc_ValueError, "moe: expert shapes do not chain: gate/up [inter, hidden], down [hidden, inter]");
            return 0;
        }
    }
    int64_t n = m->n, T = m->T = nx / hidden;
    if (npick != n || ntok != n || nwts != n || nx != T * hidden || nout != nx) {
        PyErr_SetString(PyExc_ValueError, "moe: pick, tok, wts need one entry per pair; x and out [T, hidden]");
        return 0;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t *gu = geoms + G_LEN * 2 * m->pick[i], *o = m->offs + 3 * i;
        if (m->pick[i] < 0 || 2 * m->pick[i] >= m->ng || m->tok[i] < 0 || m->tok[i] >= T) {
            PyErr_SetString(PyExc_ValueError, "moe: a pair's geometry or token is out of range");
            return 0;
        }
        if (o[0] < 0 || o[0] > nraw - gu[G_NBYTES] || o[1] < 0 || o[1] > nraw - gu[G_NBYTES] || o[2] < 0 ||
            o[2] > nraw - gu[G_LEN + G_NBYTES]) {
            PyErr_SetString(PyExc_ValueError, "moe: expert tensors lie outside their buffer");
            return 0;
        }
    }
    return 1;
}

/* both passes' jobs, the first pass's inputs and task; -1 with MemoryError set (no_memory) */
static int moe_setup(moe_run_t *m) {
    int64_t n = m->n, T = m->T, hidden = m->hidden, inter = m->inter;
    int64_t per1 = moe_rows_per_job(hidden), per2 = moe_rows_per_job(inter);
    int64_t nb1 = (inter + per1 - 1) / per1, nb2 = (hidden + per2 - 1) / per2;
    m->jobs1 = malloc(sizeof(int64_t) * JOB_LEN * 2 * n * nb1);
    m->jobs2 = malloc(sizeof(int64_t) * JOB_LEN * n * nb2);
    m->h = malloc(sizeof(float) * 3 * n * inter);
    m->y = malloc(sizeof(float) * n * hidden);
    if (!m->jobs1 || !m->jobs2 || !m->h || !m->y) { no_memory(); return -1; }
    int64_t nj1 = 0, nj2 = 0;
    for (int64_t i = 0; i < n; i++) {
        for (int w = 0; w < 2; w++)
            nj1 += moe_jobs(m->jobs1 + JOB_LEN * nj1, m->offs[3 * i + w], 2 * m->pick[i], inter, hidden, m->tok[i],
                            (2 * i + w) * inter, m->geoms[G_LEN * 2 * m->pick[i] + G_KIND] == K_Q1T);
        nj2 += moe_jobs(m->jobs2 + JOB_LEN * nj2, m->offs[3 * i + 2], 2 * m->pick[i] + 1, hidden, inter, i, i * hidden,
                        m->geoms[G_LEN * (2 * m->pick[i] + 1) + G_KIND] == K_Q1T);
    }
    m->any_x8 = 0;          /* as rows(): codecs whose products take int8 inputs, at any token count */
    for (int64_t i = 0; i < m->ng; i++) m->any_x8 |= x8_kind((int)m->geoms[G_LEN * i + G_KIND]);
    if (quantize_rows(m->x, T, hidden, &m->xq, &m->xsc, &m->xs, m->any_x8 ? &m->x8 : NULL, &m->x8d) ||
        quantize_rows_t1(m->geoms, m->ng, m->x, T, hidden, 1, &m->xt, &m->xtd) ||
        q1t_inputs(m->geoms, m->ng, m->x, T, hidden, &m->lt, &m->ltd))
        return -1;
    m->t1 = (task_t){.job = rows_job, .raw = m->base, .geoms = m->geoms, .xf = m->x, .xsc = m->xsc, .xs = m->xs,
                     .xq = m->xq, .x8 = m->x8, .x8d = m->x8d, .x8s = m->x8d ? m->x8d + T * ((hidden + 127) / 128) : NULL,
                     .xt = m->xt, .xtd = m->xtd, .xts = m->xtd ? m->xtd + T * (hidden / 128) : NULL, .lt = m->lt, .ltd = m->ltd,
                     .xp = m->xq + T * hidden, .cols = hidden, .nspan = hidden / 32, .jobs = m->jobs1, .njobs = nj1,
                     .out = m->h, .ntok = 1, .scratch_floats = rows_scratch(per1, 1, hidden / 32)};
    m->t2 = (task_t){.job = rows_job, .raw = m->base, .geoms = m->geoms, .cols = inter, .nspan = inter / 32,
                     .jobs = m->jobs2, .njobs = nj2, .out = m->y, .ntok = 1, .scratch_floats = rows_scratch(per2, 1, inter / 32)};
    return 0;
}

/* between the passes: every pair's SwiGLU, as the second pass's input; -1 with MemoryError set (no_memory) */
static int moe_between(moe_run_t *m) {
    int64_t n = m->n, inter = m->inter;
    float *act = swiglu_pairs(m->h, n, inter);
    if (quantize_rows(act, n, inter, &m->aq, &m->asc, &m->as, m->any_x8 ? &m->a8 : NULL, &m->a8d) ||
        quantize_rows_t1(m->geoms, m->ng, act, n, inter, 1, &m->atq, &m->atd) ||
        q1t_inputs(m->geoms, m->ng, act, n, inter, &m->alt, &m->altd))
        return -1;
    task_t *t = &m->t2;
    t->xf = act; t->xsc = m->asc; t->xs = m->as; t->xq = m->aq; t->xp = m->aq + n * inter;
    t->x8 = m->a8; t->x8d = m->a8d; t->x8s = m->a8d ? m->a8d + n * ((inter + 127) / 128) : NULL;
    t->xt = m->atq; t->xtd = m->atd; t->xts = m->atd ? m->atd + n * (inter / 128) : NULL;
    t->lt = m->alt; t->ltd = m->altd;
    return 0;
}

#define MOE_ARGS "base, geoms, offs, pick, tok, wts, x, out, threads"
#define MOE_DOC \
"Tokens through their experts: out[tok[i]] += wts[i] * down_i(silu(gate_i x[tok[i]]) * up_i x[tok[i]])\n" \
"for every pair i, in two passes over the thread pool (all gate and up rows, then all down rows).\n" \
"geoms (int64 [2m, 22]) holds m (gate/up, down) geometries of one shape, pick (int64 [n]) chooses pair\n" \
"i's, offs (int64 [n, 3]) are the byte offsets in base of its gate, up and down tensors, tok (int64 [n])\n" \
"its token, wts (float32 [n]) its weight; x and out are float32 [T, hidden].\n"

/* moe's and moe_launch's arguments into m (their buffers into b[8]); 0, or -1 with an exception set */
static int moe_args(PyObject *args, moe_run_t *m, buf_t *b, int *threads, int out_given) {
    PyObject *o[8];
    int ok = out_given ? PyArg_ParseTuple(args, "OOOOOOOOi", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], threads)
                       : PyArg_ParseTuple(args, "OOOOOOOi", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], threads);
    if (!ok) return -1;
    if (get_buf(o[0], &b[0], 0, 1, "base") || get_buf(o[1], &b[1], 0, 8 * G_LEN, "geoms") ||
        get_buf(o[2], &b[2], 0, 24, "offs") || get_buf(o[3], &b[3], 0, 8, "pick") ||
        get_buf(o[4], &b[4], 0, 8, "tok") || get_buf(o[5], &b[5], 0, 4, "wts") || get_buf(o[6], &b[6], 0, 4, "x") ||
        (out_given && get_buf(o[7], &b[7], 1, 4, "out")))
        return -1;
    *m = (moe_run_t){.base = b[0].b.buf, .geoms = b[1].b.buf, .offs = b[2].b.buf, .pick = b[3].b.buf, .tok = b[4].b.buf,
                     .wts = b[5].b.buf, .x = b[6].b.buf, .ng = b[1].b.len / (8 * G_LEN), .n = b[2].b.len / 24};
    return moe_fits(m, b[0].b.len, b[3].b.len / 8, b[4].b.len / 8, b[5].b.len / 4, b[6].b.len / 4,
                    out_given ? b[7].b.len / 4 : b[6].b.len / 4) ? 0 : -1;
}

PyDoc_STRVAR(moe_doc, "moe(" MOE_ARGS ") -> int\n\n" MOE_DOC "Returns 1 if a tensor's outlier columns are corrupt.");

static PyObject *py_moe(PyObject *self, PyObject *args) {
    buf_t b[8];
    memset(b, 0, sizeof b);
    moe_run_t m;
    memset(&m, 0, sizeof m);
    int threads;
    PyObject *ret = NULL;
    if (moe_args(args, &m, b, &threads, 1)) goto done;
    if (!m.n) { ret = PyLong_FromLong(0); goto done; }
    if (moe_setup(&m)) goto done;
    int bad = run_unlocked(&m.t1, threads);
    if (bad < 0 || moe_between(&m)) goto done;
    int bad2 = run_unlocked(&m.t2, threads);
    if (bad2 < 0) goto done;
    moe_sum(b[7].b.buf, m.y, m.wts, m.tok, m.n, m.hidden);
    ret = PyLong_FromLong(bad || bad2);
done:
    moe_free(&m);
    release(b, 8);
    return ret;
}

/* ---------------------------------------------------------------- a MoE call while the caller goes on */
/* moe_launch hands a call to the pool and returns: the workers run it while the interpreter does a
 * decode step's bookkeeping, and the caller joins in at moe_join (or at its next use of the pool). One
 * driver job per thread walks both passes: its share of the first pass's rows, then, once every one of
 * them is done, the SwiGLU and its rounding (by whichever driver gets there first) and its share of
 * the second pass. The call's inputs are copied and its buffer held until joined. */
struct moe_async {
    moe_run_t m;
    buf_t base;                          /* the experts' buffer, held until the call is collected */
    void *copies;                        /* geoms, offs, pick, tok, wts, x */
    float *out;                          /* [T, hidden]: the result, summed into zeros */
    task_t drive;
    atomic_int claimed, ready, failed;
    int threads, settled;
};

static void moe_drive_job(task_t *t, int64_t j, float *scratch) {
    (void)j; (void)scratch;
    moe_async_t *a = t->ctx;
    run_jobs(&a->m.t1);
    while (atomic_load_explicit(&a->m.t1.done, memory_order_acquire) < a->m.t1.njobs) cpu_relax();
    if (atomic_exchange(&a->claimed, 1) == 0) {
        quiet_oom = 1;
        if (moe_between(&a->m)) atomic_store(&a->failed, 1);
        quiet_oom = 0;
        atomic_store_explicit(&a->ready, 1, memory_order_release);
    } else {
        while (!atomic_load_explicit(&a->ready, memory_order_acquire)) cpu_relax();
    }
    if (!atomic_load(&a->failed)) run_jobs(&a->m.t2);
}

/* finish the pending call on this thread and the pool (no GIL needed): the drivers' jobs it finds
   left, then every row's, then the sum */
static void moe_settle(void) {
    moe_async_t *a = moe_pending;
    if (!a || a->settled) return;
    run_jobs(&a->drive);
    while (atomic_load_explicit(&a->drive.done, memory_order_acquire) < a->drive.njobs) cpu_relax();
    if (!atomic_load(&a->failed))
        while (atomic_load_explicit(&a->m.t2.done, memory_order_acquire) < a->m.t2.njobs) cpu_relax();
    pthread_mutex_lock(&pool_mu);
    if (pool_task == &a->drive) pool_task = NULL;
    pthread_mutex_unlock(&pool_mu);
    while (atomic_load(&pool_active)) cpu_relax();
    if (!atomic_load(&a->failed)) moe_sum(a->out, a->m.y, a->m.wts, a->m.tok, a->m.n, a->m.hidden);
    a->settled = 1;
}

static void moe_discard(void) {
    moe_async_t *a = moe_pending;
    moe_pending = NULL;
    if (!a) return;
    moe_free(&a->m);
    release(&a->base, 1);
    free(a->copies);
    free(a->out);
    free(a);
}

PyDoc_STRVAR(moe_launch_doc, "moe_launch(base, geoms, offs, pick, tok, wts, x, threads)\n\n"
"moe's call handed to the thread pool (threads >= 2), returning at once; moe_join(out) collects it.\n"
"Until then the pool's next user waits for it first. A call not yet collected is discarded.\n" MOE_DOC);

/* hand m's call (its inputs checked, base's buffer held in *base: taken over) to the pool and return;
   -1 with an exception set */
static int moe_start(moe_run_t m, buf_t *base, int threads) {
    if (moe_pending) {                    /* never collected: finish and drop it */
        Py_BEGIN_ALLOW_THREADS
        moe_settle();
        Py_END_ALLOW_THREADS
        moe_discard();
    }
    if (threads < 2 || m.n < 1) {
        PyErr_SetString(PyExc_ValueError, "moe_launch: two threads or more, one pair or more");
        return -1;
    }
    moe_async_t *a = calloc(1, sizeof *a);
    size_t ng = m.ng * G_LEN, n = m.n, nx = m.T * m.hidden;
    char *c = a ? malloc(8 * (ng + 3 * n + 2 * n) + 4 * (n + nx)) : NULL;
    float *out = c ? calloc(nx, sizeof(float)) : NULL;
    if (!a || !c || !out) { free(a); free(c); free(out); PyErr_NoMemory(); return -1; }
    a->copies = c;
    a->out = out;
    int64_t *geoms = (int64_t *)c, *offs = geoms + ng, *pick = offs + 3 * n, *tok = pick + n;
    float *wts = (float *)(tok + n), *x = wts + n;
    memcpy(geoms, m.geoms, 8 * ng); memcpy(offs, m.offs, 24 * n); memcpy(pick, m.pick, 8 * n); memcpy(tok, m.tok, 8 * n);
    memcpy(wts, m.wts, 4 * n); memcpy(x, m.x, 4 * nx);
    m.geoms = geoms; m.offs = offs; m.pick = pick; m.tok = tok; m.wts = wts; m.x = x;
    a->m = m;
    a->base = *base;                       /* the buffer stays held with the call */
    base->held = 0;
    a->threads = threads;
    moe_pending = a;
    if (moe_setup(&a->m)) { moe_discard(); return -1; }
    task_ranges(&a->m.t1, threads);
    task_ranges(&a->m.t2, threads);
    a->drive = (task_t){.job = moe_drive_job, .njobs = threads, .ctx = a, .scratch_floats = 16};
    task_ranges(&a->drive, threads);
    pool_grow(threads - 1);
    pthread_mutex_lock(&pool_mu);
    pool_task = &a->drive;
    atomic_fetch_add_explicit(&pool_gen, 1, memory_order_release);
    if (atomic_load(&pool_sleepers)) pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    return 0;
}

/* collect the launched call: settled here (without the GIL), its output added into x [nx]; the bad
   flag, or -1 with an exception set */
static int moe_collect(float *x, int64_t nx) {
    moe_async_t *a = moe_pending;
    if (!a) { PyErr_SetString(PyExc_ValueError, "moe_join: no call launched"); return -1; }
    Py_BEGIN_ALLOW_THREADS
    moe_settle();
    Py_END_ALLOW_THREADS
    int rc;
    if (atomic_load(&a->failed) || atomic_load(&a->m.t1.bad) == 2 || atomic_load(&a->m.t2.bad) == 2) {
        PyErr_NoMemory();
        rc = -1;
    } else if (nx != a->m.T * a->m.hidden) {
        PyErr_SetString(PyExc_ValueError, "moe_join: out [T, hidden] as launched");
        rc = -1;
    } else {
        for (int64_t i = 0; i < nx; i++) x[i] += a->out[i];
        rc = atomic_load(&a->m.t1.bad) || atomic_load(&a->m.t2.bad);
    }
    moe_discard();
    return rc;
}

static PyObject *py_moe_launch(PyObject *self, PyObject *args) {
    buf_t b[8];
    memset(b, 0, sizeof b);
    moe_run_t m;
    int threads;
    PyObject *ret = NULL;
    if (moe_args(args, &m, b, &threads, 0) == 0 && moe_start(m, &b[0], threads) == 0) ret = Py_NewRef(Py_None);
    release(b, 8);
    return ret;
}

PyDoc_STRVAR(moe_join_doc, "moe_join(out) -> int\n\n"
"The launched call's result (float32 [T, hidden]) added into out, this thread helping with what is left.\n"
"Returns 1 if a tensor's outlier columns are corrupt.");

static PyObject *py_moe_join(PyObject *self, PyObject *args) {
    PyObject *o;
    if (!PyArg_ParseTuple(args, "O", &o)) return NULL;
    buf_t b;
    memset(&b, 0, sizeof b);
    if (!moe_pending) { PyErr_SetString(PyExc_ValueError, "moe_join: no call launched"); return NULL; }
    if (get_buf(o, &b, 1, 4, "out")) return NULL;
    int rc = moe_collect(b.b.buf, b.b.len / 4);
    release(&b, 1);
    return rc < 0 ? NULL : PyLong_FromLong(rc);
}

/* n input values x of a product by a `type` weight, as it takes them: Q8_K codes in *q8 (use_int), or
   rounded as llama.cpp rounds them into *xr with Q8_1 corrections in *fix (llama), else x itself. The
   caller frees *q8, *xr, *fix; -1 with MemoryError set */
static int ggml_input(int type, int llama, int use_int, const float *x, int64_t n, const float **xf, float **xr,
                      float **fix, ggml_q8k_t **q8) {
    *xf = x;
    if (use_int) {
        if (!(*q8 = malloc(sizeof **q8 * (n / 256 + 1)))) goto oom;
        ggml_quantize_q8k(x, n, *q8);
    } else if (llama && ggml_input_block(type)) {
        if (!(*xr = malloc(sizeof(float) * (n + 1)))) goto oom;
        if (ggml_input_fix(type) && !(*fix = malloc(sizeof(float) * (n / 32 + 1)))) goto oom;
        ggml_round_input(type, x, *xr, n, *fix);
        *xf = *xr;
    }
    return 0;
oom:
    PyErr_NoMemory();
    return -1;
}

PyDoc_STRVAR(ggml_moe_doc,
"ggml_moe(base, types, offs, tok, wts, x, out, hidden, inter, threads, llama_inputs=0)\n\n"
"moe() for llama.cpp blocks: out[tok[i]] += wts[i] * down_i(silu(gate_i x[tok[i]]) * up_i x[tok[i]]),\n"
"gate and up of GGML type types[0] [inter, hidden], down of types[1] [hidden, inter], at byte offsets\n"
"offs[i] (int64 [n, 3]) in base; x and out float32 [T, hidden]. Every pair's gate and up rows run in\n"
"one pass over the threads, every down row in a second. With llama_inputs, each product's input is\n"
"first rounded as llama.cpp rounds it (ggml_round).");

static PyObject *py_ggml_moe(PyObject *self, PyObject *args) {
    PyObject *o[7];
    Py_ssize_t hidden, inter;
    int threads, llama_inputs = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOOnni|p", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &hidden, &inter,
                          &threads, &llama_inputs))
        return NULL;
    buf_t b[7];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    int64_t *jobs = NULL;
    float *h = NULL, *y = NULL, *xr = NULL, *fx = NULL, *ar = NULL, *fa = NULL;
    ggml_q8k_t *qx = NULL, *qa = NULL;
    if (get_buf(o[0], &b[0], 0, 1, "base") || get_buf(o[1], &b[1], 0, 8, "types") || get_buf(o[2], &b[2], 0, 24, "offs") ||
        get_buf(o[3], &b[3], 0, 8, "tok") || get_buf(o[4], &b[4], 0, 4, "wts") || get_buf(o[5], &b[5], 0, 4, "x") ||
        get_buf(o[6], &b[6], 1, 4, "out"))
        goto done;
    const int64_t *types = b[1].b.buf, *offs = b[2].b.buf, *tok = b[3].b.buf;
    const float *wts = b[4].b.buf, *x = b[5].b.buf;
    float *out = b[6].b.buf;
    int64_t n = b[2].b.len / 24, nraw = b[0].b.len;
    int64_t wg, bg, wd, bd;
    if (b[1].b.len != 16 || !ggml_block_size((int)types[0], &wg, &bg) || !ggml_block_size((int)types[1], &wd, &bd)) {
        PyErr_SetString(PyExc_ValueError, "ggml_moe: two GGML types with kernels (and codebooks loaded)");
        goto done;
    }
    if (hidden <= 0 || inter <= 0 || hidden % wg || inter % wd) {
        PyErr_SetString(PyExc_ValueError, "ggml_moe: rows are not whole blocks");
        goto done;
    }
    int64_t T = b[5].b.len / (4 * hidden);
    if (b[5].b.len != 4 * T * hidden || b[6].b.len != b[5].b.len || b[3].b.len != 8 * n || b[4].b.len != 4 * n) {
        PyErr_SetString(PyExc_ValueError, "ggml_moe: x and out [T, hidden]; tok and wts one entry per pair");
        goto done;
    }
    /* (type, row bytes, blocks per row) of gate/up, then of down */
    int64_t ty[6] = {types[0], hidden / wg * bg, hidden / wg, types[1], inter / wd * bd, inter / wd};
    int64_t gu_bytes = inter * ty[1], d_bytes = hidden * ty[4];
    for (int64_t i = 0; i < n; i++) {
        if (tok[i] < 0 || tok[i] >= T || offs[3 * i] < 0 || offs[3 * i] > nraw - gu_bytes || offs[3 * i + 1] < 0 ||
            offs[3 * i + 1] > nraw - gu_bytes || offs[3 * i + 2] < 0 || offs[3 * i + 2] > nraw - d_bytes) {
            PyErr_SetString(PyExc_ValueError, "ggml_moe: a pair's token or tensors lie outside their buffers");
            goto done;
        }
    }
    if (!n) { ret = Py_NewRef(Py_None); goto done; }
    if (moe_buffers(n, hidden, inter, &jobs, &h, &y)) goto done;
    /* every job here multiplies one input, so the integer products serve wherever a type has them */
    int int_x = llama_inputs && ggml_int_inputs((int)types[0]), int_a = llama_inputs && ggml_int_inputs((int)types[1]);
    if (ggml_input((int)types[0], llama_inputs, int_x, x, T * hidden, &x, &xr, &fx, &qx)) goto done;
    int64_t nj = 0;
    for (int64_t i = 0; i < n; i++)
        for (int w = 0; w < 2; w++)
            nj += moe_jobs(jobs + JOB_LEN * nj, offs[3 * i + w], 0, inter, hidden, tok[i], (2 * i + w) * inter, 0);
    task_t t1 = {.job = ggml_moe_job, .raw = b[0].b.buf, .geoms = ty, .xf = x, .cols = hidden, .jobs = jobs,
                 .njobs = nj, .out = h, .scratch_floats = 256 + 16, .fix = fx, .q8 = qx};
    if (run_unlocked(&t1, threads) < 0) goto done;
    const float *act;
    if (ggml_input((int)types[1], llama_inputs, int_a, swiglu_pairs(h, n, inter), n * inter, &act, &ar, &fa, &qa))
        goto done;
    nj = 0;
    for (int64_t i = 0; i < n; i++)
        nj += moe_jobs(jobs + JOB_LEN * nj, offs[3 * i + 2], 1, hidden, inter, i, i * hidden, 0);
    task_t t2 = {.job = ggml_moe_job, .raw = b[0].b.buf, .geoms = ty, .xf = act, .cols = inter, .jobs = jobs,
                 .njobs = nj, .out = y, .scratch_floats = 256 + 16, .fix = fa, .q8 = qa};
    if (run_unlocked(&t2, threads) < 0) goto done;
    moe_sum(out, y, wts, tok, n, hidden);
    ret = Py_NewRef(Py_None);
done:
    free(jobs); free(h); free(y); free(xr); free(fx); free(ar); free(fa); free(qx); free(qa);
    release(b, 7);
    return ret;
}

PyDoc_STRVAR(heads_t_doc,
"heads_t(raw, geom, v, stride, out, threads) -> int\n\n"
"out[h] (float32 [nh, cols]) = sum_j v[h, j] * W[h * stride + j] for v float32 [nh, n], W the tensor\n"
"at the start of raw with geometry geom (int64 [22]). Returns 1 if its outlier columns are corrupt.");

static PyObject *py_heads_t(PyObject *self, PyObject *args) {
    PyObject *o[4];
    Py_ssize_t nh, stride;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOnOi", &o[0], &o[1], &o[2], &stride, &o[3], &threads)) return NULL;
    buf_t b[4];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 1, "raw") || get_buf(o[1], &b[1], 0, 8 * G_LEN, "geom") ||
        get_buf(o[2], &b[2], 0, 4, "v") || get_buf(o[3], &b[3], 1, 4, "out"))
        goto done;
    const int64_t *g = tensor_geometry(&b[0], &b[1], &b[3], "heads_t");
    if (!g) goto done;
    int64_t cols = g[G_COLS];
    nh = b[3].b.len / (4 * cols);
    int64_t n = nh ? (b[2].b.len / 4) / nh : 0;
    if (b[2].b.len != 4 * nh * n || stride < 0 || (nh && (nh - 1) * stride + n > g[G_ROWS])) {
        PyErr_SetString(PyExc_ValueError, "heads_t: heads lie outside the tensor");
        goto done;
    }
    task_t t = {.job = heads_t_job, .raw = b[0].b.buf, .geoms = g, .xf = b[2].b.buf, .cols = cols,
                .nspan = cols / 32, .n = n, .stride = stride, .njobs = nh, .out = b[3].b.buf,
                .scratch_floats = HEADS_T_SCRATCH(n, cols / 32)};
    int bad = run_unlocked(&t, threads);
    if (bad >= 0) ret = PyLong_FromLong(bad);
done:
    release(b, 4);
    return ret;
}

PyDoc_STRVAR(dequantize_doc,
"dequantize(raw, geom, r0, out, threads)\n\n"
"Rows r0 .. r0 + len(out) - 1 of the tensor at the start of raw (geometry geom, int64 [22]) into out\n"
"(float32 [n, cols]), bit for bit as the reference decoder. Outlier columns are not checked here.");

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Py_ssize_t r0;
    int threads;
    if (!PyArg_ParseTuple(args, "OOnOi", &o[0], &o[1], &r0, &o[2], &threads)) return NULL;
    buf_t b[3];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 1, "raw") || get_buf(o[1], &b[1], 0, 8 * G_LEN, "geom") ||
        get_buf(o[2], &b[2], 1, 4, "out"))
        goto done;
    const int64_t *g = tensor_geometry(&b[0], &b[1], &b[2], "dequantize");
    if (!g) goto done;
    int64_t cols = g[G_COLS];
    int64_t n = b[2].b.len / (4 * cols);
    if (r0 < 0 || r0 + n > g[G_ROWS]) { PyErr_SetString(PyExc_ValueError, "dequantize: rows outside the tensor"); goto done; }
    task_t t = {.job = deq_job, .raw = b[0].b.buf, .geoms = g, .cols = cols, .nspan = cols / 32, .n = n,
                .stride = r0, .njobs = (n + DEQ_ROWS - 1) / DEQ_ROWS, .out = b[2].b.buf};
    if (run_unlocked(&t, threads) >= 0) ret = Py_NewRef(Py_None);
done:
    release(b, 3);
    return ret;
}

/* a GGUF tensor's geometry checked against its bytes: the row's bytes, or -1 with ValueError set */
static int64_t ggml_row_bytes(int type, int64_t rows, int64_t cols, Py_ssize_t have, int64_t *nblk) {
    int64_t w, b;
    if (!ggml_block_size(type, &w, &b)) {
        PyErr_Format(PyExc_ValueError, "GGML type %d has no kernel (or its codebook is not loaded)", type);
        return -1;
    }
    if (rows < 0 || cols <= 0 || cols % w || (cols / w) * b * rows > have) {
        PyErr_SetString(PyExc_ValueError, "ggml: buffers do not match the tensor's shape");
        return -1;
    }
    *nblk = cols / w;
    return *nblk * b;
}

PyDoc_STRVAR(ggml_rows_doc,
"ggml_rows(raw, type, rows, cols, xf, out, threads, head_rows=0, llama_inputs=0): out [T, rows] = xf [T, cols]\n"
"@ W.T for the GGML tensor W [rows, cols] of llama.cpp blocks of `type` in raw (float32 buffers); with\n"
"head_rows, xf holds one input per head of head_rows rows and out [rows] is each row times its head's\n"
"input. With llama_inputs, xf is first rounded as llama.cpp rounds it (ggml_round; as integer codes\n"
"and integer products for the types that have them).");

static PyObject *py_ggml_rows(PyObject *self, PyObject *args) {
    PyObject *o[3];
    int type, threads, llama_inputs = 0;
    Py_ssize_t rows, cols, head_rows = 0;
    if (!PyArg_ParseTuple(args, "OinnOOi|np", &o[0], &type, &rows, &cols, &o[1], &o[2], &threads, &head_rows,
                          &llama_inputs))
        return NULL;
    buf_t b[3];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    float *xr = NULL, *fix = NULL;
    ggml_q8k_t *q8 = NULL;
    if (get_buf(o[0], &b[0], 0, 1, "raw") || get_buf(o[1], &b[1], 0, 4, "xf") || get_buf(o[2], &b[2], 1, 4, "out"))
        goto done;
    int64_t nblk, rb = ggml_row_bytes(type, rows, cols, b[0].b.len, &nblk);
    if (rb < 0) goto done;
    int64_t ntok = b[1].b.len / (4 * cols);
    if (head_rows < 0 || (head_rows && (rows % head_rows || b[1].b.len != 4 * (rows / head_rows) * cols ||
                                        b[2].b.len != 4 * rows))) {
        PyErr_SetString(PyExc_ValueError, "ggml_rows: with head_rows, xf must be [rows / head_rows, cols] and out [rows]");
        goto done;
    }
    if (head_rows) ntok = 1;
    else if (b[1].b.len != 4 * ntok * cols || b[2].b.len != 4 * ntok * rows) {
        PyErr_SetString(PyExc_ValueError, "ggml_rows: xf must be [T, cols] and out [T, rows]");
        goto done;
    }
    const float *x;
    if (ggml_input(type, llama_inputs, llama_inputs && ntok <= ggml_int_inputs(type), b[1].b.buf, b[1].b.len / 4, &x,
                   &xr, &fix, &q8))
        goto done;
    int64_t per = GGML_JOB_WEIGHTS / cols > 8 ? GGML_JOB_WEIGHTS / cols : 8;
    task_t t = {.job = ggml_rows_job, .raw = b[0].b.buf, .xf = x, .out = b[2].b.buf, .n = type,
                .stride = rb, .nspan = nblk, .cols = cols, .ntok = ntok, .ostride = per, .njobs_rows = rows,
                .head_rows = head_rows, .njobs = (rows + per - 1) / per, .scratch_floats = ntok + 8 + 256,
                .fix = fix, .q8 = q8};
    if (!ntok || !rows || run_unlocked(&t, threads) >= 0) ret = Py_NewRef(Py_None);
done:
    free(xr); free(fix); free(q8);
    release(b, 3);
    return ret;
}

PyDoc_STRVAR(ggml_round_doc,
"ggml_round(type, cols, x, out, fix=None) -> bool\n\n"
"out = x (float32, rows of cols values) rounded as llama.cpp rounds the input of a weight of GGML type\n"
"`type` (to Q8_K, Q8_0 or Q8_1 values); False, out untouched, for a type it does not round for. For\n"
"Q4_1 and Q5_1 weights, fix (float32, one per 32 values) receives the corrections ggml_rows takes.");

static PyObject *py_ggml_round(PyObject *self, PyObject *args) {
    PyObject *o[3] = {NULL, NULL, Py_None};
    int type;
    Py_ssize_t cols;
    if (!PyArg_ParseTuple(args, "inOO|O", &type, &cols, &o[0], &o[1], &o[2])) return NULL;
    buf_t b[3];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 4, "x") || get_buf(o[1], &b[1], 1, 4, "out") ||
        (o[2] != Py_None && get_buf(o[2], &b[2], 1, 4, "fix")))
        goto done;
    int blk = ggml_input_block(type);
    if (b[0].b.len != b[1].b.len || cols <= 0 || b[0].b.len % (4 * cols) || (blk && cols % blk) ||
        (o[2] != Py_None && b[2].b.len * 32 != b[0].b.len)) {
        PyErr_SetString(PyExc_ValueError, "ggml_round: x and out of one size, rows of cols values, whole blocks, "
                                          "fix one value per 32");
        goto done;
    }
    ret = PyBool_FromLong(ggml_round_input(type, b[0].b.buf, b[1].b.buf, b[0].b.len / 4,
                                           o[2] != Py_None ? b[2].b.buf : NULL));
done:
    release(b, 3);
    return ret;
}

PyDoc_STRVAR(ggml_dequantize_doc,
"ggml_dequantize(raw, type, cols, out, threads): the rows of llama.cpp blocks of `type` in raw decoded\n"
"into out (float32 [n, cols]), as the gguf package's dequantizer gives them");

static PyObject *py_ggml_dequantize(PyObject *self, PyObject *args) {
    PyObject *o[2];
    int type, threads;
    Py_ssize_t cols;
    if (!PyArg_ParseTuple(args, "OinOi", &o[0], &type, &cols, &o[1], &threads)) return NULL;
    buf_t b[2];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 1, "raw") || get_buf(o[1], &b[1], 1, 4, "out")) goto done;
    int64_t rows = cols > 0 ? b[1].b.len / (4 * cols) : 0, nblk;
    if (cols <= 0 || b[1].b.len != 4 * rows * cols) {
        PyErr_SetString(PyExc_ValueError, "ggml_dequantize: out must be [n, cols]");
        goto done;
    }
    int64_t rb = ggml_row_bytes(type, rows, cols, b[0].b.len, &nblk);
    if (rb < 0) goto done;
    task_t t = {.job = ggml_deq_job, .raw = b[0].b.buf, .out = b[1].b.buf, .n = type, .stride = rb,
                .nspan = nblk, .cols = cols, .njobs_rows = rows, .njobs = (rows + DEQ_ROWS - 1) / DEQ_ROWS,
                .scratch_floats = 16};
    if (!rows || run_unlocked(&t, threads) >= 0) ret = Py_NewRef(Py_None);
done:
    release(b, 2);
    return ret;
}

static PyObject *py_ggml_grid(PyObject *self, PyObject *args) {
    PyObject *o;
    int type;
    if (!PyArg_ParseTuple(args, "iO", &type, &o)) return NULL;
    buf_t b;
    memset(&b, 0, sizeof b);
    if (get_buf(o, &b, 0, 4, "grid")) { release(&b, 1); return NULL; }
    int rc = ggml_set_grid(type, b.b.buf, b.b.len / 4);
    release(&b, 1);
    if (rc) return PyErr_Format(PyExc_ValueError, "GGML type %d: not a codebook of the expected size", type);
    return Py_NewRef(Py_None);
}

static PyObject *py_ggml_info(PyObject *self, PyObject *args) {
    int type;
    if (!PyArg_ParseTuple(args, "i", &type)) return NULL;
    int64_t w = 0, b = 0;
    int ready = ggml_block_size(type, &w, &b);
    return Py_BuildValue("iLLi", ready, (long long)w, (long long)b, ggml_needs_grid(type));
}

static PyObject *py_read_sum(PyObject *self, PyObject *args) {
    PyObject *o;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi", &o, &threads)) return NULL;
    buf_t b;
    memset(&b, 0, sizeof b);
    if (get_buf(o, &b, 0, 8, "buffer")) { release(&b, 1); return NULL; }
    task_t t = {.job = sum_job, .raw = b.b.buf, .n = b.b.len, .njobs = (b.b.len + SUM_BYTES - 1) / SUM_BYTES};
    int rc = run_unlocked(&t, threads);
    release(&b, 1);
    return rc < 0 ? NULL : PyLong_FromUnsignedLongLong(atomic_load(&t.sum));
}

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    buf_t b[4];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 4, "x") || get_buf(o[1], &b[1], 1, 2, "xq") ||
        get_buf(o[2], &b[2], 1, 4, "xsc") || get_buf(o[3], &b[3], 1, 4, "xs"))
        goto done;
    int64_t cols = b[0].b.len / 4;
    if (cols % 32 || b[1].b.len != 2 * cols || b[2].b.len != cols / 8 || b[3].b.len != cols / 8) {
        PyErr_SetString(PyExc_ValueError, "quantize: sizes do not match");
        goto done;
    }
    quantize_x(b[0].b.buf, cols, b[1].b.buf, b[2].b.buf, b[3].b.buf);
    ret = Py_NewRef(Py_None);
done:
    release(b, 4);
    return ret;
}

static PyObject *py_set_x8(PyObject *self, PyObject *args) {
    int kinds;
    if (!PyArg_ParseTuple(args, "i", &kinds)) return NULL;
    if (kinds & ~X8_CAPABLE) {
        PyErr_SetString(PyExc_ValueError, "set_x8: int8 activations exist for q2, q4, q6, q1 and t1 only");
        return NULL;
    }
    int old = x8_kinds;
    x8_kinds = kinds;
    return PyLong_FromLong(old);
}

static PyObject *py_set_x8_levels(PyObject *self, PyObject *args) {
    int levels;
    if (!PyArg_ParseTuple(args, "i", &levels)) return NULL;
    if (levels < 1 || levels > 127) {
        PyErr_SetString(PyExc_ValueError, "set_x8_levels: int8 inputs round to -n .. n with n from 1 to 127");
        return NULL;
    }
    int old = (int)x8_levels;
    x8_levels = (float)levels;
    return PyLong_FromLong(old);
}

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (!strcmp(name, "generic")) use_avx2 = 0;
#if HAVE_X86
    else if (!strcmp(name, "avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) use_avx2 = 1;
#endif
    else return PyErr_Format(PyExc_ValueError, "instruction set %s is not available here", name);
    ggml_avx2 = use_avx2;
    return Py_NewRef(Py_None);
}

/* whether this CPU runs VNNI level `level` (see dp_bytes), and the best it runs */
static int vnni_runs(int level) {
#if HAVE_X86
    if (level == 1) return __builtin_cpu_supports("avxvnni");
    if (level == 2) return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    if (level == 3) return vnni_runs(2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#endif
    return level == 0;
}

/* 512-bit registers first where the CPU has them (the several-token rows run 1.2-1.3x faster on them) */
static int vnni_available(void) { return vnni_runs(3) ? 3 : vnni_runs(1) ? 1 : vnni_runs(2) ? 2 : 0; }

static PyObject *py_set_vnni(PyObject *self, PyObject *args) {
    int level;
    if (!PyArg_ParseTuple(args, "i", &level)) return NULL;
    if (!vnni_runs(level)) return PyErr_Format(PyExc_ValueError, "VNNI level %d is not available here", level);
    int old = use_vnni;
    use_vnni = level;
    return PyLong_FromLong(old);
}

static PyObject *py_pool_wait(PyObject *self, PyObject *noargs) {
    return PyFloat_FromDouble(atomic_load(&pool_wait_ns) * 1e-9);
}

static PyObject *py_vnni(PyObject *self, PyObject *noargs) { return PyLong_FromLong(use_vnni); }

static PyObject *py_set_amx(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    if (on && !amx_available()) return PyErr_Format(PyExc_ValueError, "AMX tiles are not available here");
    int old = use_amx;
    use_amx = on;
    return PyBool_FromLong(old);
}

static PyObject *py_amx(PyObject *self, PyObject *noargs) { return PyBool_FromLong(use_amx); }

static PyObject *py_isa(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(use_avx2 ? "avx2" : "generic");
}

static PyObject *py_set_spin(PyObject *self, PyObject *args) {
    long us;
    if (!PyArg_ParseTuple(args, "l", &us)) return NULL;
    spin_ns = us * 1000;
    return Py_NewRef(Py_None);
}

/* the attention of a (everything but part set) in four passes over the pool; -1 with MemoryError set */
static int attend_all(att_t *a, int threads) {
    /* the positions' split into partial sums from S alone: the sums' order, and so the result's bits,
       the same on any number of threads (the thread tuner changes it during a run); at least four
       (positions allowing) so that short caches still share out, at most eight */
    int64_t S = a->S, nh = a->nh, nmix = (S + ATT_MIX_POS - 1) / ATT_MIX_POS;
    if (nmix < 4) nmix = S < 4 ? S : 4;
    nmix = nmix < 8 ? nmix : 8;
    float *probs = malloc(sizeof(float) * (nh * S + nmix * nh * a->r));
    if (!probs) { PyErr_NoMemory(); return -1; }
    a->part = probs + nh * S;
    int64_t scratch = 2 * a->r + a->dr + 16;      /* the portable jobs' rows, converted (AVX2 needs none) */
    task_t t1 = {.job = att_scores_job, .att = a, .out = probs, .njobs = (S + ATT_POS - 1) / ATT_POS, .scratch_floats = scratch};
    task_t t2 = {.job = att_softmax_job, .att = a, .out = probs, .njobs = nh, .scratch_floats = scratch};
    task_t t3 = {.job = att_mix_job, .att = a, .out = probs, .n = nmix, .njobs = nmix, .scratch_floats = scratch};
    task_t t4 = {.job = att_sum_job, .att = a, .n = nmix, .njobs = (nh * a->r + 1023) / 1024, .scratch_floats = scratch};
    int rc = run_unlocked(&t1, threads) < 0 || run_unlocked(&t2, threads) < 0 || run_unlocked(&t3, threads) < 0 ||
             run_unlocked(&t4, threads) < 0 ? -1 : 0;
    free(probs);
    return rc;
}

PyDoc_STRVAR(attend_doc,
"attend(q, qr, C, K, S, nh, half, scale, out, threads)\n\n"
"One token's absorbed attention: for each of the nh heads h, scores = scale * (q[h] . C[p] +\n"
"qr[h] . K[p]) over positions p < S, a softmax, then out[h] = sum_p probs[p] * C[p]. q float32 [nh, r],\n"
"qr float32 [nh, dr], C and K the caches' rows (float32, or binary16 if half), out float32 [nh, r].");

static PyObject *py_attend(PyObject *self, PyObject *args) {
    PyObject *o[5];
    Py_ssize_t S, nh;
    int half, threads;
    float scale;
    if (!PyArg_ParseTuple(args, "OOOOnnpfOi", &o[0], &o[1], &o[2], &o[3], &S, &nh, &half, &scale, &o[4], &threads))
        return NULL;
    buf_t b[5];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    int64_t es = half ? 2 : 4;
    if (get_buf(o[0], &b[0], 0, 4, "q") || get_buf(o[1], &b[1], 0, 4, "qr") || get_buf(o[2], &b[2], 0, es, "C") ||
        get_buf(o[3], &b[3], 0, es, "K") || get_buf(o[4], &b[4], 1, 4, "out"))
        goto done;
    int64_t nq = b[0].b.len / 4, nqr = b[1].b.len / 4;
    if (S < 1 || nh < 1 || nq % nh || nqr % nh || b[4].b.len / 4 != nq || nq / nh < 1 ||
        b[2].b.len < S * (nq / nh) * es || b[3].b.len < S * (nqr / nh) * es) {
        PyErr_SetString(PyExc_ValueError, "attend: q [nh, r], qr [nh, dr], out [nh, r] and S rows of both caches needed");
        goto done;
    }
    att_t a = {.q = b[0].b.buf, .qr = b[1].b.buf, .C = b[2].b.buf, .K = b[3].b.buf, .half = half, .S = S,
               .r = nq / nh, .dr = nqr / nh, .nh = nh, .scale = scale, .o = b[4].b.buf};
    if (attend_all(&a, threads) == 0) ret = Py_NewRef(Py_None);
done:
    release(b, 5);
    return ret;
}

/* ---------------------------------------------------------------------------------------- routing */
/* index of the largest of v[0 .. n-1] not yet taken, the lowest index among equals (a stable sort's
   order); -1 if none is left */
static int64_t pick_largest(const float *v, int64_t n, const unsigned char *taken) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* x[0] + ... + x[n-1] in the order numpy's float32 sum takes along a contiguous axis (pairwise:
   sequential below eight values, eight partial sums up to 128, halves above), so results equal the
   numpy formulations in model.py bit for bit */
static float numpy_sum(const float *x, int64_t n) {
    if (n < 8) {
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) s += x[i];
        return s;
    }
    if (n > 128) {
        int64_t h = n / 2;
        h -= h % 8;
        return numpy_sum(x, h) + numpy_sum(x + h, n - h);
    }
    float r[8];
    int64_t i;
    for (int j = 0; j < 8; j++) r[j] = x[j];
    for (i = 8; i < n - n % 8; i += 8)
        for (int j = 0; j < 8; j++) r[j] += x[i + j];
    float s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) s += x[i];
    return s;
}

/* one row of rms_norm (see rms_norm_doc) */
static void rms_row(const float *x, const float *w, int64_t n, float eps, float *y) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / (double)n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

/* one vector of rope (see rope_doc): h pairs */
static void rope_row(const float *xr, const float *ct, const float *st, int64_t h, int interleave, float *yr) {
    for (int64_t i = 0; i < h; i++) {
        float x1 = interleave ? xr[2 * i] : xr[i], x2 = interleave ? xr[2 * i + 1] : xr[i + h];
        float a = x1 * ct[i], bb = x2 * st[i], e = x2 * ct[i], f = x1 * st[i];
        yr[i] = a - bb;
        yr[i + h] = e + f;
    }
}

PyDoc_STRVAR(rms_norm_doc,
"rms_norm(x, w, eps, out)\n\n"
"out[t] = (x[t] * s) * w with s = 1 / sqrt(mean(x[t]^2) + eps), for x, out float32 [T, n] and w float32\n"
"[n]: squares in float32 summed in order in double, the mean rounded to float32 (llama.cpp's rule, so a\n"
"GGUF file's norms carry its bits).");

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    PyObject *o[3];
    float eps;
    if (!PyArg_ParseTuple(args, "OOfO", &o[0], &o[1], &eps, &o[2])) return NULL;
    buf_t b[3];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 4, "x") || get_buf(o[1], &b[1], 0, 4, "w") || get_buf(o[2], &b[2], 1, 4, "out"))
        goto done;
    int64_t n = b[1].b.len / 4, T = n ? b[0].b.len / 4 / n : 0;
    if (n < 1 || b[0].b.len != 4 * T * n || b[2].b.len != b[0].b.len) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: x and out [T, n], w [n]");
        goto done;
    }
    for (int64_t t = 0; t < T; t++) rms_row((const float *)b[0].b.buf + t * n, b[1].b.buf, n, eps, (float *)b[2].b.buf + t * n);
    ret = Py_NewRef(Py_None);
done:
    release(b, 3);
    return ret;
}

PyDoc_STRVAR(rope_doc,
"rope(x, cos, sin, interleave, T, m, out): rotate the last axis of x (float32 [T, m, d]) by cos/sin\n"
"(float32 [T, d/2]): pairs (x[2i], x[2i+1]) when interleave, else (x[i], x[i+d/2]); out [T, m, d]\n"
"holds the first members' results, then the second members' (x1 c - x2 s, x2 c + x1 s): the numpy\n"
"form's bits (the same float32 operations).");

static PyObject *py_rope(PyObject *self, PyObject *args) {
    PyObject *o[4];
    int interleave;
    Py_ssize_t T, m;
    if (!PyArg_ParseTuple(args, "OOOpnnO", &o[0], &o[1], &o[2], &interleave, &T, &m, &o[3])) return NULL;
    buf_t b[4];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 4, "x") || get_buf(o[1], &b[1], 0, 4, "cos") || get_buf(o[2], &b[2], 0, 4, "sin") ||
        get_buf(o[3], &b[3], 1, 4, "out"))
        goto done;
    int64_t n = b[0].b.len / 4, d = T > 0 && m > 0 ? n / (T * m) : 0, h = d / 2;
    if (d < 2 || d % 2 || n != T * m * d || b[1].b.len != 4 * T * h || b[2].b.len != b[1].b.len ||
        b[3].b.len != b[0].b.len) {
        PyErr_SetString(PyExc_ValueError, "rope: x and out [T, m, d], cos and sin [T, d/2]");
        goto done;
    }
    const float *x = b[0].b.buf, *c = b[1].b.buf, *sn = b[2].b.buf;
    float *y = b[3].b.buf;
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < m; j++) rope_row(x + (t * m + j) * d, c + t * h, sn + t * h, h, interleave, y + (t * m + j) * d);
    ret = Py_NewRef(Py_None);
done:
    release(b, 4);
    return ret;
}

PyDoc_STRVAR(route_doc,
"route(scores, bias, n_group, topk_group, norm, scale, idx, weights, logits=False)\n\n"
"DeepSeek-V3 top-k routing of T tokens over E experts: scores (float32 [T, E], the router's sigmoids)\n"
"plus bias (float32 [E]) choose; with n_group > 1 only the topk_group groups whose two best choices\n"
"sum highest take part; the k best (k from idx, int64 [T, k]) are taken in descending order, ties to\n"
"the lower index. weights (float32 [T, k]) are their scores, divided by their sum if norm, times scale.\n"
"With logits, `scores` are the router's outputs z and the scores 1 / (1 + e^-z).");

/* route()'s work: T tokens' scores [T, E] (or the router's outputs, with logits) -> idx, w [T, k];
   -1 with MemoryError set */
static int route_rows(const float *scores, int64_t T, int64_t E, const float *bias_in, int64_t G, int64_t KG,
                      int norm, float scale, int logits, int64_t k, int64_t *idx_out, float *w_out) {
    int rc = -1;
    float *choice = NULL;
    unsigned char *taken = NULL;
    choice = malloc(sizeof(float) * (2 * E + G));
    taken = malloc(E + G);
    if (!choice || !taken) { PyErr_NoMemory(); goto done; }
    float *gsc = choice + E, *sig = gsc + G;
    int64_t per = E / G;
    for (int64_t t = 0; t < T; t++) {
        const float *sc = scores + t * E, *bias = bias_in;
        if (logits) {           /* the router's outputs: their sigmoids, in float32 as numpy's form */
            for (int64_t e = 0; e < E; e++) sig[e] = 1.0f / (1.0f + expf(-sc[e]));
            sc = sig;
        }
        int64_t *idx = idx_out + t * k;
        float *w = w_out + t * k;
        for (int64_t e = 0; e < E; e++) choice[e] = sc[e] + bias[e];
        if (G > 1) {
            for (int64_t g = 0; g < G; g++) {       /* the group's two best, summed as numpy's sort does */
                const float *c = choice + g * per;
                float hi = c[0], lo = -INFINITY;
                for (int64_t i = 1; i < per; i++) {
                    if (c[i] > hi) { lo = hi; hi = c[i]; } else if (c[i] > lo) lo = c[i];
                }
                gsc[g] = per > 1 ? lo + hi : hi;
            }
            memset(taken, 0, G);
            for (int64_t j = 0; j < KG; j++) taken[pick_largest(gsc, G, taken)] = 1;
            for (int64_t g = 0; g < G; g++)
                if (!taken[g]) for (int64_t i = 0; i < per; i++) choice[g * per + i] = -INFINITY;
        }
        memset(taken, 0, E);
        for (int64_t j = 0; j < k; j++) {
            int64_t e = pick_largest(choice, E, taken);
            taken[e] = 1;
            idx[j] = e;
            w[j] = sc[e];
        }
        if (norm) {
            float d = numpy_sum(w, k) + 1e-20f;
            for (int64_t j = 0; j < k; j++) w[j] = w[j] / d;
        }
        for (int64_t j = 0; j < k; j++) w[j] = w[j] * scale;
    }
    rc = 0;
done:
    free(choice); free(taken);
    return rc;
}

static PyObject *py_route(PyObject *self, PyObject *args) {
    PyObject *o[4];
    Py_ssize_t G, KG;
    int norm;
    float scale;
    int logits = 0;
    if (!PyArg_ParseTuple(args, "OOnnpfOO|p", &o[0], &o[1], &G, &KG, &norm, &scale, &o[2], &o[3], &logits)) return NULL;
    buf_t b[4];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 4, "scores") || get_buf(o[1], &b[1], 0, 4, "bias") ||
        get_buf(o[2], &b[2], 1, 8, "idx") || get_buf(o[3], &b[3], 1, 4, "weights"))
        goto done;
    int64_t E = b[1].b.len / 4, T = E ? b[0].b.len / 4 / E : 0, k = T ? b[2].b.len / 8 / T : 0;
    if (E < 1 || b[0].b.len != 4 * T * E || b[2].b.len != 8 * T * k || b[3].b.len != 4 * T * k || k < 1 || k > E ||
        G < 1 || E % G || KG < 1 || KG > G) {
        PyErr_SetString(PyExc_ValueError, "route: scores [T, E], bias [E], idx and weights [T, k], k <= E, groups dividing E");
        goto done;
    }
    if (route_rows(b[0].b.buf, T, E, b[1].b.buf, G, KG, norm, scale, logits, k, b[2].b.buf, b[3].b.buf) == 0)
        ret = Py_NewRef(Py_None);
done:
    release(b, 4);
    return ret;
}

/* x rounded to the nearest binary16 (ties to even; overflow to infinity), as numpy converts */
static uint16_t half_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {                                            /* NaN: its payload's top bits, kept a NaN */
        uint16_t m = (uint16_t)((a >> 13) & 0x3ff);
        return sign | 0x7c00 | (m ? m : 1);
    }
    if (a == 0x7f800000u) return sign | 0x7c00;
    if (a >= 0x477ff000u) return sign | 0x7c00;                       /* 65520 and up round to infinity */
    if (a < 0x38800000u) {                                            /* below 2^-14: a subnormal or zero */
        float m;
        memcpy(&m, &a, 4);
        return sign | (uint16_t)nearbyintf(m * 16777216.0f);          /* exact scaling, then ties to even */
    }
    return sign | (uint16_t)((a - 0x38000000u + 0xfffu + ((a >> 13) & 1)) >> 13);
}

PyDoc_STRVAR(mla_decode_doc,
"mla_decode(q, ckv, kv_ln, eps, cos, sin, interleave, C, K, pos, half, raw, geom, nope, v, scale, out,\n"
"           threads, min_weights) -> int\n\n"
"One token's absorbed multi-head latent attention in one call, from the projections to the heads'\n"
"values: ckv (float32 [r + dr], kv_a's output) gives the latent (rms_norm by kv_ln) and the rotated key\n"
"(rope by cos, sin [dr/2]), written to row pos of the caches C [context, r] and K [context, dr]\n"
"(float32, or binary16 if half); q (float32 [nh, nope + dr]) gives q_nope, folded into the latent by\n"
"kv_b's key rows (heads_t), and q_rot (rope); attention over positions 0 .. pos (attend); the latent\n"
"output through kv_b's value rows (float32 out [nh, v]). kv_b [nh * (nope + v), r] is the tensor at\n"
"the start of raw with geometry geom. Each part runs on `threads` threads from min_weights\n"
"multiply-adds on, else on the caller's alone. The same bits as the separate calls. Returns 1 if kv_b's\n"
"outlier columns are corrupt.");

/* one token's absorbed attention (mla_decode's work once its buffers are checked) */
typedef struct {
    const float *q, *ckv, *kv_ln, *cos, *sin;          /* [nh, nope + dr], [r + dr], [r], [dr/2], [dr/2] */
    void *C, *K;                                       /* the caches, float32 or binary16 (half) */
    const uint8_t *raw;                                /* kv_b */
    const int64_t *g;
    float eps, scale;
    int interleave, half, threads;
    int64_t pos, nope, v, nh, hd, min_weights;
    float *out;                                        /* [nh, v] */
} mla_t;

/* the bad flag (kv_b's outliers corrupt), or -1 with an exception set */
static int mla_core(const mla_t *m) {
    const int64_t *g = m->g;
    int64_t r = g[G_COLS], hd = m->hd, nh = m->nh, nope = m->nope, v = m->v, stride = nope + v, pos = m->pos;
    int rc = -1;
    float *work = NULL, *xsc = NULL, *xs = NULL, *x8d = NULL, *xtd = NULL;
    int16_t *xq = NULL;
    int8_t *x8 = NULL, *xt = NULL;
    int64_t *jobs = NULL;
    int64_t dr = 2 * hd, S = pos + 1, nspan = r / 32;
    work = malloc(sizeof(float) * (r + dr + nh * (nope + dr + 2 * r)));
    int64_t per = (1 << 15) / r > 8 ? (1 << 15) / r : 8, nb = (v + per - 1) / per;
    jobs = malloc(sizeof(int64_t) * JOB_LEN * nh * nb);
    if (!work || !jobs) { PyErr_NoMemory(); goto done; }
    float *lat = work, *krot = lat + r, *qn = krot + dr, *qr = qn + nh * nope, *qlat = qr + nh * dr, *olat = qlat + nh * r;
    /* the new position's latent and rotated key, into the caches */
    rms_row(m->ckv, m->kv_ln, r, m->eps, lat);
    rope_row(m->ckv + r, m->cos, m->sin, hd, m->interleave, krot);
    if (m->half) {
        uint16_t *cr = (uint16_t *)m->C + pos * r, *kr = (uint16_t *)m->K + pos * dr;
        for (int64_t i = 0; i < r; i++) cr[i] = half_bits(lat[i]);
        for (int64_t i = 0; i < dr; i++) kr[i] = half_bits(krot[i]);
    } else {
        memcpy((float *)m->C + pos * r, lat, sizeof(float) * r);
        memcpy((float *)m->K + pos * dr, krot, sizeof(float) * dr);
    }
    for (int64_t h = 0; h < nh; h++) {
        memcpy(qn + h * nope, m->q + h * (nope + dr), sizeof(float) * nope);
        rope_row(m->q + h * (nope + dr) + nope, m->cos, m->sin, hd, m->interleave, qr + h * dr);
    }
    /* q_nope folded into the latent: kv_b's key rows, transposed */
    task_t t1 = {.job = heads_t_job, .raw = m->raw, .geoms = g, .xf = qn, .cols = r, .nspan = nspan, .n = nope,
                 .stride = stride, .njobs = nh, .out = qlat, .scratch_floats = HEADS_T_SCRATCH(nope, nspan)};
    int bad = run_unlocked(&t1, nh * nope * r >= m->min_weights ? m->threads : 1);
    if (bad < 0) goto done;
    att_t a = {.q = qlat, .qr = qr, .C = m->C, .K = m->K, .half = m->half, .S = S, .r = r, .dr = dr,
               .nh = nh, .scale = m->scale, .o = olat};
    if (attend_all(&a, nh * S * (r + dr) >= m->min_weights ? m->threads : 1)) goto done;
    /* the latent output through kv_b's value rows, head by head */
    int64_t nj = 0;
    for (int64_t h = 0; h < nh; h++)
        for (int64_t lo = 0; lo < v; lo += per, nj++) {
            int64_t *jb = jobs + JOB_LEN * nj, first = h * stride + nope;
            jb[0] = 0; jb[1] = 0; jb[2] = first + lo; jb[3] = first + (lo + per < v ? lo + per : v);
            jb[4] = h; jb[5] = h * v + lo;
        }
    if (quantize_rows(olat, nh, r, &xq, &xsc, &xs, x8_kind((int)g[G_KIND]) ? &x8 : NULL, &x8d) ||
        quantize_rows_t1(g, 1, olat, nh, r, 1, &xt, &xtd))
        goto done;
    task_t t2 = {.job = rows_job, .raw = m->raw, .geoms = g, .xf = olat, .xsc = xsc, .xs = xs, .xq = xq,
                 .xp = xq + nh * r, .x8 = x8, .x8d = x8d, .x8s = x8d ? x8d + nh * ((r + 127) / 128) : NULL,
                 .xt = xt, .xtd = xtd, .xts = xtd ? xtd + nh * (r / 128) : NULL,
                 .cols = r, .nspan = nspan, .jobs = jobs, .njobs = nj, .out = m->out, .ntok = 1,
                 .scratch_floats = rows_scratch(per, 1, nspan)};
    int bad2 = run_unlocked(&t2, nh * v * r >= m->min_weights ? m->threads : 1);
    if (bad2 < 0) goto done;
    rc = bad || bad2;
done:
    free(work); free(jobs); free(xq); free(xsc); free(xs); free(x8); free(x8d); free(xt); free(xtd);
    return rc;
}

#define MLA_SHAPES "q [nh, nope + dr], ckv [r + dr], kv_ln [r], cos and sin [dr/2], pos + 1 rows of both caches, " \
                   "kv_b [nh * (nope + v), r], out [nh, v]"
/* whether kv_b (geometry g over nraw bytes), caches of nC and nK bytes (es per value) and the heads fit
   an mla_t call at position pos; ValueError set if not */
static int mla_fits(const int64_t *g, int64_t ng_bytes, int64_t nraw, int64_t nope, int64_t v, int64_t nh, int64_t hd,
                    int64_t pos, int64_t nC, int64_t nK, int64_t es, const char *what) {
    int64_t r = ng_bytes == 8 * G_LEN ? g[G_COLS] : 0, dr = 2 * hd;
    if (r <= 0 || r % 32 || !known_layout(g) || nraw < g[G_NBYTES] || nope < 1 || v < 1 || nh < 1 || hd < 1 ||
        nh * (nope + v) > g[G_ROWS] || pos < 0 || nC < (pos + 1) * r * es || nK < (pos + 1) * dr * es) {
        PyErr_Format(PyExc_ValueError, "%s: " MLA_SHAPES, what);
        return 0;
    }
    return 1;
}

static PyObject *py_mla_decode(PyObject *self, PyObject *args) {
    PyObject *o[10];
    float eps, scale;
    int interleave, half, threads;
    Py_ssize_t pos, nope, v, min_weights;
    if (!PyArg_ParseTuple(args, "OOOfOOpOOnpOOnnfOin", &o[0], &o[1], &o[2], &eps, &o[3], &o[4], &interleave,
                          &o[5], &o[6], &pos, &half, &o[7], &o[8], &nope, &v, &scale, &o[9], &threads, &min_weights))
        return NULL;
    buf_t b[10];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    int64_t es = half ? 2 : 4;
    if (get_buf(o[0], &b[0], 0, 4, "q") || get_buf(o[1], &b[1], 0, 4, "ckv") || get_buf(o[2], &b[2], 0, 4, "kv_ln") ||
        get_buf(o[3], &b[3], 0, 4, "cos") || get_buf(o[4], &b[4], 0, 4, "sin") || get_buf(o[5], &b[5], 1, es, "C") ||
        get_buf(o[6], &b[6], 1, es, "K") || get_buf(o[7], &b[7], 0, 1, "raw") ||
        get_buf(o[8], &b[8], 0, 8 * G_LEN, "geom") || get_buf(o[9], &b[9], 1, 4, "out"))
        goto done;
    const int64_t *g = b[8].b.buf;
    int64_t hd = b[3].b.len / 4, nh = v > 0 ? b[9].b.len / (4 * v) : 0;
    if (!mla_fits(g, b[8].b.len, b[7].b.len, nope, v, nh, hd, pos, b[5].b.len, b[6].b.len, es, "mla_decode"))
        goto done;
    int64_t r = g[G_COLS];
    if (b[9].b.len != 4 * nh * v || b[4].b.len != b[3].b.len || b[0].b.len != 4 * nh * (nope + 2 * hd) ||
        b[1].b.len != 4 * (r + 2 * hd) || b[2].b.len != 4 * r) {
        PyErr_SetString(PyExc_ValueError, "mla_decode: " MLA_SHAPES);
        goto done;
    }
    mla_t m = {.q = b[0].b.buf, .ckv = b[1].b.buf, .kv_ln = b[2].b.buf, .cos = b[3].b.buf, .sin = b[4].b.buf,
               .C = b[5].b.buf, .K = b[6].b.buf, .raw = b[7].b.buf, .g = g, .eps = eps, .scale = scale,
               .interleave = interleave, .half = half, .threads = threads, .pos = pos, .nope = nope, .v = v,
               .nh = nh, .hd = hd, .min_weights = min_weights, .out = b[9].b.buf};
    int bad = mla_core(&m);
    if (bad >= 0) ret = PyLong_FromLong(bad);
done:
    release(b, 10);
    return ret;
}

PyDoc_STRVAR(matvec_doc,
"matvec(W, x, out, cols, threads=1): out [T, E] = x [T, cols] @ W.T for a float32 W [E, cols], row by row in\n"
"a fixed order (a decode step's router product; the same bits inside attn_step, on any number of threads).");

static PyObject *py_matvec(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Py_ssize_t cols;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOn|i", &o[0], &o[1], &o[2], &cols, &threads)) return NULL;
    buf_t b[3];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 4, "W") || get_buf(o[1], &b[1], 0, 4, "x") || get_buf(o[2], &b[2], 1, 4, "out"))
        goto done;
    int64_t E = cols > 0 ? b[0].b.len / 4 / cols : 0, T = cols > 0 ? b[1].b.len / 4 / cols : 0;
    if (E < 1 || b[0].b.len != 4 * E * cols || b[1].b.len != 4 * T * cols || b[2].b.len != 4 * T * E) {
        PyErr_SetString(PyExc_ValueError, "matvec: W [E, cols], x [T, cols], out [T, E]");
        goto done;
    }
    for (int64_t t = 0; t < T; t++)
        if (matvec_on(b[0].b.buf, E, cols, (const float *)b[1].b.buf + t * cols, (float *)b[2].b.buf + t * E, threads) < 0)
            goto done;
    ret = Py_NewRef(Py_None);
done:
    release(b, 3);
    return ret;
}

/* attn_step's launch: when every routed expert's offsets are known (table rows >= 0), the MoE call
   of h (one token) through them, and the shared expert after them when given, handed to the pool
   (moe_start). b[at ..] holds base, geoms, the table [E, 3], the shared expert's offsets [3] (or not
   held), pick and tok as MoEStep keeps them. 1 launched, 0 not, -1 with an exception set. */
static int launch_routed(buf_t *b, int at, const int64_t *idx, const float *wts, int64_t k, int64_t E,
                         const float *h, int64_t hidden, int threads) {
    const int64_t *table = b[at + 2].b.buf;
    int64_t n = b[at + 4].b.len / 8, shared = b[at + 3].held;
    if (b[at + 2].b.len != 24 * E || n != k + shared || b[at + 5].b.len != 8 * n || (shared && b[at + 3].b.len != 24)) {
        PyErr_SetString(PyExc_ValueError, "attn_step: launch's offsets [E, 3], pick and tok [k (+ 1)], shared [3]");
        return -1;
    }
    if (threads < 2) return 0;                 /* nothing to overlap (the thread count may change in a run) */
    for (int64_t j = 0; j < k; j++)
        if (table[3 * idx[j]] < 0) return 0;
    int64_t offs[3 * (k + 1)];
    float w[k + 1];
    for (int64_t j = 0; j < k; j++) {
        memcpy(offs + 3 * j, table + 3 * idx[j], 24);
        w[j] = wts[j];
    }
    if (shared) {
        memcpy(offs + 3 * k, b[at + 3].b.buf, 24);
        w[k] = 1.0f;
    }
    moe_run_t m = {.base = b[at].b.buf, .geoms = b[at + 1].b.buf, .offs = offs, .pick = b[at + 4].b.buf,
                   .tok = b[at + 5].b.buf, .wts = w, .x = h, .ng = b[at + 1].b.len / (8 * G_LEN), .n = n};
    if (!moe_fits(&m, b[at].b.len, n, n, n, hidden, hidden) || moe_start(m, &b[at], threads)) return -1;
    return 1;
}

PyDoc_STRVAR(attn_step_doc,
"attn_step(x, consts, cos, sin, C, K, pos, half, x_out, h_out, threads, min_weights, router=None, idx=None,\n"
"          weights=None, launch=None, join=False) -> int\n\n"
"One decode token through a layer's attention half in one call: h1 = rms_norm(x, ln1); q_a and kv_a\n"
"(one stacked product); q = q_b(rms_norm(q_a h1, q_ln)); mla_decode's attention from q and kv_a's output;\n"
"x_out = x + o(attention), h_out = rms_norm(x_out, ln2). consts, worked out once per layer: (ln1, ln2,\n"
"q_ln, kv_ln, eps, stack_base, stack_geoms, stack_jobs, q_b_raw, q_b_geoms, q_b_jobs, kv_b_raw, kv_b_geom,\n"
"nope, v, o_raw, o_geoms, o_jobs, interleave, scale). With router = (W [E, hidden] float32, bias [E],\n"
"n_group, topk_group, norm, scale), h_out is routed too (matvec, then route's logits form) into idx\n"
"(int64 [k]) and weights (float32 [k]). Each product runs on `threads` threads from\n"
"min_weights multiply-adds on. The same bits as those calls one by one. With join, the MoE call launched\n"
"before (moe_launch, or a launch here) is collected first, its output added into x. With launch = (base,\n"
"geoms, offsets [E, 3], shared [3] or None, pick, tok) and a router, the routed experts' MoE call (as\n"
"moe_launch makes it: offsets[idx] then the shared expert's, weights then 1) is launched on h_out when\n"
"every one of their offsets is known (>= 0). Returns bits: 1 a tensor's outlier columns are corrupt, 2 the\n"
"joined call's are, 4 the call was launched.");

static PyObject *py_attn_step(PyObject *self, PyObject *args) {
    PyObject *ox, *consts, *ocos, *osin, *oC, *oK, *oxo, *oho, *orouter = Py_None, *oidx = Py_None, *ow = Py_None;
    PyObject *olaunch = Py_None;
    Py_ssize_t pos, min_weights;
    int half, threads, join = 0;
    if (!PyArg_ParseTuple(args, "OO!OOOOnpOOin|OOOOp", &ox, &PyTuple_Type, &consts, &ocos, &osin, &oC, &oK, &pos, &half,
                          &oxo, &oho, &threads, &min_weights, &orouter, &oidx, &ow, &olaunch, &join))
        return NULL;
    PyObject *lo[6] = {NULL};
    if (olaunch != Py_None && (!PyTuple_Check(olaunch) || orouter == Py_None ||
                               !PyArg_ParseTuple(olaunch, "OOOOOO", &lo[0], &lo[1], &lo[2], &lo[3], &lo[4], &lo[5]))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "attn_step: launch must be a tuple, with a router");
        return NULL;
    }
    PyObject *rW = NULL, *rbias = NULL;
    Py_ssize_t rG = 1, rKG = 1;
    int rnorm = 0;
    float rscale = 1.0f;
    if (orouter != Py_None && (!PyTuple_Check(orouter) ||
                               !PyArg_ParseTuple(orouter, "OOnnpf", &rW, &rbias, &rG, &rKG, &rnorm, &rscale))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "attn_step: router must be a tuple");
        return NULL;
    }
    PyObject *c[18];
    float eps, scale;
    Py_ssize_t nope, v;
    int interleave;
    if (!PyArg_ParseTuple(consts, "OOOOfOOOOOOOOnnOOOpf", &c[0], &c[1], &c[2], &c[3], &eps, &c[4], &c[5], &c[6],
                          &c[7], &c[8], &c[9], &c[10], &c[11], &nope, &v, &c[12], &c[13], &c[14], &interleave, &scale))
        return NULL;
    enum { X, LN1, LN2, QLN, KVLN, SB, SG, SJ, QBR, QBG, QBJ, KVR, KVG, OR, OG, OJ, COS, SIN, CC, KK, XO, HO,
           RW, RB, RI, RWT, LBASE, LGEOM, LTAB, LSH, LPICK, LTOK, NB };
    buf_t b[NB];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    float *work = NULL;
    int64_t es = half ? 2 : 4;
    if (get_buf(ox, &b[X], join, 4, "x") || get_buf(c[0], &b[LN1], 0, 4, "ln1") || get_buf(c[1], &b[LN2], 0, 4, "ln2") ||
        get_buf(c[2], &b[QLN], 0, 4, "q_ln") || get_buf(c[3], &b[KVLN], 0, 4, "kv_ln") ||
        get_buf(c[4], &b[SB], 0, 1, "stack_base") || get_buf(c[5], &b[SG], 0, 8 * G_LEN, "stack_geoms") ||
        get_buf(c[6], &b[SJ], 0, 8 * JOB_LEN, "stack_jobs") || get_buf(c[7], &b[QBR], 0, 1, "q_b") ||
        get_buf(c[8], &b[QBG], 0, 8 * G_LEN, "q_b_geoms") || get_buf(c[9], &b[QBJ], 0, 8 * JOB_LEN, "q_b_jobs") ||
        get_buf(c[10], &b[KVR], 0, 1, "kv_b") || get_buf(c[11], &b[KVG], 0, 8 * G_LEN, "kv_b_geom") ||
        get_buf(c[12], &b[OR], 0, 1, "o") || get_buf(c[13], &b[OG], 0, 8 * G_LEN, "o_geoms") ||
        get_buf(c[14], &b[OJ], 0, 8 * JOB_LEN, "o_jobs") || get_buf(ocos, &b[COS], 0, 4, "cos") ||
        get_buf(osin, &b[SIN], 0, 4, "sin") || get_buf(oC, &b[CC], 1, es, "C") || get_buf(oK, &b[KK], 1, es, "K") ||
        get_buf(oxo, &b[XO], 1, 4, "x_out") || get_buf(oho, &b[HO], 1, 4, "h_out"))
        goto done;
    if (rW && (get_buf(rW, &b[RW], 0, 4, "router") || get_buf(rbias, &b[RB], 0, 4, "bias") ||
               get_buf(oidx, &b[RI], 1, 8, "idx") || get_buf(ow, &b[RWT], 1, 4, "weights")))
        goto done;
    if (lo[0] && (get_buf(lo[0], &b[LBASE], 0, 1, "base") || get_buf(lo[1], &b[LGEOM], 0, 8 * G_LEN, "geoms") ||
                  get_buf(lo[2], &b[LTAB], 0, 24, "offsets") || (lo[3] != Py_None && get_buf(lo[3], &b[LSH], 0, 24, "shared")) ||
                  get_buf(lo[4], &b[LPICK], 0, 8, "pick") || get_buf(lo[5], &b[LTOK], 0, 8, "tok")))
        goto done;
    const int64_t *sg = b[SG].b.buf, *qg = b[QBG].b.buf, *kg = b[KVG].b.buf, *og = b[OG].b.buf;
    int64_t hidden = b[X].b.len / 4, ns = b[SG].b.len / (8 * G_LEN), hd = b[COS].b.len / 4, dr = 2 * hd;
    int64_t qa = b[QLN].b.len / 4, r = b[KVLN].b.len / 4, nh = v > 0 && b[OG].b.len == 8 * G_LEN ? og[G_COLS] / v : 0;
    if (!mla_fits(kg, b[KVG].b.len, b[KVR].b.len, nope, v, nh, hd, pos, b[CC].b.len, b[KK].b.len, es, "attn_step"))
        goto done;
    if (hidden < 1 || ns != 2 || b[QBG].b.len != 8 * G_LEN || b[LN1].b.len != 4 * hidden ||
        b[LN2].b.len != 4 * hidden || b[XO].b.len != 4 * hidden || b[HO].b.len != 4 * hidden ||
        b[SIN].b.len != b[COS].b.len || sg[G_ROWS] != qa || sg[G_LEN + G_ROWS] != r + dr || sg[G_COLS] != hidden ||
        qg[G_COLS] != qa || qg[G_ROWS] != nh * (nope + dr) || kg[G_COLS] != r || og[G_COLS] != nh * v ||
        og[G_ROWS] != hidden) {
        PyErr_SetString(PyExc_ValueError, "attn_step: x [hidden], q_a [q_rank, hidden] stacked with kv_a [r + dr, hidden], "
                        "q_b [nh (nope + dr), q_rank], o [hidden, nh v], ln1, ln2, x_out, h_out [hidden]");
        goto done;
    }
    int64_t E = rW ? b[RB].b.len / 4 : 0, rk = rW ? b[RI].b.len / 8 : 0;
    if (rW && (E < 1 || b[RW].b.len != 4 * E * hidden || rk < 1 || rk > E || b[RWT].b.len != 4 * rk || rG < 1 ||
               E % rG || rKG < 1 || rKG > rG)) {
        PyErr_SetString(PyExc_ValueError, "attn_step: router [E, hidden], bias [E], idx and weights [k], k <= E, "
                        "groups dividing E");
        goto done;
    }
    int64_t nq = nh * (nope + dr);
    work = malloc(sizeof(float) * (hidden + qa + r + dr + qa + nq + nh * v + hidden));
    if (!work) { PyErr_NoMemory(); goto done; }
    float *h1 = work, *qkv = h1 + hidden, *qan = qkv + qa + r + dr, *q = qan + qa, *att = q + nq, *y = att + nh * v;
    const float *x = b[X].b.buf;
    float *xo = b[XO].b.buf;
    int bad = 0, rc;
    if (join) {                    /* the last layer's MoE call, launched before: its output into x first */
        if ((rc = moe_collect(b[X].b.buf, hidden)) < 0) goto done;
        bad |= rc ? 2 : 0;
    }
#define THREADS(rows, cols) ((rows) * (cols) >= min_weights ? threads : 1)
    rms_row(x, b[LN1].b.buf, hidden, eps, h1);
    rc = run_rows(b[SB].b.buf, b[SB].b.len, sg, 2, h1, hidden, b[SJ].b.buf, b[SJ].b.len / (8 * JOB_LEN), qkv,
                  qa + r + dr, THREADS(qa + r + dr, hidden), 1, qa + r + dr);
    if (rc < 0) goto done;
    bad |= rc;
    rms_row(qkv, b[QLN].b.buf, qa, eps, qan);
    rc = run_rows(b[QBR].b.buf, b[QBR].b.len, qg, 1, qan, qa, b[QBJ].b.buf, b[QBJ].b.len / (8 * JOB_LEN), q, nq,
                  THREADS(nq, qa), 1, nq);
    if (rc < 0) goto done;
    bad |= rc;
    mla_t m = {.q = q, .ckv = qkv + qa, .kv_ln = b[KVLN].b.buf, .cos = b[COS].b.buf, .sin = b[SIN].b.buf,
               .C = b[CC].b.buf, .K = b[KK].b.buf, .raw = b[KVR].b.buf, .g = kg, .eps = eps, .scale = scale,
               .interleave = interleave, .half = half, .threads = threads, .pos = pos, .nope = nope, .v = v,
               .nh = nh, .hd = hd, .min_weights = min_weights, .out = att};
    if ((rc = mla_core(&m)) < 0) goto done;
    bad |= rc;
    rc = run_rows(b[OR].b.buf, b[OR].b.len, og, 1, att, nh * v, b[OJ].b.buf, b[OJ].b.len / (8 * JOB_LEN), y, hidden,
                  THREADS(hidden, nh * v), 1, hidden);
    if (rc < 0) goto done;
    bad |= rc;
#undef THREADS
    for (int64_t i = 0; i < hidden; i++) xo[i] = x[i] + y[i];
    rms_row(xo, b[LN2].b.buf, hidden, eps, b[HO].b.buf);
    if (rW) {                      /* the next half's routing: the router's outputs, then top-k */
        float *z = malloc(sizeof(float) * E);
        if (!z) { PyErr_NoMemory(); goto done; }
        if (matvec_on(b[RW].b.buf, E, hidden, b[HO].b.buf, z, E * hidden >= min_weights ? threads : 1) < 0) {
            free(z);
            goto done;
        }
        rc = route_rows(z, 1, E, b[RB].b.buf, rG, rKG, rnorm, rscale, 1, rk, b[RI].b.buf, b[RWT].b.buf);
        free(z);
        if (rc < 0) goto done;
        if (lo[0]) {
            if ((rc = launch_routed(b, LBASE, b[RI].b.buf, b[RWT].b.buf, rk, E, b[HO].b.buf, hidden, threads)) < 0)
                goto done;
            bad |= rc ? 4 : 0;
        }
    }
    ret = PyLong_FromLong(bad);
done:
    free(work);
    release(b, NB);
    return ret;
}

PyDoc_STRVAR(swiglu_doc,
"swiglu(g, u, out)\n\n"
"out = silu(g) * u = g / (1 + e^-g) * u elementwise (float32, one size; e^x to about 2e-7 relative on AVX2).");

static PyObject *py_swiglu(PyObject *self, PyObject *args) {
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return NULL;
    buf_t b[3];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o[0], &b[0], 0, 4, "g") || get_buf(o[1], &b[1], 0, 4, "u") || get_buf(o[2], &b[2], 1, 4, "out"))
        goto done;
    if (b[1].b.len != b[0].b.len || b[2].b.len != b[0].b.len) {
        PyErr_SetString(PyExc_ValueError, "swiglu: g, u and out of one size");
        goto done;
    }
    const float *g = b[0].b.buf, *u = b[1].b.buf;
    float *y = b[2].b.buf;
    int64_t n = b[0].b.len / 4, i = 0;
#if HAVE_X86
    if (use_avx2) i = swiglu_avx2(g, u, y, n);
#endif
    for (; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    ret = Py_NewRef(Py_None);
done:
    release(b, 3);
    return ret;
}

PyDoc_STRVAR(causal_softmax_doc,
"causal_softmax(scores, T, start, scale, threads)\n\n"
"A prompt's attention scores (float32 [n, T, S], in place) through a causal softmax: in each block of T\n"
"rows, row t's first start + t + 1 scores are multiplied by scale and replaced by their softmax, the\n"
"others by 0.");

static PyObject *py_causal_softmax(PyObject *self, PyObject *args) {
    PyObject *o;
    Py_ssize_t T, start;
    float scale;
    int threads;
    if (!PyArg_ParseTuple(args, "Onnfi", &o, &T, &start, &scale, &threads)) return NULL;
    buf_t b;
    memset(&b, 0, sizeof b);
    PyObject *ret = NULL;
    if (get_buf(o, &b, 1, 4, "scores")) goto done;
    int64_t rows = 0, S = 0;
    if (b.b.ndim >= 2) { S = b.b.shape[b.b.ndim - 1]; rows = S ? b.b.len / 4 / S : 0; }
    if (T < 1 || start < 0 || S < 1 || rows % T) {
        PyErr_SetString(PyExc_ValueError, "causal_softmax: scores float32 [n, T, S], T >= 1, start >= 0");
        goto done;
    }
    att_t a = {.S = S, .r = T, .dr = start, .nh = rows, .scale = scale};
    task_t t = {.job = causal_softmax_job, .att = &a, .out = b.b.buf, .njobs = (rows + CAUSAL_ROWS - 1) / CAUSAL_ROWS,
                .scratch_floats = 16};
    if (run_unlocked(&t, threads) >= 0) ret = Py_NewRef(Py_None);
done:
    release(&b, 1);
    return ret;
}

PyDoc_STRVAR(keep_heap_doc,
"keep_heap(nbytes) -> int\n\n"
"Let glibc serve blocks up to nbytes from its heap and keep up to nbytes of freed heap mapped (nbytes\n"
"clamped to 32 MiB, glibc's ceiling); below 128 KiB, or without glibc, nothing changes. Returns the\n"
"bytes applied (0: nothing changed).");

static PyObject *py_keep_heap(PyObject *self, PyObject *args) {
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n)) return NULL;
    long applied = 0;
#ifdef __GLIBC__
    /* By default glibc maps blocks above a threshold it raises only to the largest block freed so far,
       and returns the freed top of its heap past twice that: a prefill's temporaries (MiBs each, every
       layer) came from fresh pages each time (a 256-token prefill of a 2.4 B model: 57 000 page
       faults, 0.3 s of kernel time). */
    if (n >= (128 << 10)) {
        applied = n < (32 << 20) ? (long)n : (32 << 20);
        if (!mallopt(M_MMAP_THRESHOLD, (int)applied) || !mallopt(M_TRIM_THRESHOLD, (int)applied)) applied = 0;
    }
#endif
    return PyLong_FromLong(applied);
}

static PyMethodDef methods[] = {
    {"rows", py_rows, METH_VARARGS, rows_doc},
    {"ggml_rows", py_ggml_rows, METH_VARARGS, ggml_rows_doc},
    {"ggml_dequantize", py_ggml_dequantize, METH_VARARGS, ggml_dequantize_doc},
    {"ggml_round", py_ggml_round, METH_VARARGS, ggml_round_doc},
    {"ggml_moe", py_ggml_moe, METH_VARARGS, ggml_moe_doc},
    {"ggml_grid", py_ggml_grid, METH_VARARGS, "ggml_grid(type, grid): an IQ type's codebook (float32), from the gguf package"},
    {"ggml_info", py_ggml_info, METH_VARARGS, "ggml_info(type) -> (ready, weights per block, bytes per block, needs a codebook)"},
    {"heads_t", py_heads_t, METH_VARARGS, heads_t_doc},
    {"moe", py_moe, METH_VARARGS, moe_doc},
    {"attend", py_attend, METH_VARARGS, attend_doc},
    {"mla_decode", py_mla_decode, METH_VARARGS, mla_decode_doc},
    {"attn_step", py_attn_step, METH_VARARGS, attn_step_doc},
    {"matvec", py_matvec, METH_VARARGS, matvec_doc},
    {"keep_heap", py_keep_heap, METH_VARARGS, keep_heap_doc},
    {"causal_softmax", py_causal_softmax, METH_VARARGS, causal_softmax_doc},
    {"swiglu", py_swiglu, METH_VARARGS, swiglu_doc},
    {"route", py_route, METH_VARARGS, route_doc},
    {"rope", py_rope, METH_VARARGS, rope_doc},
    {"rms_norm", py_rms_norm, METH_VARARGS, rms_norm_doc},
    {"dequantize", py_dequantize, METH_VARARGS, dequantize_doc},
    {"read_sum", py_read_sum, METH_VARARGS, "read_sum(buffer, threads): the buffer's uint64 words summed (reads it all)"},
    {"quantize", py_quantize, METH_VARARGS, "quantize(x, xq, xsc, xs): x float32 [cols] -> int16 per 32 values"},
    {"set_x8_levels", py_set_x8_levels, METH_VARARGS, "set_x8_levels(n): int8 activations round to -n .. n per 128 values (1 <= n <= 127, default 127); returns the old n"},
    {"set_x8", py_set_x8, METH_VARARGS, "set_x8(kinds): the codec kinds (a bit mask of 1 << kind) whose products take int8 activations (per 128 values); returns the old mask"},
    {"set_isa", py_set_isa, METH_VARARGS, "set_isa('avx2' | 'generic'): the kernels' instruction set"},
    {"moe_launch", py_moe_launch, METH_VARARGS, moe_launch_doc},
    {"moe_join", py_moe_join, METH_VARARGS, moe_join_doc},
    {"isa", py_isa, METH_NOARGS, "the instruction set in use"},
    {"pool_wait", py_pool_wait, METH_NOARGS, "seconds callers have waited, their own jobs done, for the pool's workers to finish theirs (all calls so far)"},
    {"vnni", py_vnni, METH_NOARGS, "the VNNI form the int8 kernels use (0 none, 1 AVX-VNNI, 2 AVX512-VNNI, 3 and 512-bit registers)"},
    {"set_vnni", py_set_vnni, METH_VARARGS, "set_vnni(level) -> the previous level (ValueError where the CPU lacks it)"},
    {"amx_matmul", py_amx_matmul, METH_VARARGS, amx_matmul_doc},
    {"amx", py_amx, METH_NOARGS, "whether AMX tiles serve the float products (amx_matmul) and several tokens' int8 rows (with VNNI level 3)"},
    {"set_amx", py_set_amx, METH_VARARGS, "set_amx(on) -> the previous setting (ValueError where the CPU or OS lacks AMX)"},
    {"set_spin_us", py_set_spin, METH_VARARGS, "how long idle workers spin before they sleep"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_qdot", .m_doc = "Integer-dot mat-vec kernels (C).", .m_size = -1,
    .m_methods = methods};

PyMODINIT_FUNC PyInit__qdot(void) {
    init_tables();
    q1t_init();
#if HAVE_X86
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    use_vnni = vnni_available();
    use_amx = use_avx2 && amx_available();
#endif
    ggml_avx2 = use_avx2;
    ggml_init();
    pthread_atfork(NULL, NULL, pool_after_fork);
    return PyModule_Create(&module);
}
