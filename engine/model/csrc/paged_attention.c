/*
 * Decode attention straight out of the paged KV cache, for float32 on the CPU.
 *
 * One query row per request, and each request is one task: it reads the request's
 * keys block by block through its block table (no gathered copy; a block's rows hold
 * every KV head, so a block is one contiguous read, and the next block is prefetched
 * while this one is used), takes each query head's softmax, then accumulates the
 * values the same way. K and V are read once each: the gather plus padded SDPA call
 * this replaces spent most of its time in copies and in the per-matrix overhead of
 * thousands of tiny matmuls.
 *
 * Layouts (all contiguous, float32):
 *   q            [B, Hq, D]         this step's queries, one row per request
 *   k_cache      [N, bs, Hkv, D]    one layer's paged keys (values alike)
 *   block_tables [B, max_blocks]    int64 block ids, token order
 *   context_lens [B]                int64 keys per request (the new token included)
 *   out          [B, Hq, D]
 * window > 0: each query attends to its ``window`` latest keys only (a sliding-window
 * layer); 0: to all of them.
 * Query heads g*Hkv .. are grouped as in Hugging Face's repeat_kv: KV head h serves
 * query heads h*G .. h*G+G-1, where G = Hq / Hkv.
 *
 * Built and loaded by engine/model/cpu_attention.py (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* 8 floats; unaligned loads. Plain C vectors: the compiler maps them onto whatever
 * the machine has (AVX2, AVX-512, NEON). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    v8 acc0 = {0}, acc1 = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += *(const v8 *)(a + i) * *(const v8 *)(b + i);
        acc1 += *(const v8 *)(a + i + 8) * *(const v8 *)(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) acc0 += *(const v8 *)(a + i) * *(const v8 *)(b + i);
    acc0 += acc1;  /* a tree, not a chain of 8 dependent adds */
    float s = ((acc0[0] + acc0[4]) + (acc0[1] + acc0[5])) + ((acc0[2] + acc0[6]) + (acc0[3] + acc0[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* The rows of the block holding token t0 that attention over keys [start, ctx) reads:
 * returns the first of them (row *i0 of the block), sets *n to the block's rows before
 * ctx, and *next to the same row of the block after it (the one to prefetch; this one
 * again at the end). */
static inline const float *block_span(const float *cache, const int64_t *table, int64_t t0, int64_t start,
                                      int64_t ctx, int bs, int64_t block, int64_t row, const float **next,
                                      int64_t *i0, int64_t *n) {
    *i0 = t0 < start ? start - t0 : 0;
    *n = ctx - t0 < bs ? ctx - t0 : bs;
    *next = cache + table[(t0 + bs < ctx ? t0 + bs : t0) / bs] * block + *i0 * row;
    return cache + table[t0 / bs] * block + *i0 * row;
}

static inline void prefetch_row(const float *p, int64_t row) {
    for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(p + c);
}

/* One request, every head, over its keys [start, ctx). scores: Hq * (ctx - start)
 * floats of scratch. Always inlined, so a constant head size D (see the caller)
 * unrolls the row loops. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t start, int64_t ctx,
    int Hq, int Hkv, int D, int bs, float scale, float *scores, float *out) {
    const int G = Hq / Hkv;
    const int64_t row = (int64_t)Hkv * D, block = (int64_t)bs * row, len = ctx - start;
    const float *next;
    int64_t i0, n;
    for (int64_t t0 = start - start % bs; t0 < ctx; t0 += bs) {
        const float *k = block_span(k_cache, table, t0, start, ctx, bs, block, row, &next, &i0, &n);
        for (int64_t i = i0; i < n; i++, k += row, next += row) {
            prefetch_row(next, row);
            for (int hq = 0; hq < Hq; hq++)
                scores[hq * len + t0 + i - start] = dot(q + hq * D, k + hq / G * D, D) * scale;
        }
    }
    for (int hq = 0; hq < Hq; hq++) {
        float *s = scores + hq * len, top = s[0], sum = 0.f;
        for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        for (int64_t t = 0; t < len; t++) sum += (s[t] = expf(s[t] - top));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
        for (int d = 0; d < D; d++) out[hq * D + d] = 0.f;
    }
    for (int64_t t0 = start - start % bs; t0 < ctx; t0 += bs) {
        const float *v = block_span(v_cache, table, t0, start, ctx, bs, block, row, &next, &i0, &n);
        for (int64_t i = i0; i < n; i++, v += row, next += row) {
            prefetch_row(next, row);
            for (int hq = 0; hq < Hq; hq++) axpy(out + hq * D, scores[hq * len + t0 + i - start], v + hq / G * D, D);
        }
    }
}

/* Returns 0, or -1 for bad sizes, -2 for a context length outside its block table,
 * -3 when scratch memory could not be had. */
int tandem_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *block_tables, const int64_t *context_lens, float *out,
                            int B, int Hq, int Hkv, int D, int bs, int max_blocks, float scale,
                            int window, int num_threads) {
    if (B <= 0) return 0;
    if (Hkv <= 0 || Hq % Hkv || D <= 0 || bs <= 0 || window < 0) return -1;
    int64_t longest = 0;
    for (int b = 0; b < B; b++) {
        if (context_lens[b] < 1 || context_lens[b] > (int64_t)max_blocks * bs) return -2;
        longest = context_lens[b] > longest ? context_lens[b] : longest;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)Hq * (size_t)longest);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int b = 0; b < B; b++) {
            if (!scores) continue;
            const float *qb = q + (int64_t)b * Hq * D;
            float *ob = out + (int64_t)b * Hq * D;
            const int64_t *table = block_tables + (int64_t)b * max_blocks, ctx = context_lens[b];
            const int64_t start = window && ctx > window ? ctx - window : 0;
            switch (D) {
            case 64: attend(qb, k_cache, v_cache, table, start, ctx, Hq, Hkv, 64, bs, scale, scores, ob); break;
            case 128: attend(qb, k_cache, v_cache, table, start, ctx, Hq, Hkv, 128, bs, scale, scores, ob); break;
            default: attend(qb, k_cache, v_cache, table, start, ctx, Hq, Hkv, D, bs, scale, scores, ob);
            }
        }
        free(scores);
    }
    return failed ? -3 : 0;
}
