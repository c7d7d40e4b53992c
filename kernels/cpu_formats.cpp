// The CPU path's kernels for the floating-point wire formats (fp8, mx, nvfp4): the arithmetic of
// kernels/format_reference.py, bit for bit, one pass per block (mx / nvfp4: per tile of blocks;
// nvfp4: one more pass per row for its tensor scale; its tiles on AVX-512 in cpu_formats_nvfp4.h;
// MXFP6 / NVFP4 dequantize on AVX-512 in cpu_formats_deq.h),
// and the reductions over received wire rows (the codecs' generic sum, fused). Built by
// kernels/cpu_formats.py at first use with the flags of cpu_native.py (-O3 -march=native
// -ffp-contract=off, no fast-math) and called through ctypes; single-threaded.
//
// Exactness rules (see cpu_formats.py's docstring for why each holds):
// - every float operation is one IEEE fp32 operation in the reference's order; powers of two are
//   built from their bit patterns, so a / 2^k and a * 2^-k are the same exact (or once-rounded)
//   value the reference computes;
// - an element's code comes from integer arithmetic on its exponent bits and its rounded mantissa
//   count r: code = ((e - emin) << M) + r, which is the format's bit pattern for every r in
//   [0, 2^(M+1)] (r = 2^(M+1) moves into the next binade by the carry), then clamped to the largest
//   finite code (saturation) and given the sign bit;
// - a normal code decodes by placing its exponent and mantissa bits in an fp32 pattern and adding
//   127 - bias to the exponent field (an integer add), a subnormal code as mag * 2^(emin - M): both
//   exact, with no fp32 subnormal operand (those stall the FP unit); the 8- and 4-bit vector decode
//   keeps the shorter form, the bits in an fp32 pattern times 2^(127 - bias), the same exact value;
// - absmax is the integer maximum of |x|'s bit patterns (NaN / Inf patterns exceed every finite one);
// - round half to even is rintf (vectorised as vrndscaleps), which rounds in the thread's mode:
//   round-to-nearest-even, the IEEE default that torch leaves alone.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>
#include <type_traits>
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZF_AVX512BF16 1
#endif
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZF_AVX512VBMI 1
#endif

#include "cpu_common.h"
#include "cpu_formats_nvfp4.h"  // ZF_NVFP4_AVX512: nv_tile
#include "cpu_formats_deq.h"    // ZF_DEQ_AVX512: dq_mx6_row, dq_nvfp4_row

static inline float pow2(int e) {  // 2^e for e in [-149, 127], exact
    return e >= -126 ? u2f((uint32_t)(e + 127) << 23) : u2f(1u << (e + 149));
}
static const uint32_t QNAN = 0x7fc00000u;  // torch's NaN

// ---- element formats (OCP MX v1.0): M mantissa bits, bias, code width, largest finite code ----
template <int BITS_, int M_, int BIAS_, int MAXCODE_, int NANCODE_, int EMAX_>
struct Fmt {
    static constexpr int BITS = BITS_, M = M_, BIAS = BIAS_, EMIN = 1 - BIAS_, MAXCODE = MAXCODE_;
    static constexpr int NANCODE = NANCODE_;  // -1: the format has no NaN
    static constexpr int EMAX = EMAX_;        // exponent of the largest normal (the MX scale rule)
    static constexpr bool INT = false;
    static constexpr uint32_t SIGN = 1u << (BITS_ - 1);
    static inline float maxval() { return u2f(((uint32_t)MAXCODE_ << (23 - M_))) * pow2(127 - BIAS_); }
    static inline float minval() { return pow2(1 - BIAS_ - M_); }  // the smallest nonzero magnitude
};
typedef Fmt<8, 3, 7, 0x7e, 0x7f, 8> E4M3;    // max 448, NaN S.1111.111, no Inf
typedef Fmt<8, 2, 15, 0x7b, 0x7f, 15> E5M2;  // max 57344, IEEE Inf (0x7c) / NaN
typedef Fmt<6, 2, 3, 0x1f, -1, 4> E3M2;      // max 28
typedef Fmt<6, 3, 1, 0x1f, -1, 2> E2M3;      // max 7.5
typedef Fmt<4, 1, 1, 0x7, -1, 2> E2M1;       // max 6
struct I8 {  // MX INT8: value = k / 64, k in [-127, 127]
    static constexpr int BITS = 8, EMAX = 0;
    static constexpr bool INT = true;
    static inline float maxval() { return 127.0f / 64.0f; }
    static inline float minval() { return 1.0f / 64.0f; }
};

// One element: v (already scaled) -> code bits (two's complement byte for INT8). u: the
// stochastic uniform (ignored for nearest). Branch-free so that loops over a block vectorise.
template <class F, bool STOCH>
static inline uint32_t encode(float v, float u) {
    if constexpr (F::INT) {
        float t = v * 64.0f;  // exact (a power-of-two scaling that cannot overflow here)
        t = STOCH ? floorf(t + u) : rintf(t);
        t = t < -127.0f ? -127.0f : t;
        t = t > 127.0f ? 127.0f : t;
        return (uint32_t)(int32_t)t & 0xffu;
    } else {
        const uint32_t vb = f2u(v), ab = vb & 0x7fffffffu, sign = (vb >> 31) * F::SIGN;
        const uint32_t mb = f2u(F::maxval());
        const uint32_t ac = ab < mb ? ab : mb;  // saturate (+Inf too)
        int32_t e = (int32_t)(ac >> 23) - 127;
        e = e < F::EMIN ? F::EMIN : e;
        const float m = u2f(ac) * u2f((uint32_t)(127 + F::M - e) << 23);  // a / 2^(e - M), exact
        const float r = STOCH ? floorf(m + u) : rintf(m);
        int32_t code = ((e - F::EMIN) << F::M) + (int32_t)r;
        code = code > F::MAXCODE ? F::MAXCODE : code;
        return (uint32_t)code | sign;  // (NaN never gets here: non-finite blocks are handled whole)
    }
}

// The fp32 bits of a normal code's magnitude (exponent field >= 1): its exponent and mantissa
// fields placed in an fp32 pattern and the exponent rebiased by an integer add. Subnormal codes are
// mag * 2^(emin - M) (an exact int conversion and power-of-two product). Neither multiplies an fp32
// subnormal: placing a subnormal code's bits in an fp32 pattern and scaling it by 2^(127 - bias)
// gives the same value but stalls the FP unit on denormal operands (microcode assists).
template <class F>
static inline uint32_t normal_bits(uint32_t mag) {
    return (mag << (23 - F::M)) + ((uint32_t)(127 - F::BIAS) << 23);
}

