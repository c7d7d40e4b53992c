// The CPU path's kernels: the arithmetic of kernels/reference.py, bit for bit, one pass per block.
// Built by kernels/cpu_native.py at first use (g++ -O3 -march=native -ffp-contract=off, no
// fast-math) and called through ctypes; single-threaded (the caller's thread).
//
// Exactness rules (see cpu_native.py's docstring for why each holds):
// - every float operation is an IEEE fp32 operation in the reference's order: x / scale (a true
//   division, never a reciprocal multiply), + 0.5 or + the Philox uniform, floor, clamp;
//   code * scale; sums 0 + d_0 + d_1 + ... in index order;
// - absmax is the integer maximum of |x|'s bit patterns: for non-negative floats the integer
//   order is the float order, and Inf / NaN patterns exceed every finite one, so one reduction
//   gives both the block's absmax and whether it is finite;
// - non-finite blocks get scale NaN (0x7fc00000, torch's NaN) and codes 0; zero-scale blocks codes 0.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZQ_AVX512BF16 1
#endif

#include "cpu_common.h"

// ---- one block: x[0:n] (n <= gs, the rest zero padding) -> codes, *scale ----
template <class L, int BITS, bool STOCH>
static inline void quantize_block(const typename L::T* __restrict x, i64 n, i64 gs, uint8_t* __restrict codes,
                                  float* __restrict scale_out, uint64_t base, uint32_t k0, uint32_t k1,
                                  float* __restrict ubuf, int8_t* __restrict cbuf) {
    const float Q = (float)((1 << (BITS - 1)) - 1);
    const i64 nbytes = gs * BITS / 8;
    uint32_t m = 0;
    for (i64 i = 0; i < n; i++) {
        uint32_t a = f2u(L::load(x, i)) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    const float scale = u2f(m) / Q;  // the reference's absmax / qmax
    if (m >= 0x7f800000u) {  // a NaN or +-Inf in the block
        *scale_out = u2f(0x7fc00000u);
        memset(codes, BITS == 8 ? 0 : 0x88, nbytes);
        return;
    }
    *scale_out = scale;
    if (!(scale > 0.0f)) {
        memset(codes, BITS == 8 ? 0 : 0x88, nbytes);
        return;
    }
    if (STOCH) philox_uniform(ubuf, gs, base, k0, k1);
    int8_t* __restrict c = BITS == 8 ? (int8_t*)codes : cbuf;
    for (i64 i = 0; i < n; i++) {
        float t = L::load(x, i) / scale;
        t = t + (STOCH ? ubuf[i] : 0.5f);
        t = floorf(t);
        t = t < -Q ? -Q : t;
        t = t > Q ? Q : t;
        c[i] = (int8_t)(int32_t)t;
    }
    for (i64 i = n; i < gs; i++) {  // zero padding, through the same formula
        float t = 0.0f / scale;
        t = t + (STOCH ? ubuf[i] : 0.5f);
        t = floorf(t);
        t = t < -Q ? -Q : t;
        t = t > Q ? Q : t;
        c[i] = (int8_t)(int32_t)t;
    }
    if (BITS == 4) {
        for (i64 j = 0; j < gs / 2; j++)
            codes[j] = (uint8_t)((uint8_t)(cbuf[2 * j] + 8) | (uint8_t)((cbuf[2 * j + 1] + 8) << 4));
    }
}

template <class L, int BITS, bool STOCH>
static void quantize_rows(const void* xv, i64 x_rs, i64 rows, i64 cols, i64 gs, uint8_t* codes, i64 c_rs,
                          float* scales, i64 s_rs, uint64_t seed, float* ubuf, int8_t* cbuf) {
    const typename L::T* x = (const typename L::T*)xv;
    const i64 G = (cols + gs - 1) / gs, bpg = gs * BITS / 8;
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (i64 r = 0; r < rows; r++)
        for (i64 g = 0; g < G; g++) {
            i64 n = cols - g * gs < gs ? cols - g * gs : gs;
            quantize_block<L, BITS, STOCH>(x + r * x_rs + g * gs, n, gs, codes + r * c_rs + g * bpg,
                                           scales + r * s_rs + g, (uint64_t)(r * G + g) * (uint64_t)gs, k0, k1,
                                           ubuf, cbuf);
        }
}

// ---- dequantize one block of codes into fp32 d[0:gs] = code * scale ----
template <int BITS>
static inline void decode_block(const uint8_t* __restrict codes, float s, i64 gs, float* __restrict d) {
    if (BITS == 8) {
        const int8_t* c = (const int8_t*)codes;
        for (i64 i = 0; i < gs; i++) d[i] = (float)c[i] * s;
    } else {
        for (i64 j = 0; j < gs / 2; j++) {
            uint8_t b = codes[j];
            d[2 * j] = (float)((int32_t)(b & 15) - 8) * s;
            d[2 * j + 1] = (float)((int32_t)(b >> 4) - 8) * s;
        }
    }
}

// One block of a plain dequantize: o[0:n] = code * sc rounded to S, elements from ``from`` on.
// NOT_NAN: sc is finite, so no product is NaN (a code is an integer of magnitude <= 127).
template <class S, int BITS, bool NOT_NAN>
static inline void dequantize_block(const uint8_t* __restrict cb, float sc, i64 from, i64 n,
                                    typename S::T* __restrict o) {
    if (BITS == 8) {
        const int8_t* c = (const int8_t*)cb;
        for (i64 i = from; i < n; i++) {
            const float f = (float)c[i] * sc;
            o[i] = NOT_NAN ? S::store_not_nan(f) : S::store(f);
        }
    } else {
        for (i64 j = from / 2; j < n / 2; j++) {
            const uint8_t b = cb[j];
            const float lo = (float)((int32_t)(b & 15) - 8) * sc, hi = (float)((int32_t)(b >> 4) - 8) * sc;
            o[2 * j] = NOT_NAN ? S::store_not_nan(lo) : S::store(lo);
            o[2 * j + 1] = NOT_NAN ? S::store_not_nan(hi) : S::store(hi);
        }
        if (n % 2) o[n - 1] = S::store((float)((int32_t)(cb[n / 2] & 15) - 8) * sc);
    }
}

#ifdef ZQ_AVX512BF16
// bf16 output through vcvtneps2bf16 (round to nearest even; it treats denormals as zero). Used
// only for a finite scale that is 0 or normal: every product is then +-0, normal or +-Inf, where
// the instruction and torch's rounding agree bit for bit. Returns how many elements it wrote
// (a multiple of 16); the caller finishes the block.
template <int BITS>
static inline i64 dequantize_bf16_avx512(const uint8_t* __restrict cb, float sc, i64 n, uint16_t* __restrict o) {
    const __m512 s = _mm512_set1_ps(sc);
    i64 i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i v;
        if (BITS == 8) {
            v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(cb + i)));
        } else {  // 8 bytes -> 16 nibbles in element order (low nibble first), minus 8
            const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(cb + i / 2)));
            const __m128i b = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(15)), _mm_slli_epi16(_mm_srli_epi16(w, 4), 8));
            v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(b), _mm512_set1_epi32(8));
        }
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(v), s));
        _mm256_storeu_si256((__m256i*)(o + i), (__m256i)h);
    }
    return i;
}
#endif

