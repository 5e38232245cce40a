/* llama.cpp's block types, decoded and multiplied in C: a GGUF tensor kept bit for bit
   (formats/ggufcodecs.py) runs without being decoded to float32 as a whole. Each decoder below follows
   the block layout of llama.cpp's ggml-common.h and computes every weight with the same float32
   operations, in the same order, as the `gguf` package's numpy dequantizer (tests/test_ggml_kernels.py
   holds them to it bit for bit). The IQ types' codebooks are not typed in here: the runtime hands in
   the `gguf` package's own grids (ggml_set_grid). For one input, a product runs the same decoder
   bodies with each group of eight weights multiplied straight into two accumulators (nothing is
   stored); for several, it decodes one block (32 or 256 weights) into a small buffer in L1 and
   multiplies it by every input. No row is ever materialised. */
#include "_ggml.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GGML_X86 1
/* one AVX2 clone and one portable clone of each decoder: the compiler vectorises the simple loops */
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GGML_X86 0
#define CLONES
#endif

int ggml_avx2 = 0;     /* set by _qdot.c (the kernels' instruction set) */

static inline float f16(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 31) bits = sign | 0x7f800000u | (m << 13);                 /* inf, NaN */
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else {                                                              /* subnormal: normalise */
        e = 113;
        while (!(m & 1024)) { m <<= 1; e--; }
        bits = sign | (e << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t u32(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24); }

/* ksigns: 7 sign bits and their parity as the eighth */
static inline uint8_t ksign(uint32_t k) { return (uint8_t)(k | ((__builtin_popcount(k) & 1) << 7)); }
static inline float sgn(uint8_t signs, int j) { return (signs >> j) & 1 ? -1.0f : 1.0f; }

/* eight bytes of +1 / -1 for each 7 sign bits (the eighth sign is their parity), for vpsignb */
static uint64_t SIGNS_I8[128];

static void init_signs_i8(void) {
    for (uint32_t k = 0; k < 128; k++) {
        uint8_t s = ksign(k), v[8];
        for (int j = 0; j < 8; j++) v[j] = (s >> j) & 1 ? 0xFF : 0x01;
        memcpy(&SIGNS_I8[k], v, 8);
    }
}

static const int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#define IQ1_DELTA 0.125f
static const float IQ1_DELTAS[2] = {IQ1_DELTA, -IQ1_DELTA};   /* by the sign bit: a load, not a branch */

/* codebooks, from the gguf package: entries x levels */
static float *grid_iq2xxs, *grid_iq2xs, *grid_iq2s, *grid_iq3xxs, *grid_iq3s, *grid_iq1s;
static uint8_t *igrid_iq2xxs, *igrid_iq2xs, *igrid_iq3xxs, *igrid_iq1s;   /* as bytes (ggml_set_grid) */

static float **grid_slot(int type, int64_t *n) {
    switch (type) {
    case GT_IQ2_XXS: *n = 256 * 8; return &grid_iq2xxs;
    case GT_IQ2_XS: *n = 512 * 8; return &grid_iq2xs;
    case GT_IQ2_S: *n = 1024 * 8; return &grid_iq2s;
    case GT_IQ3_XXS: *n = 256 * 4; return &grid_iq3xxs;
    case GT_IQ3_S: *n = 512 * 4; return &grid_iq3s;
    case GT_IQ1_S: case GT_IQ1_M: *n = 2048 * 8; return &grid_iq1s;
    default: *n = 0; return NULL;
    }
}

int ggml_needs_grid(int type) { int64_t n; return grid_slot(type, &n) != NULL; }

int ggml_set_grid(int type, const float *grid, int64_t n) {
    int64_t want;
    float **slot = grid_slot(type, &want);
    if (!slot || n != want) return -1;
    if (*slot) return 0;   /* set once: a codebook never changes, and a kernel may be reading it */
    float *copy = malloc(sizeof(float) * n);
    if (!copy) return -1;
    memcpy(copy, grid, sizeof(float) * n);
    uint8_t **bslot = type == GT_IQ2_XXS ? &igrid_iq2xxs : type == GT_IQ2_XS ? &igrid_iq2xs :
                      type == GT_IQ3_XXS ? &igrid_iq3xxs : type == GT_IQ1_S || type == GT_IQ1_M ? &igrid_iq1s : NULL;
    if (bslot) {
        /* the same codebook as bytes, for the integer products (IQ1's levels -1, 0, 1 stored plus one) */
        uint8_t *bytes = malloc((size_t)n);
        if (!bytes) { free(copy); return -1; }
        float plus = bslot == &igrid_iq1s ? 1.0f : 0.0f;
        for (int64_t i = 0; i < n; i++) bytes[i] = (uint8_t)(int)(grid[i] + plus);
        *bslot = bytes;
    }
    *slot = copy;
    return 0;
}

int ggml_block_size(int type, int64_t *weights, int64_t *bytes) {
    static const struct { int type, w, b; } SIZES[] = {
        {GT_Q4_0, 32, 18}, {GT_Q4_1, 32, 20}, {GT_Q5_0, 32, 22}, {GT_Q5_1, 32, 24}, {GT_Q8_0, 32, 34},
        {GT_IQ4_NL, 32, 18}, {GT_Q2_K, 256, 84}, {GT_Q3_K, 256, 110}, {GT_Q4_K, 256, 144}, {GT_Q5_K, 256, 176},
        {GT_Q6_K, 256, 210}, {GT_IQ2_XXS, 256, 66}, {GT_IQ2_XS, 256, 74}, {GT_IQ2_S, 256, 82},
        {GT_IQ3_XXS, 256, 98}, {GT_IQ3_S, 256, 110}, {GT_IQ1_S, 256, 50}, {GT_IQ1_M, 256, 56},
        {GT_IQ4_XS, 256, 136}, {GT_TQ1_0, 256, 54}, {GT_TQ2_0, 256, 66},
    };
    for (size_t i = 0; i < sizeof SIZES / sizeof SIZES[0]; i++) {
        if (SIZES[i].type != type) continue;
        int64_t n;
        float **slot = grid_slot(type, &n);
        if (slot && !*slot) return 0;
        *weights = SIZES[i].w;
        *bytes = SIZES[i].b;
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------ 32-weight blocks */

CLONES static void deq_q4_0(const uint8_t *b, float *y) {
    float d = f16(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[2 + j] & 15) - 8);
        y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

CLONES static void deq_q4_1(const uint8_t *b, float *y) {
    float d = f16(b), m = f16(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b[4 + j] & 15) + m;
        y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

CLONES static void deq_q5_0(const uint8_t *b, float *y) {
    float d = f16(b);
    uint32_t qh = u32(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
        y[j + 16] = d * (float)((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}

CLONES static void deq_q5_1(const uint8_t *b, float *y) {
    float d = f16(b), m = f16(b + 2);
    uint32_t qh = u32(b + 4);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[8 + j] & 15) | (((qh >> j) & 1) << 4)) + m;
        y[j + 16] = d * (float)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
}

CLONES static void deq_q8_0(const uint8_t *b, float *y) {
    float d = f16(b);
    for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

CLONES static void deq_iq4_nl(const uint8_t *b, float *y) {
    float d = f16(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)KV_IQ4NL[b[2 + j] & 15];
        y[j + 16] = d * (float)KV_IQ4NL[b[2 + j] >> 4];
    }
}

/* ----------------------------------------------------------------------------- 256-weight blocks */

CLONES static void deq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    float d = f16(b + 80), dmin = f16(b + 82);
    for (int h = 0; h < 2; h++)                     /* 128 weights from 32 bytes, four 2-bit planes */
        for (int s = 0; s < 4; s++)
            for (int half = 0; half < 2; half++) {
                int g = 8 * h + 2 * s + half;
                float dl = d * (float)(sc[g] & 15), ml = dmin * (float)(sc[g] >> 4);
                const uint8_t *q = qs + 32 * h + 16 * half;
                float *o = y + 128 * h + 32 * s + 16 * half;
                for (int l = 0; l < 16; l++) o[l] = dl * (float)((q[l] >> (2 * s)) & 3) - ml;
            }
}

CLONES static void deq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32, *ss = b + 96;
    float d = f16(b + 108);
    for (int g = 0; g < 16; g++) {
        int lo = g < 8 ? ss[g] & 15 : ss[g - 8] >> 4;
        int hi = (ss[8 + g % 4] >> (2 * (g / 4))) & 3;
        float dl = d * (float)((lo | (hi << 4)) - 32);
        int w0 = 16 * g, h = w0 / 128, s = (w0 % 128) / 32, l0 = w0 % 32, bit = 4 * h + s;
        for (int l = l0; l < l0 + 16; l++) {
            int q = ((qs[32 * h + l] >> (2 * s)) & 3) - (((hm[l] >> bit) & 1) ? 0 : 4);
            y[128 * h + 32 * s + l] = dl * (float)q;
        }
    }
}

static inline void k4_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

/* Q4_K, and Q5_K with its fifth bits (qh) */
static inline void deq_q45_k(const uint8_t *b, float *y, int five) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k4_scale_min(b + 4, j, &sc, &m);
        float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++)
            y[32 * j + l] = dl * (float)(((q[l] >> shift) & 15) | (five ? ((qh[l] >> j) & 1) << 4 : 0)) - ml;
    }
}
CLONES static void deq_q4_k(const uint8_t *b, float *y) { deq_q45_k(b, y, 0); }
CLONES static void deq_q5_k(const uint8_t *b, float *y) { deq_q45_k(b, y, 1); }

