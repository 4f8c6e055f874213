/* bf16 matrix x few-rows product for CPU decode: y[m, n] = sum_k W[n, k] * x[m, k] (+ bias[n]).
 *
 * Built by meshllm.engine.kernels.build (gcc -O3 -march=native -fopenmp); needs AVX-512 BF16.
 * W, x, bias and y are bf16 (uint16 bit patterns), accumulation is fp32, y is rounded to nearest
 * even. bf16 stores pairs of neighbouring k values contiguously, which is exactly the operand
 * layout _mm512_dpbf16_ps wants, so neither W nor x is converted.
 * Four W rows are walked together (four independent load streams keep the prefetchers busy)
 * against up to four x rows at once (16 accumulators fit the 32 zmm registers); more x rows
 * re-walk the same four W rows, which by then sit in L1/L2.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define W_ROWS 4
#define MAX_X_ROWS_PER_PASS 4
/* Each W chunk is prefetched into L2 this many W rows ahead (the same k of the tile two tiles on).
 * The walk of four rows at once defeats the hardware prefetcher, and at 4+ x rows the dot products
 * stopped overlapping the weight stream: their time added to it. The old prefetch, into L1 4 KiB
 * further along the same row, did not help (1-8 KiB, or none: the same). Measured, 1 thread,
 * SmolLM2's 210 matrices + head from DRAM (AMD Zen 4), ms for 1 / 4 / 8 / 16 x rows: 12.2 / 30.4 /
 * 32.4 / 44.5 -> 13.8 / 14.5 / 16.8 / 29.6; 2 threads, TinyLlama 1.1B shapes: 66.7 / 88-94 / 107 /
 * 149 -> 68.8 / 74-80 / 74-78 / 101-115 (4 and 8 rows one or two rows apart: noise). */
#define PREFETCH_W_ROWS (2 * W_ROWS)

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Horizontal sums of four accumulators at once, as [sum a, sum b, sum c, sum d]: one shuffle
 * tree instead of four, which matters when K is short (576 wide: 18 steps per dot product). */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* Dot products of W rows [n0, n0+nw) with x rows [m0, m0+mx): nw <= W_ROWS, mx <= 4, into
 * out[m * W_ROWS + r]. `each`: every accumulator reduced on its own, in row_dots' order (the ggml
 * op below, whose rows must not depend on the path), not four at a time by reduce4. */
