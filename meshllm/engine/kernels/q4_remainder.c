/* The per-block remainder of a Q4_1 matrix held as Q4_0, as one ggml custom op.
 *
 * ggml_weights.split_q4_1 holds a Q4_1 matrix W as Q4_0 blocks (the same d and nibbles, meaning
 * d*(q - 8)) plus R[b][r] = 8d + m, constant over block b of row r, so that
 *     W x = Q4_0(W) x + sum_b R[b][r] * (x summed over block b).
 * This op adds the second term to the first: dst = src0 + R^T blocksums(x), with
 *     src0 f32 [rows, n]   the Q4_0 product (ggml ne0 = rows)
 *     src1 f32 [cols, n]   x
 *     src2 f32 or f16 [8, K, rows / 8]   R group-major, K = cols / 32 (GGMLMatrix holds it so
 *                          for quant_few_rows.c): R[b][i] at ((i / 8) * K + b) * 8 + i % 8; f16
 *                          where every value is a float16 (the same values, in half the bytes)
 * In ggml ops that is sum_rows + out_prod + add: three nodes, and out_prod runs on one thread for
 * a one-row product; here one node, its rows split over the threads (SmolLM2 Q4_1 decode, 2
 * threads: 360 nodes a token fewer). Each output row depends only on its own x row, so a k-row
 * verify pass adds what k one-row steps add. Built by build.py (plain C, -O3 -march=native) against
 * the pinned ggml's header. Where quant_few_rows.c's op runs (AVX-512 VNNI) it adds the remainder
 * itself and this op is not in the graph. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#if !defined(__F16C__) /* with F16C the op converts 8 at once */
/* A float16's value, exactly (every float16 is a float). */
static inline float half_to_float(uint16_t h) {
#if defined(__aarch64__)
    __fp16 f;
    memcpy(&f, &h, sizeof f);
    return f;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (mant << 13); /* inf, nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (mant << 13);
    else if (!mant) bits = sign;
    else { /* subnormal: mant * 2^-24, normalised */
        uint32_t e = 113;
        while (!(mant & 0x400)) { mant <<= 1; e--; }
        bits = sign | (e << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}
#endif

size_t meshllm_q4_remainder_tensor_size(void) { return sizeof(struct ggml_tensor); }

void meshllm_ggml_q4_remainder(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *main = dst->src[0], *x = dst->src[1], *r = dst->src[2];
    const int64_t rows = dst->ne[0], n = dst->ne[1], cols = x->ne[0], blocks = cols / 32;
    /* ggml_stage.py builds only these; anything else is a bug, not bad input */
    const size_t r_size = r->type == GGML_TYPE_F16 ? 2 : 4;
    if (main->type != GGML_TYPE_F32 || x->type != GGML_TYPE_F32 || (r->type != GGML_TYPE_F32 && r->type != GGML_TYPE_F16)
        || dst->type != GGML_TYPE_F32 || cols % 32 || main->ne[0] != rows || main->ne[1] != n || x->ne[1] != n
        || rows % 8 || r->ne[0] != 8 || r->ne[1] != blocks || r->ne[2] != rows / 8 || x->nb[0] != sizeof(float)
        || main->nb[0] != sizeof(float) || r->nb[0] != r_size || r->nb[1] != 8 * r_size
        || r->nb[2] != (size_t)blocks * 8 * r_size || dst->nb[0] != sizeof(float)) abort();
    /* the threads split the groups of 8 rows: a group's R column is 8 contiguous floats a block */
    const int64_t groups = rows / 8, per = (groups + nth - 1) / nth, g0 = ith * per;
    const int64_t g1 = g0 + per < groups ? g0 + per : groups;
    if (g0 >= g1) return;
    for (int64_t j = 0; j < n; j++) {
        const float *xj = (const float *)((const char *)x->data + j * x->nb[1]);
        const float *mj = (const float *)((const char *)main->data + j * main->nb[1]);
        float *out = (float *)((char *)dst->data + j * dst->nb[1]);
        for (int64_t i = g0 * 8; i < g1 * 8; i++) out[i] = mj[i];
        for (int64_t b = 0; b < blocks; b++) {
            float sum = 0.0f;
            for (int k = 0; k < 32; k++) sum += xj[b * 32 + k];
            for (int64_t g = g0; g < g1; g++) {
                const int64_t at = (g * blocks + b) * 8;
                float rg[8];
                if (r_size == 4) memcpy(rg, (const float *)r->data + at, sizeof rg);
                else {
#if defined(__F16C__)
                    _mm256_storeu_ps(rg, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)r->data + at))));
#else
                    for (int i = 0; i < 8; i++) rg[i] = half_to_float(((const uint16_t *)r->data)[at + i]);
#endif
                }
                for (int i = 0; i < 8; i++) out[g * 8 + i] += rg[i] * sum;
            }
        }
    }
}