CLONES static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16(b + 208);
    for (int w = 0; w < 256; w += 16) {
        float dl = d * (float)sc[w / 16];
        int h = w / 128, k0 = w % 128;
        for (int k = k0; k < k0 + 16; k++) {
            int lo = (ql[64 * h + k % 64] >> (4 * (k / 64))) & 15;
            int hi = (qh[32 * h + k % 32] >> (2 * (k / 32))) & 3;
            y[128 * h + k] = dl * (float)((lo | (hi << 4)) - 32);
        }
    }
}

CLONES static void deq_tq1_0(const uint8_t *b, float *y) {
    static const uint8_t POW3[5] = {1, 3, 9, 27, 81};
    const uint8_t *qs = b, *qh = b + 48;
    float d = f16(b + 52);
    int o = 0;
    for (int n = 0; n < 5; n++)
        for (int m = 0; m < 32; m++) y[o++] = d * (float)((((uint8_t)(qs[m] * POW3[n]) * 3) >> 8) - 1);
    for (int n = 0; n < 5; n++)
        for (int m = 0; m < 16; m++) y[o++] = d * (float)((((uint8_t)(qs[32 + m] * POW3[n]) * 3) >> 8) - 1);
    for (int n = 0; n < 4; n++)
        for (int m = 0; m < 4; m++) y[o++] = d * (float)((((uint8_t)(qh[m] * POW3[n]) * 3) >> 8) - 1);
}

CLONES static void deq_tq2_0(const uint8_t *b, float *y) {
    float d = f16(b + 64);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int m = 0; m < 32; m++) y[128 * h + 32 * s + m] = d * (float)(((b[32 * h + m] >> (2 * s)) & 3) - 1);
}

CLONES static void deq_iq4_xs(const uint8_t *b, float *y) {
    float d = f16(b);
    uint16_t sh = u16(b + 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
        float dl = d * (float)(ls - 32);
        for (int j = 0; j < 16; j++) {
            y[32 * ib + j] = dl * (float)KV_IQ4NL[qs[16 * ib + j] & 15];
            y[32 * ib + 16 + j] = dl * (float)KV_IQ4NL[qs[16 * ib + j] >> 4];
        }
    }
}

/* eight weights: scale * grid entry, signs applied */
static inline void grid8(float *y, float db, const float *g, uint8_t signs) {
    for (int j = 0; j < 8; j++) y[j] = db * g[j] * sgn(signs, j);
}

/* eight weights from two 4-level grid entries */
static inline void grid44(float *y, float db, const float *g1, const float *g2, uint8_t signs) {
    for (int j = 0; j < 4; j++) {
        y[j] = db * g1[j] * sgn(signs, j);
        y[j + 4] = db * g2[j] * sgn(signs, j + 4);
    }
}

CLONES static void deq_iq2_xxs(const uint8_t *b, float *y) {
    float d = f16(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 8 * ib;
        uint32_t aux = u32(q + 4);
        float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++) grid8(y + 32 * ib + 8 * l, db, grid_iq2xxs + 8 * q[l], ksign((aux >> (7 * l)) & 127));
    }
}

CLONES static void deq_iq2_xs(const uint8_t *b, float *y) {
    float d = f16(b);
    const uint8_t *sc = b + 66;
    for (int i = 0; i < 32; i++) {
        uint16_t q = u16(b + 2 + 2 * i);
        float db = d * (0.5f + (float)((sc[i / 4] >> (4 * ((i / 2) % 2))) & 15)) * 0.25f;
        grid8(y + 8 * i, db, grid_iq2xs + 8 * (q & 511), ksign(q >> 9));
    }
}

CLONES static void deq_iq2_s(const uint8_t *b, float *y) {
    float d = f16(b);
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *sc = b + 74;
    for (int i = 0; i < 32; i++) {
        float db = d * (0.5f + (float)((sc[i / 4] >> (4 * ((i / 2) % 2))) & 15)) * 0.25f;
        int idx = qs[i] | (((qh[i / 4] >> (2 * (i % 4))) & 3) << 8);
        grid8(y + 8 * i, db, grid_iq2s + 8 * idx, signs[i]);
    }
}

CLONES static void deq_iq3_xxs(const uint8_t *b, float *y) {
    float d = f16(b);
    const uint8_t *qs = b + 2, *ss = b + 66;
    for (int ib = 0; ib < 8; ib++) {
        uint32_t aux = u32(ss + 4 * ib);
        float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++) {
            const float *g1 = grid_iq3xxs + 4 * qs[8 * ib + 2 * l], *g2 = grid_iq3xxs + 4 * qs[8 * ib + 2 * l + 1];
            grid44(y + 32 * ib + 8 * l, db, g1, g2, ksign((aux >> (7 * l)) & 127));
        }
    }
}

CLONES static void deq_iq3_s(const uint8_t *b, float *y) {
    float d = f16(b);
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *sc = b + 106;
    for (int ib = 0; ib < 8; ib++) {
        float db = d * (float)(1 + 2 * ((sc[ib / 2] >> (4 * (ib % 2))) & 15));
        for (int l = 0; l < 4; l++) {
            int i = 8 * ib + 2 * l;
            const float *g1 = grid_iq3s + 4 * (qs[i] | (((qh[i / 8] >> (i % 8)) & 1) << 8));
            const float *g2 = grid_iq3s + 4 * (qs[i + 1] | (((qh[(i + 1) / 8] >> ((i + 1) % 8)) & 1) << 8));
            grid44(y + 32 * ib + 8 * l, db, g1, g2, signs[4 * ib + l]);
        }
    }
}

