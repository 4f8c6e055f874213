/* Causal attention of a few query rows of one sequence over its bf16 KV cache, as a ggml custom op.
 *
 * Why: ggml's CPU flash attention handles one (query row, head) at a time and, per key, calls a
 * bf16 dot product, a scalar expf, a bf16-to-f32 conversion of the V row and an f32 axpy: for
 * head_dim 64 the calls cost more than the arithmetic, every V row is converted again for every
 * query row and every head of its GQA group, and none of it is shared between the rows of a
 * speculative verify pass. Measured on SmolLM2 (9 heads over 3 KV heads, ~200 cached tokens, AMD
 * Zen 4, 1 thread), attention was ~14% of a one-row decode step and ~27% of an 8-row verify pass.
 * Here, per KV head and per thread, K and V rows are converted to f32 once, every query row of
 * every head of the group is scored against them, 16 keys at a time (16 partial-sum vectors
 * folded into one vector of 16 scores by a tree of shuffles and adds: one horizontal sum per key
 * cost ~8 dependent ops), softmax runs vectorized (exp by its degree-7 Taylor polynomial after
 * Cody-Waite range reduction: relative error < 1e-7), and V rows are accumulated for 4 query rows
 * at once in registers. Measured (AMD Zen 4, 1 thread, 400 cached keys, 30 layers' worth, ms):
 * 9 heads over 3 (SmolLM2) 1 / 8 rows 0.97 / 5.35 with a horizontal sum per key and accumulators
 * left in memory, 0.78 / 3.77 now; 32 heads over 4 (TinyLlama) 2.67 / 18.2 -> 1.97 / 12.6.
 *
 * Exactness: each query row's scores, softmax and weighted sum are computed in the same order
 * whatever the number of rows in the op, so a k-row verify pass gives bitwise what k one-row steps
 * give. The result differs from ggml's flash attention in the last bits (two-pass softmax instead
 * of online, another exp); tests compare it with float64 attention.
 *
 *     src0  q f32 [hd, heads, t] (nb1 between heads, nb2 between rows), after rotary
 *     src1  k bf16 [hd, end, kv_heads]: the sequence's cached keys, the t new ones last
 *     src2  v bf16 [hd, end, kv_heads]
 *     dst   f32 [hd, heads, t], contiguous
 * Query row r (0-based) sees keys 0 .. end - t + r (causal). hd must be a multiple of 16 (<= 256),
 * heads a multiple of kv_heads. Built by build.py with -march=native against the pinned ggml's
 * header; without AVX-512 it builds as an op that reports itself unavailable. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"

size_t meshllm_attention_tensor_size(void) { return sizeof(struct ggml_tensor); }

#if defined(__AVX512F__)
#include <immintrin.h>

#define MAX_HD 256
#define V_QUERIES 4 /* query rows accumulated at once against each V row (hd 64: 16 zmm) */

int meshllm_attention_available(void) { return 1; }

/* e^x for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
 * polynomial to degree 7 (relative error < 1e-7 there), scaled by 2^n; below -87 it is 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2 in two steps (Cody-Waite) so r keeps its low bits */
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* per-thread scratch, grown on demand: K and V of one KV head in f32, and the scores */
struct scratch {
    float *k, *v, *s;
    size_t k_len, v_len, s_len;
};

static float *grow(float *p, size_t *len, size_t want) {
    if (want <= *len) return p;
    free(p);
    *len = want;
    p = aligned_alloc(64, (want * sizeof(float) + 63) / 64 * 64);
    if (!p) abort();
    return p;
}

/* Where rows live: element (i, a, b) at data + i * 4 or 2 bytes + a * nb1 + b * nb2. q: a head, b row;
 * K and V caches: a position, b KV head; dst: a head, b row. */
struct view {
    const char *data;
    int64_t nb1, nb2;
};

static void to_f32(struct view src, int64_t kvh, int64_t end, int64_t hd, float *out) {
    for (int64_t j = 0; j < end; j++) {
        const uint16_t *row = (const uint16_t *)(src.data + j * src.nb1 + kvh * src.nb2);
        for (int64_t c = 0; c < hd; c += 16) _mm512_store_ps(out + j * hd + c, bf16x16_to_f32(row + c));
    }
}

/* The 16 dot products of 16 keys' partial sums (acc[j]: 16 lanes of key j's products, summed
 * over the head dimension), one per lane in key order. A tree of shuffles and adds: each level
 * halves the vectors and the partials per key, 45 ops for 16 keys where a full horizontal sum per
 * key took ~8 and stalled on its own latency. Every lane of every level adds the same two partials
 * of the same key whichever keys share the block, so a key's score has the same bits in any block. */