// One code -> its exact fp32 value.
template <class F>
static inline float decode(uint32_t c) {
    if constexpr (F::INT) {
        return (float)(int32_t)(int8_t)(uint8_t)c * 0.015625f;
    } else {
        const uint32_t mag = c & (F::SIGN - 1u);
        uint32_t b = mag < (1u << F::M) ? f2u((float)(int32_t)mag * pow2(F::EMIN - F::M)) : normal_bits<F>(mag);
        b |= (c & F::SIGN) ? 0x80000000u : 0u;
        if constexpr (F::NANCODE == 0x7f && F::M == 3) b = mag == 0x7fu ? QNAN : b;  // E4M3
        if constexpr (F::M == 2 && F::BITS == 8) {  // E5M2: exponent field all ones
            const uint32_t inf = 0x7f800000u | ((c & F::SIGN) ? 0x80000000u : 0u);
            b = mag >= 0x7cu ? (mag == 0x7cu ? inf : QNAN) : b;
        }
        return u2f(b);
    }
}

// ---- packing: 8 bits one byte; 6 bits four codes in three bytes (little endian 24-bit word);
// 4 bits two codes per byte, low nibble first. n is a multiple of 4 (blocks of 16 / 32, or any
// fp8 group for 8 bits). ----
template <int BITS>
static inline void pack(const uint8_t* __restrict c, i64 n, uint8_t* __restrict out) {
    if (BITS == 8) {
        memcpy(out, c, (size_t)n);
    } else if (BITS == 6) {
        i64 j = 0;
#ifdef ZF_AVX512VBMI
        // 64 codes -> 48 bytes: pairs (c0 + 64 c1, c2 + 64 c3) by vpmaddubsw, the 24-bit word
        // w = p0 + 4096 p1 by vpmaddwd, then vpermb keeps the three low bytes of each word.
        const __m512i pair = _mm512_set1_epi16(0x4001), quad = _mm512_set1_epi32(0x10000001);
        alignas(64) uint8_t idx[64];
        for (int k = 0; k < 64; k++) idx[k] = (uint8_t)(k < 48 ? (k / 3) * 4 + k % 3 : 0);
        const __m512i perm = _mm512_load_si512((const void*)idx);
        for (; j + 16 <= n / 4; j += 16) {
            const __m512i v = _mm512_loadu_si512((const void*)(c + 4 * j));
            const __m512i w = _mm512_madd_epi16(_mm512_maddubs_epi16(v, pair), quad);
            _mm512_mask_storeu_epi8(out + 3 * j, (__mmask64)0xffffffffffffULL, _mm512_permutexvar_epi8(perm, w));
        }
#endif
        for (; j < n / 4; j++) {
            const uint32_t w = (uint32_t)c[4 * j] | ((uint32_t)c[4 * j + 1] << 6) | ((uint32_t)c[4 * j + 2] << 12) |
                               ((uint32_t)c[4 * j + 3] << 18);
            out[3 * j] = (uint8_t)w;
            out[3 * j + 1] = (uint8_t)(w >> 8);
            out[3 * j + 2] = (uint8_t)(w >> 16);
        }
    } else {
        for (i64 j = 0; j < n / 2; j++) out[j] = (uint8_t)(c[2 * j] | (c[2 * j + 1] << 4));
    }
}

// The codes of n elements (n a multiple of 4 for 6 bits, of 2 for 4 bits) into c[0:n], one per byte.
template <int BITS>
static inline void unpack(const uint8_t* __restrict p, i64 n, uint8_t* __restrict c) {
    if (BITS == 8) {
        memcpy(c, p, (size_t)n);
    } else if (BITS == 4) {
        for (i64 j = 0; j < n / 2; j++) {
            c[2 * j] = p[j] & 15u;
            c[2 * j + 1] = p[j] >> 4;
        }
    } else {
        i64 j = 0;
#ifdef ZF_AVX512VBMI
        // 48 bytes -> 64 codes: vpermb puts bytes 6q..6q+5 in qword q, vpmultishiftqb takes the
        // byte at bit offsets 0, 6, ..., 42 of each qword, and the mask keeps 6 bits.
        alignas(64) uint8_t idx[64];
        for (int k = 0; k < 64; k++) idx[k] = (uint8_t)((k / 8) * 6 + (k % 8 < 6 ? k % 8 : 5));
        const __m512i perm = _mm512_load_si512((const void*)idx);
        const __m512i shifts = _mm512_set1_epi64(0x2a241e18120c0600LL), m63 = _mm512_set1_epi8(63);
        for (; j + 16 <= n / 4; j += 16) {
            const __m512i b = _mm512_maskz_loadu_epi8((__mmask64)0xffffffffffffULL, p + 3 * j);
            const __m512i v = _mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(perm, b));
            _mm512_storeu_si512((void*)(c + 4 * j), _mm512_and_si512(v, m63));
        }
#endif
        for (; j < n / 4; j++) {
            const uint32_t w = (uint32_t)p[3 * j] | ((uint32_t)p[3 * j + 1] << 8) | ((uint32_t)p[3 * j + 2] << 16);
            c[4 * j] = w & 63u;
            c[4 * j + 1] = (w >> 6) & 63u;
            c[4 * j + 2] = (w >> 12) & 63u;
            c[4 * j + 3] = (w >> 18) & 63u;
        }
    }
}

// d[0:n] = decode(c[i]) * sc (fp32).
template <class F>
static inline void decode_block(const uint8_t* __restrict c, i64 n, float sc, float* __restrict d) {
    for (i64 i = 0; i < n; i++) d[i] = decode<F>(c[i]) * sc;
}

// o[0:n] = d[0:n] rounded to S. FAST (bf16 on AVX512-BF16 CPUs): no d[i] is an fp32 subnormal
// and none is NaN unless it is torch's NaN, where vcvtneps2bf16 (which treats denormals as zero)
// rounds exactly as torch does; the caller knows this from the block's scale.
template <class S>
static inline void store_block(const float* __restrict d, i64 n, bool fast, typename S::T* __restrict o) {
    i64 i = 0;
#ifdef ZF_AVX512BF16
    if (S::IS_BF16 && fast)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i*)(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(d + i)));
#else
    (void)fast;
#endif
    for (; i < n; i++) o[i] = S::store(d[i]);
}