CLONES static void deq_iq1_s(const uint8_t *b, float *y) {
    float d = f16(b);
    const uint8_t *qs = b + 2, *qhp = b + 34;
    for (int ib = 0; ib < 8; ib++) {
        uint16_t qh = u16(qhp + 2 * ib);
        float dl = d * (float)(2 * ((qh >> 12) & 7) + 1);
        float delta = IQ1_DELTAS[qh >> 15];
        for (int l = 0; l < 4; l++) {
            const float *g = grid_iq1s + 8 * (qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8));
            for (int j = 0; j < 8; j++) y[32 * ib + 8 * l + j] = dl * (g[j] + delta);
        }
    }
}

CLONES static void deq_iq1_m(const uint8_t *b, float *y) {
    const uint8_t *qs = b, *qh = b + 32, *scp = b + 48;
    uint16_t sc[4] = {u16(scp), u16(scp + 2), u16(scp + 4), u16(scp + 6)};
    uint16_t dbits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
    uint8_t dh[2] = {(uint8_t)(dbits & 255), (uint8_t)(dbits >> 8)};
    float d = f16(dh);
    for (int i = 0; i < 32; i++) {                  /* groups of 8 weights */
        int half = i / 2;                           /* 16 weights share a 3-bit scale */
        float dl = d * (float)(2 * ((sc[half / 4] >> (3 * (half % 4))) & 7) + 1);
        int nib = (qh[i / 2] >> (4 * (i % 2))) & 15;
        float delta = IQ1_DELTAS[nib >> 3];
        const float *g = grid_iq1s + 8 * (qs[i] | ((nib & 7) << 8));
        for (int j = 0; j < 8; j++) y[8 * i + j] = dl * (g[j] + delta);
    }
}

/* ------------------------------------------------------------------------ AVX2 decoders (same bits) */
#if GGML_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define LD32(p) _mm256_loadu_si256((const __m256i *)(p))
#define LD16(p) _mm_loadu_si128((const __m128i *)(p))

static float SIGN8[256][8];                 /* sign patterns as factors of +-1 */

static void init_signs(void) {
    for (int s = 0; s < 256; s++)
        for (int j = 0; j < 8; j++) SIGN8[s][j] = (s >> j) & 1 ? -1.0f : 1.0f;
}

AVX2 static inline __m256 u8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
AVX2 static inline __m256 i8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* Every decoder body below runs in two modes, each compiled on its own (`dot` is a constant where
   the body is inlined): dot = 0 stores the weights at y; dot = 1 multiplies them straight into the
   accumulators acc[0..1] by the inputs at y (then pointing at x), so a mat-vec never writes a block
   out. Eight weights v at p go through put(). */
#define INL AVX2 static inline __attribute__((always_inline))

INL void put(float *p, __m256 v, __m256 *acc, int dot) {
    if (dot) *acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(p), *acc);
    else _mm256_storeu_ps(p, v);
}

/* 16 codes (bytes) -> y = dl * q - ml; `sgn` if the codes are signed */
INL void emit16(float *y, __m128i q, float dl, float ml, int sgn, __m256 *acc, int dot) {
    __m256 d = _mm256_set1_ps(dl), m = _mm256_set1_ps(ml);
    __m256 a = sgn ? i8f(q) : u8f(q), b = sgn ? i8f(_mm_srli_si128(q, 8)) : u8f(_mm_srli_si128(q, 8));
    put(y, _mm256_sub_ps(_mm256_mul_ps(d, a), m), acc, dot);
    put(y + 8, _mm256_sub_ps(_mm256_mul_ps(d, b), m), acc + 1, dot);
}

/* 16 signed codes -> y = dl * q (no offset term, as the reference computes it) */
INL void emit16m(float *y, __m128i q, float dl, __m256 *acc, int dot) {
    __m256 d = _mm256_set1_ps(dl);
    put(y, _mm256_mul_ps(d, i8f(q)), acc, dot);
    put(y + 8, _mm256_mul_ps(d, i8f(_mm_srli_si128(q, 8))), acc + 1, dot);
}

#define LO(v) _mm256_castsi256_si128(v)
#define HI(v) _mm256_extracti128_si256(v, 1)

INL void q2_k_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    const uint8_t *sc = b;
    float d = f16(b + 80), dmin = f16(b + 82);
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        __m256i v = LD32(b + 16 + 32 * h);
        for (int s = 0; s < 4; s++) {
            __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m3);
            int g = 8 * h + 2 * s;
            float *o = y + 128 * h + 32 * s;
            emit16(o, LO(q), d * (float)(sc[g] & 15), dmin * (float)(sc[g] >> 4), 0, acc, dot);
            emit16(o + 16, HI(q), d * (float)(sc[g + 1] & 15), dmin * (float)(sc[g + 1] >> 4), 0, acc, dot);
        }
    }
}

INL void q3_k_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    const uint8_t *ss = b + 96;
    float d = f16(b + 108);
    float dl[16];
    for (int g = 0; g < 16; g++) {
        int lo = g < 8 ? ss[g] & 15 : ss[g - 8] >> 4;
        int hi = (ss[8 + g % 4] >> (2 * (g / 4))) & 3;
        dl[g] = d * (float)((lo | (hi << 4)) - 32);
    }
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    __m256i hm = LD32(b);
    for (int h = 0; h < 2; h++) {
        __m256i v = LD32(b + 32 + 32 * h);
        for (int s = 0; s < 4; s++) {
            __m256i ql = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m3);
            __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), one);
            __m256i q = _mm256_sub_epi8(ql, _mm256_slli_epi16(_mm256_xor_si256(hb, one), 2));
            int g = 8 * h + 2 * s;
            emit16m(y + 128 * h + 32 * s, LO(q), dl[g], acc, dot);
            emit16m(y + 128 * h + 32 * s + 16, HI(q), dl[g + 1], acc, dot);
        }
    }
}

INL void q45_k_body(const uint8_t *b, float *y, __m256 *acc, int dot, int five) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *qs = b + (five ? 48 : 16);
    const __m256i m15 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256i qh = five ? LD32(b + 16) : _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k4_scale_min(b + 4, j, &sc, &m);
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(LD32(qs + 32 * (j / 2)), 4 * (j % 2)), m15);
        if (five) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
        float dl = d * (float)sc, ml = dmin * (float)m;
        emit16(y + 32 * j, LO(q), dl, ml, 0, acc, dot);
        emit16(y + 32 * j + 16, HI(q), dl, ml, 0, acc, dot);
    }
}
INL void q4_k_body(const uint8_t *b, float *y, __m256 *acc, int dot) { q45_k_body(b, y, acc, dot, 0); }
INL void q5_k_body(const uint8_t *b, float *y, __m256 *acc, int dot) { q45_k_body(b, y, acc, dot, 1); }

INL void q6_k_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16(b + 208);
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        __m256i qh = LD32(b + 128 + 32 * h);
        for (int p = 0; p < 4; p++) {
            __m256i lo = _mm256_and_si256(_mm256_srli_epi16(LD32(b + 64 * h + 32 * (p % 2)), 4 * (p / 2)), m15);
            __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), m3), 4);
            __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), k32);
            int g = 8 * h + 2 * p;
            emit16m(y + 128 * h + 32 * p, LO(q), d * (float)sc[g], acc, dot);
            emit16m(y + 128 * h + 32 * p + 16, HI(q), d * (float)sc[g + 1], acc, dot);
        }
    }
}

