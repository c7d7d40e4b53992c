// NVFP4 quantization of one tile on AVX-512 CPUs, a part of cpu_formats.cpp (included there; its
// text is hashed into that library's build key with the .cpp's): block maxima, E4M3 block scales and
// packed E2M1 codes, the same arithmetic as that file's scalar path (and so the reference's), lane
// by lane, with fewer operations:
// - block maxima by a transposing tree of shuffles and maxima over 16 or 32 blocks at once, on the
//   16-bit patterns for bf16 / fp16 inputs (their order is the values' order, the maximum is then
//   widened exactly);
// - each element divided by its block's scale (a true division, as the reference), its code found
//   by one fp32 addition (nearest, see nv_e2m1_16) or the scalar path's operations (stochastic);
// - the codes of 8 blocks joined into bytes and written in block order by one byte permute.
// Checked against the scalar encode / decode for every fp32 input (nearest E2M1 and E4M3) and by
// tests/unit/test_kernels_formats_cpu.py against the reference.
#pragma once
#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VBMI__)
#include <immintrin.h>
#define ZF_NVFP4_AVX512 1

static constexpr i64 NV_TILE_BLOCKS = 128;  // the most blocks of 16 one nv_tile call takes

// 16 elements at p, widened exactly to fp32 (bf16: the bits shifted up; fp16: vcvtph2ps).
template <class L>
static inline __m512 nv_load16(const typename L::T* p) {
    if constexpr (sizeof(typename L::T) == 4) return _mm512_loadu_ps((const float*)p);
    else if constexpr (L::IS_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    else return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// Lanes of nv_hmax16's tree: dword 4l + k holds block l + 4k; this index puts them in block order.
static inline __m512i nv_block_order() { return _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0); }

// Lane b of the result = the unsigned maximum of the 16 lanes of v[b]: a transposing tree of
// lane shuffles and maxima (46 operations for 16 blocks, against 8 per block reduced alone).
static inline __m512i nv_hmax16(const __m512i* v) {
    __m512i a[8], c[4], e[2];
    for (int j = 0; j < 8; j++)  // a[j]: v[2j]'s 8 partial maxima in 128-bit lanes 0-1, v[2j+1]'s in 2-3
        a[j] = _mm512_max_epu32(_mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0x44),
                                _mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++)  // c[j]: 128-bit lane l holds 4 partial maxima of v[4j + l]
        c[j] = _mm512_max_epu32(_mm512_shuffle_i32x4(a[2 * j], a[2 * j + 1], 0x88),
                                _mm512_shuffle_i32x4(a[2 * j], a[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++)  // e[j]: lane l's dwords 0-1 hold v[8j + l]'s 2 partials, 2-3 v[8j + 4 + l]'s
        e[j] = _mm512_max_epu32(_mm512_unpacklo_epi64(c[2 * j], c[2 * j + 1]), _mm512_unpackhi_epi64(c[2 * j], c[2 * j + 1]));
    const __m512 e0 = _mm512_castsi512_ps(e[0]), e1 = _mm512_castsi512_ps(e[1]);
    const __m512i m = _mm512_max_epu32(_mm512_castps_si512(_mm512_shuffle_ps(e0, e1, 0x88)),
                                       _mm512_castps_si512(_mm512_shuffle_ps(e0, e1, 0xDD)));
    return _mm512_permutexvar_epi32(nv_block_order(), m);  // dword 4l + k held v[l + 4k]
}

// The same tree on 16-bit elements: v[j] holds blocks 2j and 2j + 1 (32 elements, 16 each), and
// m[h] gets the maxima of blocks 16h .. 16h + 15, zero extended, in nv_hmax16's lane order.
static inline void nv_hmax32x16(const __m512i* v, __m512i* m) {
    __m512i a[8], c[4];
    for (int j = 0; j < 8; j++)  // 128-bit lane l of a[j]: 8 partial maxima of block 4j + l
        a[j] = _mm512_max_epu16(_mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0x88),
                                _mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0xDD));
    for (int j = 0; j < 4; j++)  // lane l of c[j]: 4 partials of block 8j + l, then 4 of block 8j + 4 + l
        c[j] = _mm512_max_epu16(_mm512_unpacklo_epi64(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_epi64(a[2 * j], a[2 * j + 1]));
    for (int h = 0; h < 2; h++) {  // dword k of lane l: 2 partials of block 16h + l + 4k, then the pair's maximum
        const __m512 x = _mm512_castsi512_ps(c[2 * h]), y = _mm512_castsi512_ps(c[2 * h + 1]);
        const __m512i e = _mm512_max_epu16(_mm512_castps_si512(_mm512_shuffle_ps(x, y, 0x88)),
                                           _mm512_castps_si512(_mm512_shuffle_ps(x, y, 0xDD)));
        m[h] = _mm512_max_epu32(_mm512_and_si512(e, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(e, 16));
    }
}

// mb[0:nb] = the absmax bits (fp32, NaN / Inf patterns included) of the nb blocks of 16 at p:
// integer maxima of |x|'s bit patterns, on the 16-bit patterns for bf16 / fp16 (whose order is
// the values' order too; the maximum is then widened exactly), 16 or 32 blocks per tree.
template <class L>
static inline void nv_block_maxima(const typename L::T* __restrict p, i64 nb, uint32_t* __restrict mb) {
    if constexpr (sizeof(typename L::T) == 4) {
        for (i64 g = 0; g < nb; g += 16) {
            const int k = nb - g < 16 ? (int)(nb - g) : 16;
            __m512i v[16];
            for (int j = 0; j < 16; j++)
                v[j] = j < k ? _mm512_and_si512(_mm512_loadu_si512((const void*)(p + (g + j) * 16)), _mm512_set1_epi32(0x7fffffff))
                             : _mm512_setzero_si512();
            _mm512_store_si512((void*)(mb + g), nv_hmax16(v));
        }
    } else {
        for (i64 g = 0; g < nb; g += 32) {
            const i64 k = nb - g < 32 ? nb - g : 32;  // blocks in this tree
            __m512i v[16], m[2];
            for (int j = 0; j < 16; j++) {
                const i64 left = k - 2 * j;  // blocks 2j, 2j + 1 of the tree, where present
                const __mmask32 ld = left >= 2 ? ~(__mmask32)0 : (left == 1 ? (__mmask32)0xffff : (__mmask32)0);
                v[j] = _mm512_and_si512(_mm512_maskz_loadu_epi16(ld, (const void*)(p + (g + 2 * j) * 16)), _mm512_set1_epi16(0x7fff));
            }
            nv_hmax32x16(v, m);
            for (int h = 0; h < 2; h++) {
                const __m512i o = _mm512_permutexvar_epi32(nv_block_order(), m[h]);
                const __m512i w = L::IS_BF16 ? _mm512_slli_epi32(o, 16)
                                             : _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(o)));
                _mm512_store_si512((void*)(mb + g + 16 * h), w);
            }
        }
    }
}

