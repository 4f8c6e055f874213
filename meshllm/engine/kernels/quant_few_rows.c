/* Quantized matrices x a few activation rows, as ggml custom ops: Q4_0 in ggml's repacked 8-row
 * layout (with a Q4_1 matrix's remainder) and Q8_0 in its plain layout. The Q4_0 op takes prefill
 * chunks too, faster than ggml's repacked GEMM (ggml_stage.ALL_ROWS_OPS has the figures).
 *
 * Why: on AMD Zen 4 at one thread ggml's products cost nearly a whole step per extra activation
 * row (SmolLM2 as shipped, Q4_1 held as Q4_0: a 4-row step 3.3x a 1-row step, 8 rows 5.3x; its
 * Q8_0 head 2 rows 3.6x one), so a speculative verify pass of k+1 rows cost about as much as
 * k+1 plain steps and drafting rarely paid. Here each weight block is loaded and unpacked once
 * and multiplied with every activation row (AVX-512 VNNI dot products), so an extra row costs
 * only its own multiply-adds. Measured, one thread, 4 Q4_0 matrices of 5632x2048 in one graph:
 * 1 / 2 / 4 / 8 rows 0.84 / 1.06 / 1.83 / 5.3 ms, ggml's 1.28 / 2.64 / 4.19 / 8.2 ms.
 *
 * Exactness: activations are quantized per 32 values to int8 exactly as ggml's x86 q8_0 does
 * (same scale, f16-rounded; same rounding), the integer dot of each block is ggml's, and scaling,
 * accumulation and final sums follow ggml's one-row kernels (gemv_q4_b32_8x8_q8_0, q4_remainder.c,
 * vec_dot_q8_0_q8_0) op for op: one row is bitwise ggml's product, and a row's result never
 * depends on the rows beside it, so a k-row verify pass scores bitwise what k one-row steps
 * score (tests/engine/test_quant_few_rows.py checks both).
 *
 *     src0  Q4_0 [K, N] in ggml's CPU_REPACK buffer: block_q4_0x8 (8 f16 scales, then 128 bytes
 *           of nibbles XORed with 0x88, 8-byte chunks: chunk i holds bytes (i / 8) * 8 .. +8 of
 *           row i % 8's block), blocks of a group of 8 rows contiguous; N % 8 == 0
 *           or Q8_0 [K, N] plain: per row K / 32 blocks of an f16 scale and 32 int8
 *     src1  f32 [K, n] activations, n <= OP_MAX_ROWS for Q8_0, any n for Q4_0
 *     src2  Q4_0 only, optional: a Q4_1 matrix's per-block remainder R (ggml_weights.split_q4_1),
 *           adding sum_b R[b][r] * (x summed over block b); f32 or f16 (the same values where
 *           all are float16s: 2 bytes a block less to read), group-major [8, K / 32, N / 8]
 *           (R[b][r] at ((r / 8) * (K / 32) + b) * 8 + r % 8), contiguous
 *     dst   f32 [N, n]
 * Built by build.py with -march=native against the pinned ggml's header; without AVX-512 VNNI it
 * builds as ops that report themselves unavailable (meshllm_quant_few_rows_available() == 0). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"

size_t meshllm_quant_few_rows_tensor_size(void) { return sizeof(struct ggml_tensor); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include "few_rows.h"

#define GROUP_BYTES (8 * 2 + 128)

int meshllm_quant_few_rows_available(void) { return 1; }

/* Per activation row and 32-value block, what the op at hand reads: for Q4_0 weights the int8
 * values, -8 * (their sum) (the Q4_0 offset: weights are d * (q - 8) with q the unsigned nibble)
 * and, with a Q4_1 remainder, the float sum of the block; for Q8_0 weights (signed) the values
 * offset to unsigned (+128); for both the scale. Stored block by block (block b of row m at
 * b * rows + m): a pass reads block b of all its rows together, from one or two cache lines, where
 * rows K bytes apart kept more lines live than L1 holds beside the weights streaming through it.
 * Measured, one thread, 16 Q4_0 matrices 4096x576 (SmolLM2's widths) in one-op graphs: 4 / 8 rows
 * 2.0 / 3.4 -> 1.7 / 2.8 ms (with the offset broadcast from memory, below), 1 row unchanged.
 * It also carries, per call, where a Q4_1 product's remainder lies beside the weights (below). */