INL void q8_0_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    __m256 d = _mm256_set1_ps(f16(b));
    #pragma GCC unroll 32      /* constant accumulator indices: they stay in registers */
    for (int j = 0; j < 32; j += 8)
        put(y + j, _mm256_mul_ps(i8f(_mm_loadl_epi64((const __m128i *)(b + 2 + j))), d), acc + ((j >> 3) & 1), dot);
}

/* 32 weights from 16 bytes of nibbles: low nibbles first, then high */
AVX2 static inline __m256i nibbles32(const uint8_t *p) {
    __m128i v = LD16(p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* the 32 fifth bits of Q5_0 / Q5_1 as 0 or 16 per byte */
AVX2 static inline __m256i fifth_bits(uint32_t qh) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

INL void q4_0_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    __m256i q = _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
    float d = f16(b);
    emit16m(y, LO(q), d, acc, dot);
    emit16m(y + 16, HI(q), d, acc, dot);
}

INL void q5_0_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), fifth_bits(u32(b + 2))), _mm256_set1_epi8(16));
    float d = f16(b);
    emit16m(y, LO(q), d, acc, dot);
    emit16m(y + 16, HI(q), d, acc, dot);
}

/* y = d * q + m, as Q4_1 and Q5_1 are computed */
INL void emit32_add(float *y, __m256i q, float dd, float mm, __m256 *acc, int dot) {
    __m256 d = _mm256_set1_ps(dd), m = _mm256_set1_ps(mm);
    __m128i lo = LO(q), hi = HI(q);
    put(y, _mm256_add_ps(_mm256_mul_ps(d, u8f(lo)), m), acc, dot);
    put(y + 8, _mm256_add_ps(_mm256_mul_ps(d, u8f(_mm_srli_si128(lo, 8))), m), acc + 1, dot);
    put(y + 16, _mm256_add_ps(_mm256_mul_ps(d, u8f(hi)), m), acc, dot);
    put(y + 24, _mm256_add_ps(_mm256_mul_ps(d, u8f(_mm_srli_si128(hi, 8))), m), acc + 1, dot);
}

INL void q4_1_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    emit32_add(y, nibbles32(b + 4), f16(b), f16(b + 2), acc, dot);
}
INL void q5_1_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    emit32_add(y, _mm256_or_si256(nibbles32(b + 8), fifth_bits(u32(b + 4))), f16(b), f16(b + 2), acc, dot);
}

AVX2 static inline __m256i iq4_values(const uint8_t *p) {
    __m256i tbl = _mm256_broadcastsi128_si256(LD16(KV_IQ4NL));
    return _mm256_shuffle_epi8(tbl, nibbles32(p));
}

INL void iq4_nl_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    __m256i q = iq4_values(b + 2);
    float d = f16(b);
    emit16m(y, LO(q), d, acc, dot);
    emit16m(y + 16, HI(q), d, acc, dot);
}

INL void iq4_xs_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    float d = f16(b);
    uint16_t sh = u16(b + 2);
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
        __m256i q = iq4_values(b + 8 + 16 * ib);
        float dl = d * (float)(ls - 32);
        emit16m(y + 32 * ib, LO(q), dl, acc, dot);
        emit16m(y + 32 * ib + 16, HI(q), dl, acc, dot);
    }
}

/* eight weights db * grid * sign, in that order (as the reference multiplies them) */
INL void grid8_avx2(float *y, __m256 db, __m256 g, uint8_t signs, __m256 *acc, int dot) {
    put(y, _mm256_mul_ps(_mm256_mul_ps(db, g), _mm256_loadu_ps(SIGN8[signs])), acc, dot);
}
#define G8(p) _mm256_loadu_ps(p)
#define G44(p1, p2) _mm256_set_m128(_mm_loadu_ps(p2), _mm_loadu_ps(p1))

INL void iq2_xxs_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    float d = f16(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 8 * ib;
        uint32_t aux = u32(q + 4);
        __m256 db = _mm256_set1_ps(d * (0.5f + (float)(aux >> 28)) * 0.25f);
        #pragma GCC unroll 32      /* constant accumulator indices: they stay in registers */
        for (int l = 0; l < 4; l++)
            grid8_avx2(y + 32 * ib + 8 * l, db, G8(grid_iq2xxs + 8 * q[l]), ksign((aux >> (7 * l)) & 127), acc + (l & 1), dot);
    }
}

INL void iq2_xs_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    float d = f16(b);
    for (int i = 0; i < 32; i += 2) {
        __m256 db = _mm256_set1_ps(d * (0.5f + (float)((b[66 + i / 4] >> (4 * ((i / 2) % 2))) & 15)) * 0.25f);
        uint16_t q0 = u16(b + 2 + 2 * i), q1 = u16(b + 4 + 2 * i);
        grid8_avx2(y + 8 * i, db, G8(grid_iq2xs + 8 * (q0 & 511)), ksign(q0 >> 9), acc, dot);
        grid8_avx2(y + 8 * i + 8, db, G8(grid_iq2xs + 8 * (q1 & 511)), ksign(q1 >> 9), acc + 1, dot);
    }
}

INL void iq2_s_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    float d = f16(b);
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *sc = b + 74;
    for (int i = 0; i < 32; i += 2) {
        __m256 db = _mm256_set1_ps(d * (0.5f + (float)((sc[i / 4] >> (4 * ((i / 2) % 2))) & 15)) * 0.25f);
        #pragma GCC unroll 32      /* constant accumulator indices: they stay in registers */
        for (int k = i; k < i + 2; k++)
            grid8_avx2(y + 8 * k, db, G8(grid_iq2s + 8 * (qs[k] | (((qh[k / 4] >> (2 * (k % 4))) & 3) << 8))), signs[k], acc + (k & 1), dot);
    }
}

INL void iq3_xxs_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    float d = f16(b);
    const uint8_t *qs = b + 2, *ss = b + 66;
    for (int ib = 0; ib < 8; ib++) {
        uint32_t aux = u32(ss + 4 * ib);
        __m256 db = _mm256_set1_ps(d * (0.5f + (float)(aux >> 28)) * 0.5f);
        #pragma GCC unroll 32      /* constant accumulator indices: they stay in registers */
        for (int l = 0; l < 4; l++) {
            const uint8_t *q = qs + 8 * ib + 2 * l;
            grid8_avx2(y + 32 * ib + 8 * l, db, G44(grid_iq3xxs + 4 * q[0], grid_iq3xxs + 4 * q[1]),
                       ksign((aux >> (7 * l)) & 127), acc + (l & 1), dot);
        }
    }
}

INL void iq3_s_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    float d = f16(b);
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *sc = b + 106;
    for (int ib = 0; ib < 8; ib++) {
        __m256 db = _mm256_set1_ps(d * (float)(1 + 2 * ((sc[ib / 2] >> (4 * (ib % 2))) & 15)));
        int h = qh[ib];
        #pragma GCC unroll 32      /* constant accumulator indices: they stay in registers */
        for (int l = 0; l < 4; l++) {
            int i = 8 * ib + 2 * l;
            const float *g1 = grid_iq3s + 4 * (qs[i] | (((h >> (2 * l)) & 1) << 8));
            const float *g2 = grid_iq3s + 4 * (qs[i + 1] | (((h >> (2 * l + 1)) & 1) << 8));
            grid8_avx2(y + 32 * ib + 8 * l, db, G44(g1, g2), signs[4 * ib + l], acc + (l & 1), dot);
        }
    }
}

