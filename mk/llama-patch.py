"""The changes mk/llama-wheel.sh makes to llama.cpp's CPU flash attention (ggml-cpu/ops.cpp) and to one of its x86
weight kernels (ggml-cpu/arch/x86/repack.cpp) before it builds.

    python3 mk/llama-patch.py SOURCE_TREE      (the unpacked llama-cpp-python sdist)

Each change replaces text that must occur exactly as often as said, or the script fails and names it: a new
llama.cpp must be looked at again, never patched blindly.

1. A lone query row's KV is no longer split among the threads (use_split_kv_path): that path sums the KV in
   another order than the one every batched row takes, so a request decoded alone got other bits than the same
   request beside others (plugins/llamacpp/syshax_llamacpp/engine.py, _proves_lone).
2. With SYSHAX_FA_TILED=1 in a process's environment (read once, at its first flash attention), every query row
   takes the tiled path, a decode step's lone row too, where llama.cpp tiles only prompt chunks of 64 rows or more.
   The tiled path gives a row the same bits whatever else its tile holds, so a token's KV then has the same bits
   whether a prompt chunk of any size or a decode step computed it: the prefix cache can keep what a request
   generated (config keep_generated_tokens; bench/bench_decode_kv.py).
3. So that a tile of one row costs one row, the tiled path computes the rows its tile holds instead of all 64
   (the products, the softmax and the zeroing of its scratch). A row's arithmetic is unchanged: each element of
   its products is the same sequence of fused multiply-adds (simd-gemm.h), whatever the number of rows.
4. The tiled path packs a tile of K transposed (K_f32[dk][kv]) with vector loads and conversions and a transpose in
   registers (AVX-512: 16x16, AVX2 with F16C: 8x8), where llama.cpp converts and stores one scalar at a time: 64 a
   cell, which pays off only over many query rows, and a decode step's tile has one. The packed tile holds the same
   floats (a half's conversion to float is exact), so the products are the same. Elsewhere (ARM) the scalar loop
   stays, and a decode step's attention costs more with SYSHAX_FA_TILED=1.
5. A decode step has one query row per head. Where heads share a KV head (grouped-query attention; no ALiBi, no
   sinks, one mask for all heads) the rows of those heads make one tile, so its K and V tiles are packed once for
   them all, and the threads' chunks of such rows hold whole groups. Each row's arithmetic is the one it has alone.
6. A tile of at most 8 rows (a decode step's: a group of heads, or a short prompt chunk's rows) takes its products
   straight from K's and V's halves, converted and (K) transposed in registers, without storing the packed K_f32 and
   V32 tiles and loading them again; the heads of a group convert their shared mask row once. Each element of a
   product is still simd_gemm's chain over the packed tile, one fused multiply-add per term in the same order, so
   the bits are the same (tests/test_llama_patch.py checks both vector paths against that chain). It brings a
   decode step with every row tiled back to llama.cpp's own cost (bench/bench_decode_step.py). The transposes are
   inlined where they are called, so that the rows stay in registers.
7. x86's kernel for repacked q4_0 weights (gemm_q4_b32_8x8_q8_0_lut_avx, AVX-512 and AVX2) takes 16 activation
   rows per pass over the weights, unpacking each block's nibbles once for all 16, but only 4 rows per pass when
   fewer than 16 are left: a decode step of 8 sequences unpacked every weight twice. Now 8 rows share a pass too.
   Each row's arithmetic is unchanged (its integer dot products, then one fused multiply-add a block into its
   accumulator), so every row keeps its bits (tests/test_llama_patch.py compares them in the real build). With it
   (and the inlined transposes) the engine's decode step of 8 sequences took 19.7 ms against llama-server's 24.9,
   where it took 24.9 against 25.6 before (bench/bench_serving_cost.py; llama-server is built without these
   changes).
"""

from __future__ import annotations

import sys
from pathlib import Path

OPS = "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp"
REPACK = "vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/repack.cpp"