struct quantized {
    int8_t *q;
    uint8_t *u;
    float *d, *sum;
    int32_t *offset;
    size_t capacity;
    int64_t rows;
    /* a Q4_1 product's remainder (src2, group-major; NULL for Q4_0; f32 or, in remainder_f16, f16),
     * and the weights' first group of 8 rows (a pass adds the columns of R of the groups it multiplies) */
    const void *remainder;
    int remainder_f16;
    const uint8_t *groups;
};

enum { FOR_Q4_0 = 1, WITH_SUMS = 2, FOR_Q8_0 = 4 };

static void quantize_rows(const struct ggml_tensor *x, int64_t n, int64_t K, struct quantized *out, int what) {
    const int64_t blocks = K / 32;
    if ((size_t)(n * K) > out->capacity) {
        free(out->q); free(out->u); free(out->d); free(out->sum); free(out->offset);
        out->capacity = (size_t)(n * K);
        out->q = malloc(out->capacity);
        out->u = malloc(out->capacity);
        out->d = malloc(out->capacity / 32 * sizeof(float));
        out->sum = malloc(out->capacity / 32 * sizeof(float));
        out->offset = malloc(out->capacity / 32 * sizeof(int32_t));
        if (!out->q || !out->u || !out->d || !out->sum || !out->offset) abort();
    }
    out->rows = n;
    for (int64_t m = 0; m < n; m++) {
        const float *row = (const float *)((const char *)x->data + m * x->nb[1]);
        for (int64_t b = 0; b < blocks; b++) {
            const __m512 v0 = _mm512_loadu_ps(row + b * 32), v1 = _mm512_loadu_ps(row + b * 32 + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            /* as ggml's x86 quantize_row_q8_0: the same id, the scale kept as f16 */
            const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            const int64_t i = b * n + m;
            out->d[i] = _cvtsh_ss(_cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT));
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
            const __m256i q = _mm256_set_m128i(_mm512_cvtsepi32_epi8(q1), _mm512_cvtsepi32_epi8(q0));
            if (what & FOR_Q4_0) {
                _mm256_storeu_si256((__m256i *)(out->q + i * 32), q);
                out->offset[i] = -8 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            }
            if (what & FOR_Q8_0)
                _mm256_storeu_si256((__m256i *)(out->u + i * 32), _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)));
            if (what & WITH_SUMS) {
                float sum = 0.0f; /* in order, as q4_remainder.c sums a block */
                for (int k = 0; k < 32; k++) sum += row[b * 32 + k];
                out->sum[i] = sum;
            }
        }
    }
}

/* A worker's quantized activations outlive the call up to OP_MAX_ROWS rows (a decode step's or a
 * verify pass's, reused every step); a prefill chunk's (512 rows of 5632: 6 MiB) are given back. */
static void release_large(struct quantized *xq) {
    if (xq->rows <= OP_MAX_ROWS) return;
    free(xq->q); free(xq->u); free(xq->d); free(xq->sum); free(xq->offset);
    memset(xq, 0, sizeof *xq);
}

/* Activation row i's integer dot with one block of 8 weight rows: lanes 2r and 2r+1 hold row r's
 * two halves, the Q4_0 offset in lane 2r. */
static inline __attribute__((always_inline)) __m512i row_dot(__m512i lo0, __m512i lo1, __m512i hi0, __m512i hi1,
                                                            const struct quantized *xq, int64_t i) {
    const int64_t *xb = (const int64_t *)(xq->q + i * 32);
    /* into lane 2r only; a masked broadcast from memory, not a move from a general register */
    __m512i dot = _mm512_maskz_set1_epi32(0x5555, xq->offset[i]);
    dot = _mm512_dpbusd_epi32(dot, lo0, _mm512_set1_epi64(xb[0]));
    dot = _mm512_dpbusd_epi32(dot, lo1, _mm512_set1_epi64(xb[1]));
    dot = _mm512_dpbusd_epi32(dot, hi0, _mm512_set1_epi64(xb[2]));
    return _mm512_dpbusd_epi32(dot, hi1, _mm512_set1_epi64(xb[3]));
}

/* Two activation rows' dots with a block of 8 weight rows (lanes 2r and 2r+1: weight row r's
 * halves) -> row m's whole dot in lane 2r, row m+1's in lane 2r+1, each lane's integer sum the
 * one-row form's (dot + its upper half), so the two rows share one conversion, scaling and
 * accumulation: 8 rows of SmolLM2's Q4_1 matrices 11.1 -> 9.2 ms, one thread. */