static inline __attribute__((always_inline)) void tile(const uint16_t *W, const uint16_t *x, float *out,
                                                       int64_t K, int nw, int mx, int each) {
    __m512 acc[W_ROWS][MAX_X_ROWS_PER_PASS];
    for (int r = 0; r < nw; r++)
        for (int m = 0; m < mx; m++) acc[r][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh w[W_ROWS];
        for (int r = 0; r < nw; r++) {
            _mm_prefetch((const char *)(W + (r + PREFETCH_W_ROWS) * K + k), _MM_HINT_T1);
            w[r] = (__m512bh)_mm512_loadu_si512(W + r * K + k);
        }
        for (int m = 0; m < mx; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
            for (int r = 0; r < nw; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w[r], xv);
        }
    }
    if (k < K) { /* masked tail: missing lanes load as zero on both sides */
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh w[W_ROWS];
        for (int r = 0; r < nw; r++) w[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, W + r * K + k);
        for (int m = 0; m < mx; m++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
            for (int r = 0; r < nw; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w[r], xv);
        }
    }
    for (int m = 0; m < mx; m++) {
        if (nw == W_ROWS && !each) {
            _mm_storeu_ps(out + m * W_ROWS, reduce4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
        } else {
            for (int r = 0; r < nw; r++) out[m * W_ROWS + r] = _mm512_reduce_add_ps(acc[r][m]);
        }
    }
}

/* Constant nw/mx per call site so the compiler unrolls and keeps accumulators in registers. */
#define TILE_CASE(NW, MX) tile(W, x, out, K, NW, MX, 0)
static void tile_dispatch(const uint16_t *W, const uint16_t *x, float *out, int64_t K, int nw, int mx) {
    if (nw == W_ROWS) {
        switch (mx) {
        case 1: TILE_CASE(4, 1); return;
        case 2: TILE_CASE(4, 2); return;
        case 3: TILE_CASE(4, 3); return;
        default: TILE_CASE(4, 4); return;
        }
    }
    switch (mx) {
    case 1: TILE_CASE(1, 1); return;
    case 2: TILE_CASE(1, 2); return;
    case 3: TILE_CASE(1, 3); return;
    default: TILE_CASE(1, 4); return;
    }
}

/* W: [N, K], x: [rows_x, K], bias: [N] or NULL, y: [rows_x, N]; all bf16, row-major contiguous. */
void gemv_bf16(const uint16_t *W, const uint16_t *x, const uint16_t *bias, uint16_t *y,
               int64_t rows_x, int64_t N, int64_t K, int threads) {
    int64_t blocks = (N + W_ROWS - 1) / W_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * W_ROWS;
        int nw = (int)(N - n0 < W_ROWS ? N - n0 : W_ROWS);
        float out[MAX_X_ROWS_PER_PASS * W_ROWS];
        for (int64_t m0 = 0; m0 < rows_x; m0 += MAX_X_ROWS_PER_PASS) {
            int mx = (int)(rows_x - m0 < MAX_X_ROWS_PER_PASS ? rows_x - m0 : MAX_X_ROWS_PER_PASS);
            if (nw == W_ROWS) {
                tile_dispatch(W + n0 * K, x + m0 * K, out, K, W_ROWS, mx);
            } else { /* N tail: one W row at a time */
                for (int r = 0; r < nw; r++) {
                    float one[MAX_X_ROWS_PER_PASS * W_ROWS];
                    tile_dispatch(W + (n0 + r) * K, x + m0 * K, one, K, 1, mx);
                    for (int m = 0; m < mx; m++) out[m * W_ROWS + r] = one[m * W_ROWS];
                }
            }
            for (int m = 0; m < mx; m++)
                for (int r = 0; r < nw; r++) {
                    float v = out[m * W_ROWS + r] + (bias ? bf16_to_float(bias[n0 + r]) : 0.0f);
                    y[(m0 + m) * N + n0 + r] = float_to_bf16(v);
                }
        }
    }
}

#ifdef MESHLLM_GGML_OP
/* A ggml custom op for a bf16 weight inside a stage's ggml graph (ggml_stage.py):
 * dst [n, N] f32 = x [n, K] f32 . W [N, K] bf16 ^T, for n <= OP_MAX_ROWS: decode batches and the
 * k+1 rows of a speculative verify pass. Why not ggml's own mul_mat: it sends n >= 2 to llamafile's
 * tinyBLAS, where (SmolLM2 shapes, 1 thread) 2 rows cost 2.3x one and 5 rows 3x, though the
 * weight stream, the real cost, is the same. Here each W row is streamed once, sequentially (the
 * shape of ggml's vec_dot_bf16, which the hardware prefetcher follows at full speed; the 4-row
 * tiles of gemv_bf16 above streamed at half that), against all n x rows: 1 row as fast as ggml's
 * gemv. From QUAD_MIN_ROWS rows, four W rows at a time (quad_dispatch): on wide matrices the x
 * rows no longer fit L1, and reloading them for every W row made 8 rows cost 1.6x ggml's.
 * A row's result does not depend on n (one accumulator per x row, the same k order), so a k-row
 * verify pass gives bitwise the logits of k one-row steps. x is rounded to bf16 as ggml rounds it
 * for a bf16 weight. ggml.h is the pinned ggml's own header (site-packages/include), found by build.py. */
#include <stdlib.h>
#include "ggml.h"