# change 4: K rows [kv_tile][DK] (halves or floats, nbk1 bytes apart) into K_f32[dk * kv_stride + kv]; false where this
# CPU or layout has no vector way (the caller's scalar loop packs it then)
PACK_K = r"""
// a transpose is inlined where it is called, so that the rows stay in registers and are not passed through memory
#if defined(__GNUC__)
#define SYSHAX_INLINE inline __attribute__((always_inline))
#else
#define SYSHAX_INLINE inline
#endif
#if defined(__AVX512F__)
static SYSHAX_INLINE void syshax_transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2*i]     = _mm512_unpacklo_ps(r[2*i], r[2*i + 1]);
        t[2*i + 1] = _mm512_unpackhi_ps(r[2*i], r[2*i + 1]);
    }
    for (int g = 0; g < 4; g++) {
        const __m512d a = _mm512_castps_pd(t[4*g]),     b = _mm512_castps_pd(t[4*g + 2]);
        const __m512d c = _mm512_castps_pd(t[4*g + 1]), d = _mm512_castps_pd(t[4*g + 3]);
        u[4*g]     = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4*g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4*g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4*g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int j = 0; j < 4; j++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
        const __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
        r[j]      = _mm512_shuffle_f32x4(v0, v2, 0x88);
        r[j + 8]  = _mm512_shuffle_f32x4(v0, v2, 0xdd);
        r[j + 4]  = _mm512_shuffle_f32x4(v1, v3, 0x88);
        r[j + 12] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
    }
}
#elif defined(__AVX2__) && defined(__F16C__)
static SYSHAX_INLINE void syshax_transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2*i]     = _mm256_unpacklo_ps(r[2*i], r[2*i + 1]);
        t[2*i + 1] = _mm256_unpackhi_ps(r[2*i], r[2*i + 1]);
    }
    for (int g = 0; g < 2; g++) {
        u[4*g]     = _mm256_shuffle_ps(t[4*g],     t[4*g + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4*g + 1] = _mm256_shuffle_ps(t[4*g],     t[4*g + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4*g + 2] = _mm256_shuffle_ps(t[4*g + 1], t[4*g + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4*g + 3] = _mm256_shuffle_ps(t[4*g + 1], t[4*g + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; j++) {
        r[j]     = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
}
#endif

static bool syshax_pack_k(const char * k_base, size_t nbk1, int kv_tile, int64_t DK, ggml_type kv_type,
                          float * K_f32, int kv_stride) {
#if defined(__AVX512F__)
    const int W = 16;
#elif defined(__AVX2__) && defined(__F16C__)
    const int W = 8;
#else
    const int W = 0;
#endif
    if (W == 0 || DK % W != 0 || kv_stride % W != 0 || (kv_type != GGML_TYPE_F16 && kv_type != GGML_TYPE_F32)) {
        return false;
    }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
    for (int tk0 = 0; tk0 < kv_tile; tk0 += W) {
        for (int64_t d0 = 0; d0 < DK; d0 += W) {
#if defined(__AVX512F__)
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const char * row = k_base + (size_t)(tk0 + i) * nbk1;
                r[i] = tk0 + i >= kv_tile ? _mm512_setzero_ps()
                     : kv_type == GGML_TYPE_F16
                        ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const ggml_fp16_t *)row + d0)))
                        : _mm512_loadu_ps((const float *)row + d0);
            }
            syshax_transpose16(r);
            for (int c = 0; c < 16; c++) {
                _mm512_storeu_ps(K_f32 + (d0 + c) * kv_stride + tk0, r[c]);
            }
#else
            __m256 r[8];
            for (int i = 0; i < 8; i++) {
                const char * row = k_base + (size_t)(tk0 + i) * nbk1;
                r[i] = tk0 + i >= kv_tile ? _mm256_setzero_ps()
                     : kv_type == GGML_TYPE_F16
                        ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const ggml_fp16_t *)row + d0)))
                        : _mm256_loadu_ps((const float *)row + d0);
            }
            syshax_transpose8(r);
            for (int c = 0; c < 8; c++) {
                _mm256_storeu_ps(K_f32 + (d0 + c) * kv_stride + tk0, r[c]);
            }
#endif
        }
    }
    return true;
#else
    GGML_UNUSED(k_base); GGML_UNUSED(nbk1); GGML_UNUSED(kv_tile); GGML_UNUSED(K_f32);
    return false;
#endif
}

"""
# change 6: a tile of few query rows (a decode step's: one row, or a group of heads) takes its products straight from
# the halves of K and V, without the packed K_f32 and V32 tiles in between. Each product element is the same chain
# of fused multiply-adds as simd_gemm's over the packed tiles (C starts at its value, then one fma per kk in order),
# so the bits are the same; only the stores and loads of the packed tiles go.
FEW_ROWS = r"""
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#define SYSHAX_FEW_ROWS 8
#else
#define SYSHAX_FEW_ROWS 0
#endif

// whether syshax_few_qk and syshax_few_v take a tile of `rows` query rows
static inline bool syshax_few(int rows, int64_t DK, int64_t DV, ggml_type kv_type, int kv_stride) {
#if defined(__AVX512F__)
    const int W = 16;
#else
    const int W = 8;
#endif
    return rows <= SYSHAX_FEW_ROWS && kv_type == GGML_TYPE_F16 && DK % W == 0 && DV % W == 0 && kv_stride % W == 0;
}

// the cache lines of n rows of `bytes` each, `stride` apart, on their way (a prefetch never faults: past the
// tensor's end it fetches nothing useful, and harms nothing)
static inline void syshax_prefetch_rows(const char * p, size_t stride, int n, int64_t bytes) {
    for (int i = 0; i < n; i++) {
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + i * stride + o);
    }
}

// KQ[tq * kv_stride + tk] = Q[tq] . K[tk] for tk < kv_stride (0 past kv_tile), as simd_gemm over the packed tile.
// ROWS is a constant, so that the accumulators stay in registers
template <int ROWS>
static void syshax_few_qk_rows(float * KQ, const float * Q, const char * k_base, size_t nbk1, int kv_tile,
                               int64_t DK, int kv_stride) {
#if defined(__AVX512F__)
    for (int tk0 = 0; tk0 < kv_stride; tk0 += 16) {
        __m512 acc[ROWS];
        for (int tq = 0; tq < ROWS; tq++) acc[tq] = _mm512_setzero_ps();
        syshax_prefetch_rows(k_base + (size_t)(tk0 + 16) * nbk1, nbk1, 16, DK * 2);
        for (int64_t d0 = 0; tk0 < kv_tile && d0 < DK; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                r[i] = tk0 + i >= kv_tile ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_loadu_si256(
                    (const __m256i *)((const ggml_fp16_t *)(k_base + (size_t)(tk0 + i) * nbk1) + d0)));
            }
            syshax_transpose16(r);
            for (int c = 0; c < 16; c++) {
                for (int tq = 0; tq < ROWS; tq++) {
                    acc[tq] = _mm512_fmadd_ps(r[c], _mm512_set1_ps(Q[tq * DK + d0 + c]), acc[tq]);
                }
            }
        }
        for (int tq = 0; tq < ROWS; tq++) _mm512_storeu_ps(KQ + tq * kv_stride + tk0, acc[tq]);
    }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    for (int tk0 = 0; tk0 < kv_stride; tk0 += 8) {
        __m256 acc[ROWS];
        for (int tq = 0; tq < ROWS; tq++) acc[tq] = _mm256_setzero_ps();
        syshax_prefetch_rows(k_base + (size_t)(tk0 + 8) * nbk1, nbk1, 8, DK * 2);
        for (int64_t d0 = 0; tk0 < kv_tile && d0 < DK; d0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) {
                r[i] = tk0 + i >= kv_tile ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128(
                    (const __m128i *)((const ggml_fp16_t *)(k_base + (size_t)(tk0 + i) * nbk1) + d0)));
            }
            syshax_transpose8(r);
            for (int c = 0; c < 8; c++) {
                for (int tq = 0; tq < ROWS; tq++) {
                    acc[tq] = _mm256_fmadd_ps(r[c], _mm256_set1_ps(Q[tq * DK + d0 + c]), acc[tq]);
                }
            }
        }
        for (int tq = 0; tq < ROWS; tq++) _mm256_storeu_ps(KQ + tq * kv_stride + tk0, acc[tq]);
    }
#else
    GGML_UNUSED(KQ); GGML_UNUSED(Q); GGML_UNUSED(k_base); GGML_UNUSED(nbk1); GGML_UNUSED(kv_tile); GGML_UNUSED(DK);
    GGML_UNUSED(kv_stride);
#endif
}

// VKQ[tq] += sum over tk < kv_tile of KQ[tq * kv_stride + tk] * V[tk], as simd_gemm over the packed V tile (whose
// rows past kv_tile are zeros: their products add +0 to a sum that is never -0, and so change nothing)
template <int ROWS>
static void syshax_few_v_rows(float * VKQ, const float * KQ, const char * v_base, size_t nbv1, int kv_tile,
                              int64_t DV, int kv_stride) {
#if defined(__AVX512F__)
    if (DV == 64 && ROWS <= 6) {  // all of a row's accumulators in registers: V is read row by row, once
        __m512 acc[ROWS][4];
        for (int tq = 0; tq < ROWS; tq++)
            for (int b = 0; b < 4; b++) acc[tq][b] = _mm512_loadu_ps(VKQ + tq * DV + 16 * b);
        for (int tk = 0; tk < kv_tile; tk++) {
            const ggml_fp16_t * row = (const ggml_fp16_t *)(v_base + (size_t)tk * nbv1);
            __builtin_prefetch((const char *)row + 8 * nbv1);
            __builtin_prefetch((const char *)row + 8 * nbv1 + 64);
            __m512 v[4];
            for (int b = 0; b < 4; b++) v[b] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 16 * b)));
            for (int tq = 0; tq < ROWS; tq++) {
                const __m512 p = _mm512_set1_ps(KQ[tq * kv_stride + tk]);
                for (int b = 0; b < 4; b++) acc[tq][b] = _mm512_fmadd_ps(v[b], p, acc[tq][b]);
            }
        }
        for (int tq = 0; tq < ROWS; tq++)
            for (int b = 0; b < 4; b++) _mm512_storeu_ps(VKQ + tq * DV + 16 * b, acc[tq][b]);
        return;
    }
    for (int64_t d0 = 0; d0 < DV; d0 += 16) {
        __m512 acc[ROWS];
        for (int tq = 0; tq < ROWS; tq++) acc[tq] = _mm512_loadu_ps(VKQ + tq * DV + d0);
        for (int tk = 0; tk < kv_tile; tk++) {
            const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(
                (const __m256i *)((const ggml_fp16_t *)(v_base + (size_t)tk * nbv1) + d0)));
            for (int tq = 0; tq < ROWS; tq++) {
                acc[tq] = _mm512_fmadd_ps(v, _mm512_set1_ps(KQ[tq * kv_stride + tk]), acc[tq]);
            }
        }
        for (int tq = 0; tq < ROWS; tq++) _mm512_storeu_ps(VKQ + tq * DV + d0, acc[tq]);
    }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    for (int64_t d0 = 0; d0 < DV; d0 += 8) {
        __m256 acc[ROWS];
        for (int tq = 0; tq < ROWS; tq++) acc[tq] = _mm256_loadu_ps(VKQ + tq * DV + d0);
        for (int tk = 0; tk < kv_tile; tk++) {
            const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(
                (const __m128i *)((const ggml_fp16_t *)(v_base + (size_t)tk * nbv1) + d0)));
            for (int tq = 0; tq < ROWS; tq++) {
                acc[tq] = _mm256_fmadd_ps(v, _mm256_set1_ps(KQ[tq * kv_stride + tk]), acc[tq]);
            }
        }
        for (int tq = 0; tq < ROWS; tq++) _mm256_storeu_ps(VKQ + tq * DV + d0, acc[tq]);
    }
#else
    GGML_UNUSED(VKQ); GGML_UNUSED(KQ); GGML_UNUSED(v_base); GGML_UNUSED(nbv1); GGML_UNUSED(kv_tile); GGML_UNUSED(DV);
    GGML_UNUSED(kv_stride);
#endif
}

#define SYSHAX_FEW_CASES(f, ...) switch (rows) { \
    case 1: f<1>(__VA_ARGS__); break; case 2: f<2>(__VA_ARGS__); break; case 3: f<3>(__VA_ARGS__); break; \
    case 4: f<4>(__VA_ARGS__); break; case 5: f<5>(__VA_ARGS__); break; case 6: f<6>(__VA_ARGS__); break; \
    case 7: f<7>(__VA_ARGS__); break; default: f<8>(__VA_ARGS__); break; }

static void syshax_few_qk(float * KQ, const float * Q, int rows, const char * k_base, size_t nbk1, int kv_tile,
                          int64_t DK, int kv_stride) {
    SYSHAX_FEW_CASES(syshax_few_qk_rows, KQ, Q, k_base, nbk1, kv_tile, DK, kv_stride)
}

static void syshax_few_v(float * VKQ, const float * KQ, int rows, const char * v_base, size_t nbv1, int kv_tile,
                         int64_t DV, int kv_stride) {
    SYSHAX_FEW_CASES(syshax_few_v_rows, VKQ, KQ, v_base, nbv1, kv_tile, DV, kv_stride)
}

"""