INL void iq1_s_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    float d = f16(b);
    for (int ib = 0; ib < 8; ib++) {
        uint16_t qh = u16(b + 34 + 2 * ib);
        __m256 dl = _mm256_set1_ps(d * (float)(2 * ((qh >> 12) & 7) + 1));
        __m256 delta = _mm256_set1_ps(IQ1_DELTAS[qh >> 15]);
        #pragma GCC unroll 32      /* constant accumulator indices: they stay in registers */
        for (int l = 0; l < 4; l++) {
            const float *g = grid_iq1s + 8 * (b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8));
            put(y + 32 * ib + 8 * l, _mm256_mul_ps(dl, _mm256_add_ps(G8(g), delta)), acc + (l & 1), dot);
        }
    }
}

INL void iq1_m_body(const uint8_t *b, float *y, __m256 *acc, int dot) {
    const uint8_t *qs = b, *qh = b + 32, *scp = b + 48;
    uint16_t sc[4] = {u16(scp), u16(scp + 2), u16(scp + 4), u16(scp + 6)};
    uint16_t dbits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
    uint8_t dh[2] = {(uint8_t)(dbits & 255), (uint8_t)(dbits >> 8)};
    float d = f16(dh);
    for (int k = 0; k < 16; k++) {                  /* 16 weights share a 3-bit scale; 8 a delta's sign */
        __m256 dl = _mm256_set1_ps(d * (float)(2 * ((sc[k / 4] >> (3 * (k % 4))) & 7) + 1));
        int n0 = qh[k] & 15, n1 = qh[k] >> 4;
        __m256 d0 = _mm256_set1_ps(IQ1_DELTAS[n0 >> 3]), d1 = _mm256_set1_ps(IQ1_DELTAS[n1 >> 3]);
        put(y + 16 * k, _mm256_mul_ps(dl, _mm256_add_ps(G8(grid_iq1s + 8 * (qs[2 * k] | ((n0 & 7) << 8))), d0)), acc, dot);
        put(y + 16 * k + 8, _mm256_mul_ps(dl, _mm256_add_ps(G8(grid_iq1s + 8 * (qs[2 * k + 1] | ((n1 & 7) << 8))), d1)),
            acc + 1, dot);
    }
}

/* each body as a decoder (into y) and as a fused product (into two accumulators, by x) */
#define VARIANTS(name) \
    AVX2 static void deq_##name##_avx2(const uint8_t *b, float *y) { name##_body(b, y, NULL, 0); } \
    AVX2 static void dot_##name##_avx2(const uint8_t *b, const float *x, __m256 *acc) { \
        __m256 a[2] = {acc[0], acc[1]};   /* local: loads of x cannot alias them, so they stay in registers */ \
        name##_body(b, (float *)x, a, 1); \
        acc[0] = a[0]; \
        acc[1] = a[1]; \
    }
VARIANTS(q4_0)
VARIANTS(q4_1)
VARIANTS(q5_0)
VARIANTS(q5_1)
VARIANTS(q8_0)
VARIANTS(iq4_nl)
VARIANTS(q2_k)
VARIANTS(q3_k)
VARIANTS(q4_k)
VARIANTS(q5_k)
VARIANTS(q6_k)
VARIANTS(iq4_xs)
VARIANTS(iq2_xxs)
VARIANTS(iq2_xs)
VARIANTS(iq2_s)
VARIANTS(iq3_xxs)
VARIANTS(iq3_s)
VARIANTS(iq1_s)
VARIANTS(iq1_m)
#endif

void ggml_init(void) {
    init_signs_i8();
#if GGML_X86
    init_signs();
#endif
}

typedef void (*deq_fn)(const uint8_t *, float *);

static deq_fn decoder(int type) {
#if GGML_X86
    if (ggml_avx2) {
        switch (type) {
        case GT_Q4_0: return deq_q4_0_avx2;
        case GT_Q4_1: return deq_q4_1_avx2;
        case GT_Q5_0: return deq_q5_0_avx2;
        case GT_Q5_1: return deq_q5_1_avx2;
        case GT_Q8_0: return deq_q8_0_avx2;
        case GT_IQ4_NL: return deq_iq4_nl_avx2;
        case GT_Q2_K: return deq_q2_k_avx2;
        case GT_Q3_K: return deq_q3_k_avx2;
        case GT_Q4_K: return deq_q4_k_avx2;
        case GT_Q5_K: return deq_q5_k_avx2;
        case GT_Q6_K: return deq_q6_k_avx2;
        case GT_IQ4_XS: return deq_iq4_xs_avx2;
        case GT_IQ2_XXS: return deq_iq2_xxs_avx2;
        case GT_IQ2_XS: return deq_iq2_xs_avx2;
        case GT_IQ2_S: return deq_iq2_s_avx2;
        case GT_IQ3_XXS: return deq_iq3_xxs_avx2;
        case GT_IQ3_S: return deq_iq3_s_avx2;
        case GT_IQ1_S: return deq_iq1_s_avx2;
        case GT_IQ1_M: return deq_iq1_m_avx2;
        default: break;       /* TQ1_0, TQ2_0: the portable decoders */
        }
    }
#endif
    switch (type) {
    case GT_Q4_0: return deq_q4_0;
    case GT_Q4_1: return deq_q4_1;
    case GT_Q5_0: return deq_q5_0;
    case GT_Q5_1: return deq_q5_1;
    case GT_Q8_0: return deq_q8_0;
    case GT_IQ4_NL: return deq_iq4_nl;
    case GT_Q2_K: return deq_q2_k;
    case GT_Q3_K: return deq_q3_k;
    case GT_Q4_K: return deq_q4_k;
    case GT_Q5_K: return deq_q5_k;
    case GT_Q6_K: return deq_q6_k;
    case GT_TQ1_0: return deq_tq1_0;
    case GT_TQ2_0: return deq_tq2_0;
    case GT_IQ4_XS: return deq_iq4_xs;
    case GT_IQ2_XXS: return deq_iq2_xxs;
    case GT_IQ2_XS: return deq_iq2_xs;
    case GT_IQ2_S: return deq_iq2_s;
    case GT_IQ3_XXS: return deq_iq3_xxs;
    case GT_IQ3_S: return deq_iq3_s;
    case GT_IQ1_S: return deq_iq1_s;
    case GT_IQ1_M: return deq_iq1_m;
    default: return NULL;
    }
}

#if GGML_X86
typedef void (*dot_fn)(const uint8_t *, const float *, __m256 *);

static dot_fn fused_dot(int type) {
    if (!ggml_avx2) return NULL;
    switch (type) {
    case GT_Q4_0: return dot_q4_0_avx2;
    case GT_Q4_1: return dot_q4_1_avx2;
    case GT_Q5_0: return dot_q5_0_avx2;
    case GT_Q5_1: return dot_q5_1_avx2;
    case GT_Q8_0: return dot_q8_0_avx2;
    case GT_IQ4_NL: return dot_iq4_nl_avx2;
    case GT_Q2_K: return dot_q2_k_avx2;
    case GT_Q3_K: return dot_q3_k_avx2;
    case GT_Q4_K: return dot_q4_k_avx2;
    case GT_Q5_K: return dot_q5_k_avx2;
    case GT_Q6_K: return dot_q6_k_avx2;
    case GT_IQ4_XS: return dot_iq4_xs_avx2;
    case GT_IQ2_XXS: return dot_iq2_xxs_avx2;
    case GT_IQ2_XS: return dot_iq2_xs_avx2;
    case GT_IQ2_S: return dot_iq2_s_avx2;
    case GT_IQ3_XXS: return dot_iq3_xxs_avx2;
    case GT_IQ3_S: return dot_iq3_s_avx2;
    case GT_IQ1_S: return dot_iq1_s_avx2;
    case GT_IQ1_M: return dot_iq1_m_avx2;
    default: return NULL;
    }
}

