// What the two CPU kernel libraries (cpu_native.cpp: the int scheme; cpu_formats.cpp: the float
// formats) share: bit casts, the element types they load and store, and the Philox uniforms of
// stochastic rounding. Each library includes it (#include "cpu_common.h", found next to the
// source) and hashes its text into its build-cache key (cpu_native.py, cpu_formats.py), so an
// edit here rebuilds both.
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef int64_t i64;

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// ---- element types: load as fp32 (exact widening), store from fp32 (round to nearest even) ----
struct F32 {
    typedef float T;
    static constexpr bool IS_BF16 = false;
    static inline float load(const T* p, i64 i) { return p[i]; }
    static inline T store(float f) { return f; }
    static inline T store_not_nan(float f) { return f; }
};
struct BF16 {
    typedef uint16_t T;
    static constexpr bool IS_BF16 = true;
    static inline float load(const T* p, i64 i) { return u2f((uint32_t)p[i] << 16); }
    static inline T store(float f) {  // torch's round_to_nearest_even; NaN -> 0x7fc0
        uint32_t u = f2u(f);
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)r;
    }
    static inline T store_not_nan(float f) {  // the same for a value known not to be NaN
        uint32_t u = f2u(f);
        return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
};
struct F16 {
    typedef _Float16 T;
    static constexpr bool IS_BF16 = false;
    static inline float load(const T* p, i64 i) { return (float)p[i]; }
    static inline T store(float f) { return (T)f; }
    static inline T store_not_nan(float f) { return (T)f; }
};

// ---- the stochastic-rounding stream of reference.philox_uniform (its docstring has the rule) ----
// The element at offset o takes word o % 4 of Philox4x32-10 (Triton's) at counter o // 4 on
// (lo, hi, 0, 0) under key (k0, k1), as a non-negative int31 (~x for negatives) times 2^-31
// (rounded as fp32): one Philox evaluation gives the uniforms of four consecutive elements.
static inline void philox4(uint64_t ctr, uint32_t k0, uint32_t k1, uint32_t w[4]) {
    uint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0, c3 = 0;
    uint32_t a = k0, b = k1;
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xCD9E8D57u * c2;
        uint64_t p1 = (uint64_t)0xD2511F53u * c0;
        uint32_t n0 = (uint32_t)(p0 >> 32) ^ c1 ^ a;
        uint32_t n2 = (uint32_t)(p1 >> 32) ^ c3 ^ b;
        c1 = (uint32_t)p0;
        c3 = (uint32_t)p1;
        c0 = n0;
        c2 = n2;
        a += 0x9E3779B9u;
        b += 0xBB67AE85u;
    }
    w[0] = c0;
    w[1] = c1;
    w[2] = c2;
    w[3] = c3;
}

static inline float philox_to_uniform(uint32_t w) {
    int32_t x = (int32_t)w;
    x = x < 0 ? ~x : x;  // -x - 1 for negatives
    return (float)x * 4.6566127342e-10f;
}

// u[0:4] = the uniforms of the four offsets of counter ctr, lanes from..to-1 only
static inline void philox_uniform4(float* __restrict u, uint64_t ctr, int from, int to, uint32_t k0, uint32_t k1) {
    uint32_t w[4];
    philox4(ctr, k0, k1, w);
    for (int l = from; l < to; l++) u[l - from] = philox_to_uniform(w[l]);
}

#if defined(__AVX512F__)
// ~x for negative x: x ^ (x >> 31), then int -> float and the scale, as philox_to_uniform
static inline __m512 uniform16(__m512i w) {
    const __m512i x = _mm512_xor_si512(w, _mm512_srai_epi32(w, 31));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(x), _mm512_set1_ps(4.6566127342e-10f));
}