static inline __attribute__((always_inline)) __m512 sum16(__m512 acc[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* keys 2i, 2i+1: 8 partials each, in halves */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++) /* keys 4i .. 4i+3: 4 partials each, one per 128-bit lane */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++) /* per 128-bit lane: 2 partials of 2 keys */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xee));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xdd));
    /* b[i]'s 128-bit lane l holds key 4i + l, so element e of d's lane l holds key 4e + l */
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), d);
}

/* scores of one query row against keys 0 .. visible, scaled, then softmax in place; returns 1 / sum.
 * k holds keys up to visible rounded up to 16 (padding finite: its scores are never read). */
static inline __attribute__((always_inline)) float scores(const float *qrow, const float *k, int64_t visible,
                                                         int64_t hd, float scale, float *s) {
    __m512 qv[MAX_HD / 16];
    for (int64_t c = 0; c < hd / 16; c++) qv[c] = _mm512_loadu_ps(qrow + c * 16);
    for (int64_t j0 = 0; j0 < visible; j0 += 16) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const float *kj = k + (j0 + j) * hd;
            acc[j] = _mm512_mul_ps(_mm512_load_ps(kj), qv[0]);
            for (int64_t c = 1; c < hd / 16; c++) acc[j] = _mm512_fmadd_ps(_mm512_load_ps(kj + c * 16), qv[c], acc[j]);
        }
        _mm512_store_ps(s + j0, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= visible; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    const __mmask16 tail = (__mmask16)((1u << (visible - j)) - 1);
    m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + j));
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= visible; j += 16) {
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), max));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), max));
        _mm512_mask_storeu_ps(s + j, tail, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* acc += p v (one query row, one value row of hd floats) */
static inline __attribute__((always_inline)) void add_value(__m512 acc[], float p, const float *v, int64_t hd) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t d = 0; d < hd / 16; d++) acc[d] = _mm512_fmadd_ps(pv, _mm512_load_ps(v + d * 16), acc[d]);
}

/* out[c] = sum_j p[c][j] v_j over each query row's own visible keys, in key order, for NC query
 * rows at once (a compile-time count, so the accumulators stay in registers). Keys all of them see
 * run without a branch; the few beyond the nearest row's last (a verify pass's later rows) after. */
static inline __attribute__((always_inline)) void weighted_values(const float *v, const float *s, int64_t stride,
                                                                  const int64_t *visible, int64_t hd, int NC,
                                                                  __m512 acc[][MAX_HD / 16]) {
    int64_t shared = visible[0], most = visible[0];
    for (int c = 1; c < NC; c++) {
        shared = visible[c] < shared ? visible[c] : shared;
        most = visible[c] > most ? visible[c] : most;
    }
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++)
        for (int64_t d = 0; d < hd / 16; d++) acc[c][d] = _mm512_setzero_ps();
    for (int64_t j = 0; j < shared; j++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) add_value(acc[c], s[c * stride + j], v + j * hd, hd);
    for (int64_t j = shared; j < most; j++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++)
            if (j < visible[c]) add_value(acc[c], s[c * stride + j], v + j * hd, hd);
}