CHANGES = [
    # 1. no split of a lone row's KV
    ("const bool use_split_kv_path = !use_ref && (neq1 == 1 && neq3 == 1)",
     "const bool use_split_kv_path = false && !use_ref && (neq1 == 1 && neq3 == 1)", 1),
    # 2. the switch
    ("        bool use_tiled = !use_ref &&",
     "        static const bool syshax_tiled = [] { const char * v = getenv(\"SYSHAX_FA_TILED\"); "
     "return v != nullptr && v[0] == '1'; }();\n"
     "        bool use_tiled = !use_ref &&", 1),
    ("                                neq1 >= Q_TILE_SZ);",
     "                                (neq1 >= Q_TILE_SZ || syshax_tiled));", 1),
    # 5. a decode step's query rows, one per head: the heads that share a KV head (grouped-query attention) make one
    # tile, so that its K and V tiles are converted once for all of them. Each row is computed as alone
    ("        const int tile_rows = MIN(Q_TILE_SZ, MIN((int)(ir1 - ir), (int)(neq1 - iq1)));",
     "        const bool heads = neq1 == 1 && rk2 > 1 && max_bias == 0.0f && sinks == nullptr &&\n"
     "                           (mask == nullptr || mask->ne[2] == 1);\n"
     "        const int tile_rows = heads ? (int) MIN((int64_t) MIN(Q_TILE_SZ, (int)(ir1 - ir)), rk2 - iq2 % rk2)\n"
     "                                    : MIN(Q_TILE_SZ, MIN((int)(ir1 - ir), (int)(neq1 - iq1)));", 1),
    ("const float * pq = (const float *) ((char *) q->data + ((iq1 + tq)*nbq1 + iq2*nbq2 + iq3*nbq3));",
     "const float * pq = (const float *) ((char *) q->data + (heads ? iq1*nbq1 + (iq2 + tq)*nbq2\n"
     "                                                                         "
     ": (iq1 + tq)*nbq1 + iq2*nbq2) + iq3*nbq3);", 1),
    ("const ggml_fp16_t * mp_row = (const ggml_fp16_t *)((const char *) mask->data + (iq1 + tq)*mask->nb[1]",
     "const ggml_fp16_t * mp_row = (const ggml_fp16_t *)((const char *) mask->data + "
     "(iq1 + (heads ? 0 : tq))*mask->nb[1]", 1),
    ("            const int i1 = iq1 + tq;\n"
     "            const int i2 = iq2;",
     "            const int i1 = heads ? iq1 : iq1 + tq;\n"
     "            const int i2 = heads ? iq2 + tq : iq2;", 1),
    # and so that a group is not cut in two, a decode step's thread chunks hold whole groups
    ("        const int64_t dr = (nr + nchunk - 1) / nchunk;\n",
     "        const int64_t group = neq1 == 1 && nek2 > 0 && neq2 % nek2 == 0 ? neq2 / nek2 : 1;\n"
     "        const int64_t dr = ((nr + nchunk - 1) / nchunk + group - 1) / group * group;\n", 1),
    # 3. a tile's own rows only: its scratch (the rows and KV columns past the tile's are never read: a short KV
    # tile's columns are set to -inf after the product, and its V rows past the tile's end to zero below)
    ("        memset(VKQ32, 0, Q_TILE_SZ * DV * sizeof(float));\n"
     "        memset(mask32, 0, Q_TILE_SZ * KV_TILE_SZ * sizeof(float));",
     "        memset(VKQ32, 0, tile_rows * DV * sizeof(float));\n"
     "        memset(mask32, 0, tile_rows * KV_TILE_SZ * sizeof(float));", 1),
    ("            for (int tq = tile_rows; tq < Q_TILE_SZ; tq++) {\n"
     "                memset(Q_f32 + tq * DK, 0, DK * sizeof(float));\n"
     "            }\n", "", 1),
    ("        memset(K_f32, 0, DK * KV_TILE_SZ * sizeof(float));\n"
     "        memset(V32,   0, KV_TILE_SZ * DV * sizeof(float));\n", "", 1),
    ("                    memcpy(V32 + tk * DV, v_data, DV * sizeof(float));\n"
     "                }\n"
     "            }\n",
     "                    memcpy(V32 + tk * DV, v_data, DV * sizeof(float));\n"
     "                }\n"
     "            }\n"
     "            if (kv_tile < KV_TILE_SZ) {\n"
     "                memset(V32 + kv_tile * DV, 0, (KV_TILE_SZ - kv_tile) * DV * sizeof(float));\n"
     "            }\n", 1),
    # and its products and softmax
    # 4. K packed transposed with vector loads, conversions and an in-register transpose, where llama.cpp converts
    # and stores it one scalar at a time (64 a cell, paid back only over many rows: a decode step's tile has one).
    # The packed tile is the same, so are the products
    ("static void ggml_compute_forward_flash_attn_ext_tiled(",
     PACK_K + "static void ggml_compute_forward_flash_attn_ext_tiled(", 1),
    ("            // Pack K tile transposed: K_f32[dk][kv] so KV_TILE is contiguous (SIMD dim)\n"
     "            // Zero-pad the last tile so the GEMM always operates on KV_TILE_SZ columns\n"
     "            for (int tk = 0; tk < kv_tile; tk++) {\n",
     "            // Pack K tile transposed: K_f32[dk][kv] so KV_TILE is contiguous (SIMD dim)\n"
     "            // Zero-pad the last tile so the GEMM always operates on KV_TILE_SZ columns\n"
     "            if (!syshax_pack_k((const char *)k->data + ic*nbk1 + ik2*nbk2 + ik3*nbk3, nbk1, kv_tile, DK,\n"
     "                               kv_type, K_f32, KV_TILE_SZ))\n"
     "            for (int tk = 0; tk < kv_tile; tk++) {\n", 1),
    ("memset(KQ, 0, Q_TILE_SZ * KV_TILE_SZ * sizeof(float));\n"
     "            simd_gemm(KQ, (const float *)Q_q, K_f32, Q_TILE_SZ, DK, KV_TILE_SZ);",
     "memset(KQ, 0, tile_rows * KV_TILE_SZ * sizeof(float));\n"
     "            simd_gemm(KQ, (const float *)Q_q, K_f32, tile_rows, DK, KV_TILE_SZ);", 1),
    ("ggml_vec_scale_f32(Q_TILE_SZ * KV_TILE_SZ, KQ, scale);",
     "ggml_vec_scale_f32(tile_rows * KV_TILE_SZ, KQ, scale);", 1),
    ("                ggml_vec_tanh_f32(Q_TILE_SZ * KV_TILE_SZ, KQ, KQ);\n"
     "                ggml_vec_scale_f32(Q_TILE_SZ * KV_TILE_SZ, KQ, logit_softcap);",
     "                ggml_vec_tanh_f32(tile_rows * KV_TILE_SZ, KQ, KQ);\n"
     "                ggml_vec_scale_f32(tile_rows * KV_TILE_SZ, KQ, logit_softcap);", 1),
    # the padding of a short KV tile, the softmax, and the skipped rows' zeroing: three loops over the tile's rows
    ("for (int tq = 0; tq < Q_TILE_SZ; tq++) {", "for (int tq = 0; tq < tile_rows; tq++) {", 3),
    ("simd_gemm(VKQ32, KQ, V32, Q_TILE_SZ, KV_TILE_SZ, DV);",
     "simd_gemm(VKQ32, KQ, V32, tile_rows, KV_TILE_SZ, DV);", 1),
    # 6. a tile of few rows (a decode step's) takes its products straight from the halves of K and V
    ("static void ggml_compute_forward_flash_attn_ext_tiled(",
     FEW_ROWS + "static void ggml_compute_forward_flash_attn_ext_tiled(", 1),
    ("        memset(mask32, 0, tile_rows * KV_TILE_SZ * sizeof(float));\n",
     "        memset(mask32, 0, tile_rows * KV_TILE_SZ * sizeof(float));\n"
     "        const bool few = syshax_few(tile_rows, DK, DV, kv_type, KV_TILE_SZ);\n", 1),
    ("            if (!syshax_pack_k(", "            if (!few && !syshax_pack_k(", 1),
    ("memset(KQ, 0, tile_rows * KV_TILE_SZ * sizeof(float));\n"
     "            simd_gemm(KQ, (const float *)Q_q, K_f32, tile_rows, DK, KV_TILE_SZ);",
     "if (few) {\n"
     "                syshax_few_qk(KQ, (const float *)Q_q, tile_rows,\n"
     "                              (const char *)k->data + ic*nbk1 + ik2*nbk2 + ik3*nbk3, nbk1, kv_tile, DK, "
     "KV_TILE_SZ);\n"
     "            } else {\n"
     "            memset(KQ, 0, tile_rows * KV_TILE_SZ * sizeof(float));\n"
     "            simd_gemm(KQ, (const float *)Q_q, K_f32, tile_rows, DK, KV_TILE_SZ);\n"
     "            }", 1),
    ("            for (int tk = 0; tk < kv_tile; tk++) {\n"
     "                const char * v_data = ",
     "            if (!few)\n"
     "            for (int tk = 0; tk < kv_tile; tk++) {\n"
     "                const char * v_data = ", 1),
    ("            if (kv_tile < KV_TILE_SZ) {\n"
     "                memset(V32 + kv_tile * DV",
     "            if (!few && kv_tile < KV_TILE_SZ) {\n"
     "                memset(V32 + kv_tile * DV", 1),
    ("simd_gemm(VKQ32, KQ, V32, tile_rows, KV_TILE_SZ, DV);",
     "if (few) {\n"
     "                syshax_few_v(VKQ32, KQ, tile_rows, (const char *)v->data + ic*nbv1 + iv2*nbv2 + iv3*nbv3, nbv1,\n"
     "                             kv_tile, DV, KV_TILE_SZ);\n"
     "            } else {\n"
     "            simd_gemm(VKQ32, KQ, V32, tile_rows, KV_TILE_SZ, DV);\n"
     "            }", 1),
    # and the heads of a group share one mask row: it is converted once, not once a head
    ("                bool can_skip = true;\n"
     "                for (int tq = 0; tq < tile_rows; tq++) {",
     "                bool can_skip = true;\n"
     "                for (int tq = 0; tq < (heads ? 1 : tile_rows); tq++) {", 1),
    ("                ggml_vec_add_f32(tile_rows * KV_TILE_SZ, KQ, KQ, mask32);",
     "                for (int tq = 0; heads && tq < tile_rows; tq++) {\n"
     "                    ggml_vec_add_f32(KV_TILE_SZ, KQ + tq * KV_TILE_SZ, KQ + tq * KV_TILE_SZ, mask32);\n"
     "                }\n"
     "                if (!heads) ggml_vec_add_f32(tile_rows * KV_TILE_SZ, KQ, KQ, mask32);", 1),
]