// u[0:64] = the uniforms of the 16 counters ctr .. ctr + 15, in offset order (word l of counter j
// -> u[4 * j + l]). Two vectors of 8 counters, one per 64-bit lane: each state word sits in the
// low half of its lane, so vpmuludq gives the full 64-bit product (high word: one shift, low
// word: the product itself; the high halves are never read as state, vpmuludq ignores them and
// xor keeps the low halves exact), and the two vectors' independent rounds overlap.
static inline void philox_uniform64(float* __restrict u, uint64_t ctr, uint32_t k0, uint32_t k1) {
    const __m512i step = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i m0 = _mm512_set1_epi64(0xD2511F53u), m2 = _mm512_set1_epi64(0xCD9E8D57u);
    __m512i c0[2], c1[2], c2[2], c3[2];
    for (int h = 0; h < 2; h++) {  // counters ctr + 8h + 0..7: (low word, high word, 0, 0)
        const __m512i cv = _mm512_add_epi64(_mm512_set1_epi64((long long)(ctr + 8 * (uint64_t)h)), step);
        c0[h] = cv;
        c1[h] = _mm512_srli_epi64(cv, 32);
        c2[h] = _mm512_setzero_si512();
        c3[h] = _mm512_setzero_si512();
    }
    uint32_t a = k0, b = k1;
    for (int r = 0; r < 10; r++) {
        const __m512i ka = _mm512_set1_epi64(a), kb = _mm512_set1_epi64(b);
        for (int h = 0; h < 2; h++) {
            const __m512i p0 = _mm512_mul_epu32(c2[h], m2), p1 = _mm512_mul_epu32(c0[h], m0);
            const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(p0, 32), c1[h]), ka);
            const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(p1, 32), c3[h]), kb);
            c1[h] = p0;
            c3[h] = p1;
            c0[h] = n0;
            c2[h] = n2;
        }
        a += 0x9E3779B9u;
        b += 0xBB67AE85u;
    }
    // per lane the pairs (word 0, word 1) and (word 2, word 3) as 64-bit values, then the two pairs
    // of each counter side by side: counters 0-3 and 4-7 of each vector
    const __m512i qlo = _mm512_set_epi64(11, 3, 10, 2, 9, 1, 8, 0), qhi = _mm512_set_epi64(15, 7, 14, 6, 13, 5, 12, 4);
    for (int h = 0; h < 2; h++) {
        const __m512i p01 = _mm512_mask_blend_epi32((__mmask16)0xAAAA, c0[h], _mm512_slli_epi64(c1[h], 32));
        const __m512i p23 = _mm512_mask_blend_epi32((__mmask16)0xAAAA, c2[h], _mm512_slli_epi64(c3[h], 32));
        _mm512_storeu_ps(u + 32 * h, uniform16(_mm512_permutex2var_epi64(p01, qlo, p23)));
        _mm512_storeu_ps(u + 32 * h + 16, uniform16(_mm512_permutex2var_epi64(p01, qhi, p23)));
    }
}
#endif

// u[0:n] = the uniforms of offsets base .. base + n - 1. Vectorised by hand: g++ 12 -O3 does
// vectorise a loop of philox_uniform4 (one counter chain per vector), at half this speed (measured
// on the 2-core AVX-512 dev machine: 0.99 against 0.48 ns per uniform).
static void philox_uniform(float* __restrict u, i64 n, uint64_t base, uint32_t k0, uint32_t k1) {
    i64 i = 0;
    uint64_t ctr = base >> 2;
    const int first = (int)(base & 3);
    if (first && n > 0) {  // the rest of a counter begun before base
        const int to = n < 4 - first ? first + (int)n : 4;
        philox_uniform4(u, ctr++, first, to, k0, k1);
        i = to - first;
    }
#if defined(__AVX512F__)
    for (; i + 64 <= n; i += 64, ctr += 16) philox_uniform64(u + i, ctr, k0, k1);
    if (n - i > 4) {  // a part vector costs about 1.5 scalar counters (measured): it pays from 2
        float t[64];
        philox_uniform64(t, ctr, k0, k1);
        memcpy(u + i, t, (size_t)(n - i) * sizeof(float));
        return;
    }
#endif
    for (; i < n; i += 4, ctr++) philox_uniform4(u + i, ctr, 0, n - i < 4 ? (int)(n - i) : 4, k0, k1);
}