#ifdef ZF_AVX512BF16
// decode<F> of 16 codes (zero-extended bytes in v), the same operations on whole vectors.
template <class F>
static inline __m512 decode16(__m512i v) {
    if constexpr (F::INT) {
        const __m512i k = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);  // the byte's two's complement
        return _mm512_mul_ps(_mm512_cvtepi32_ps(k), _mm512_set1_ps(0.015625f));
    } else {
        const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32((int)(F::SIGN - 1u)));
        const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32((int)F::SIGN)), 32 - F::BITS);
        __m512i b;
        if constexpr (F::BITS == 6) {  // as decode(): no fp32 subnormal operand (6-bit blocks hold many subnormal codes)
            const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(pow2(F::EMIN - F::M)));
            const __m512i nor = _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - F::M), _mm512_set1_epi32((127 - F::BIAS) << 23));
            const __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(1 << F::M));
            b = _mm512_or_si512(_mm512_mask_mov_epi32(nor, is_sub, _mm512_castps_si512(sub)), sign);
        } else {  // the bits placed in an fp32 pattern times 2^(127 - bias): fewer operations, the same value
            const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 23 - F::M)), _mm512_set1_ps(pow2(127 - F::BIAS)));
            b = _mm512_or_si512(_mm512_castps_si512(f), sign);
        }
        if constexpr (F::NANCODE == 0x7f && F::M == 3)
            b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32((int)QNAN));
        if constexpr (F::M == 2 && F::BITS == 8) {
            b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7c)),
                                      _mm512_or_si512(sign, _mm512_set1_epi32(0x7f800000)));
            b = _mm512_mask_mov_epi32(b, _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7c)), _mm512_set1_epi32((int)QNAN));
        }
        return _mm512_castsi512_ps(b);
    }
}
#endif

// o[0:n] = decode(c[i]) * sc rounded to S, in one pass where the CPU allows (fp32 always, bf16
// under store_block's FAST rule); otherwise through d[] and store_block.
template <class S, class F>
static inline void decode_store(const uint8_t* __restrict c, i64 n, float sc, bool fast, float* __restrict d,
                                typename S::T* __restrict o) {
    i64 i = 0;
#ifdef ZF_AVX512BF16
    if (S::IS_BF16 ? fast : sizeof(typename S::T) == 4) {
        const __m512 s = _mm512_set1_ps(sc);
        // 4-bit codes: the 16 products decode(k) * sc (the same operations) looked up by code
        const __m512 table = _mm512_mul_ps(decode16<F>(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)), s);
        for (; i + 16 <= n; i += 16) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + i)));
            const __m512 x = F::BITS == 4 ? _mm512_permutexvar_ps(v, table) : _mm512_mul_ps(decode16<F>(v), s);
            if (S::IS_BF16) _mm256_storeu_si256((__m256i*)(o + i), (__m256i)_mm512_cvtneps_pbh(x));
            else _mm512_storeu_ps((float*)(o + i), x);
        }
    }
#endif
    decode_block<F>(c + i, n - i, sc, d);
    store_block<S>(d, n - i, fast, o + i);
}