static inline __attribute__((always_inline)) __m512i pair_dots(__m512i a, __m512i c) {
    const __m512i own = _mm512_mask_blend_epi32(0xaaaa, a, c); /* a[2r], c[2r+1] */
    const __m512i other = _mm512_shuffle_epi32(_mm512_mask_blend_epi32(0x5555, a, c), _MM_PERM_CDAB); /* a[2r+1], c[2r] */
    return _mm512_add_epi32(own, other);
}

/* lanes 2r / 2r+1: activation rows i / i+1's scales (adjacent floats: stored block-major) */
static inline __attribute__((always_inline)) __m512 pair_scales(const struct quantized *xq, int64_t i) {
    return _mm512_castsi512_ps(_mm512_set1_epi64(*(const int64_t *)(xq->d + i)));
}

/* The 8 weight rows' f16 scales that open a block of both 8-row layouts, each twice: lanes 2r
 * and 2r+1 hold weight row r's */
static inline __attribute__((always_inline)) __m512 group_scales(const uint8_t *blk) {
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk))));
}

/* One block's integer dots of MX activation rows (dots[m]: row i + m's, lanes 2r and 2r+1 weight
 * row r's halves) scaled by the weight rows' scales `dw` and each row's own, and summed into acc
 * in block order: rows paired in acc[m / 2] (pair_dots), an odd last row alone in lanes 2r of
 * acc[MX / 2], each lane's arithmetic that of ggml's one-row gemv. */
static inline __attribute__((always_inline)) void accumulate_block(__m512 acc[], const __m512i dots[], __m512 dw,
                                                                   const struct quantized *xq, int64_t i, int MX) {
    /* unrolled for all ROWS_PER_PASS / 2 pairs (8 must stay >= that): unrolled 4 deep, a 12-row
     * pass indexed acc[] in memory (17 stack accesses a block, 236 instructions against 173), and
     * prefill, which runs passes of 12, went ~10% slower (SmolLM2 Q4_1 / Q8_0, 177 and 512 rows) */
#pragma GCC unroll 8
    for (int m = 0; m + 1 < MX; m += 2)
        acc[m / 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_dots(dots[m], dots[m + 1])),
                                     _mm512_mul_ps(dw, pair_scales(xq, i + m)), acc[m / 2]);
    if (MX % 2) {
        const __m512i dot = _mm512_add_epi32(dots[MX - 1], _mm512_srli_epi64(dots[MX - 1], 32));
        acc[MX / 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(xq->d[i + MX - 1])),
                                      acc[MX / 2]);
    }
}

/* acc[m / 2] holds row m in lanes 2r for even m, in lanes 2r+1 for odd m: row m's 8 outputs */
static inline __attribute__((always_inline)) void store_rows(__m512 acc[], int MX, float out[][8]) {
    const __m512i evens = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_set_epi32(14, 12, 10, 8, 6, 4, 2, 0, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int m = 0; m < MX; m++)
        _mm256_storeu_ps(out[m], _mm512_castps512_ps256(_mm512_permutexvar_ps(m % 2 ? odds : evens, acc[m / 2])));
}

PASS_DRIVERS(quantized, struct quantized)

/* A Q4_1 matrix's remainder term, sum_b R[b][r] * (x row m summed over block b), added to the
 * Q4_0 products of a group of 8 weight rows (first row r0) in acc (as accumulate_block left them):
 * per output one fused multiply-add per block, in block order, after the whole Q4_0 sum, which is
 * the arithmetic of q4_remainder.c's op after ggml's product (so one row stays bitwise ggml's
 * product plus that op, and rows stay independent). In the pass, not as a sweep over the outputs
 * after it: that sweep read and wrote every output row once per block, 12% of a SmolLM2 Q4_1
 * decode step (perf, 1 and 9 rows). R group-major (ggml_weights.GGMLMatrix), so a group's column
 * streams beside its weights: R[blocks][N] read a column per group, one cache line and often one
 * page per block, and a step was slower than with the sweep (1 row 4.4 -> 5.2-6.4 ms). */
static inline __attribute__((always_inline)) void add_remainder(__m512 acc[], const struct quantized *xq, int64_t K,
                                                                int64_t r0, int64_t m0, int MX) {
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const int64_t blocks = K / 32;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = r0 * blocks + b * 8; /* R[b][r0 .. r0 + 8) */
        const __m256 r8 = xq->remainder_f16
            ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)xq->remainder + at)))
            : _mm256_loadu_ps((const float *)xq->remainder + at);
        const __m512 rb = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(r8));
        const float *s = xq->sum + b * xq->rows + m0;