#define OP_MAX_ROWS 16
#define ROWS_PER_PASS 8 /* accumulators in registers; more x rows re-read the W row from L1 */
#define QUAD_MIN_ROWS 2 /* from this many x rows, W_ROWS W rows at a time (quad_dispatch) */
/* The pass that streams four W rows from memory runs at the speed of a one-row product with 3 x
 * rows, and markedly slower with 2 or 4 (not understood: not the loop's unrolling, which changed
 * nothing, nor its registers, which hold). A 2-row first pass therefore runs as 3 (the third x
 * row read and its dot products dropped: each x row's accumulators are its own, so the two real
 * rows come out bitwise the same), and 4 rows run as 3 + 1, the 1 on W rows then in cache. Later
 * passes of any count cost little. Measured, a whole SmolLM2 bf16 stage, 300 cached tokens, AMD
 * Zen 4, 1 thread, ms for 1 / 2 / 3 / 4 / 5 rows: 11.6 / 16.5 / 12.8 / 16.2 / 14.3 before,
 * 11.4 / 12.5 / 12.7 / 14.6 / 14.3 after; the op alone over SmolLM2's matrices, 2 threads:
 * 2 rows 14.1 -> 13.4 ms, 4 rows 13.9 -> 13.0. Other first-pass splits of 7-10 rows (3+4, 4+2+1,
 * 3+3+1, ...) were no faster than passes of four. */

