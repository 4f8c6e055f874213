/* K-quant matrices x a few activation rows, as ggml custom ops: Q4_K, Q5_K and Q6_K in ggml's plain
 * layout (meshllm_ggml_k_quant_few_rows) and Q4_K in ggml's repack buffer (meshllm_ggml_q4_kx8_few_rows).
 *
 * Why: ggml multiplies fewer than 8 activation rows of the plain types with one dot product per
 * (weight row, activation row), unpacking every weight block again for each activation row, and 8
 * rows and more with a tiled GEMM whose sums run in another order, so a row's bits would depend on
 * how many rows share its step; ggml_stage ran 8-16 rows in pieces of at most 7 to keep them
 * bitwise (two passes over the weights for 8 rows). Repacked Q4_K it multiplies 4 rows and more at
 * a time with its own GEMM, which differs from its one-row gemv. Here each weight block is unpacked
 * once and taken to every activation row of the pass, all rows in one pass over the weights.
 * Measured (AMD Zen 4 VM, 2 threads, 11264x2048 matrices from DRAM, medians; this VM swings
 * +-30% between runs), ms for 2 / 4 / 8 / 16 rows, op against ggml: Q6_K 0.47 / 0.99 / 1.96 /
 * 3.34 against 1.37 / 1.90 / 5.38 / 5.62; Q5_K 0.77 / 1.57 / 2.87 / 3.93 against 1.91 / 3.74 /
 * 3.18 / 2.55 (ggml's tiled GEMM is faster at 12-16 rows, not bitwise); repacked Q4_K 0.79 /
 * 1.53 / 1.94 / 2.84 against 0.99 / 2.17 / 3.67 / 3.80. One row costs the same either way
 * (ggml_stage leaves it to ggml).
 *
 * Exactness: a row's result is bitwise that of ggml's one-row kernel (plain: ggml_vec_dot_q4_K_q8_K,
 * ggml_vec_dot_q5_K_q8_K, ggml_vec_dot_q6_K_q8_K, the AVX2 path its x86 build takes; repacked:
 * ggml_gemv_q4_K_8x8_q8_K): activations are quantized to Q8_K by ggml's own function (its CPU type
 * traits), every integer ggml's kernel scales is the same integer (summed here in another order,
 * which integers allow), and the float steps (scales, fused multiply-adds per lane, ggml's
 * horizontal sums, the Q5_K minimums' sum, which ggml's build contracts into a fused multiply-add)
 * are ggml's, op for op. A row's result never depends on the rows beside it
 * (tests/engine/test_k_quant_few_rows.py checks both).
 *
 *     src0  Q4_K, Q5_K or Q6_K [K, N], plain layout, K % 256 == 0; or Q4_K repacked, N % 8 == 0
 *     src1  f32 [K, n] activations, n <= OP_MAX_ROWS
 *     dst   f32 [N, n]
 * Built by build.py with -march=native against the pinned ggml's headers and its CPU library;
 * without AVX-512 VNNI it builds as ops that report themselves unavailable. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-cpu.h"

size_t meshllm_k_quant_few_rows_tensor_size(void) { return sizeof(struct ggml_tensor); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include "few_rows.h"

#define QK_K 256
#define Q8_K_BYTES (4 + QK_K + 2 * QK_K / 16) /* block_q8_K: f32 d, 256 int8, 16 int16 sums of 16 */
#define Q4_K_BYTES (2 + 2 + 12 + QK_K / 2) /* block_q4_K: f16 d, dmin; 6-bit scales, mins; qs */
#define Q5_K_BYTES (2 + 2 + 12 + QK_K / 8 + QK_K / 2) /* block_q5_K: f16 d, dmin; 6-bit scales, mins; qh; qs */
#define Q6_K_BYTES (QK_K / 2 + QK_K / 4 + QK_K / 16 + 2) /* block_q6_K: ql, qh, int8 scales, f16 d */

int meshllm_k_quant_few_rows_available(void) { return 1; }