/* one input: every block multiplied straight into two accumulators, summed once per row; the bytes
   a few blocks ahead are asked for early (the loads of a block's codes otherwise wait on memory) */
#define PREFETCH_AHEAD 1024
AVX2 static int row_dot_fused(int type, const uint8_t *src, int64_t nblocks, int64_t w, int64_t nb, const float *x,
                              float *acc) {
    dot_fn f = fused_dot(type);
    if (!f) return 0;
    __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nblocks; i++) {
        const uint8_t *p = src + i * nb;
        for (int64_t o = 0; o < nb; o += 64) __builtin_prefetch(p + PREFETCH_AHEAD + o);
        f(p, x + i * w, a);
    }
    __m256 v = _mm256_add_ps(a[0], a[1]);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    *acc += _mm_cvtss_f32(h);
    return 1;
}
#endif

void ggml_decode(int type, const uint8_t *src, int64_t nblocks, float *out) {
    int64_t w, nb;
    deq_fn f = decoder(type);
    if (!f || !ggml_block_size(type, &w, &nb)) return;
    for (int64_t i = 0; i < nblocks; i++) f(src + i * nb, out + i * w);
}

/* ---------------------------------------------------------------- llama.cpp's rounding of an input */

/* llama.cpp multiplies a weight of a block type by its input rounded to 8 bits first (the type's
   "vec_dot_type"): Q8_K (per 256 values, a float scale) for the k-, i- and ternary types, Q8_0 (per
   32, a binary16 scale) for Q4_0, Q5_0, Q8_0 and IQ4_NL, Q8_1 (Q8_0's values, plus a sum) for Q4_1 and
   Q5_1. Values per scale, or 0 for a type this file does not know. */
int ggml_input_block(int type) {
    switch (type) {
    case GT_Q4_0: case GT_Q4_1: case GT_Q5_0: case GT_Q5_1: case GT_Q8_0: case GT_IQ4_NL:
        return 32;
    case GT_Q2_K: case GT_Q3_K: case GT_Q4_K: case GT_Q5_K: case GT_Q6_K: case GT_IQ2_XXS: case GT_IQ2_XS:
    case GT_IQ3_XXS: case GT_IQ1_S: case GT_IQ3_S: case GT_IQ2_S: case GT_IQ4_XS: case GT_IQ1_M: case GT_TQ1_0:
    case GT_TQ2_0:
        return 256;
    default:
        return 0;
    }
}

/* v rounded to the nearest integer, ties to even, for |v| < 2^22: adding and taking off 1.5 * 2^23
   leaves no fraction bits (the default rounding mode rounds them away); a plain add the compiler
   vectorises, where nearbyintf is a call per value on baseline x86-64 */
static inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* binary16 nearest to f (ties to even), as F16C converts */
static uint16_t to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);            /* rounds past 65504 */
    if (ax < 0x38800000u) {                                              /* subnormal in binary16 */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    }
    uint32_t e = ax - 0x38000000u;
    return (uint16_t)(sign | ((e + 0x0fffu + ((e >> 13) & 1)) >> 13));
}

/* y = x rounded as llama.cpp rounds the input of a `type` weight (ggml_input_block(type) divides n):
   y[i] = scale * q[i], q the int8 it multiplies with. Q8_K: q = rint(-127 x / m), m the value of
   largest magnitude, clipped at 127, scale = 1 / (-127 / m). Q8_0/Q8_1: q = rint(x * 127 / amax),
   scale = amax / 127 stored as binary16. Returns 0 for a type without such rounding (y untouched).
   Q8_1 (Q4_1, Q5_1 weights) also carries the block's sum s, rounded on its own, which llama.cpp
   multiplies by the weight block's offset: with `fix` (n / 32 floats) each block's s - sum(y) goes
   there, for ggml_row_dot to add times the offset. */
int ggml_input_fix(int type) { return type == GT_Q4_1 || type == GT_Q5_1; }

int ggml_round_input(int type, const float *x, float *y, int64_t n, float *fix) {
    int blk = ggml_input_block(type);
    if (!blk) return 0;
    if (blk == 256) {           /* Q8_K: the codes ggml_quantize_q8k gives, times their scale */
        ggml_q8k_t q;
        for (int64_t b = 0; b < n; b += 256, x += 256, y += 256) {
            ggml_quantize_q8k(x, 256, &q);
            for (int j = 0; j < 256; j++) y[j] = q.d * (float)q.qs[j];
        }
        return 1;
    }
    if (!ggml_input_fix(type)) fix = NULL;
    for (int64_t b = 0; b < n; b += blk, x += blk, y += blk) {
        float amax = 0.0f;
        for (int j = 0; j < blk; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        if (amax == 0.0f) {
            for (int j = 0; j < blk; j++) y[j] = 0.0f;
            if (fix) *fix++ = 0.0f;
            continue;
        }
        uint16_t h = to_f16(amax / 127.0f);
        uint8_t hb[2] = {(uint8_t)h, (uint8_t)(h >> 8)};
        float d = f16(hb), id = 127.0f / amax, sum = 0.0f;
        for (int j = 0; j < blk; j++) {
            float q = round_even(x[j] * id);
            y[j] = d * q;
            sum += q;
        }
        if (fix) {              /* Q8_1's sum, s = binary16(scale * sum) with the scale unrounded */
            uint16_t sh = to_f16(amax / 127.0f * sum);
            uint8_t sb[2] = {(uint8_t)sh, (uint8_t)(sh >> 8)};
            *fix++ = f16(sb) - d * sum;
        }
    }
    return 1;
}

/* ------------------------------------------------------------------- integer products on Q8_K codes */

/* The k-quants (Q2_K ... Q6_K) and the codebook types IQ1_S, IQ2_XXS, IQ2_XS and IQ3_XXS times an
   input of Q8_K codes: per 32 weights, bytes of codes times bytes of input summed in 16 and 32 bits
   (vpmaddubsw, vpmaddwd), the block's sub-scales applied as integers, and one or two float multiplies
   per 256 weights. The weights' codes are taken unsigned; their offsets (minima, Q3_K's 4, Q6_K's 32,
   IQ1_S's one and delta) come off through the input's sums per 16, and signs go onto the input codes. */

void ggml_quantize_q8k(const float *x, int64_t n, ggml_q8k_t *y) {
    for (int64_t b = 0; b < n; b += 256, x += 256, y++) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 256; j++) {
            float a = fabsf(x[j]);
            if (a > amax) { amax = a; max = x[j]; }
        }
        if (amax == 0.0f) {
            memset(y, 0, sizeof *y);
            continue;
        }
        float iscale = -127.0f / max;
        y->d = 1.0f / iscale;
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 16 * g; j < 16 * g + 16; j++) {
                float q = round_even(iscale * x[j]);
                y->qs[j] = (int8_t)(q > 127.0f ? 127 : (int)q);
                s += y->qs[j];
            }
            y->bsums[g] = (int16_t)s;
        }
    }
}

#if GGML_X86
INL int hsum_i32(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}

/* sum over the 16 groups of scale[g] * bsums[g], scales as 16 int16 */
INL int scaled_bsums(__m256i scales16, const ggml_q8k_t *y) {
    return hsum_i32(_mm256_madd_epi16(scales16, _mm256_loadu_si256((const __m256i *)y->bsums)));
}