/* One thread's share of the attention of t query rows (the last t of `end` positions), hd a
 * compile-time constant at each call site so the query and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(struct view q, struct view k, struct view v, struct view dst,
                                                         int64_t hd, int64_t heads, int64_t kv_heads, int64_t t,
                                                         int64_t end, int ith, int nth) {
    const int64_t group = heads / kv_heads, start = end - t, stride = (end + 15) / 16 * 16;
    const float scale = 1.0f / sqrtf((float)hd);
    /* a thread takes a contiguous range of query heads; the heads of one KV group that it holds
     * share the group's K and V, converted once */
    const int64_t per = (heads + nth - 1) / nth, h0 = ith * per, h1 = h0 + per < heads ? h0 + per : heads;
    static __thread struct scratch sc;
    for (int64_t h = h0; h < h1;) {
        const int64_t kvh = h / group, hg1 = (kvh + 1) * group < h1 ? (kvh + 1) * group : h1;
        const int64_t nq = (hg1 - h) * t; /* query vectors: (head, row) for heads h .. hg1 */
        sc.k = grow(sc.k, &sc.k_len, (size_t)(stride * hd));
        sc.v = grow(sc.v, &sc.v_len, (size_t)(end * hd));
        /* the scores of one block of query vectors at a time: all of a prefill chunk's (512 rows,
         * 8 heads, 4096 keys) would be 64 MiB */
        sc.s = grow(sc.s, &sc.s_len, (size_t)(V_QUERIES * stride));
        to_f32(k, kvh, end, hd, sc.k);
        memset(sc.k + end * hd, 0, (size_t)((stride - end) * hd) * sizeof(float)); /* the last block's padding */
        to_f32(v, kvh, end, hd, sc.v);
        float inv[V_QUERIES];
        for (int64_t q0 = 0; q0 < nq; q0 += V_QUERIES) {
            const int nc = (int)(nq - q0 < V_QUERIES ? nq - q0 : V_QUERIES);
            int64_t visible[V_QUERIES];
            for (int c = 0; c < nc; c++) {
                const int64_t qi = q0 + c, head = h + qi / t, row = qi % t;
                visible[c] = start + row + 1;
                const float *qrow = (const float *)(q.data + head * q.nb1 + row * q.nb2);
                inv[c] = scores(qrow, sc.k, visible[c], hd, scale, sc.s + c * stride);
            }
            __m512 acc[V_QUERIES][MAX_HD / 16];
            const float *s = sc.s;
            switch (nc) {
            case 1: weighted_values(sc.v, s, stride, visible, hd, 1, acc); break;
            case 2: weighted_values(sc.v, s, stride, visible, hd, 2, acc); break;
            case 3: weighted_values(sc.v, s, stride, visible, hd, 3, acc); break;
            default: weighted_values(sc.v, s, stride, visible, hd, 4, acc); break;
            }
            for (int c = 0; c < nc; c++) {
                const int64_t qi = q0 + c, head = h + qi / t, row = qi % t;
                float *out = (float *)(dst.data + row * dst.nb2 + head * dst.nb1);
                for (int64_t d = 0; d < hd / 16; d++)
                    _mm512_storeu_ps(out + d * 16, _mm512_mul_ps(acc[c][d], _mm512_set1_ps(inv[c])));
            }
        }
        h = hg1;
    }
}

static void attend_any(struct view q, struct view k, struct view v, struct view dst, int64_t hd, int64_t heads,
                       int64_t kv_heads, int64_t t, int64_t end, int ith, int nth) {
    if (hd == 64) attend(q, k, v, dst, 64, heads, kv_heads, t, end, ith, nth);
    else if (hd == 128) attend(q, k, v, dst, 128, heads, kv_heads, t, end, ith, nth);
    else attend(q, k, v, dst, hd, heads, kv_heads, t, end, ith, nth);
}

void meshllm_ggml_attention_few_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2];
    const int64_t hd = q->ne[0], heads = q->ne[1], t = q->ne[2], end = k->ne[1], kv_heads = k->ne[2];
    /* ggml_stage.py builds only these; anything else is a bug, not bad input */
    if (q->type != GGML_TYPE_F32 || k->type != GGML_TYPE_BF16 || v->type != GGML_TYPE_BF16 || hd % 16 || hd > MAX_HD
        || k->ne[0] != hd || v->ne[0] != hd || v->ne[1] != end || v->ne[2] != kv_heads || heads % kv_heads
        || t > end || t < 1 || q->nb[0] != sizeof(float) || k->nb[0] != 2 || v->nb[0] != 2
        || dst->type != GGML_TYPE_F32 || dst->ne[0] != hd || dst->ne[1] != heads || dst->ne[2] != t
        || dst->nb[1] != (size_t)hd * sizeof(float))
        abort();
    attend_any((struct view){(const char *)q->data, (int64_t)q->nb[1], (int64_t)q->nb[2]},
               (struct view){(const char *)k->data, (int64_t)k->nb[1], (int64_t)k->nb[2]},
               (struct view){(const char *)v->data, (int64_t)v->nb[1], (int64_t)v->nb[2]},
               (struct view){(const char *)dst->data, (int64_t)dst->nb[1], (int64_t)dst->nb[2]},
               hd, heads, kv_heads, t, end, ith, nth);
}

/* The same for every sequence of a step at once, from a table of where each sequence's rows and
 * KV cache are, which ggml_stage.py rewrites in place before each step: a graph built once serves
 * every later step with the same number of rows however they split into sequences (speculative
 * drafts change that split nearly every step, and a new graph cost half a step at 8 sequences).
 *     table  int64 [1 + 7 * num]: num, then per sequence row (its first row in the step), t (its
 *            rows), start (its cached positions before them), K and V cache addresses of this
 *            layer ([kv_heads, capacity, hd] bf16), the byte strides of a position and of a KV head
 * meshllm_ggml_kv_write_batch: src0 k f32 [hd, kv_heads, n], src1 v f32 [hd, kv_heads, n] (any
 * strides) -> each sequence's rows into its caches at start .. start + t, rounded to bf16 as ggml
 * rounds them; dst is a 1-element placeholder the attention takes as its second source, so ggml
 * runs the write first. */