/* The activation rows in ggml's Q8_K blocks, row after row (each row as ggml's quantizer writes
 * it: 292 contiguous bytes a 256-value block, so a pass reads whole lines however rows lie). */
struct q8_k_rows {
    uint8_t *blocks;
    size_t capacity; /* bytes */
    int64_t row_bytes;
};

static void quantize_rows(const struct ggml_tensor *x, int64_t n, int64_t K, struct q8_k_rows *out) {
    out->row_bytes = K / QK_K * Q8_K_BYTES;
    if ((size_t)(n * out->row_bytes) > out->capacity) {
        free(out->blocks);
        out->capacity = (size_t)(n * out->row_bytes);
        out->blocks = calloc(out->capacity, 1); /* ggml's quantizer leaves an all-zero block's sums unwritten */
        if (!out->blocks) abort();
    }
    const ggml_from_float_t to_q8_k = ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float;
    for (int64_t m = 0; m < n; m++)
        to_q8_k((const float *)((const char *)x->data + m * x->nb[1]), out->blocks + m * out->row_bytes, K);
}

/* Block b of activation row m */
static inline const uint8_t *q8_k_block(const struct q8_k_rows *xq, int64_t m, int64_t b) {
    return xq->blocks + m * xq->row_bytes + b * Q8_K_BYTES;
}

PASS_DRIVERS(q8_k, struct q8_k_rows)

/* int16 lane t of a product over 64 weights (32 lanes of byte pairs) scaled by sub-block scale
 * first + t / per: these lanes' indices into 16 scales widened to int16 */
static inline __m512i scale_lanes(int first, int per) {
    int16_t idx[32];
    for (int t = 0; t < 32; t++) idx[t] = (int16_t)(first + t / per);
    return _mm512_loadu_si512(idx);
}

/* Per-lane 16-bit shift counts: `lo` in the low 256 bits, `hi` in the high */
static inline __m512i counts(short lo, short hi) {
    return _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1);
}

/* One row's 16 int32 lanes of a 256-value block (the 4 products of 64 weights each, scaled per
 * sub-block, summed) folded to ggml's 8: lane l of each half is lane l of one of ggml's 256-bit
 * registers, and ggml adds those registers lane by lane. */
static inline __attribute__((always_inline)) __m256i block_lanes(const __m512i w[4], const __m512i s[4],
                                                                 const int8_t *q8) {
    __m512i sum = _mm512_setzero_si512();
    for (int k = 0; k < 4; k++)
        sum = _mm512_dpwssd_epi32(sum, s[k], _mm512_maddubs_epi16(w[k], _mm512_loadu_si512(q8 + 64 * k)));
    return _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
}

/* Q6_K: 16 sub-blocks of 16 values q in 0..63 (4 low bits in ql, 2 high in qh), weight d * s * (q - 32).
 * ggml's integer lane l: sum over its registers of the scaled pair sums, minus 32 * (the block's
 * activation sums of sub-blocks 2l and 2l+1 times their scales). */
