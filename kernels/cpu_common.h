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

// ---- Triton's Philox4x32-10 + uint -> uniform, as reference.philox_uniform ----
// u[i] = the uniform of counter base + i under key (k0, k1): the first word of Philox4x32-10 on
// (lo, hi, 0, 0), as a non-negative int31 (~x for negatives) times 2^-31 (rounded as fp32).
static inline uint32_t philox_word(uint64_t off, uint32_t k0, uint32_t k1) {
    uint32_t c0 = (uint32_t)off, c1 = (uint32_t)(off >> 32), c2 = 0, c3 = 0;
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
    return c0;
}

static inline float philox_to_uniform(uint32_t w) {
    int32_t x = (int32_t)w;
    x = x < 0 ? ~x : x;  // -x - 1 for negatives
    return (float)x * 4.6566127342e-10f;
}

#if defined(__AVX512F__)
// 32x32 -> 64-bit products of 16 lanes: (high words, low words). vpmuludq multiplies the even
// lanes; the odd lanes go through a 32-bit shift.
static inline void mul_hilo16(__m512i a, __m512i m, __m512i* hi, __m512i* lo) {
    const __m512i pe = _mm512_mul_epu32(a, m);
    const __m512i po = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    *hi = _mm512_mask_blend_epi32((__mmask16)0xAAAA, _mm512_srli_epi64(pe, 32), po);
    *lo = _mm512_mask_blend_epi32((__mmask16)0xAAAA, pe, _mm512_slli_epi64(po, 32));
}
#endif

// Hand-written rather than left to the auto-vectoriser: it widens each product to a 64-bit lane
// (8 counters per vector); this keeps 16 counters per vector, the same integer operations.
static void philox_uniform(float* __restrict u, i64 n, uint64_t base, uint32_t k0, uint32_t k1) {
    i64 i = 0;
#if defined(__AVX512F__)
    const __m512i step = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i m0 = _mm512_set1_epi32((int)0xD2511F53u), m2 = _mm512_set1_epi32((int)0xCD9E8D57u);
    for (; i + 16 <= n; i += 16) {
        const uint64_t off = base + (uint64_t)i;
        // counters off + 0..15: the low words wrap into the high word lane by lane
        const __m512i lo = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)off), step);
        const __mmask16 carry = _mm512_cmplt_epu32_mask(lo, _mm512_set1_epi32((int)(uint32_t)off));
        __m512i c0 = lo, c1 = _mm512_mask_add_epi32(_mm512_set1_epi32((int)(uint32_t)(off >> 32)), carry,
                                                    _mm512_set1_epi32((int)(uint32_t)(off >> 32)), _mm512_set1_epi32(1));
        __m512i c2 = _mm512_setzero_si512(), c3 = _mm512_setzero_si512();
        uint32_t a = k0, b = k1;
        for (int r = 0; r < 10; r++) {
            __m512i h0, l0, h1, l1;
            mul_hilo16(c2, m2, &h0, &l0);
            mul_hilo16(c0, m0, &h1, &l1);
            const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(h0, c1), _mm512_set1_epi32((int)a));
            const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(h1, c3), _mm512_set1_epi32((int)b));
            c1 = l0;
            c3 = l1;
            c0 = n0;
            c2 = n2;
            a += 0x9E3779B9u;
            b += 0xBB67AE85u;
        }
        // ~x for negative x: x ^ (x >> 31), then int -> float and the scale, as philox_to_uniform
        const __m512i x = _mm512_xor_si512(c0, _mm512_srai_epi32(c0, 31));
        _mm512_storeu_ps(u + i, _mm512_mul_ps(_mm512_cvtepi32_ps(x), _mm512_set1_ps(4.6566127342e-10f)));
    }
#endif
    for (; i < n; i++) u[i] = philox_to_uniform(philox_word(base + (uint64_t)i, k0, k1));
}