#define TABLE_FIELDS 7

static inline uint16_t f32_to_bf16(float f) { /* ggml's GGML_FP32_TO_BF16: nearest even, NaN kept quiet */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 64);
    return (uint16_t)((bits + (0x7fffu + ((bits >> 16) & 1u))) >> 16);
}

void meshllm_ggml_kv_write_batch(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const int64_t *table = (const int64_t *)userdata;
    const struct ggml_tensor *k = dst->src[0], *v = dst->src[1];
    const int64_t hd = k->ne[0], kv_heads = k->ne[1], n = k->ne[2];
    if (k->type != GGML_TYPE_F32 || v->type != GGML_TYPE_F32 || v->ne[0] != hd || v->ne[1] != kv_heads
        || v->ne[2] != n || k->nb[0] != sizeof(float) || v->nb[0] != sizeof(float) || table[0] < 1) abort();
    for (int64_t i = 0; i < table[0]; i++) {
        const int64_t *e = table + 1 + i * TABLE_FIELDS;
        const int64_t row = e[0], t = e[1], start = e[2], row_nb = e[5], head_nb = e[6];
        if (row < 0 || t < 1 || row + t > n) abort();
        for (int64_t r = 0; r < t; r++) {
            if ((row + r) % nth != ith) continue;
            for (int64_t kh = 0; kh < kv_heads; kh++) {
                const struct ggml_tensor *src[2] = {k, v};
                for (int which = 0; which < 2; which++) {
                    const float *from = (const float *)((const char *)src[which]->data + kh * src[which]->nb[1]
                                                        + (row + r) * src[which]->nb[2]);
                    uint16_t *to = (uint16_t *)((char *)(intptr_t)e[3 + which] + kh * head_nb + (start + r) * row_nb);
                    for (int64_t d = 0; d < hd; d++) to[d] = f32_to_bf16(from[d]);
                }
            }
        }
    }
}

/* src0 q f32 [hd, heads, n] contiguous, src1 the write's placeholder (its ne0 is the KV head
 * count) -> dst f32 [hd, heads, n] */
void meshllm_ggml_attention_batch(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const int64_t *table = (const int64_t *)userdata;
    const struct ggml_tensor *q = dst->src[0], *kv_heads_of = dst->src[1];
    const int64_t hd = q->ne[0], heads = q->ne[1], n = q->ne[2], kv_heads = kv_heads_of->ne[0];
    if (q->type != GGML_TYPE_F32 || q->nb[0] != sizeof(float) || hd % 16 || hd > MAX_HD || heads % kv_heads
        || dst->type != GGML_TYPE_F32 || dst->ne[0] != hd || dst->ne[1] != heads || dst->ne[2] != n
        || dst->nb[1] != (size_t)hd * sizeof(float) || table[0] < 1) abort();
    for (int64_t i = 0; i < table[0]; i++) {
        const int64_t *e = table + 1 + i * TABLE_FIELDS;
        const int64_t row = e[0], t = e[1], start = e[2];
        if (row < 0 || t < 1 || row + t > n) abort();
        attend_any((struct view){(const char *)q->data + row * q->nb[2], (int64_t)q->nb[1], (int64_t)q->nb[2]},
                   (struct view){(const char *)(intptr_t)e[3], e[5], e[6]},
                   (struct view){(const char *)(intptr_t)e[4], e[5], e[6]},
                   (struct view){(const char *)dst->data + row * dst->nb[2], (int64_t)dst->nb[1], (int64_t)dst->nb[2]},
                   hd, heads, kv_heads, t, start + t, ith, nth);
    }
}

#else
int meshllm_attention_available(void) { return 0; }
void meshllm_ggml_attention_few_rows(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)dst; (void)ith; (void)nth; (void)userdata;
    abort(); /* never built into a graph: the ops report themselves unavailable */
}
void meshllm_ggml_kv_write_batch(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)dst; (void)ith; (void)nth; (void)userdata;
    abort();
}
void meshllm_ggml_attention_batch(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)dst; (void)ith; (void)nth; (void)userdata;
    abort();
}
#endif