static inline __attribute__((always_inline)) void q6_k_row(const uint8_t *row, const struct q8_k_rows *xq, int64_t K,
                                                           int64_t m0, int MX, float *out) {
    const int64_t blocks = K / QK_K;
    __m256 acc[ROWS_PER_PASS];
    for (int m = 0; m < MX; m++) acc[m] = _mm256_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
    const __m512i up_4_2 = counts(4, 2), down_0_2 = counts(0, 2);
    __m512i pick[4];
    for (int k = 0; k < 4; k++) pick[k] = scale_lanes(4 * k, 8);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *x = row + b * Q6_K_BYTES, *ql = x, *qh = x + QK_K / 2;
        const __m128i scales = _mm_loadu_si128((const __m128i *)(x + QK_K / 2 + QK_K / 4));
        const __m256i scales16 = _mm256_cvtepi8_epi16(scales);
        const float dx = f16_at(x + QK_K / 2 + QK_K / 4 + QK_K / 16);
        /* w[2j] holds values 128j .. 128j+63 (ggml's q4_0 | q4_1 of round j), w[2j+1] the next 64 */
        __m512i w[4], s[4];
        for (int j = 0; j < 2; j++) {
            const __m512i lo = _mm512_loadu_si512(ql + 64 * j);
            const __m512i hi = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * j)));
            w[2 * j] = _mm512_or_si512(_mm512_and_si512(lo, low4),
                                       _mm512_and_si512(_mm512_sllv_epi16(hi, up_4_2), bits45));
            w[2 * j + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), low4),
                                           _mm512_and_si512(_mm512_srlv_epi16(hi, down_0_2), bits45));
        }
        const __m512i scales512 = _mm512_castsi256_si512(scales16);
        for (int k = 0; k < 4; k++) s[k] = _mm512_permutexvar_epi16(pick[k], scales512);
        for (int m = 0; m < MX; m++) {
            const uint8_t *y = q8_k_block(xq, m0 + m, b);
            float dy;
            memcpy(&dy, y, sizeof dy);
            const __m256i sums = _mm256_loadu_si256((const __m256i *)(y + 4 + QK_K));
            const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sums, scales16), 5);
            const __m256i lanes = _mm256_sub_epi32(block_lanes(w, s, (const int8_t *)(y + 4)), offset);
            const float d = dy * dx;
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc[m]);
        }
    }
    for (int m = 0; m < MX; m++) out[m] = hsum_float_8(acc[m]);
}

/* Q4_K and Q5_K share their 6-bit scales and minimums, unpacked as ggml does: bytes 0-7 of u the
 * 8 sub-blocks' scales, 8-15 their minimums */
static inline void scales_and_mins(const uint8_t *packed, uint32_t u[4]) {
    memcpy(u, packed, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t scales_hi = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = scales_hi;
    u[0] &= 0x3f3f3f3f;
}

/* Q4_K (FIVE 0) and Q5_K (FIVE 1): 8 sub-blocks of 32 values q, 4 bits in qs (and for Q5_K a 5th
 * in qh), weight d * sc * q - dmin * mn with 6-bit sc and mn per sub-block. The minimums' term is
 * summed as each of ggml's kernels sums it: Q5_K's in one float (a fused multiply-add per block,
 * as ggml's build contracts it), Q4_K's in 4 lanes (pairs of sub-blocks), folded at the end. */
static inline __attribute__((always_inline)) void q4_q5_k_row(const uint8_t *row, const struct q8_k_rows *xq,
                                                              int64_t K, int64_t m0, int MX, float *out,
                                                              const int FIVE) {
    const int64_t blocks = K / QK_K;
    const size_t block_bytes = FIVE ? Q5_K_BYTES : Q4_K_BYTES;
    __m256 acc[ROWS_PER_PASS];
    __m128 mins_acc[ROWS_PER_PASS];
    float mins_sum[ROWS_PER_PASS];
    for (int m = 0; m < MX; m++) acc[m] = _mm256_setzero_ps(), mins_acc[m] = _mm_setzero_ps(), mins_sum[m] = 0.0f;
    const __m512i low4 = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(0x10);
    const __m512i down_0_4 = counts(0, 4);
    __m512i pick[4];
    for (int j = 0; j < 4; j++) pick[j] = scale_lanes(2 * j, 16);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *x = row + b * block_bytes, *qh = x + 4 + 12, *qs = FIVE ? qh + QK_K / 8 : qh;
        uint32_t u[4];
        scales_and_mins(x + 4, u);
        const uint8_t *sc = (const uint8_t *)u, *mn = sc + 8;
        const float dx = f16_at(x), dminx = f16_at(x + 2);
        const __m512i scales512 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        /* Q5_K: each minimum twice (int16), against the two 16-value activation sums of its
         * sub-block; Q4_K: once, against their sum (ggml's 16-bit horizontal add) */
        const __m128i mn8 = _mm_loadl_epi64((const __m128i *)mn);
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
        const __m128i mins8 = _mm_cvtepu8_epi16(mn8);
        const __m512i hi = FIVE ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh))
                                : _mm512_setzero_si512();
        /* w[j] holds values 64j .. 64j+63: the low nibbles of qs[32j ..] then their high nibbles
         * (Q5_K: each with bit 2j, then 2j+1, of qh as bit 4) */
        __m512i w[4], s[4];
        for (int j = 0; j < 4; j++) {
            const __m512i lo = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
            w[j] = _mm512_and_si512(_mm512_srlv_epi16(lo, down_0_4), low4);
            if (FIVE) {
                const __m512i bit = counts((short)(2 * j), (short)(2 * j + 1));
                w[j] = _mm512_or_si512(w[j], _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(hi, bit), 4), bit4));
            }
            s[j] = _mm512_permutexvar_epi16(pick[j], scales512);
        }
        for (int m = 0; m < MX; m++) {
            const uint8_t *y = q8_k_block(xq, m0 + m, b);
            float dy;
            memcpy(&dy, y, sizeof dy);
            const __m256i sums = _mm256_loadu_si256((const __m256i *)(y + 4 + QK_K));
            const float d = dy * dx, dmin = -dy * dminx;
            if (FIVE) { /* the minimums times their sub-blocks' activation sums, summed: an exact integer */
                const __m256i dots = _mm256_madd_epi16(sums, mins16);
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(dots), _mm256_extracti128_si256(dots, 1));
                t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
                mins_sum[m] = __builtin_fmaf(dmin, (float)_mm_cvtsi128_si32(t), mins_sum[m]);
            } else {
                const __m128i sub_block_sums = _mm_hadd_epi16(_mm256_castsi256_si128(sums),
                                                              _mm256_extracti128_si256(sums, 1));
                mins_acc[m] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins8, sub_block_sums)),
                                           mins_acc[m]);
            }
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(block_lanes(w, s, (const int8_t *)(y + 4))),
                                     acc[m]);
        }
    }
    for (int m = 0; m < MX; m++) {
        if (FIVE) {
            out[m] = hsum_float_8(acc[m]) + mins_sum[m];
        } else {
            __m128 t = _mm_add_ps(mins_acc[m], _mm_movehl_ps(mins_acc[m], mins_acc[m]));
            t = _mm_add_ss(t, _mm_movehdup_ps(t));
            out[m] = hsum_float_8(acc[m]) + _mm_cvtss_f32(t);
        }
    }
}