/* byte shuffles taking int16 scales 2s (into the low 128 bits) and 2s + 1 (high) of a 128-bit lane */
static const uint8_t PAIR_MASK[4][32] = {
#define P2(a) a, a + 1
#define R8(a) P2(a), P2(a), P2(a), P2(a), P2(a), P2(a), P2(a), P2(a)
    {R8(0), R8(2)}, {R8(4), R8(6)}, {R8(8), R8(10)}, {R8(12), R8(14)},
#undef R8
#undef P2
};

/* the 32 products of codes q (unsigned bytes) by input bytes x, summed per 16 and scaled: sc16h holds
   eight int16 scales in both lanes, and pair s takes scales 2s (first 16) and 2s + 1 (last 16) */
INL __m256i dot32(__m256i q, const int8_t *x, __m256i sc16h, int s) {
    __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_madd_epi16(p, _mm256_shuffle_epi8(sc16h, LD32(PAIR_MASK[s])));
}

/* lane h of sixteen int16 scales, in both lanes */
INL __m256i half_scales(__m256i sc16, int h) {
    return _mm256_broadcastsi128_si256(h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
}

INL float q2_k_q8k(const uint8_t *b, const ggml_q8k_t *y) {
    __m128i s8 = _mm_loadu_si128((const __m128i *)b);
    __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(15)));
    __m256i scales = _mm256_cvtepu8_epi16(_mm_and_si128(s8, _mm_set1_epi8(15)));
    const __m256i m3 = _mm256_set1_epi8(3);
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256i v = LD32(b + 16 + 32 * h), sh = half_scales(scales, h);
        for (int s = 0; s < 4; s++)
            acc = _mm256_add_epi32(acc, dot32(_mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m3),
                                              y->qs + 128 * h + 32 * s, sh, s));
    }
    return y->d * f16(b + 80) * (float)hsum_i32(acc) - y->d * f16(b + 82) * (float)scaled_bsums(mins, y);
}

INL float q3_k_q8k(const uint8_t *b, const ggml_q8k_t *y) {
    const uint8_t *ss = b + 96;
    int16_t sc[16];
    for (int g = 0; g < 16; g++) {
        int lo = g < 8 ? ss[g] & 15 : ss[g - 8] >> 4;
        int hi = (ss[8 + g % 4] >> (2 * (g / 4))) & 3;
        sc[g] = (int16_t)((lo | (hi << 4)) - 32);
    }
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), scales = _mm256_loadu_si256((const __m256i *)sc);
    __m256i hm = LD32(b), acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256i v = LD32(b + 32 + 32 * h), sh = half_scales(scales, h);
        for (int s = 0; s < 4; s++) {
            /* code + 4 when the high bit is set: 0 .. 7, the weight's value plus 4 */
            __m256i ql = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m3);
            __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), one);
            acc = _mm256_add_epi32(acc, dot32(_mm256_or_si256(ql, _mm256_slli_epi16(hb, 2)),
                                              y->qs + 128 * h + 32 * s, sh, s));
        }
    }
    int off = 4 * scaled_bsums(scales, y);
    return y->d * f16(b + 108) * (float)(hsum_i32(acc) - off);
}

INL float q6_k_q8k(const uint8_t *b, const ggml_q8k_t *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256i l0 = LD32(ql + 64 * h), l1 = LD32(ql + 64 * h + 32), hh = LD32(qh + 32 * h), sh = half_scales(scales, h);
        /* codes 0 .. 63 (the weight plus 32) of values 128 h + 32 k + (0 .. 31), k = 0 .. 3 */
        __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hh, m3), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), m3), 4)),
        };
        for (int k = 0; k < 4; k++)
            acc = _mm256_add_epi32(acc, dot32(q[k], y->qs + 128 * h + 32 * k, sh, k));
    }
    int off = 32 * scaled_bsums(scales, y);
    return y->d * f16(b + 208) * (float)(hsum_i32(acc) - off);
}

INL __m256i signs32(uint32_t aux) {
    return _mm256_set_epi64x((long long)SIGNS_I8[(aux >> 21) & 127], (long long)SIGNS_I8[(aux >> 14) & 127],
                             (long long)SIGNS_I8[(aux >> 7) & 127], (long long)SIGNS_I8[aux & 127]);
}

INL __m256i grid32(const uint8_t *grid, int i0, int i1, int i2, int i3) {
    uint64_t g[4];
    memcpy(&g[0], grid + 8 * i0, 8); memcpy(&g[1], grid + 8 * i1, 8);
    memcpy(&g[2], grid + 8 * i2, 8); memcpy(&g[3], grid + 8 * i3, 8);
    return _mm256_set_epi64x((long long)g[3], (long long)g[2], (long long)g[1], (long long)g[0]);
}

/* the 32 products of unsigned codes q by input bytes x, times `scale`, as eight int32 partial sums */
INL __m256i sum32(__m256i q, __m256i x, int scale) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16((short)scale));
}

/* Q4_K / Q5_K: per 32 weights a 6-bit scale and a 6-bit minimum; the minima through the input's sums */
INL float q45_k_q8k(const uint8_t *b, const ggml_q8k_t *y, int five) {
    const uint8_t *qs = b + (five ? 48 : 16);
    const __m256i m15 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256i qh = five ? LD32(b + 16) : _mm256_setzero_si256(), acc = _mm256_setzero_si256();
    int mins = 0;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k4_scale_min(b + 4, j, &sc, &m);
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(LD32(qs + 32 * (j / 2)), 4 * (j % 2)), m15);
        if (five) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
        acc = _mm256_add_epi32(acc, sum32(q, _mm256_loadu_si256((const __m256i *)(y->qs + 32 * j)), sc));
        mins += m * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
    }
    return y->d * f16(b) * (float)hsum_i32(acc) - y->d * f16(b + 2) * (float)mins;
}
INL float q4_k_q8k(const uint8_t *b, const ggml_q8k_t *y) { return q45_k_q8k(b, y, 0); }
INL float q5_k_q8k(const uint8_t *b, const ggml_q8k_t *y) { return q45_k_q8k(b, y, 1); }

/* IQ2_XXS: per 32 weights four codebook rows (8, 25 or 43) with their signs put on the input */
INL float iq2_xxs_q8k(const uint8_t *b, const ggml_q8k_t *y) {
    __m256i acc = _mm256_setzero_si256();
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 8 * ib;
        uint32_t aux = u32(q + 4);
        __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * ib)), signs32(aux));
        acc = _mm256_add_epi32(acc, sum32(grid32(igrid_iq2xxs, q[0], q[1], q[2], q[3]), x, (int)(2 * (aux >> 28) + 1)));
    }
    return y->d * f16(b) * 0.125f * (float)hsum_i32(acc);
}

/* IQ2_XS: per 16 weights two codebook rows (9-bit indices, 7 sign bits each) and a 4-bit scale */
INL float iq2_xs_q8k(const uint8_t *b, const ggml_q8k_t *y) {
    __m256i acc = _mm256_setzero_si256();
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 8 * ib;
        uint16_t e[4] = {u16(q), u16(q + 2), u16(q + 4), u16(q + 6)};
        uint32_t signs = (e[0] >> 9) | ((uint32_t)(e[1] >> 9) << 7) | ((uint32_t)(e[2] >> 9) << 14) |
                         ((uint32_t)(e[3] >> 9) << 21);
        __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * ib)), signs32(signs));
        __m256i p = _mm256_maddubs_epi16(grid32(igrid_iq2xs, e[0] & 511, e[1] & 511, e[2] & 511, e[3] & 511), x);
        int s0 = 2 * (b[66 + ib] & 15) + 1, s1 = 2 * (b[66 + ib] >> 4) + 1;
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set_m128i(_mm_set1_epi16((short)s1),
                                                                          _mm_set1_epi16((short)s0))));
    }
    return y->d * f16(b) * 0.125f * (float)hsum_i32(acc);
}