#pragma GCC unroll 8 /* at least ROWS_PER_PASS / 2, as in accumulate_block */
        for (int m = 0; m + 1 < MX; m += 2) /* lanes 2r / 2r+1: rows m / m+1's block sums */
            acc[m / 2] = _mm512_fmadd_ps(rb, _mm512_castsi512_ps(_mm512_set1_epi64(*(const int64_t *)(s + m))),
                                         acc[m / 2]);
        if (MX % 2) acc[MX / 2] = _mm512_fmadd_ps(rb, _mm512_set1_ps(s[MX - 1]), acc[MX / 2]);
    }
}

/* One group of 8 weight rows against activation rows [m0, m0 + MX): out[m][0..8). */
static inline __attribute__((always_inline)) void group_rows(const uint8_t *group, const struct quantized *xq,
                                                             int64_t K, int64_t m0, int MX, float out[][8]) {
    const int64_t blocks = K / 32;
    const int64_t r0 = xq->remainder ? (group - xq->groups) / (blocks * GROUP_BYTES) * 8 : 0; /* its first row */
    __m512 acc[(ROWS_PER_PASS + 1) / 2]; /* rows m and m+1 share acc[m / 2]: lanes 2r and 2r+1 */
    for (int m = 0; m < (MX + 1) / 2; m++) acc[m] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x88);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = group + b * GROUP_BYTES;
        const __m512i q0 = _mm512_xor_si512(_mm512_loadu_si512(blk + 16), flip);
        const __m512i q1 = _mm512_xor_si512(_mm512_loadu_si512(blk + 80), flip);
        /* per row r (bytes 8r..8r+7): lo0 elements 0-7, hi0 16-23, lo1 8-15, hi1 24-31 */
        const __m512i lo0 = _mm512_and_si512(q0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), low);
        const __m512i lo1 = _mm512_and_si512(q1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), low);
        const int64_t i = b * xq->rows + m0;
        __m512i dots[ROWS_PER_PASS];
        for (int m = 0; m < MX; m++) dots[m] = row_dot(lo0, lo1, hi0, hi1, xq, i + m);
        accumulate_block(acc, dots, group_scales(blk), xq, i, MX);
    }
    if (xq->remainder) add_remainder(acc, xq, K, r0, m0, MX);
    store_rows(acc, MX, out);
}

ROW_COUNT_DISPATCH(group_dispatch, group_rows, struct quantized, float out[][8])

void meshllm_ggml_q4_0x8_few_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1], *r = dst->src[2];
    const int64_t K = w->ne[0], N = w->ne[1], n = x->ne[1];
    /* ggml_stage.py builds only these (any n: prefill chunks too, ALL_ROWS_OPS says why); anything
     * else is a bug, not bad input */
    if (n < 1 || w->type != GGML_TYPE_Q4_0 || N % 8 || K % 32 || x->type != GGML_TYPE_F32
        || x->ne[0] != K || x->nb[0] != sizeof(float) || dst->type != GGML_TYPE_F32 || dst->ne[0] != N
        || dst->ne[1] != n || dst->nb[0] != sizeof(float)
        || (r && ((r->type != GGML_TYPE_F32 && r->type != GGML_TYPE_F16) || r->ne[0] != 8 || r->ne[1] != K / 32
                  || r->ne[2] != N / 8 || r->nb[0] != (r->type == GGML_TYPE_F16 ? 2u : 4u)
                  || r->nb[1] != 8 * r->nb[0] || r->nb[2] != (size_t)(K / 32) * 8 * r->nb[0])))
        abort();
    int64_t g0, g1;
    share(N / 8, ith, nth, &g0, &g1);
    if (g0 >= g1) return;
    /* each ggml worker quantizes the activations itself (a few KiB) into a buffer it keeps */
    static __thread struct quantized xq;
    quantize_rows(x, n, K, &xq, FOR_Q4_0 | (r ? WITH_SUMS : 0));
    xq.groups = (const uint8_t *)w->data;
    xq.remainder = r ? r->data : NULL;
    xq.remainder_f16 = r && r->type == GGML_TYPE_F16;
    quantized_groups_times_passes(xq.groups, (K / 32) * GROUP_BYTES, g0, g1, &xq, K, n, group_dispatch, dst);
    release_large(&xq);
}