static inline __attribute__((always_inline)) void q4_k_row(const uint8_t *row, const struct q8_k_rows *xq, int64_t K,
                                                           int64_t m0, int MX, float *out) {
    q4_q5_k_row(row, xq, K, m0, MX, out, 0);
}

static inline __attribute__((always_inline)) void q5_k_row(const uint8_t *row, const struct q8_k_rows *xq, int64_t K,
                                                           int64_t m0, int MX, float *out) {
    q4_q5_k_row(row, xq, K, m0, MX, out, 1);
}

/* Q4_K in ggml's repack buffer (block_q4_Kx8: for each group of 8 rows and 256-value block, the 8
 * rows' f16 scales and minimum scales, 8 x 12 bytes of 6-bit sub-block scales and minimums (12
 * bytes a sub-block, its 8 rows packed as one Q4_K block packs its 8 sub-blocks), then 1024 bytes
 * of nibbles: per pair of sub-blocks 256 bytes, 8-byte chunks, chunk k holding bytes
 * (k / 8) * 8 .. +8 of row k % 8's 32, low nibbles the first sub-block, high the second).
 * ggml multiplies one to three rows of it with ggml_gemv_q4_K_8x8_q8_K, four and more with its
 * 4-row GEMM, whose activation blocks and sums differ, so a verify pass of 4+ rows was not bitwise
 * its one-row steps. Per output row r and activation row this is the gemv's arithmetic: the
 * block's integer dot I (the sub-blocks' dots times their scales) and minimums' term M (minimums
 * times the activation sums of their sub-blocks), exact integers, then acc = fma(I, d_r * dy, acc)
 * and accm = fma(M, dmin_r * dy, accm) block by block, and acc - accm. */
