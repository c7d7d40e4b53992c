// MXFP6 (E3M2, E2M3) and NVFP4 dequantization of whole rows on AVX-512 CPUs, a part of
// cpu_formats.cpp (included there; its text is hashed into that library's build key with the
// .cpp's). The same values as that file's scalar path (and so the reference's), lane by lane:
// - an element's value is looked up by its code in a table of the exactly decoded values (the
//   scalar decode of each code, built by the caller): one vpermps for E2M1's 16 codes, one
//   vpermt2ps over the 32 magnitudes of a 6-bit code and its sign bit OR-ed in;
// - times its block's scale, one fp32 multiply as the scalar path's decode(c) * scale (no FMA,
//   no flush to zero: IEEE products, subnormal ones included); the scales of 16 blocks at once:
//   E8M0 2^(b - 127) from its bits (NaN for 255), E4M3 decoded as the scalar decode (normal codes
//   by their bits, subnormal ones as mag * 2^-9, no fp32 subnormal operand) times the row's t;
// - stored to fp32 as is; to bf16 by vcvtne2ps2bf16 where none of the 32 products is NaN or an
//   fp32 subnormal (that instruction treats denormals as zero; on every other value it rounds to
//   nearest even, as torch), else by the scalar path's integer rounding (BF16::store) on whole
//   vectors; to fp16 by vcvtps2ph, round to nearest even (the scalar cast's instruction).
// The codes are read in place: 6-bit codes of two blocks (48 bytes) unpacked by one byte permute
// and one multishift, E2M1 codes of two blocks (16 bytes) split into nibbles by one interleave.
// A row's last, partial block is stored with masked stores (nothing past cols is written).
#pragma once
#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VBMI__)
#include <immintrin.h>
#define ZF_DEQ_AVX512 1

// 16 products -> 16 bf16 bit patterns (in the low 16 bits of each dword) as BF16::store rounds:
// (u + 0x7fff + ((u >> 16) & 1)) >> 16, NaN -> 0x7fc0.
static inline __m512i dq_bf16_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}

// o[0:n] (n in 1..32) = a[0:16], b[0:16] in S's type; nothing past o + n is written.
template <class S>
static inline void dq_store32(__m512 a, __m512 b, typename S::T* o, i64 n) {
    if constexpr (sizeof(typename S::T) == 4) {
        float* f = (float*)o;
        if (n == 32) {
            _mm512_storeu_ps(f, a);
            _mm512_storeu_ps(f + 16, b);
        } else if (n > 16) {
            _mm512_storeu_ps(f, a);
            _mm512_mask_storeu_ps(f + 16, (__mmask16)((1u << (n - 16)) - 1u), b);
        } else {
            _mm512_mask_storeu_ps(f, (__mmask16)((1u << n) - 1u), a);
        }
        return;
    } else {
        __m512i h;
        if constexpr (S::IS_BF16) {
#if defined(__AVX512BF16__)
            // 0xA1: quiet NaN, denormal, signalling NaN
            if (!(_mm512_fpclass_ps_mask(a, 0xA1) | _mm512_fpclass_ps_mask(b, 0xA1)))
                h = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's 16 values first
            else
#endif
                h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(dq_bf16_bits(a))),
                                       _mm512_cvtepi32_epi16(dq_bf16_bits(b)), 1);
        } else {
            const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(a, rn)), _mm512_cvtps_ph(b, rn), 1);
        }
        if (n == 32) _mm512_storeu_si512((void*)o, h);
        else _mm512_mask_storeu_epi16((void*)o, (__mmask32)((1u << n) - 1u), h);
    }
}

// n (1..16) bytes at p, zero extended: a plain load where all 16 are there (a masked load costs
// much more, measured: it left the whole row waiting on memory).
static inline __m128i dq_load_bytes(const uint8_t* p, i64 n) {
    return n == 16 ? _mm_loadu_si128((const __m128i*)p) : _mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1u), p);
}

// The scales of 16 MX blocks: E8M0 bytes b -> 2^(b - 127) (b = 0: the fp32 subnormal 2^-127),
// NaN for 255; the bits the scalar pow2 / block_scale give.
static inline __m512 dq_e8m0_16(__m128i bytes) {
    const __m512i b = _mm512_cvtepu8_epi32(bytes);
    __m512i s = _mm512_slli_epi32(b, 23);
    s = _mm512_mask_mov_epi32(s, _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    s = _mm512_mask_mov_epi32(s, _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(s);
}

// The element scales of 16 NVFP4 blocks: decode(E4M3 byte) * t, decode as the scalar one (normal
// codes' bits rebiased by an integer add, subnormal codes as mag * 2^-9, 0x7F / 0xFF -> NaN).
static inline __m512 dq_nvscale16(__m128i bytes, __m512 t) {
    const __m512i b = _mm512_cvtepu8_epi32(bytes);
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    const __m512i nor = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
    __m512i v = _mm512_mask_mov_epi32(nor, _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)), _mm512_castps_si512(sub));
    v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24));
    v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7fc00000));
    return _mm512_mul_ps(_mm512_castsi512_ps(v), t);
}