/* IQ3_XXS: per 32 weights eight 4-byte codebook rows, signs as IQ2_XXS's */
INL float iq3_xxs_q8k(const uint8_t *b, const ggml_q8k_t *y) {
    const uint8_t *qs = b + 2, *ss = b + 66;
    __m256i acc = _mm256_setzero_si256();
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 8 * ib;
        uint32_t aux = u32(ss + 4 * ib), g[8];
        for (int l = 0; l < 8; l++) memcpy(&g[l], igrid_iq3xxs + 4 * q[l], 4);
        __m256i grid = _mm256_setr_epi32((int)g[0], (int)g[1], (int)g[2], (int)g[3], (int)g[4], (int)g[5], (int)g[6],
                                         (int)g[7]);
        __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * ib)), signs32(aux));
        acc = _mm256_add_epi32(acc, sum32(grid, x, (int)(2 * (aux >> 28) + 1)));
    }
    return y->d * f16(b) * 0.25f * (float)hsum_i32(acc);
}

/* IQ1_S: per 32 weights (2 s + 1) (codebook levels + delta); levels are stored plus one, the one and
   the delta (1/8) come off through the input's sums */
INL float iq1_s_q8k(const uint8_t *b, const ggml_q8k_t *y) {
    __m256i acc = _mm256_setzero_si256();
    int rest = 0;
    for (int ib = 0; ib < 8; ib++) {
        uint32_t qh = u16(b + 34 + 2 * ib);
        const uint8_t *qs = b + 2 + 4 * ib;
        __m256i g = grid32(igrid_iq1s, qs[0] | ((qh & 7) << 8), qs[1] | (((qh >> 3) & 7) << 8),
                           qs[2] | (((qh >> 6) & 7) << 8), qs[3] | (((qh >> 9) & 7) << 8));
        int sc = (int)(2 * ((qh >> 12) & 7) + 1), bs = y->bsums[2 * ib] + y->bsums[2 * ib + 1];
        acc = _mm256_add_epi32(acc, sum32(g, _mm256_loadu_si256((const __m256i *)(y->qs + 32 * ib)), 8 * sc));
        rest += sc * ((qh & 0x8000 ? -bs : bs) - 8 * bs);
    }
    return y->d * f16(b) * 0.125f * (float)(hsum_i32(acc) + rest);
}

/* one row of blocks times each input, the block product inlined */
#define Q8K_ROW(name, bytes) \
    AVX2 static void name##_row(const uint8_t *src, int64_t nblocks, const ggml_q8k_t *y, int64_t ntok, float *acc) { \
        for (int64_t t = 0; t < ntok; t++) { \
            const ggml_q8k_t *yt = y + t * nblocks; \
            float s = 0.0f; \
            for (int64_t i = 0; i < nblocks; i++) { \
                __builtin_prefetch(src + (i + 4) * (bytes)); \
                s += name##_q8k(src + i * (bytes), yt + i); \
            } \
            acc[t] += s; \
        } \
    }
Q8K_ROW(q2_k, 84)
Q8K_ROW(q3_k, 110)
Q8K_ROW(q4_k, 144)
Q8K_ROW(q5_k, 176)
Q8K_ROW(q6_k, 210)
Q8K_ROW(iq2_xxs, 66)
Q8K_ROW(iq1_s, 50)
Q8K_ROW(iq2_xs, 74)
Q8K_ROW(iq3_xxs, 98)
#endif

typedef void (*q8k_row_fn)(const uint8_t *, int64_t, const ggml_q8k_t *, int64_t, float *);

/* a type's integer row product, and up to how many inputs it beats decoding each block once for all of
   them (it unpacks every block again per input; measured on random blocks, two threads, 1024 x 1024) */
static q8k_row_fn q8k_row(int type, int *max_inputs) {
    *max_inputs = 0;
#if GGML_X86
    if (ggml_avx2) {
        switch (type) {
        case GT_Q2_K: *max_inputs = 16; return q2_k_row;
        case GT_Q6_K: *max_inputs = 16; return q6_k_row;
        case GT_Q4_K: *max_inputs = 4; return q4_k_row;
        case GT_Q3_K: *max_inputs = 2; return q3_k_row;
        case GT_Q5_K: *max_inputs = 2; return q5_k_row;
        case GT_IQ2_XXS: *max_inputs = 2; return igrid_iq2xxs ? iq2_xxs_row : NULL;
        case GT_IQ2_XS: *max_inputs = 2; return igrid_iq2xs ? iq2_xs_row : NULL;
        case GT_IQ3_XXS: *max_inputs = 2; return igrid_iq3xxs ? iq3_xxs_row : NULL;
        case GT_IQ1_S: *max_inputs = 1; return igrid_iq1s ? iq1_s_row : NULL;
        default: break;
        }
    }
#endif
    (void)type;
    return NULL;
}

int ggml_int_inputs(int type) {
    int n;
    return q8k_row(type, &n) ? n : 0;
}

void ggml_row_dot_q8k(int type, const uint8_t *src, int64_t nblocks, const ggml_q8k_t *y, int64_t ntok, float *acc) {
    int n;
    q8k_row_fn f = q8k_row(type, &n);
    if (f) f(src, nblocks, y, ntok, acc);
}

/* ------------------------------------------------------------------------------------------ products */

static float dot_generic(const float *a, const float *b, int64_t n) {
    float s[8] = {0};
    for (int64_t i = 0; i < n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

#if GGML_X86
/* n is a multiple of 32 */
__attribute__((target("avx2,fma"))) static void dots_avx2(const float *w, int64_t n, const float *x, int64_t xstride,
                                                            int64_t ntok, float *acc) {
    for (int64_t t = 0; t < ntok; t++) {
        const float *xt = x + t * xstride;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 32) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(xt + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(xt + i + 8), s1);
            s2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(xt + i + 16), s2);
            s3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(xt + i + 24), s3);
        }
        __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        acc[t] += _mm_cvtss_f32(h);
    }
}
#endif

/* acc[t] += sum over blocks of the block's offset (Q4_1/Q5_1: binary16 at byte 2) times fix[t][block] */
static void offset_fix(const uint8_t *src, int64_t nblocks, int64_t nb, const float *fix, int64_t ntok, float *acc) {
    for (int64_t t = 0; t < ntok; t++) {
        const float *f = fix + t * nblocks;
        float s = 0.0f;
        for (int64_t i = 0; i < nblocks; i++) s += f16(src + i * nb + 2) * f[i];
        acc[t] += s;
    }
}

void ggml_row_dot(int type, const uint8_t *src, int64_t nblocks, const float *x, int64_t xstride, int64_t ntok,
                  float *acc, float *buf, const float *fix) {
    int64_t w, nb;
    deq_fn f = decoder(type);
    if (!f || !ggml_block_size(type, &w, &nb)) return;
    if (fix && ggml_input_fix(type)) offset_fix(src, nblocks, nb, fix, ntok, acc);
#if GGML_X86
    if (ntok == 1 && row_dot_fused(type, src, nblocks, w, nb, x, acc)) return;
#endif
    for (int64_t i = 0; i < nblocks; i++) {
        f(src + i * nb, buf);
#if GGML_X86
        if (ggml_avx2) {
            dots_avx2(buf, w, x + i * w, xstride, ntok, acc);
            continue;
        }
#endif
        for (int64_t t = 0; t < ntok; t++) acc[t] += dot_generic(buf, x + t * xstride + i * w, w);
    }
}