template <class S, int BITS>
static inline void dequantize_one(const uint8_t* __restrict cb, float sc, i64 n, typename S::T* __restrict o) {
    const float a = fabsf(sc);
    if (!(a <= FLT_MAX)) {  // NaN or +-Inf scale
        dequantize_block<S, BITS, false>(cb, sc, 0, n, o);
        return;
    }
    i64 from = 0;
#ifdef ZQ_AVX512BF16
    if (S::IS_BF16 && (a == 0.0f || a >= FLT_MIN))
        from = dequantize_bf16_avx512<BITS>(cb, sc, n, (uint16_t*)o);
#endif
    dequantize_block<S, BITS, true>(cb, sc, from, n, o);
}

// k stacked inputs (codes [k, rows, *] with strides c_ks / c_rs bytes, scales likewise in floats);
// SUM: 0 + d_0 + ... + d_{k-1} (the reference's dequantize_sum), else d_0 alone (dequantize).
template <class S, int BITS, bool SUM>
static void dequantize_rows(const uint8_t* codes, i64 c_ks, i64 c_rs, const float* scales, i64 s_ks, i64 s_rs,
                            i64 k, i64 rows, i64 cols, i64 gs, void* outv, float* acc, float* d) {
    typename S::T* out = (typename S::T*)outv;
    const i64 G = (cols + gs - 1) / gs, bpg = gs * BITS / 8;
    for (i64 r = 0; r < rows; r++)
        for (i64 g = 0; g < G; g++) {
            const i64 n = cols - g * gs < gs ? cols - g * gs : gs;
            typename S::T* __restrict o = out + r * cols + g * gs;
            if (!SUM) {  // one pass: decode, multiply, round to the output dtype
                dequantize_one<S, BITS>(codes + r * c_rs + g * bpg, scales[r * s_rs + g], n, o);
                continue;
            }
            for (i64 i = 0; i < n; i++) acc[i] = 0.0f;
            for (i64 j = 0; j < k; j++) {
                decode_block<BITS>(codes + j * c_ks + r * c_rs + g * bpg, scales[j * s_ks + r * s_rs + g], gs, d);
                for (i64 i = 0; i < n; i++) acc[i] = acc[i] + d[i];
            }
            for (i64 i = 0; i < n; i++) o[i] = S::store(acc[i]);
        }
}