static inline uint32_t absmax_bits_f(const float* __restrict x, i64 n) {
    uint32_t m = 0;
    for (i64 i = 0; i < n; i++) {
        const uint32_t a = f2u(x[i]) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m;
}

// The largest finite |x[i]|'s bits over x[0:n] (NaN and Inf skipped; 0 when none is finite):
// one integer max over bit patterns, on bf16's 16-bit patterns directly. Written with AVX-512
// intrinsics where the CPU has them because gcc leaves this masked maximum scalar.
template <class L>
static inline uint32_t row_finite_absmax(const typename L::T* __restrict x, i64 n) {
    i64 i = 0;
    uint32_t m = 0;
    if constexpr (L::IS_BF16) {
        const uint16_t* __restrict p = (const uint16_t*)x;
#ifdef __AVX512BW__
        __m512i mv = _mm512_setzero_si512();
        const __m512i abs = _mm512_set1_epi16(0x7fff), inf = _mm512_set1_epi16(0x7f80);
        for (; i + 32 <= n; i += 32) {
            const __m512i v = _mm512_and_si512(_mm512_loadu_si512((const void*)(p + i)), abs);
            mv = _mm512_max_epu16(mv, _mm512_maskz_mov_epi16(_mm512_cmplt_epu16_mask(v, inf), v));
        }
        alignas(64) uint16_t lanes[32];
        _mm512_store_si512((void*)lanes, mv);
        for (int k = 0; k < 32; k++) m = lanes[k] > m ? lanes[k] : m;
#endif
        for (; i < n; i++) {
            const uint32_t v = p[i] & 0x7fffu, f = v < 0x7f80u ? v : 0u;
            m = f > m ? f : m;
        }
        return m << 16;
    } else {
#ifdef __AVX512F__
        if constexpr (sizeof(typename L::T) == 4) {
            __m512i mv = _mm512_setzero_si512();
            const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
            for (; i + 16 <= n; i += 16) {
                const __m512i v = _mm512_and_si512(_mm512_loadu_si512((const void*)((const float*)x + i)), abs);
                mv = _mm512_max_epu32(mv, _mm512_maskz_mov_epi32(_mm512_cmplt_epu32_mask(v, inf), v));
            }
            m = _mm512_reduce_max_epu32(mv);
        }
#endif
        for (; i < n; i++) {
            const uint32_t v = f2u(L::load(x, i)) & 0x7fffffffu, f = v < 0x7f800000u ? v : 0u;
            m = f > m ? f : m;
        }
        return m;
    }
}

// ---- scheme parameters ----
enum { S_FP8 = 0, S_MX = 1, S_NVFP4 = 2 };
struct Args {
    i64 rows, cols, gs;     // gs: elements per block (fp8 group_size; mx 32; nvfp4 16)
    int stochastic;
    uint64_t seed;
    int round_up;           // mx: the round-up scale rule instead of OCP's
};

// MX shared exponent of a finite, nonzero block (absmax bits m), before the E8M0 clamp.
template <class F>
static inline int mx_exponent(uint32_t m, int round_up) {
    int e = (int)(m >> 23) - 127 - F::EMAX;
    if (round_up && e >= -127 && e <= 127 && u2f(m) * pow2(-e) > F::maxval()) e += 1;
    return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// Codes of one block of w[0:gs] (already loaded) scaled by: division by s (DIV) or
// multiplication by s (an exact power of two), into c[0:gs].
template <class F, bool STOCH, bool DIV>
static inline void encode_block(const float* __restrict w, i64 gs, float s, const float* __restrict u,
                                uint8_t* __restrict c) {
    for (i64 i = 0; i < gs; i++) {
        const float v = DIV ? w[i] / s : w[i] * s;
        c[i] = (uint8_t)encode<F, STOCH>(v, STOCH ? u[i] : 0.0f);
    }
}

static constexpr i64 TILE = 2048;  // elements per tile of fixed-size blocks (values, codes in L1)

// Scratch of one block or one tile (n = max(gs, TILE) elements): fp32 values w, uniforms u,
// per-element scales sv, codes c.
struct Scratch {
    float *w, *u, *sv;
    uint8_t* c;
    explicit Scratch(i64 n)
        : w((float*)malloc((size_t)n * 4)), u((float*)malloc((size_t)n * 4)), sv((float*)malloc((size_t)n * 4)),
          c((uint8_t*)malloc((size_t)n)) {}
    ~Scratch() { free(w); free(u); free(sv); free(c); }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    bool ok() const { return w && u && sv && c; }
};

// ---- row sources: where a quantization reads its rows. fill(r, i0, n, nt, w, s) writes elements
// i0 .. i0 + n - 1 of row r as fp32 into w[0:n] and zeros into w[n:nt] (it may use s.c, s.u and
// s.sv as scratch: the quantizer fills them only after); finite_absmax(r, cols, s) is the largest
// finite |element|'s bits over the row (nvfp4's tensor scale). ----

// Rows of an input tensor x (element type L, row stride rs elements), widened exactly.
template <class L>
struct XRows {
    const typename L::T* x;
    i64 rs;
    inline void fill(i64 r, i64 i0, i64 n, i64 nt, float* __restrict w, Scratch&) const {
        const typename L::T* __restrict xr = x + r * rs + i0;
        for (i64 i = 0; i < n; i++) w[i] = L::load(xr, i);
        for (i64 i = n; i < nt; i++) w[i] = 0.0f;
    }
    inline uint32_t finite_absmax(i64 r, i64 cols, Scratch&) const { return row_finite_absmax<L>(x + r * rs, cols); }
    typedef L Elem;
    static constexpr bool PADDED = false;  // tile(): only whole tiles may be read in place
    inline const typename L::T* tile(i64 r, i64 i0) const { return x + r * rs + i0; }
    // fill, and mb[b] = the absmax bits of block b (GSC elements) of w[0:nt], read as it is written
    template <int GSC>
    inline void fill_absmax(i64 r, i64 i0, i64 n, i64 nt, float* __restrict w, uint32_t* __restrict mb, Scratch& s) const {
        const typename L::T* __restrict xr = x + r * rs + i0;
        const i64 full = n / GSC;
        for (i64 b = 0; b < full; b++) {
            uint32_t m = 0;
            for (i64 i = 0; i < GSC; i++) {
                const float v = L::load(xr + b * GSC, i);
                w[b * GSC + i] = v;
                const uint32_t a = f2u(v) & 0x7fffffffu;
                m = a > m ? a : m;
            }
            mb[b] = m;
        }
        for (i64 i = full * GSC; i < n; i++) w[i] = L::load(xr, i);
        for (i64 i = n; i < nt; i++) w[i] = 0.0f;
        for (i64 b = full; b < nt / GSC; b++) mb[b] = absmax_bits_f(w + b * GSC, GSC);
        (void)s;
    }
};

// A source whose element format is chosen at run time (the received rows of a reduction): one
// virtual call per tile or block, so each input format is compiled once, not once per output format.
struct TileSource {
    virtual void fill(i64 r, i64 i0, i64 n, i64 nt, float* w, Scratch& s) const = 0;
    virtual ~TileSource() = default;
};

// Fixed-size blocks (mx: 32, nvfp4: 16) of row r, TILE elements at a time: widen (each block's
// absmax taken as it is widened: one pass less over the tile; measured 5-30% faster for MX to
// nearest), per-block scales, one long encode loop over x / scale (nvfp4) or x * 2^-k (mx), one
// pack. Blocks that store zero codes (zero, non-finite, zero-scale) are cleared after the encode.
// nvfp4 on AVX-512 CPUs takes nv_tile instead (cpu_formats_nvfp4.h: the same arithmetic in about
// half the operations), reading whole tiles of the source in place.
template <class Src, class F, int SCHEME, bool STOCH, int GSC>
static void quantize_tiles(const Src& src, i64 r, const Args& a, uint8_t* codes_r, uint8_t* scales_r, float t,
                           Scratch& s, uint32_t k0, uint32_t k1) {
    const i64 G = (a.cols + GSC - 1) / GSC, padded = G * GSC;
#ifdef ZF_NVFP4_AVX512
    static_assert(TILE / 16 <= NV_TILE_BLOCKS, "nv_tile takes a whole tile of nvfp4 blocks");
    if constexpr (SCHEME == S_NVFP4) {
        for (i64 i0 = 0; i0 < padded; i0 += TILE) {
            const i64 nt = padded - i0 < TILE ? padded - i0 : TILE, n = a.cols - i0 < nt ? a.cols - i0 : nt;
            if (STOCH) philox_uniform(s.u, nt, (uint64_t)(r * padded + i0), k0, k1);
            if (i0 + 3 * TILE <= a.cols) nv_prefetch(src.tile(r, i0 + 2 * TILE), TILE * (i64)sizeof(typename Src::Elem::T));
            if (n == nt || Src::PADDED) {
                nv_tile<typename Src::Elem, STOCH>(src.tile(r, i0), nt / GSC, t, s.u, scales_r + i0 / GSC, codes_r + i0 / 2);
            } else {
                src.fill(r, i0, n, nt, s.w, s);
                nv_tile<F32, STOCH>(s.w, nt / GSC, t, s.u, scales_r + i0 / GSC, codes_r + i0 / 2);
            }
        }
        return;
    }
#endif
    const float tt = t > 0.0f ? t : 1.0f;  // nvfp4: the row's tensor scale (a stand-in 1 where it is 0)
    for (i64 i0 = 0; i0 < padded; i0 += TILE) {
        const i64 nt = padded - i0 < TILE ? padded - i0 : TILE, n = a.cols - i0 < nt ? a.cols - i0 : nt;
        // the tile's values and each block's absmax bits, in one pass where the source allows
        const i64 nb = nt / GSC, g0 = i0 / GSC;
        uint32_t mb[TILE / GSC];
        float mult[TILE / GSC];
        uint8_t zero[TILE / GSC];  // blocks that store zero codes
        src.template fill_absmax<GSC>(r, i0, n, nt, s.w, mb, s);
        for (i64 b = 0; b < nb; b++) {
            const uint32_t m = mb[b];
            if (SCHEME == S_MX) {
                const bool z = m == 0 || m >= 0x7f800000u;
                const int e = z ? 0 : mx_exponent<F>(m, a.round_up);
                scales_r[g0 + b] = m >= 0x7f800000u ? (uint8_t)255 : (m == 0 ? (uint8_t)0 : (uint8_t)(e + 127));
                mult[b] = pow2(-e);
                zero[b] = z;
            } else {  // E4M3 block scale code of absmax / 6 / t, element scale decode(code) * t
                const uint32_t bc = encode<E4M3, false>(u2f(m) / 6.0f / tt, 0.0f);
                const uint32_t code = m >= 0x7f800000u ? 0x7fu : (t > 0.0f ? bc : 0u);
                scales_r[g0 + b] = (uint8_t)code;
                const float d = m >= 0x7f800000u ? 0.0f : decode<E4M3>(code) * t;
                zero[b] = !(d > 0.0f);
                mult[b] = d > 0.0f ? d : 1.0f;
            }
        }
        for (i64 b = 0; b < nb; b++)
            for (i64 i = 0; i < GSC; i++) s.sv[b * GSC + i] = mult[b];
        if (STOCH) philox_uniform(s.u, nt, (uint64_t)(r * padded + i0), k0, k1);
        const float* __restrict w = s.w;
        const float* __restrict sv = s.sv;
        const float* __restrict u = s.u;
        uint8_t* __restrict c = s.c;
        for (i64 i = 0; i < nt; i++) {
            const float v = SCHEME == S_NVFP4 ? w[i] / sv[i] : w[i] * sv[i];
            c[i] = (uint8_t)encode<F, STOCH>(v, STOCH ? u[i] : 0.0f);
        }
        for (i64 b = 0; b < nb; b++)
            if (zero[b]) memset(c + b * GSC, 0, GSC);
        pack<F::BITS>(c, nt, codes_r + i0 * F::BITS / 8);
    }
}

// x [rows, cols] (row stride x_rs elements) -> codes [rows, *] (c_rs bytes) and scales:
// fp8 fp32 [rows, G] (s_rs floats); mx E8M0 bytes [rows, G] (s_rs bytes); nvfp4 E4M3 bytes
// [rows, G] (s_rs bytes) and fp32 tensor scales (t[r * t_rs]).
template <class Src, class F, int SCHEME, bool STOCH, int GSC>
static void quantize_rows(const Src& src, const Args& a, uint8_t* codes, i64 c_rs, void* scales, i64 s_rs, float* tsc,
                          i64 t_rs, Scratch& s) {
    static_assert(GSC > 0 || SCHEME == S_FP8, "mx and nvfp4 blocks go through quantize_tiles");
    const i64 gs = GSC ? GSC : a.gs, G = (a.cols + gs - 1) / gs, bpg = gs * F::BITS / 8;
    const uint32_t k0 = (uint32_t)a.seed, k1 = (uint32_t)(a.seed >> 32);
    for (i64 r = 0; r < a.rows; r++) {
        float t = 0.0f;
        if constexpr (SCHEME == S_NVFP4) {  // first pass: the row's finite absmax; t = that / (6 * 448)
            t = u2f(src.finite_absmax(r, a.cols, s)) / 2688.0f;
            tsc[r * t_rs] = t;
        }
        if (GSC) {
            quantize_tiles<Src, F, SCHEME, STOCH, GSC>(src, r, a, codes + r * c_rs, (uint8_t*)scales + r * s_rs, t, s, k0, k1);
            continue;
        }
        for (i64 g = 0; g < G; g++) {  // fp8: one block at a time
            const i64 n = a.cols - g * gs < gs ? a.cols - g * gs : gs;
            src.fill(r, g * gs, n, gs, s.w, s);
            const uint32_t m = absmax_bits_f(s.w, gs);
            uint8_t* cb = codes + r * c_rs + g * bpg;
            float* sc = (float*)scales + r * s_rs + g;
            if (m >= 0x7f800000u) { *sc = u2f(QNAN); memset(cb, 0, (size_t)bpg); continue; }
            const float scale = u2f(m) / F::maxval();
            *sc = scale;
            if (!(scale > 0.0f)) { memset(cb, 0, (size_t)bpg); continue; }
            if (STOCH) philox_uniform(s.u, gs, (uint64_t)(r * G + g) * (uint64_t)gs, k0, k1);
            encode_block<F, STOCH, true>(s.w, gs, scale, s.u, s.c);
            pack<F::BITS>(s.c, gs, cb);
        }
    }
}

// The scale of block g of row r (fp8: fp32; mx: 2^(E8M0 - 127), NaN for 255; nvfp4: decode(b) * t).
template <int SCHEME>
static inline float block_scale(const void* scales, i64 r, i64 s_rs, i64 g, float t) {
    if (SCHEME == S_FP8) return ((const float*)scales)[r * s_rs + g];
    const uint8_t b = ((const uint8_t*)scales)[r * s_rs + g];
    if (SCHEME == S_MX) return b == 255 ? u2f(QNAN) : pow2((int)b - 127);
    return decode<E4M3>(b) * t;
}

// Whether products code * sc may take store_block's FAST path: sc is finite and 0, or its
// smallest nonzero product is a normal fp32.
template <class F>
static inline bool fast_scale(float sc) {
    const float as = fabsf(sc);
    return as == 0.0f || (as <= FLT_MAX && as * F::minval() >= FLT_MIN);
}

// codes / scales as quantize_rows writes them -> out [rows, cols] (contiguous) in dtype S. Fixed
// block sizes (GSC > 0) go through tiles of TILE elements: one unpack and one store per tile;
// MXFP6 and NVFP4 on AVX-512 CPUs row by row in cpu_formats_deq.h (values looked up by code).
template <class S, class F, int SCHEME, int GSC>
static void dequantize_rows(const uint8_t* codes, i64 c_rs, const void* scales, i64 s_rs, const float* tsc, i64 t_rs,
                            const Args& a, void* outv, uint8_t* c, float* d) {
    typename S::T* out = (typename S::T*)outv;
    const i64 gs = GSC ? GSC : a.gs, G = (a.cols + gs - 1) / gs, bpg = gs * F::BITS / 8;
#ifdef ZF_DEQ_AVX512
    if constexpr ((SCHEME == S_MX && F::BITS == 6) || SCHEME == S_NVFP4) {  // cpu_formats_deq.h
        alignas(64) float tab[32];  // the exact values of codes 0-31 (6 bits: the positive ones)
        for (uint32_t k = 0; k < 32; k++) tab[k] = decode<F>(k);
        for (i64 r = 0; r < a.rows; r++)
            if constexpr (SCHEME == S_NVFP4) dq_nvfp4_row<S>(codes + r * c_rs, (const uint8_t*)scales + r * s_rs, tsc[r * t_rs], a.cols, tab, out + r * a.cols);
            else dq_mx6_row<S>(codes + r * c_rs, (const uint8_t*)scales + r * s_rs, a.cols, tab, out + r * a.cols);
        return;
    }
#endif
    for (i64 r = 0; r < a.rows; r++) {
        const float t = SCHEME == S_NVFP4 ? tsc[r * t_rs] : 0.0f;
        if (GSC) {
            const i64 padded = G * GSC;
            for (i64 i0 = 0; i0 < padded; i0 += TILE) {
                const i64 nt = padded - i0 < TILE ? padded - i0 : TILE;
                const uint8_t* ct = codes + r * c_rs + i0 * F::BITS / 8;
                if (F::BITS != 8) unpack<F::BITS>(ct, nt, c);
                const uint8_t* cc = F::BITS == 8 ? ct : c;
                for (i64 b = 0; b < nt / GSC; b++) {
                    const i64 at = i0 + b * GSC, n = a.cols - at < GSC ? a.cols - at : GSC;
                    if (n <= 0) break;
                    const float sc = block_scale<SCHEME>(scales, r, s_rs, i0 / GSC + b, t);
                    decode_store<S, F>(cc + b * GSC, n, sc, fast_scale<F>(sc), d, out + r * a.cols + at);
                }
            }
            continue;
        }
        for (i64 g = 0; g < G; g++) {
            const i64 n = a.cols - g * gs < gs ? a.cols - g * gs : gs;
            const float sc = block_scale<SCHEME>(scales, r, s_rs, g, t);
            decode_store<S, F>(codes + r * c_rs + g * bpg, n, sc, fast_scale<F>(sc), d, out + r * a.cols + g * gs);
        }
    }
}

// ---- exported entry points. scheme: 0 fp8, 1 mx, 2 nvfp4; fmt: 0 E4M3, 1 E5M2, 2 E3M2,
// 3 E2M3, 4 E2M1, 5 INT8; dtype: 0 fp32, 1 bf16, 2 fp16. Return 0, or -1 (an unsupported
// combination or out of memory). ----
template <class Src, class F, int SCHEME>
static void q_stoch(const Src& x, const Args& a, uint8_t* c, i64 c_rs, void* s, i64 s_rs, float* t, i64 t_rs,
                    Scratch& sc) {
    constexpr int GSC = SCHEME == S_MX ? 32 : (SCHEME == S_NVFP4 ? 16 : 0);
    if (a.stochastic) quantize_rows<Src, F, SCHEME, true, GSC>(x, a, c, c_rs, s, s_rs, t, t_rs, sc);
    else quantize_rows<Src, F, SCHEME, false, GSC>(x, a, c, c_rs, s, s_rs, t, t_rs, sc);
}

// Calls fn with a value-initialised tag of the element format of (scheme, fmt) and the scheme as
// a constant; returns -1 for a combination no scheme has.
template <class Fn>
static int with_format(int scheme, int fmt, Fn&& fn) {
    auto go = [&](auto f, auto sch) { fn(f, sch); return 0; };
    using MX = std::integral_constant<int, S_MX>;
    if (scheme == S_FP8 && fmt == 0) return go(E4M3{}, std::integral_constant<int, S_FP8>{});
    if (scheme == S_FP8 && fmt == 1) return go(E5M2{}, std::integral_constant<int, S_FP8>{});
    if (scheme == S_MX && fmt == 0) return go(E4M3{}, MX{});
    if (scheme == S_MX && fmt == 1) return go(E5M2{}, MX{});
    if (scheme == S_MX && fmt == 2) return go(E3M2{}, MX{});
    if (scheme == S_MX && fmt == 3) return go(E2M3{}, MX{});
    if (scheme == S_MX && fmt == 4) return go(E2M1{}, MX{});
    if (scheme == S_MX && fmt == 5) return go(I8{}, MX{});
    if (scheme == S_NVFP4 && fmt == 4) return go(E2M1{}, std::integral_constant<int, S_NVFP4>{});
    return -1;
}

template <class Src>
static int q_fmt(int scheme, int fmt, const Src& x, const Args& a, uint8_t* c, i64 c_rs, void* s, i64 s_rs, float* t,
                 i64 t_rs, Scratch& sc) {
    return with_format(scheme, fmt, [&](auto f, auto sch) {
        q_stoch<Src, decltype(f), decltype(sch)::value>(x, a, c, c_rs, s, s_rs, t, t_rs, sc);
    });
}

extern "C" int zf_quantize(const void* x, i64 x_rs, int dtype, i64 rows, i64 cols, int scheme, int fmt, i64 gs,
                           int round_up, int stochastic, uint64_t seed, uint8_t* codes, i64 c_rs, void* scales,
                           i64 s_rs, float* tscales, i64 t_rs) {
    if (gs <= 0) return -1;
    const Args a{rows, cols, gs, stochastic, seed, round_up};
    Scratch s(gs > TILE ? gs : TILE);
    if (!s.ok()) return -1;
    if (dtype == 0) return q_fmt(scheme, fmt, XRows<F32>{(const float*)x, x_rs}, a, codes, c_rs, scales, s_rs, tscales, t_rs, s);
    if (dtype == 1) return q_fmt(scheme, fmt, XRows<BF16>{(const uint16_t*)x, x_rs}, a, codes, c_rs, scales, s_rs, tscales, t_rs, s);
    if (dtype == 2) return q_fmt(scheme, fmt, XRows<F16>{(const _Float16*)x, x_rs}, a, codes, c_rs, scales, s_rs, tscales, t_rs, s);
    return -1;
}

template <class S>
static int dq_fmt(int scheme, int fmt, const uint8_t* c, i64 c_rs, const void* s, i64 s_rs, const float* t, i64 t_rs,
                  const Args& a, void* out, uint8_t* buf) {
    if (scheme == S_FP8 && fmt == 0) dequantize_rows<S, E4M3, S_FP8, 0>(c, c_rs, s, s_rs, t, t_rs, a, out, buf, (float*)(buf + (((a.gs > TILE ? a.gs : TILE) + 63) & ~(i64)63)));
    else if (scheme == S_FP8 && fmt == 1) dequantize_rows<S, E5M2, S_FP8, 0>(c, c_rs, s, s_rs, t, t_rs, a, out, buf, (float*)(buf + (((a.gs > TILE ? a.gs : TILE) + 63) & ~(i64)63)));
    else if (scheme == S_MX && fmt == 0) dequantize_rows<S, E4M3, S_MX, 32>(c, c_rs, s, s_rs, t, t_rs, a, out, buf, (float*)(buf + (((a.gs > TILE ? a.gs : TILE) + 63) & ~(i64)63)));
    else if (scheme == S_MX && fmt == 1) dequantize_rows<S, E5M2, S_MX, 32>(c, c_rs, s, s_rs, t, t_rs, a, out, buf, (float*)(buf + (((a.gs > TILE ? a.gs : TILE) + 63) & ~(i64)63)));
    else if (scheme == S_MX && fmt == 2) dequantize_rows<S, E3M2, S_MX, 32>(c, c_rs, s, s_rs, t, t_rs, a, out, buf, (float*)(buf + (((a.gs > TILE ? a.gs : TILE) + 63) & ~(i64)63)));
    else if (scheme == S_MX && fmt == 3) dequantize_rows<S, E2M3, S_MX, 32>(c, c_rs, s, s_rs, t, t_rs, a, out, buf, (float*)(buf + (((a.gs > TILE ? a.gs : TILE) + 63) & ~(i64)63)));
    else if (scheme == S_MX && fmt == 4) dequantize_rows<S, E2M1, S_MX, 32>(c, c_rs, s, s_rs, t, t_rs, a, out, buf, (float*)(buf + (((a.gs > TILE ? a.gs : TILE) + 63) & ~(i64)63)));
    else if (scheme == S_MX && fmt == 5) dequantize_rows<S, I8, S_MX, 32>(c, c_rs, s, s_rs, t, t_rs, a, out, buf, (float*)(buf + (((a.gs > TILE ? a.gs : TILE) + 63) & ~(i64)63)));
    else if (scheme == S_NVFP4 && fmt == 4) dequantize_rows<S, E2M1, S_NVFP4, 16>(c, c_rs, s, s_rs, t, t_rs, a, out, buf, (float*)(buf + (((a.gs > TILE ? a.gs : TILE) + 63) & ~(i64)63)));
    else return -1;
    return 0;
}

extern "C" int zf_dequantize(const uint8_t* codes, i64 c_rs, const void* scales, i64 s_rs, const float* tscales,
                             i64 t_rs, i64 rows, i64 cols, int scheme, int fmt, i64 gs, void* out, int dtype) {
    if (gs <= 0) return -1;
    const Args a{rows, cols, gs, 0, 0, 0};
    const i64 cap = gs > TILE ? gs : TILE;  // codes, then fp32 values, of one block or one tile
    uint8_t* buf = (uint8_t*)malloc((size_t)((cap + 63) & ~(i64)63) + (size_t)cap * 4);
    if (!buf) return -1;
    int rc = -1;
    if (dtype == 0) rc = dq_fmt<F32>(scheme, fmt, codes, c_rs, scales, s_rs, tscales, t_rs, a, out, buf);
    if (dtype == 1) rc = dq_fmt<BF16>(scheme, fmt, codes, c_rs, scales, s_rs, tscales, t_rs, a, out, buf);
    if (dtype == 2) rc = dq_fmt<F16>(scheme, fmt, codes, c_rs, scales, s_rs, tscales, t_rs, a, out, buf);
    free(buf);
    return rc;
}

// ---- reductions over received wire rows (qgZ's reduce side). The specification is the codecs'
// generic path: each source row dequantized to fp32 and added, in source order 0..k-1, to an
// accumulator that starts at +0.0 (torch.zeros, then +=), then rounded to the output dtype or
// quantized like any fp32 row. Here each tile of a row is decoded source by source (in L1) and
// summed, so the k sources are read once, in place, and no fp32 [k, rows, cols] temporary exists. ----

// Where the k received rows lie: source j's row r starts at p + j * k_rs + r * r_rs (bytes); it
// holds cb code bytes, then the block scales (fp8: G fp32 at any alignment; mx / nvfp4: G bytes),
// then nvfp4's fp32 tensor scale.
struct Wire {
    const uint8_t* p;
    i64 k, k_rs, r_rs, cb, G;
};

// The scale of block g of a wire row (block_scale's rule, reading unaligned fp32 by memcpy).
template <int SCHEME>
static inline float wire_scale(const uint8_t* row, i64 cb, i64 g, float t) {
    if (SCHEME == S_FP8) {
        float f;
        memcpy(&f, row + cb + 4 * g, 4);
        return f;
    }
    const uint8_t b = row[cb + g];
    if (SCHEME == S_MX) return b == 255 ? u2f(QNAN) : pow2((int)b - 127);
    return decode<E4M3>(b) * t;
}

// The sum of the k received rows in element format F. i0 and nt are whole blocks of gs elements.
template <class F, int SCHEME>
struct SumRows final : TileSource {
    Wire w;
    i64 gs;
    SumRows(const Wire& w_, i64 gs_) : w(w_), gs(gs_) {}
    void fill(i64 r, i64 i0, i64 n, i64 nt, float* __restrict acc, Scratch& s) const override {
        for (i64 i = 0; i < nt; i++) acc[i] = 0.0f;
        float* __restrict d = s.sv;  // one source's decoded tile
        for (i64 j = 0; j < w.k; j++) {
            const uint8_t* row = w.p + j * w.k_rs + r * w.r_rs;
            float t = 0.0f;
            if (SCHEME == S_NVFP4) memcpy(&t, row + w.cb + w.G, 4);
            const uint8_t* ct = row + i0 * F::BITS / 8;
            if (F::BITS != 8) unpack<F::BITS>(ct, nt, s.c);
            const uint8_t* cc = F::BITS == 8 ? ct : s.c;
            for (i64 b = 0; b * gs < n; b++) {
                const i64 m = n - b * gs < gs ? n - b * gs : gs;
                decode_store<F32, F>(cc + b * gs, m, wire_scale<SCHEME>(row, w.cb, i0 / gs + b, t), true, s.u, d + b * gs);
            }
            for (i64 i = 0; i < n; i++) acc[i] += d[i];
        }
    }
};

// A TileSource as a quantizer's row source. With a row buffer (nvfp4, whose tensor scale needs
// the whole summed row's absmax before any block is encoded) finite_absmax sums row r into it
// once and fill then reads from there: two passes over the row; the others sum tile by tile.
struct SourceRows {
    const TileSource* src;
    float* row;  // scratch of one row padded to whole blocks (nvfp4's 16), or null
    i64 tile_n;
    typedef F32 Elem;
    static constexpr bool PADDED = true;  // tile(): the row buffer, zero padded to whole blocks
    inline const float* tile(i64, i64 i0) const { return row + i0; }
    inline void fill(i64 r, i64 i0, i64 n, i64 nt, float* __restrict w, Scratch& s) const {
        if (!row) return src->fill(r, i0, n, nt, w, s);
        for (i64 i = 0; i < n; i++) w[i] = row[i0 + i];
        for (i64 i = n; i < nt; i++) w[i] = 0.0f;
    }
    template <int GSC>
    inline void fill_absmax(i64 r, i64 i0, i64 n, i64 nt, float* __restrict w, uint32_t* __restrict mb, Scratch& s) const {
        fill(r, i0, n, nt, w, s);
        for (i64 b = 0; b < nt / GSC; b++) mb[b] = absmax_bits_f(w + b * GSC, GSC);
    }
    inline uint32_t finite_absmax(i64 r, i64 cols, Scratch& s) const {
        for (i64 i0 = 0; i0 < cols; i0 += tile_n) {  // tile_n and row are whole blocks of 16
            const i64 n = cols - i0 < tile_n ? cols - i0 : tile_n;
            src->fill(r, i0, n, (n + 15) / 16 * 16, row + i0, s);
        }
        return row_finite_absmax<F32>(row, cols);
    }
};

// Elements per tile of a reduction: TILE for the fixed blocks, whole fp8 groups otherwise.
static inline i64 sum_tile(int scheme, i64 gs) {
    if (scheme != S_FP8) return TILE;
    return gs >= TILE ? gs : (TILE / gs) * gs;
}

// Builds the SumRows of (scheme, fmt) and calls fn with it; -1 for an unknown combination.
template <class Fn>
static int with_sum_rows(int scheme, int fmt, const Wire& w, i64 gs, Fn&& fn) {
    return with_format(scheme, fmt, [&](auto f, auto sch) {
        const SumRows<decltype(f), decltype(sch)::value> src(w, gs);
        fn(static_cast<const TileSource&>(src));
    });
}

template <class S>
static void sum_store(const TileSource& src, const Args& a, i64 tile, typename S::T* out, Scratch& s) {
    for (i64 r = 0; r < a.rows; r++)
        for (i64 i0 = 0; i0 < a.cols; i0 += tile) {
            const i64 n = a.cols - i0 < tile ? a.cols - i0 : tile, nt = (n + a.gs - 1) / a.gs * a.gs;
            src.fill(r, i0, n, nt, s.w, s);
            store_block<S>(s.w, n, false, out + r * a.cols + i0);
        }
}

// Received rows (k sources of rows x cols elements at scheme / fmt, block gs) -> their sum in
// dtype (0 fp32, 1 bf16, 2 fp16) into out [rows, cols] (contiguous).
extern "C" int zf_dequantize_sum(const uint8_t* buf, i64 k, i64 k_rs, i64 r_rs, i64 rows, i64 cols, int scheme, int fmt,
                                 i64 gs, i64 cb, i64 G, void* out, int dtype) {
    if (gs <= 0 || dtype < 0 || dtype > 2) return -1;
    const Args a{rows, cols, gs, 0, 0, 0};
    const i64 tile = sum_tile(scheme, gs);
    Scratch s(tile);
    if (!s.ok()) return -1;
    return with_sum_rows(scheme, fmt, Wire{buf, k, k_rs, r_rs, cb, G}, gs, [&](const TileSource& src) {
        if (dtype == 0) sum_store<F32>(src, a, tile, (float*)out, s);
        else if (dtype == 1) sum_store<BF16>(src, a, tile, (uint16_t*)out, s);
        else sum_store<F16>(src, a, tile, (_Float16*)out, s);
    });
}

// Received rows at fmt_in -> their sum quantized at fmt_out (zf_quantize's outputs and arguments,
// the same bits as quantizing the fp32 sum). nvfp4 needs row_scratch: G * 16 floats (one padded
// row), passed in so that the caller can reuse it (fresh memory would fault in every page again).
extern "C" int zf_dequantize_sum_requantize(const uint8_t* buf, i64 k, i64 k_rs, i64 r_rs, i64 rows, i64 cols,
                                            int scheme, int fmt_in, int fmt_out, i64 gs, i64 cb, i64 G, int round_up,
                                            int stochastic, uint64_t seed, uint8_t* codes, i64 c_rs, void* scales,
                                            i64 s_rs, float* tscales, i64 t_rs, float* row_scratch) {
    if (gs <= 0 || (scheme == S_NVFP4 && !row_scratch)) return -1;
    const Args a{rows, cols, gs, stochastic, seed, round_up};
    const i64 tile = sum_tile(scheme, gs);
    Scratch s(tile > gs ? tile : gs);
    if (!s.ok()) return -1;
    float* row = scheme == S_NVFP4 ? row_scratch : nullptr;
    int rc = -1;
    const int known = with_sum_rows(scheme, fmt_in, Wire{buf, k, k_rs, r_rs, cb, G}, gs, [&](const TileSource& src) {
        rc = q_fmt(scheme, fmt_out, SourceRows{&src, row, tile}, a, codes, c_rs, scales, s_rs, tscales, t_rs, s);
    });
    return known == 0 ? rc : -1;
}

// u[0:n] = the Philox uniforms of offsets base .. base + n - 1 under seed: the stream stochastic
// rounding draws from, exported so that tests compare it with reference.philox_uniform directly
// (a part counter at the start, the vector body, its part-vector and scalar tails, and counters
// that carry into the high word).
extern "C" void zf_philox_uniform(float* u, i64 n, uint64_t base, uint64_t seed) {
    philox_uniform(u, n, base, (uint32_t)seed, (uint32_t)(seed >> 32));
}