/* Q8_0 (plain layout: per block an f16 scale and 32 int8) x a few rows. dpbusd multiplies unsigned
 * by signed bytes, so activations go in as p + 128 and each block's dot starts from -128 * (the sum
 * of its weights, per group of 4), which the same instruction computes against a vector of ones,
 * once per block for all activation rows. Each 4-byte lane's integer dot then equals the one of
 * ggml's vec_dot_q8_0_q8_0, and scaling, accumulation and the final sum follow it op for op, so a
 * row's result is bitwise ggml's one-row product. */
#define Q8_BLOCK 34

static inline __attribute__((always_inline)) void q8_row(const uint8_t *row, const struct quantized *xq, int64_t K,
                                                         int64_t m0, int MX, float *out) {
    const int64_t blocks = K / 32;
    const __m256i ones = _mm256_set1_epi8(1);
    __m256 acc[ROWS_PER_PASS];
    for (int m = 0; m < MX; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(row + b * Q8_BLOCK + 2));
        const __m256i init = _mm256_sub_epi32(_mm256_setzero_si256(),
                                              _mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, w), 7));
        const float dw = f16_at(row + b * Q8_BLOCK);
        for (int m = 0; m < MX; m++) {
            const int64_t i = b * xq->rows + m0 + m;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq->u + i * 32));
            const __m256 q = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(init, x, w));
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xq->d[i]), q, acc[m]);
        }
    }
    for (int m = 0; m < MX; m++) out[m] = hsum_float_8(acc[m]);
}

ROW_COUNT_DISPATCH(q8_dispatch, q8_row, struct quantized, float *out)

void meshllm_ggml_q8_0_few_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], n = x->ne[1];
    if (n > OP_MAX_ROWS || w->type != GGML_TYPE_Q8_0 || K % 32 || w->nb[1] != (size_t)(K / 32 * Q8_BLOCK)
        || x->type != GGML_TYPE_F32 || x->ne[0] != K || x->nb[0] != sizeof(float) || dst->type != GGML_TYPE_F32
        || dst->ne[0] != N || dst->ne[1] != n || dst->nb[0] != sizeof(float))
        abort();
    int64_t r0, r1;
    share(N, ith, nth, &r0, &r1);
    if (r0 >= r1) return;
    static __thread struct quantized xq;
    quantize_rows(x, n, K, &xq, FOR_Q8_0);
    quantized_rows_times_passes((const uint8_t *)w->data, w->nb[1], r0, r1, &xq, K, n, q8_dispatch, dst);
}

/* Q8_0 in meshllm's 8-row layout (ggml_weights.repack_q8_0x8, for an LM head): per group of 8
 * rows and 32-column block, the 8 rows' f16 scales, then 4 chunks of 64 bytes, chunk j holding
 * bytes 8j .. 8j+7 of rows 0..7 in turn; 272 bytes, as 8 plain blocks. One pass over a group's
 * weights then serves 8 rows at once per dot-product instruction, where the plain layout gives
 * one row's 8-lane partial dot per block (SmolLM2's 49152 x 576 head, one thread, 1 / 8 / 16
 * activation rows: the op above 1.5 / 5.2 / 10.2 ms, this one 0.8 / 2.0 / 5.4). Each block's integer dot is exact; it is scaled and
 * accumulated in block order per output (not ggml's 8 partial lanes per row, so one row is not
 * bitwise ggml's product), and rows stay independent of each other, any number of them: a
 * group's weights stay in L1 across passes (rows_per_pass). Embedding lookups of the same table (a tied
 * head) go through meshllm_ggml_q8_0x8_get_rows, which dequantizes as ggml's get_rows does. */
#define Q8X8_GROUP_BYTES (8 * 2 + 256)

static inline __attribute__((always_inline)) __m512i q8x8_dot(__m512i init, const __m512i w[4],
                                                             const struct quantized *xq, int64_t i) {
    const int64_t *xb = (const int64_t *)(xq->u + i * 32);
    __m512i dot = init;
    for (int j = 0; j < 4; j++) dot = _mm512_dpbusd_epi32(dot, _mm512_set1_epi64(xb[j]), w[j]);
    return dot;
}