// the fused reduce: each block's ordered fp32 sum (all gs positions, padding included, as the
// reference sums the padded blocks) re-quantized where it lies.
template <int IN_BITS, int OUT_BITS, bool STOCH>
static void requantize_rows(const uint8_t* codes, i64 c_ks, i64 c_rs, const float* scales, i64 s_ks, i64 s_rs,
                            i64 k, i64 rows, i64 cols, i64 gs, uint8_t* out_codes, i64 oc_rs, float* out_scales,
                            i64 os_rs, uint64_t seed, float* acc, float* d, float* ubuf, int8_t* cbuf) {
    const i64 G = (cols + gs - 1) / gs, ibpg = gs * IN_BITS / 8, obpg = gs * OUT_BITS / 8;
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (i64 r = 0; r < rows; r++)
        for (i64 g = 0; g < G; g++) {
            for (i64 i = 0; i < gs; i++) acc[i] = 0.0f;
            for (i64 j = 0; j < k; j++) {
                decode_block<IN_BITS>(codes + j * c_ks + r * c_rs + g * ibpg, scales[j * s_ks + r * s_rs + g], gs, d);
                for (i64 i = 0; i < gs; i++) acc[i] = acc[i] + d[i];
            }
            quantize_block<F32, OUT_BITS, STOCH>(acc, gs, gs, out_codes + r * oc_rs + g * obpg,
                                                 out_scales + r * os_rs + g, (uint64_t)(r * G + g) * (uint64_t)gs,
                                                 k0, k1, ubuf, cbuf);
        }
}

// ---- exported entry points: dtype 0 = fp32, 1 = bf16, 2 = fp16. Return 0, or -1 (bad arguments
// or out of memory: the caller then takes another path). ----
struct Scratch {
    float* f;
    int8_t* c;
    explicit Scratch(i64 floats) : f((float*)malloc((size_t)(floats > 0 ? floats : 1) * 4)),
                                   c((int8_t*)malloc((size_t)(floats > 0 ? floats / 3 + 1 : 1))) {}
    ~Scratch() { free(f); free(c); }
    bool ok() const { return f && c; }
};