#define Q4_KX8_BYTES (8 * 2 + 8 * 2 + 96 + 1024)

static inline __attribute__((always_inline)) void q4_kx8_group_rows(const uint8_t *group, const struct q8_k_rows *xq,
                                                                    int64_t K, int64_t m0, int MX, float out[][8]) {
    const int64_t blocks = K / QK_K;
    __m256 acc[ROWS_PER_PASS], acc_mins[ROWS_PER_PASS];
    for (int m = 0; m < MX; m++) acc[m] = _mm256_setzero_ps(), acc_mins[m] = _mm256_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *x = group + b * Q4_KX8_BYTES, *scales = x + 32, *qs = x + 32 + 96;
        __m512i dots[ROWS_PER_PASS]; /* lanes 2r, 2r+1: halves of row r's scaled dots */
        __m256i mins_dots[ROWS_PER_PASS];
        for (int m = 0; m < MX; m++) dots[m] = _mm512_setzero_si512(), mins_dots[m] = _mm256_setzero_si256();
        for (int sb = 0; sb < 4; sb++) {
            uint32_t u0[4], u1[4]; /* sub-blocks 2sb and 2sb+1: bytes 0-7 the rows' scales, 8-15 their minimums */
            scales_and_mins(scales + 24 * sb, u0);
            scales_and_mins(scales + 24 * sb + 12, u1);
            const __m128i s0 = _mm_loadu_si128((const __m128i *)u0), s1 = _mm_loadu_si128((const __m128i *)u1);
            /* each row's scale in its two lanes */
            const __m512i scale0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(s0, s0));
            const __m512i scale1 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(s1, s1));
            /* per row r: its minimums of the two sub-blocks, side by side (int16) */
            const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(s0, s1));
            __m512i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                const __m512i raw = _mm512_loadu_si512(qs + 256 * sb + 64 * c);
                lo[c] = _mm512_and_si512(raw, low4);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            }
            for (int m = 0; m < MX; m++) {
                const uint8_t *y = q8_k_block(xq, m0 + m, b);
                int64_t q8[8]; /* the 64 activations of sub-blocks 2sb and 2sb+1, 8 at a time */
                memcpy(q8, y + 4 + 64 * sb, sizeof q8);
                __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    d0 = _mm512_dpbusd_epi32(d0, lo[c], _mm512_set1_epi64(q8[c]));
                    d1 = _mm512_dpbusd_epi32(d1, hi[c], _mm512_set1_epi64(q8[4 + c]));
                }
                dots[m] = _mm512_add_epi32(dots[m], _mm512_add_epi32(_mm512_mullo_epi32(d0, scale0),
                                                                     _mm512_mullo_epi32(d1, scale1)));
                /* the activation sums of sub-blocks 2sb and 2sb+1 (16 values each, summed in pairs) */
                int16_t sums[QK_K / 16];
                memcpy(sums, y + 4 + QK_K, sizeof sums);
                const uint16_t first = (uint16_t)(sums[4 * sb] + sums[4 * sb + 1]);
                const uint16_t second = (uint16_t)(sums[4 * sb + 2] + sums[4 * sb + 3]);
                const __m256i pair = _mm256_set1_epi32((int32_t)((uint32_t)second << 16 | first));
                mins_dots[m] = _mm256_add_epi32(mins_dots[m], _mm256_madd_epi16(mins, pair));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)x));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + 16)));
        for (int m = 0; m < MX; m++) {
            float dy;
            memcpy(&dy, q8_k_block(xq, m0 + m, b), sizeof dy);
            const __m256i dot = _mm512_cvtepi64_epi32(_mm512_add_epi32(dots[m], _mm512_srli_epi64(dots[m], 32)));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(dy)), acc[m]);
            acc_mins[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins_dots[m]), _mm256_mul_ps(dmin, _mm256_set1_ps(dy)),
                                          acc_mins[m]);
        }
    }
    for (int m = 0; m < MX; m++) _mm256_storeu_ps(out[m], _mm256_sub_ps(acc[m], acc_mins[m]));
}