# change 7, in the x86 kernel that multiplies repacked q4_0 (and iq4_nl, mxfp4) weights by up to 16 rows at once
# (gemm_q4_b32_8x8_q8_0_lut_avx, AVX-512 and AVX2 alike): 8 rows (a decode step of 8 sequences) share one pass
# over the weights as 16 do, where llama.cpp unpacked the weights' nibbles once for every 4 rows. Each row's
# arithmetic is unchanged: per block, its integer dot products, then one fused multiply-add into its accumulator.
GEMM_Q4 = "static void gemm_q4_b32_8x8_q8_0_lut_avx("
GEMM_CHANGES = [
    # both 16-row loops below count the rows themselves; nothing else in the function reads anr
    ("    int anr = nr - nr%16; // Used to align nr with boundary of 16\n", "", 1),
    # the 16-row loop (AVX-512, then AVX2) runs with 4 row groups while 16 rows are left, then with 2 while 8 are
    ("    for (; y < anr / 4; y += 4) {",
     "    for (int syshax_rb = 4; syshax_rb >= 2; syshax_rb -= 2)  // row groups (of 4 rows) a pass takes\n"
     "    for (; y + syshax_rb <= nr / 4; y += syshax_rb) {", 2),
    ("for (int rp = 0; rp < 4; rp++) {", "for (int rp = 0; rp < syshax_rb; rp++) {", 2),
    ("            for (int i = 0; i < 16; i++) {\n"
     "                _mm512_storeu_ps((float *)(s + ((y * 4 + i) * bs + x * 8)), acc_rows[i]);",
     "            for (int i = 0; i < 4 * syshax_rb; i++) {\n"
     "                _mm512_storeu_ps((float *)(s + ((y * 4 + i) * bs + x * 8)), acc_rows[i]);", 1),
    ("            for (int i = 0; i < 16; i++) {\n"
     "                _mm256_storeu_ps((float *)(s + ((y * 4 + i) * bs + x * 8)), acc_rows[i]);",
     "            for (int i = 0; i < 4 * syshax_rb; i++) {\n"
     "                _mm256_storeu_ps((float *)(s + ((y * 4 + i) * bs + x * 8)), acc_rows[i]);", 1),
]