#define QDISPATCH(L)                                                                                            \
    if (bits == 8 && !stochastic) quantize_rows<L, 8, false>(x, x_rs, rows, cols, gs, codes, c_rs, scales, s_rs, seed, s.f, s.c); \
    else if (bits == 8) quantize_rows<L, 8, true>(x, x_rs, rows, cols, gs, codes, c_rs, scales, s_rs, seed, s.f, s.c);           \
    else if (!stochastic) quantize_rows<L, 4, false>(x, x_rs, rows, cols, gs, codes, c_rs, scales, s_rs, seed, s.f, s.c);          \
    else quantize_rows<L, 4, true>(x, x_rs, rows, cols, gs, codes, c_rs, scales, s_rs, seed, s.f, s.c);

extern "C" int zq_quantize(const void* x, i64 x_rs, int dtype, i64 rows, i64 cols, i64 gs, int bits, int stochastic,
                           uint64_t seed, uint8_t* codes, i64 c_rs, float* scales, i64 s_rs) {
    if ((bits != 8 && bits != 4) || gs <= 0 || (bits == 4 && gs % 2)) return -1;
    Scratch s(3 * gs);  // ubuf gs floats; cbuf gs bytes
    if (!s.ok()) return -1;
    if (dtype == 0) { QDISPATCH(F32) } else if (dtype == 1) { QDISPATCH(BF16) } else if (dtype == 2) { QDISPATCH(F16) } else return -1;
    return 0;
}

#define DQ(S, B)                                                                                       \
    (sum ? dequantize_rows<S, B, true>(codes, c_ks, c_rs, scales, s_ks, s_rs, k, rows, cols, gs, out, s.f, s.f + gs) \
         : dequantize_rows<S, B, false>(codes, c_ks, c_rs, scales, s_ks, s_rs, k, rows, cols, gs, out, s.f, s.f + gs))
#define DQDISPATCH(S) if (bits == 8) DQ(S, 8); else DQ(S, 4);

extern "C" int zq_dequantize(const uint8_t* codes, i64 c_ks, i64 c_rs, const float* scales, i64 s_ks, i64 s_rs, i64 k,
                             i64 rows, i64 cols, i64 gs, int bits, int sum, void* out, int dtype) {
    if ((bits != 8 && bits != 4) || gs <= 0 || (bits == 4 && gs % 2)) return -1;
    Scratch s(3 * gs);  // acc gs floats; d gs floats
    if (!s.ok()) return -1;
    if (dtype == 0) { DQDISPATCH(F32) } else if (dtype == 1) { DQDISPATCH(BF16) } else if (dtype == 2) { DQDISPATCH(F16) } else return -1;
    return 0;
}

#define RQ(IB, OB)                                                                                                 \
    (stochastic ? requantize_rows<IB, OB, true>(codes, c_ks, c_rs, scales, s_ks, s_rs, k, rows, cols, gs, out_codes, \
                                                oc_rs, out_scales, os_rs, seed, s.f, s.f + gs, s.f + 2 * gs, s.c)      \
                : requantize_rows<IB, OB, false>(codes, c_ks, c_rs, scales, s_ks, s_rs, k, rows, cols, gs, out_codes, \
                                                 oc_rs, out_scales, os_rs, seed, s.f, s.f + gs, s.f + 2 * gs, s.c))

extern "C" int zq_requantize(const uint8_t* codes, i64 c_ks, i64 c_rs, const float* scales, i64 s_ks, i64 s_rs, i64 k,
                             i64 rows, i64 cols, i64 gs, int in_bits, int out_bits, int stochastic, uint64_t seed,
                             uint8_t* out_codes, i64 oc_rs, float* out_scales, i64 os_rs) {
    if ((in_bits != 8 && in_bits != 4) || (out_bits != 8 && out_bits != 4) || gs <= 0 || gs % 2 && (in_bits == 4 || out_bits == 4))
        return -1;
    Scratch s(3 * gs);  // acc, d, ubuf: gs floats each
    if (!s.ok()) return -1;
    if (in_bits == 8 && out_bits == 8) RQ(8, 8);
    else if (in_bits == 8) RQ(8, 4);
    else if (out_bits == 8) RQ(4, 8);
    else RQ(4, 4);
    return 0;
}
