/* What meshllm's few-row ggml ops over quantized weights share (quant_few_rows.c,
 * k_quant_few_rows.c): the row bounds, how work splits over ggml's workers and passes, and ggml's
 * own float helpers, step for step. Included where AVX-512 is compiled in. */
#ifndef MESHLLM_FEW_ROWS_H
#define MESHLLM_FEW_ROWS_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include "ggml.h"

#define OP_MAX_ROWS 16
/* A pass over a block of weights unpacks it once (Q4_0 nibbles, Q8_0's offset sums) and takes it
 * to every activation row of the pass. Passes of up to 8 rows made a 9th row cost a second unpack
 * and pass: whole SmolLM2 step, 8 sequences at 300 cached tokens, one thread, 8 / 9 / 11 rows
 * Q4_1 23.0 / 29.9 / 33.4 ms -> 22.8 / 27.1 / 30.8, Q8_0 32.4 / 41.9 / 48.3 -> 31.9 / 37.3 / 43.1.
 * Past 12 rows the accumulators outgrow the registers (one pass of 16 measured no better than
 * two of 8): even passes of at most 12 (13 and 16 rows as before). */
#define ROWS_PER_PASS 12

/* Activation rows per pass over a weight block: all of them up to ROWS_PER_PASS, else as few
 * even passes as keep each within it */
static inline int64_t rows_per_pass(int64_t n) {
    const int64_t passes = (n + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
    return (n + passes - 1) / passes;
}

/* This worker's share [*lo, *hi) of `total` items split evenly over nth workers */
static inline void share(int64_t total, int ith, int nth, int64_t *lo, int64_t *hi) {
    const int64_t per = (total + nth - 1) / nth;
    *lo = ith * per;
    *hi = *lo + per < total ? *lo + per : total;
}

/* A function `name` running rows_fn with the pass's row count (1..ROWS_PER_PASS) as a constant at each call
 * site, so each instance keeps its accumulators in registers */
#define ROW_COUNT_DISPATCH(name, rows_fn, xq_type, out_decl) \
    static void name(const uint8_t *weights, const xq_type *xq, int64_t K, int64_t m0, int mx, out_decl) { \
        switch (mx) { \
        case 1: rows_fn(weights, xq, K, m0, 1, out); break; \
        case 2: rows_fn(weights, xq, K, m0, 2, out); break; \
        case 3: rows_fn(weights, xq, K, m0, 3, out); break; \
        case 4: rows_fn(weights, xq, K, m0, 4, out); break; \
        case 5: rows_fn(weights, xq, K, m0, 5, out); break; \
        case 6: rows_fn(weights, xq, K, m0, 6, out); break; \
        case 7: rows_fn(weights, xq, K, m0, 7, out); break; \
        case 8: rows_fn(weights, xq, K, m0, 8, out); break; \
        case 9: rows_fn(weights, xq, K, m0, 9, out); break; \
        case 10: rows_fn(weights, xq, K, m0, 10, out); break; \
        case 11: rows_fn(weights, xq, K, m0, 11, out); break; \
        default: rows_fn(weights, xq, K, m0, 12, out); break; \
        } \
    }

/* Drivers of a ROW_COUNT_DISPATCH function over a worker's weights, in passes of rows_per_pass(n)
 * activation rows, writing dst's f32 [N, n] outputs: `prefix##_rows_times_passes` for weights row
 * by row (rows [r0, r1), `row_bytes` apart), `prefix##_groups_times_passes` for groups of 8 rows
 * (groups [g0, g1), `group_bytes` apart, outputs g*8 .. g*8+7) */
#define PASS_DRIVERS(prefix, xq_type) \
    __attribute__((unused)) static void prefix##_rows_times_passes( \
        const uint8_t *weights, size_t row_bytes, int64_t r0, int64_t r1, const xq_type *xq, int64_t K, int64_t n, \
        void (*dispatch)(const uint8_t *, const xq_type *, int64_t, int64_t, int, float *), \
        struct ggml_tensor *dst) { \
        const int64_t per = rows_per_pass(n); \
        for (int64_t r = r0; r < r1; r++) \
            for (int64_t m0 = 0; m0 < n; m0 += per) { \
                const int mx = (int)(n - m0 < per ? n - m0 : per); \
                float out[ROWS_PER_PASS]; \
                dispatch(weights + r * row_bytes, xq, K, m0, mx, out); \
                for (int m = 0; m < mx; m++) \
                    ((float *)((char *)dst->data + (m0 + m) * dst->nb[1]))[r] = out[m]; \
            } \
    } \
    __attribute__((unused)) static void prefix##_groups_times_passes( \
        const uint8_t *weights, size_t group_bytes, int64_t g0, int64_t g1, const xq_type *xq, int64_t K, int64_t n, \
        void (*dispatch)(const uint8_t *, const xq_type *, int64_t, int64_t, int, float[][8]), \
        struct ggml_tensor *dst) { \
        const int64_t per = rows_per_pass(n); \
        for (int64_t g = g0; g < g1; g++) \
            for (int64_t m0 = 0; m0 < n; m0 += per) { \
                const int mx = (int)(n - m0 < per ? n - m0 : per); \
                float out[ROWS_PER_PASS][8]; \
                dispatch(weights + g * group_bytes, xq, K, m0, mx, out); \
                for (int m = 0; m < mx; m++) \
                    memcpy((float *)((char *)dst->data + (m0 + m) * dst->nb[1]) + g * 8, out[m], sizeof out[m]); \
            } \
    }

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* ggml's, step for step */
static inline float hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

#endif