static inline __attribute__((always_inline)) void q8x8_group_rows(const uint8_t *group, const struct quantized *xq,
                                                                  int64_t K, int64_t m0, int MX, float out[][8]) {
    const int64_t blocks = K / 32;
    __m512 acc[(ROWS_PER_PASS + 1) / 2]; /* rows m and m+1 share acc[m / 2] (store_rows) */
    for (int m = 0; m < (MX + 1) / 2; m++) acc[m] = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = group + b * Q8X8_GROUP_BYTES;
        const __m512i w[4] = {_mm512_loadu_si512(blk + 16), _mm512_loadu_si512(blk + 80),
                              _mm512_loadu_si512(blk + 144), _mm512_loadu_si512(blk + 208)};
        /* activations go in as x + 128 (dpbusd multiplies unsigned by signed bytes): each lane
         * starts from -128 x the sum of its weights, once per block for all rows */
        __m512i init = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) init = _mm512_dpbusd_epi32(init, ones, w[j]);
        init = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(init, 7));
        const int64_t i = b * xq->rows + m0;
        __m512i dots[ROWS_PER_PASS];
        for (int m = 0; m < MX; m++) dots[m] = q8x8_dot(init, w, xq, i + m);
        accumulate_block(acc, dots, group_scales(blk), xq, i, MX);
    }
    store_rows(acc, MX, out);
}

ROW_COUNT_DISPATCH(q8x8_dispatch, q8x8_group_rows, struct quantized, float out[][8])

/* src0 Q8_0 [K, N] in the 8-row layout (N % 8 == 0), src1 f32 [K, n] (any n), dst f32 [N, n] */
void meshllm_ggml_q8_0x8_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], n = x->ne[1];
    if (w->type != GGML_TYPE_Q8_0 || N % 8 || K % 32 || x->type != GGML_TYPE_F32 || x->ne[0] != K
        || x->nb[0] != sizeof(float) || dst->type != GGML_TYPE_F32 || dst->ne[0] != N || dst->ne[1] != n
        || dst->nb[0] != sizeof(float))
        abort();
    int64_t g0, g1;
    share(N / 8, ith, nth, &g0, &g1);
    if (g0 >= g1) return;
    static __thread struct quantized xq;
    quantize_rows(x, n, K, &xq, FOR_Q8_0);
    quantized_groups_times_passes((const uint8_t *)w->data, (K / 32) * Q8X8_GROUP_BYTES, g0, g1, &xq, K, n,
                                  q8x8_dispatch, dst);
}

/* src0 the same table, src1 int32 [n] row ids -> dst f32 [K, n]: each row dequantized as ggml's
 * get_rows does (the int8 value times the block's f16 scale, in f32) */
void meshllm_ggml_q8_0x8_get_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *w = dst->src[0], *ids = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], n = ids->ne[0];
    if (w->type != GGML_TYPE_Q8_0 || N % 8 || K % 32 || ids->type != GGML_TYPE_I32 || dst->type != GGML_TYPE_F32
        || dst->ne[0] != K || dst->ne[1] != n || dst->nb[0] != sizeof(float))
        abort();
    const int64_t blocks = K / 32, group_stride = blocks * Q8X8_GROUP_BYTES;
    for (int64_t k = ith; k < n; k += nth) {
        const int32_t id = ((const int32_t *)ids->data)[k];
        if (id < 0 || id >= N) abort(); /* as ggml_get_rows asserts */
        const uint8_t *group = (const uint8_t *)w->data + (id / 8) * group_stride;
        const int r = id % 8;
        float *out = (float *)((char *)dst->data + k * dst->nb[1]);
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *blk = group + b * Q8X8_GROUP_BYTES;
            const float d = f16_at(blk + 2 * r);
            for (int j = 0; j < 4; j++) {
                const int8_t *q = (const int8_t *)(blk + 16 + j * 64 + r * 8);
                for (int i = 0; i < 8; i++) out[b * 32 + j * 8 + i] = q[i] * d;
            }
        }
    }
}

#else
int meshllm_quant_few_rows_available(void) { return 0; }
/* never built into a graph: the ops report themselves unavailable */
#define UNAVAILABLE_OP(name) \
    void name(struct ggml_tensor *dst, int ith, int nth, void *userdata) { \
        (void)dst; (void)ith; (void)nth; (void)userdata; \
        abort(); \
    }
UNAVAILABLE_OP(meshllm_ggml_q4_0x8_few_rows)
UNAVAILABLE_OP(meshllm_ggml_q8_0_few_rows)
UNAVAILABLE_OP(meshllm_ggml_q8_0x8_rows)
UNAVAILABLE_OP(meshllm_ggml_q8_0x8_get_rows)
#endif