// The E2M1 codes of 16 scaled values (encode<E2M1, STOCH> on each lane). Stochastic: the same
// operations. Nearest: with a = min(|v|, 6), e = max(floor(log2 a), 0) and M = 2^(e + 22), whose
// fp32 spacing 2^(e - 1) is the element's ulp, fl(a + M) = M + rint(a / 2^(e - 1)) * 2^(e - 1)
// (round half to even on that grid is rintf's rounding of the exact m = a / ulp; the sum stays
// below 2M), so its bits are bits(M) + rint(m) and the code 2e + rint(m) is bits(a + M) minus
// bits(M) - 2e; both constants are looked up by a's exponent (clamped to [127, 129]).
template <bool STOCH>
static inline __m512i nv_e2m1_16(__m512 v, __m512 u) {
    const __m512i vb = _mm512_castps_si512(v);
    const __m512i ac = _mm512_min_epu32(_mm512_and_si512(vb, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x40c00000));
    __m512i code;
    if constexpr (STOCH) {
        const __m512i e = _mm512_max_epi32(_mm512_sub_epi32(_mm512_srli_epi32(ac, 23), _mm512_set1_epi32(127)), _mm512_setzero_si512());
        const __m512 m = _mm512_mul_ps(_mm512_castsi512_ps(ac),
                                       _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(128), e), 23)));
        const __m512 r = _mm512_roundscale_ps(_mm512_add_ps(m, u), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        code = _mm512_min_epi32(_mm512_add_epi32(_mm512_slli_epi32(e, 1), _mm512_cvttps_epi32(r)), _mm512_set1_epi32(7));
    } else {
        (void)u;
        // exponent field 127, 128, 129 (e = 0, 1, 2) -> index 15, 0, 1 (vpermd reads 4 bits)
        const __m512i idx = _mm512_srli_epi32(_mm512_max_epu32(ac, _mm512_set1_epi32(0x3f800000)), 23);
        const __m512i mb = _mm512_permutexvar_epi32(
            idx, _mm512_set_epi32(149 << 23, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 151 << 23, 150 << 23));
        const __m512i xb = _mm512_permutexvar_epi32(
            idx, _mm512_set_epi32(149 << 23, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, (151 << 23) - 4, (150 << 23) - 2));
        code = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(ac), _mm512_castsi512_ps(mb))), xb);
    }
    // the sign bit into bit 3: code | ((vb >> 28) & 8)
    return _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(vb, 28), _mm512_set1_epi32(8), 0xF8);
}