def _refused(path: Path, old: str, found: int, count: int) -> None:
    print(f"mk/llama-patch.py: {path} holds {found} of {old!r} where {count} were expected; this llama.cpp needs its "
          "changes looked at again", file=sys.stderr)


def _apply(path: Path, text: str, changes: list[tuple[str, str, int]]) -> str | None:
    """text with every change made, or None (and why, on stderr) where a change's text is not found as often as
    expected."""
    for old, new, count in changes:
        found = text.count(old)
        if found != count:
            _refused(path, old, found, count)
            return None
        text = text.replace(old, new)
    return text


def _apply_in_function(path: Path, text: str, signature: str, changes: list[tuple[str, str, int]]) -> str | None:
    """text with the changes made inside the one function that starts with `signature` (up to its closing brace
    at a line's start) and nowhere else, or None (and why, on stderr)."""
    if text.count(signature) != 1:
        _refused(path, signature, text.count(signature), 1)
        return None
    start = text.index(signature)
    end = text.index("\n}\n", start) + 3
    changed = _apply(path, text[start:end], changes)
    return None if changed is None else text[:start] + changed + text[end:]


def main() -> int:
    tree = Path(sys.argv[1])
    ops, repack = tree / OPS, tree / REPACK
    ops_text = _apply(ops, ops.read_text(), CHANGES)
    repack_text = ops_text and _apply_in_function(repack, repack.read_text(), GEMM_Q4, GEMM_CHANGES)
    if repack_text is None:
        return 1
    ops.write_text("#include <cstdlib>\n" + ops_text)
    repack.write_text(repack_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