ROW_COUNT_DISPATCH(q4_kx8_dispatch, q4_kx8_group_rows, struct q8_k_rows, float out[][8])

/* src0 Q4_K [K, N] in the repack buffer (N % 8 == 0), src1 f32 [K, n], n <= OP_MAX_ROWS, dst f32 [N, n] */
void meshllm_ggml_q4_kx8_few_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], n = x->ne[1];
    if (n > OP_MAX_ROWS || w->type != GGML_TYPE_Q4_K || N % 8 || K % QK_K || x->type != GGML_TYPE_F32
        || x->ne[0] != K || x->nb[0] != sizeof(float) || dst->type != GGML_TYPE_F32 || dst->ne[0] != N
        || dst->ne[1] != n || dst->nb[0] != sizeof(float) || w->extra == NULL /* not in the repack buffer */)
        abort();
    int64_t g0, g1;
    share(N / 8, ith, nth, &g0, &g1);
    if (g0 >= g1) return;
    static __thread struct q8_k_rows xq;
    quantize_rows(x, n, K, &xq);
    q8_k_groups_times_passes((const uint8_t *)w->data, K / QK_K * Q4_KX8_BYTES, g0, g1, &xq, K, n, q4_kx8_dispatch,
                             dst);
}

ROW_COUNT_DISPATCH(q6_k_dispatch, q6_k_row, struct q8_k_rows, float *out)
ROW_COUNT_DISPATCH(q5_k_dispatch, q5_k_row, struct q8_k_rows, float *out)
ROW_COUNT_DISPATCH(q4_k_dispatch, q4_k_row, struct q8_k_rows, float *out)

typedef void (*row_dispatch_fn)(const uint8_t *, const struct q8_k_rows *, int64_t, int64_t, int, float *);

void meshllm_ggml_k_quant_few_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], n = x->ne[1];
    const size_t block_bytes = w->type == GGML_TYPE_Q6_K ? Q6_K_BYTES : w->type == GGML_TYPE_Q5_K ? Q5_K_BYTES
                                                                                                  : Q4_K_BYTES;
    /* ggml_stage.py builds only these; anything else is a bug, not bad input */
    if (n > OP_MAX_ROWS || (w->type != GGML_TYPE_Q4_K && w->type != GGML_TYPE_Q5_K && w->type != GGML_TYPE_Q6_K)
        || K % QK_K
        || w->nb[1] != (size_t)(K / QK_K) * block_bytes || x->type != GGML_TYPE_F32 || x->ne[0] != K
        || x->nb[0] != sizeof(float) || dst->type != GGML_TYPE_F32 || dst->ne[0] != N || dst->ne[1] != n
        || dst->nb[0] != sizeof(float) || w->extra != NULL /* ggml's repack buffer marks its tensors */)
        abort();
    int64_t r0, r1;
    share(N, ith, nth, &r0, &r1);
    if (r0 >= r1) return;
    /* each ggml worker quantizes the activations itself (a few KiB) into a buffer it keeps */
    static __thread struct q8_k_rows xq;
    quantize_rows(x, n, K, &xq);
    const row_dispatch_fn dispatch = w->type == GGML_TYPE_Q6_K ? q6_k_dispatch
                                   : w->type == GGML_TYPE_Q5_K ? q5_k_dispatch : q4_k_dispatch;
    q8_k_rows_times_passes((const uint8_t *)w->data, w->nb[1], r0, r1, &xq, K, n, dispatch, dst);
}

#else
int meshllm_k_quant_few_rows_available(void) { return 0; }
/* never built into a graph: the ops report themselves unavailable */
void meshllm_ggml_k_quant_few_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)dst; (void)ith; (void)nth; (void)userdata;
    abort();
}
void meshllm_ggml_q4_kx8_few_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)dst; (void)ith; (void)nth; (void)userdata;
    abort();
}
#endif
