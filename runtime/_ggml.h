/* llama.cpp's block types (GGUF tensors kept as they are): decoding and dot products, for _qdot.c. */
#ifndef KIMI_GGML_H
#define KIMI_GGML_H
#include <stdint.h>

/* GGML type ids, as in the GGUF format */
enum {
    GT_Q4_0 = 2, GT_Q4_1 = 3, GT_Q5_0 = 6, GT_Q5_1 = 7, GT_Q8_0 = 8, GT_Q2_K = 10, GT_Q3_K = 11, GT_Q4_K = 12,
    GT_Q5_K = 13, GT_Q6_K = 14, GT_IQ2_XXS = 16, GT_IQ2_XS = 17, GT_IQ3_XXS = 18, GT_IQ1_S = 19, GT_IQ4_NL = 20,
    GT_IQ3_S = 21, GT_IQ2_S = 22, GT_IQ4_XS = 23, GT_IQ1_M = 29, GT_TQ1_0 = 34, GT_TQ2_0 = 35,
};

/* tables built once, at module load */
void ggml_init(void);
/* weights and bytes per block of `type`; 0 if the type is unknown or its codebook is not loaded yet */
int ggml_block_size(int type, int64_t *weights, int64_t *bytes);
/* whether `type` needs a codebook (a grid handed in by ggml_set_grid before use) */
int ggml_needs_grid(int type);
/* the codebook of an IQ type: `n` float32 values (entries x 8 or x 4 levels), copied; -1 on a bad size */
int ggml_set_grid(int type, const float *grid, int64_t n);
/* the `nblocks` blocks at `src` decoded to float32, as the gguf package's dequantizer computes them */
void ggml_decode(int type, const uint8_t *src, int64_t nblocks, float *out);
/* for each of `ntok` inputs x[t * xstride ..], acc[t] += (the row of `nblocks` blocks at src) . x;
   `buf` holds one block's weights (256 floats); `fix` (NULL: none) nblocks corrections per input
   from ggml_round_input */
void ggml_row_dot(int type, const uint8_t *src, int64_t nblocks, const float *x, int64_t xstride, int64_t ntok,
                  float *acc, float *buf, const float *fix);

/* values per scale of the 8-bit input llama.cpp multiplies a `type` weight by (0: none) */
int ggml_input_block(int type);
/* whether llama.cpp's input for `type` carries a block sum of its own (Q8_1: Q4_1 and Q5_1 weights) */
int ggml_input_fix(int type);
/* y = x (n values) rounded as llama.cpp rounds the input of a `type` weight; 0 if it does not. For
   ggml_input_fix types, `fix` (if not NULL) receives n / 32 corrections for ggml_row_dot */
int ggml_round_input(int type, const float *x, float *y, int64_t n, float *fix);

/* An input rounded to Q8_K (llama.cpp's layout in spirit: 256 int8 codes, their scale, and the sums of
   each 16 codes), for the integer products below */
typedef struct {
    float d;
    int16_t bsums[16];
    int8_t qs[256];
} ggml_q8k_t;

/* up to how many inputs at a time `type`'s integer product with Q8_K inputs is the faster one (0: it
   has none here; it needs AVX2) */
int ggml_int_inputs(int type);
/* x (n values, a multiple of 256) rounded as ggml_round_input rounds it for a Q8_K type, as codes */
void ggml_quantize_q8k(const float *x, int64_t n, ggml_q8k_t *y);
/* acc[t] += (the row of `nblocks` blocks at src) . y_t for the ntok inputs y_t = y + t * nblocks, in
   integers per block as llama.cpp computes it; ggml_int_inputs(type) must be > 0 */
void ggml_row_dot_q8k(int type, const uint8_t *src, int64_t nblocks, const ggml_q8k_t *y, int64_t ntok, float *acc);

#endif