// The E4M3 codes (encode<E4M3, false>) of 16 non-negative values (nearest, saturating at 448).
static inline __m512i nv_e4m3_16(__m512 v) {
    const __m512i ac = _mm512_min_epu32(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)),
                                        _mm512_set1_epi32(0x43e00000));
    const __m512i e = _mm512_max_epi32(_mm512_sub_epi32(_mm512_srli_epi32(ac, 23), _mm512_set1_epi32(127)), _mm512_set1_epi32(-6));
    const __m512 m = _mm512_mul_ps(_mm512_castsi512_ps(ac),
                                   _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(130), e), 23)));
    const __m512 r = _mm512_roundscale_ps(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i code = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(6)), 3), _mm512_cvttps_epi32(r));
    return _mm512_min_epi32(code, _mm512_set1_epi32(0x7e));
}
// The fp32 values of 16 E4M3 codes 0 .. 0x7e (decode<E4M3>: a subnormal code as mag * 2^-9, a
// normal one by its bits rebiased).
static inline __m512 nv_e4m3_decode16(__m512i code) {
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(code), _mm512_set1_ps(0.001953125f));
    const __m512i nor = _mm512_add_epi32(_mm512_slli_epi32(code, 20), _mm512_set1_epi32(120 << 23));
    const __mmask16 is_sub = _mm512_cmplt_epu32_mask(code, _mm512_set1_epi32(8));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(nor, is_sub, _mm512_castps_si512(sub)));
}