// 16 6-bit codes (low 6 bits of each dword; higher bits ignored) -> their values: the magnitude
// (code bits 0-4) looked up in lo / hi (values of codes 0-15 / 16-31), the sign (bit 5) OR-ed in.
static inline __m512 dq_lookup6(__m512i idx, __m512 lo, __m512 hi) {
    const __m512 mag = _mm512_permutex2var_ps(lo, idx, hi);
    const __m512i sign = _mm512_slli_epi32(idx, 26);  // bit 5 -> bit 31 (bits 6, 7 shifted out)
    return _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(_mm512_castps_si512(mag), sign, _mm512_set1_epi32((int)0x80000000), 0xF8));
}

// One MX row of 6-bit codes (G blocks of 32, 24 bytes each) with its E8M0 scales -> o[0:cols].
// tab: the values of codes 0-31 (the positive ones), 64-byte aligned.
template <class S>
static void dq_mx6_row(const uint8_t* __restrict codes, const uint8_t* __restrict scales, i64 cols,
                       const float* tab, typename S::T* __restrict o) {
    const __m512 lo = _mm512_load_ps(tab), hi = _mm512_load_ps(tab + 16);
    alignas(64) uint8_t idx[64];  // bytes 6q .. 6q + 5 (four codes per 3 bytes) into qword q
    for (int k = 0; k < 64; k++) idx[k] = (uint8_t)((k / 8) * 6 + (k % 8 < 6 ? k % 8 : 5));
    const __m512i perm = _mm512_load_si512((const void*)idx);
    const __m512i shifts = _mm512_set1_epi64(0x2a241e18120c0600LL);  // bit offsets 0, 6, ..., 42
    const i64 G = (cols + 31) / 32;
    alignas(64) float sc[16];
    for (i64 g0 = 0; g0 < G; g0 += 16) {
        const i64 nb = G - g0 < 16 ? G - g0 : 16;
        _mm512_store_ps(sc, dq_e8m0_16(dq_load_bytes(scales + g0, nb)));
        for (i64 b = 0; b < nb; b += 2) {  // two blocks: 48 bytes, 64 codes
            const i64 g = g0 + b, at = g * 32;
            const __m512i raw = G - g >= 3 ? _mm512_loadu_si512((const void*)(codes + g * 24))
                                           : _mm512_maskz_loadu_epi8(G - g >= 2 ? (__mmask64)0xffffffffffffULL : (__mmask64)0xffffffULL, codes + g * 24);
            const __m512i c = _mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(perm, raw));
            for (int h = 0; h < 2 && at + 32 * h < cols; h++) {
                const __m512 s = _mm512_set1_ps(sc[b + h]);
                const __m512 x0 = _mm512_mul_ps(dq_lookup6(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c, 2 * h)), lo, hi), s);
                const __m512 x1 = _mm512_mul_ps(dq_lookup6(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c, 2 * h + 1)), lo, hi), s);
                const i64 n = cols - at - 32 * h;
                dq_store32<S>(x0, x1, o + at + 32 * h, n < 32 ? n : 32);
            }
        }
    }
}

// One NVFP4 row of E2M1 codes (G blocks of 16, 8 bytes each, low nibble first) with its E4M3
// scales and tensor scale t -> o[0:cols]. tab: the values of codes 0-15, 64-byte aligned.
template <class S>
static void dq_nvfp4_row(const uint8_t* __restrict codes, const uint8_t* __restrict scales, float t, i64 cols,
                         const float* tab, typename S::T* __restrict o) {
    const __m512 table = _mm512_load_ps(tab), tv = _mm512_set1_ps(t);
    const i64 G = (cols + 15) / 16;
    alignas(64) float sc[16];
    for (i64 g0 = 0; g0 < G; g0 += 16) {
        const i64 nb = G - g0 < 16 ? G - g0 : 16;
        _mm512_store_ps(sc, dq_nvscale16(dq_load_bytes(scales + g0, nb), tv));
        for (i64 b = 0; b < nb; b += 2) {  // two blocks: 16 bytes, 32 codes
            const i64 g = g0 + b, at = g * 16;
            const __m128i raw = G - g >= 2 ? _mm_loadu_si128((const __m128i*)(codes + g * 8))
                                           : _mm_loadl_epi64((const __m128i*)(codes + g * 8));
            const __m128i hi4 = _mm_srli_epi16(raw, 4);  // byte j: its high nibble in bits 0-3
            // dword i of the expansions holds code i of the pair in its low 4 bits (vpermps reads only those)
            const __m512i c0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(raw, hi4));
            const __m512i c1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(raw, hi4));
            const __m512 x0 = _mm512_mul_ps(_mm512_permutexvar_ps(c0, table), _mm512_set1_ps(sc[b]));
            const __m512 x1 = _mm512_mul_ps(_mm512_permutexvar_ps(c1, table), _mm512_set1_ps(b + 1 < nb ? sc[b + 1] : 0.0f));
            const i64 n = cols - at;
            dq_store32<S>(x0, x1, o + at, n < 32 ? n : 32);
        }
    }
}
#endif