static inline __attribute__((always_inline)) void row_dots(const uint16_t *w, const uint16_t *x, float *out,
                                                           int64_t K, int mx) {
    __m512 acc[ROWS_PER_PASS];
    for (int m = 0; m < mx; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
        for (int m = 0; m < mx; m++) {
            acc[m] = _mm512_dpbf16_ps(acc[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
            acc[m] = _mm512_dpbf16_ps(acc[m], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
        }
    }
    for (; k < K; k += 32) { /* masked tail: missing lanes load as zero on both sides */
        __mmask32 mask = K - k >= 32 ? (__mmask32)~0u : (__mmask32)((1ull << (K - k)) - 1);
        __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
        for (int m = 0; m < mx; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], w0, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
    }
    for (int m = 0; m < mx; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}

/* From QUAD_MIN_ROWS x rows, W_ROWS W rows per pass over K (tile, each accumulator reduced on its
 * own): each x chunk loaded once serves four W rows, where row_dots reloads every x row for every
 * W row (8 rows of a 5632-wide x are 90 KiB, past L1, so from L2 each time). Each accumulator sees
 * the same 32-wide k chunks in the same order as row_dots and is reduced the same way, so a row's
 * result never depends on which path (or how many rows) computed it. Measured on 1.1B shapes
 * (2560x2048, 11264x2048, 2048x5632; AMD Zen 4, 2 threads), ms for 8 rows: row_dots 6.7; W rows x
 * x rows per pass 2x8 5.5, 3x8 4.5, 4x4 4.2, 4x8 4.2. With the L2 prefetch (PREFETCH_W_ROWS) it
 * also serves 2 and 3 rows: a whole SmolLM2 bf16 stage, 1 thread, 400 cached tokens, ms for 2 / 3
 * rows 17.5-19.6 / 20-23 with row_dots, 18.4-19.6 / 13.8-16 with quad_dispatch (4 rows 18-19, 8
 * rows 23-26, against 34.5-36 and 42-45 before the prefetch; 1 row 15). */
#define EACH_CASE(MX) tile(w, x, out, K, W_ROWS, MX, 1); return
static void quad_dispatch(const uint16_t *w, const uint16_t *x, float *out, int64_t K, int mx) {
    switch (mx) {
    case 1: EACH_CASE(1);
    case 2: EACH_CASE(2);
    case 3: EACH_CASE(3);
    default: EACH_CASE(MAX_X_ROWS_PER_PASS);
    }
}

#define ROW_CASE(MX) row_dots(w, x, out, K, MX); return
static void row_dispatch(const uint16_t *w, const uint16_t *x, float *out, int64_t K, int mx) {
    switch (mx) { /* constant counts so the accumulators stay in registers */
    case 1: ROW_CASE(1);
    case 2: ROW_CASE(2);
    case 3: ROW_CASE(3);
    case 4: ROW_CASE(4);
    case 5: ROW_CASE(5);
    case 6: ROW_CASE(6);
    case 7: ROW_CASE(7);
    default: ROW_CASE(8);
    }
}

/* The struct layout this library was built against: gemv.py refuses the op when ggml's (the one
 * loaded, through ctypes) differs, e.g. after ggml was rebuilt without rebuilding this kernel. */
size_t meshllm_ggml_tensor_size(void) { return sizeof(struct ggml_tensor); }

void meshllm_ggml_bf16_few_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], n = x->ne[1];
    /* ggml_stage.py builds only these; anything else is a bug, not bad input */
    if (n > OP_MAX_ROWS || w->type != GGML_TYPE_BF16 || x->type != GGML_TYPE_F32 || x->nb[0] != sizeof(float)
        || w->nb[1] != (size_t)K * sizeof(uint16_t) || x->ne[0] != K || dst->ne[0] != N) abort();
    const int64_t per = (N + nth - 1) / nth, r0 = ith * per, r1 = r0 + per < N ? r0 + per : N;
    if (r0 >= r1) return;
    /* x in bf16, in a buffer each ggml worker thread keeps (a stack copy could overflow a
     * secondary thread's stack: 16 rows of a 14336-wide MLP are 448 KiB) */
    static __thread uint16_t *xb = NULL;
    static __thread size_t xb_len = 0;
    if ((size_t)((n + 1) * K) > xb_len) {
        free(xb);
        xb_len = (size_t)((n + 1) * K);
        xb = malloc(xb_len * sizeof *xb);
        if (!xb) abort();
    }
    for (int64_t m = 0; m < n; m++) {
        const float *row = (const float *)((const char *)x->data + m * x->nb[1]);
        for (int64_t k = 0; k < K; k++) xb[m * K + k] = float_to_bf16(row[k]);
    }
    if (n == 2) memcpy(xb + n * K, xb + (n - 1) * K, K * sizeof *xb); /* a pad row: 2 rows run as 3 */
    const uint16_t *W = (const uint16_t *)w->data; /* contiguous rows: ggml_stage.py wraps torch weights */
    int64_t r = r0;
    if (n >= QUAD_MIN_ROWS) {
        for (; r + W_ROWS <= r1; r += W_ROWS) {
            for (int64_t m0 = 0; m0 < n;) {
                /* The first pass streams the W rows from memory: 3 x rows, not 2 or 4 (see QUAD_MIN_ROWS). */
                const int most = m0 == 0 && n == 4 ? 3 : MAX_X_ROWS_PER_PASS;
                const int mx = (int)(n - m0 < most ? n - m0 : most);
                float out[MAX_X_ROWS_PER_PASS * W_ROWS];
                quad_dispatch(W + r * K, xb + m0 * K, out, K, m0 == 0 && mx == 2 ? 3 : mx);
                for (int m = 0; m < mx; m++)
                    for (int q = 0; q < W_ROWS; q++)
                        ((float *)((char *)dst->data + (m0 + m) * dst->nb[1]))[r + q] = out[m * W_ROWS + q];
                m0 += mx;
            }
        }
    }
    for (; r < r1; r++) {
        for (int64_t m0 = 0; m0 < n; m0 += ROWS_PER_PASS) {
            const int mx = (int)(n - m0 < ROWS_PER_PASS ? n - m0 : ROWS_PER_PASS);
            float out[ROWS_PER_PASS];
            row_dispatch(W + r * K, xb + m0 * K, out, K, mx);
            for (int m = 0; m < mx; m++) ((float *)((char *)dst->data + (m0 + m) * dst->nb[1]))[r] = out[m];
        }
    }
}
#endif