// Prefetch of the n bytes at p into L1, for the tile two ahead of the one being encoded: the
// hardware prefetchers alone left this second pass over a long row waiting on memory (measured on
// the 2-core dev machine, a 64 MiB bf16 row: 9.7 ms without, 7.0-7.4 ms with).
static inline void nv_prefetch(const void* p, i64 n) {
    for (i64 o = 0; o < n; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
}

// One tile of nvfp4 blocks: nb blocks of 16 at p (element type L, zero padded to whole blocks)
// -> their E4M3 scales in sc[0:nb] and packed codes in out[0:8 nb]. The same arithmetic as
// quantize_tiles' nvfp4 branch, lane by lane: scale code of absmax / 6 / t (E4M3, nearest;
// 0x7F for a non-finite block, 0 where t is 0), element scale d = decode(code) * t, x / d per
// element; blocks with d == 0 or non-finite store zero codes. u: the tile's uniforms (stochastic).
template <class L, bool STOCH>
static void nv_tile(const typename L::T* __restrict p, i64 nb, float t, const float* __restrict u, uint8_t* __restrict sc,
                    uint8_t* __restrict out) {
    const float tt = t > 0.0f ? t : 1.0f;
    alignas(64) float dv[NV_TILE_BLOCKS];
    alignas(64) uint16_t keep[NV_TILE_BLOCKS / 16 + 1];  // per group of 16 blocks: blocks whose codes are kept
    alignas(64) uint32_t mb[NV_TILE_BLOCKS];
    nv_block_maxima<L>(p, nb, mb);
    for (i64 g = 0; g < nb; g += 16) {
        const int k = nb - g < 16 ? (int)(nb - g) : 16;
        const __m512i m = _mm512_load_si512((const void*)(mb + g));
        const __mmask16 fin = _mm512_cmplt_epu32_mask(m, _mm512_set1_epi32(0x7f800000));
        const __m512 ratio = _mm512_div_ps(_mm512_div_ps(_mm512_castsi512_ps(m), _mm512_set1_ps(6.0f)), _mm512_set1_ps(tt));
        __m512i code = t > 0.0f ? nv_e4m3_16(ratio) : _mm512_setzero_si512();
        const __m512 d = _mm512_maskz_mul_ps(fin, nv_e4m3_decode16(code), _mm512_set1_ps(t));
        const __mmask16 pos = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ);
        code = _mm512_mask_mov_epi32(_mm512_set1_epi32(0x7f), fin, code);
        _mm_mask_storeu_epi8(sc + g, (__mmask16)((1u << k) - 1u), _mm512_cvtepi32_epi8(code));
        _mm512_store_ps(dv + g, _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), pos, d));
        keep[g / 16] = (uint16_t)pos;
    }
    // 8 blocks at a time: the codes of block j in byte j of each dword (element i in dword i),
    // adjacent elements' nibbles joined within each qword, then one byte permute writes the 64
    // packed bytes in block order; blocks that store zero codes are cleared by a qword mask.
    alignas(64) uint8_t idx[64];
    for (int k = 0; k < 64; k++) idx[k] = (uint8_t)((k & 7) * 8 + (k >> 3) % 4 + (k >= 32 ? 64 : 0));
    const __m512i perm = _mm512_load_si512((const void*)idx);
    for (i64 b0 = 0; b0 < nb; b0 += 8) {
        const int kk = nb - b0 < 8 ? (int)(nb - b0) : 8;
        __m512i y[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int j = 0; j < 8; j++) {
            if (j >= kk) break;
            const i64 b = b0 + j;
            const __m512 v = _mm512_div_ps(nv_load16<L>(p + b * 16), _mm512_set1_ps(dv[b]));
            const __m512i c = nv_e2m1_16<STOCH>(v, STOCH ? _mm512_loadu_ps(u + b * 16) : _mm512_setzero_ps());
            y[j / 4] = _mm512_or_si512(y[j / 4], _mm512_slli_epi32(c, 8 * (j % 4)));
        }
        for (int h = 0; h < 2; h++) y[h] = _mm512_or_si512(y[h], _mm512_srli_epi64(y[h], 28));
        const __mmask8 kb = (__mmask8)(keep[b0 / 16] >> (b0 % 16));
        const __m512i o = _mm512_maskz_permutex2var_epi8(_mm512_movepi8_mask(_mm512_movm_epi64(kb)), y[0], perm, y[1]);
        _mm512_mask_storeu_epi8(out + 8 * b0, kk == 8 ? ~(__mmask64)0 : (((__mmask64)1 << (8 * kk)) - 1), o);
    }
}
#endif
