// One AdamW step over fp32 flat buffers in one pass: the arithmetic of torch.optim.AdamW's
// single-tensor path (foreach=False), element for element. Built by kernels/cpu_adamw.py at first
// use (g++ -O3 -march=native -ffp-contract=off -fno-math-errno -fopenmp, no fast-math) and called
// through ctypes. The range is cut into tiles that up to `threads` threads of an OpenMP team take
// in turn from a shared counter (a thread the OS holds back does fewer tiles): TILE elements, or
// for a range of fewer than TILES_PER_THREAD tiles per thread, smaller tiles (whole BLOCKs, at least
// MIN_TILE) so that every thread still gets several (tile_size()); a range of at most MIN_TILE
// elements runs on the calling thread alone.
// The team is torch's own: libgomp is loaded by name (libgomp.so.1), and torch's CPU library,
// loaded first, has already brought in its copy under that name, so the kernel runs on the
// threads torch's element-wise ops just used (still spinning for work after them) instead of
// starting threads that compete with those spinning ones for the same cores.
// With the IEEE square root, one pass does the whole update: with AVX-512 or AVX2 (compiled in
// by -march=native), explicit vector code that loads SPAN vectors of each array in a row (runs of
// whole cache lines per stream: past the L3 the update is bound by memory, and runs of lines per
// stream keep more of each DRAM page open than one line per stream in turn), else a plain loop
// the compiler vectorises. With torch's square root (sqrt_fn), each tile goes in blocks of BLOCK
// elements that stay in L1 across the moments loop, the call that takes the block's roots and the
// weight loop.
//
// Each element sees torch's operations in torch's order, every one an fp32 operation on values
// already rounded to fp32 (the caller rounds the Python scalars to fp32, as torch rounds a Python
// scalar operand of an fp32 tensor op):
//   p = p * decay                                  (param.mul_(1 - lr * wd); skipped when wd == 0)
//   m = fma(coeff, g - m, base)                    (exp_avg.lerp_(grad, w): ATen's lerp, one fma;
//                                                   coeff = w, base = m when |w| < 0.5,
//                                                   else coeff = w - 1, base = g)
//   v = fma(one_minus_beta2 * g, g, v * beta2)     (exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2):
//                                                   torch's build contracts addcmul into one fma)
//   s = sqrt(v)                                    (v.sqrt(): torch's own routine, see below)
//   d = s / bc2_sqrt + eps                         ((... / bias_correction2_sqrt).add_(eps))
//   p = p + (neg_step_size * m) / d                (param.addcdiv_(m, d, value=-step_size))
// -ffp-contract=off keeps every other multiply-add unfused; the two fmas are explicit (fmaf).
// torch computes fp32 sqrt with MKL's vmsSqrt where it is built with MKL, which is not always
// the correctly rounded square root (1 ulp off on about one element in six); so the caller
// passes that routine (`sqrt_fn`, found in torch's own library) and the second loop of each
// block takes the block's square roots from it. With sqrt_fn NULL, sqrtf (IEEE, correctly
// rounded) is used: then the result is exact where torch's sqrt is IEEE, and at most 1 ulp of
// the square root away elsewhere.
#include <stdint.h>
#include <math.h>
#include <atomic>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

typedef int64_t i64;
typedef void (*sqrt_fn_t)(int n, const float* in, float* out, int64_t mode);  // MKL's vmsSqrt

namespace {

constexpr i64 BLOCK = 1024;  // 4 KiB per array: p, g, m, v and the roots of a block stay in L1
constexpr i64 TILE = 1 << 16;  // 256 KiB per array, a multiple of BLOCK: what a thread takes at a time
constexpr i64 MIN_TILE = 1 << 14;  // 64 KiB per array (a few microseconds of work): the smallest tile
constexpr i64 TILES_PER_THREAD = 4;  // below TILE * TILES_PER_THREAD * threads, tiles shrink to keep this many
constexpr int SPAN = 8;        // vectors of each array loaded in a row (8 x 64 bytes with AVX-512)

struct Args {
    float* p;
    const float* g;
    float* m;
    float* v;
    float decay, coeff, beta2, omb2, bc2_sqrt, eps, neg_step;
    int apply_decay, base_is_m;
    sqrt_fn_t sqrt_fn;
    int64_t sqrt_mode;
};

// The whole update of [lo, hi) in one loop, with the IEEE square root (sqrt_fn NULL).
template <bool DECAY, bool BASE_M>
void whole(const Args& a, i64 lo, i64 hi) {
    float* __restrict p = a.p;
    const float* __restrict g = a.g;
    float* __restrict m = a.m;
    float* __restrict v = a.v;
    const float decay = a.decay, coeff = a.coeff, beta2 = a.beta2, omb2 = a.omb2;
    const float bc2 = a.bc2_sqrt, eps = a.eps, ns = a.neg_step;
    for (i64 i = lo; i < hi; ++i) {
        const float pi = DECAY ? p[i] * decay : p[i];
        const float gi = g[i], mi = m[i];
        const float m2 = fmaf(coeff, gi - mi, BASE_M ? mi : gi);
        const float v2 = fmaf(omb2 * gi, gi, v[i] * beta2);
        const float d = sqrtf(v2) / bc2 + eps;
        p[i] = pi + (ns * m2) / d;
        m[i] = m2;
        v[i] = v2;
    }
}

// The vector operations whole_vec() needs, on BITS-bit registers (AVX-512: 512, AVX2: 256).
#define ZA_VEC(BITS)                                                               \
    struct Vec {                                                                   \
        typedef __m##BITS T;                                                       \
        static constexpr int W = BITS / 32;                                        \
        static T load(const float* x) { return _mm##BITS##_loadu_ps(x); }          \
        static void store(float* x, T a) { _mm##BITS##_storeu_ps(x, a); }          \
        static T set(float a) { return _mm##BITS##_set1_ps(a); }                   \
        static T add(T a, T b) { return _mm##BITS##_add_ps(a, b); }                \
        static T sub(T a, T b) { return _mm##BITS##_sub_ps(a, b); }                \
        static T mul(T a, T b) { return _mm##BITS##_mul_ps(a, b); }                \
        static T div(T a, T b) { return _mm##BITS##_div_ps(a, b); }                \
        static T sqrt(T a) { return _mm##BITS##_sqrt_ps(a); }                      \
        static T fma(T a, T b, T c) { return _mm##BITS##_fmadd_ps(a, b, c); }      \
    };
#if defined(__AVX512F__)
ZA_VEC(512)
#define ZA_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
ZA_VEC(256)
#define ZA_VECTOR 1
#endif

#ifdef ZA_VECTOR
// whole() with explicit vectors: the same operations in the same order (every lane's result is
// the scalar loop's bits; vsqrtps is the correctly rounded root, like sqrtf), in steps of SPAN
// vectors whose loads and stores are grouped per array; the last < SPAN * W elements go to whole().
template <bool DECAY, bool BASE_M>
void whole_vec(const Args& a, i64 lo, i64 hi) {
    typedef Vec::T T;
    constexpr i64 STEP = (i64)SPAN * Vec::W;
    float* __restrict p = a.p;
    const float* __restrict g = a.g;
    float* __restrict m = a.m;
    float* __restrict v = a.v;
    const T decay = Vec::set(a.decay), coeff = Vec::set(a.coeff), beta2 = Vec::set(a.beta2);
    const T omb2 = Vec::set(a.omb2), bc2 = Vec::set(a.bc2_sqrt), eps = Vec::set(a.eps), ns = Vec::set(a.neg_step);
    i64 i = lo;
    for (; i + STEP <= hi; i += STEP) {
        T gs[SPAN], ms[SPAN], vs[SPAN], ps[SPAN];
        for (int k = 0; k < SPAN; ++k) gs[k] = Vec::load(g + i + k * Vec::W);
        for (int k = 0; k < SPAN; ++k) ms[k] = Vec::load(m + i + k * Vec::W);
        for (int k = 0; k < SPAN; ++k) vs[k] = Vec::load(v + i + k * Vec::W);
        for (int k = 0; k < SPAN; ++k) ps[k] = Vec::load(p + i + k * Vec::W);
        for (int k = 0; k < SPAN; ++k) {
            const T pk = DECAY ? Vec::mul(ps[k], decay) : ps[k];
            ms[k] = Vec::fma(coeff, Vec::sub(gs[k], ms[k]), BASE_M ? ms[k] : gs[k]);
            vs[k] = Vec::fma(Vec::mul(omb2, gs[k]), gs[k], Vec::mul(vs[k], beta2));
            const T d = Vec::add(Vec::div(Vec::sqrt(vs[k]), bc2), eps);
            ps[k] = Vec::add(pk, Vec::div(Vec::mul(ns, ms[k]), d));
        }
        for (int k = 0; k < SPAN; ++k) Vec::store(p + i + k * Vec::W, ps[k]);
        for (int k = 0; k < SPAN; ++k) Vec::store(m + i + k * Vec::W, ms[k]);
        for (int k = 0; k < SPAN; ++k) Vec::store(v + i + k * Vec::W, vs[k]);
    }
    whole<DECAY, BASE_M>(a, i, hi);
}
#define ZA_WHOLE whole_vec
#else
#define ZA_WHOLE whole
#endif

// The moments and the decayed weights of [lo, hi) (the first loop of a block with sqrt_fn).
template <bool DECAY, bool BASE_M>
void moments(const Args& a, i64 lo, i64 hi) {
    float* __restrict p = a.p;
    const float* __restrict g = a.g;
    float* __restrict m = a.m;
    float* __restrict v = a.v;
    const float decay = a.decay, coeff = a.coeff, beta2 = a.beta2, omb2 = a.omb2;
    for (i64 i = lo; i < hi; ++i) {
        if (DECAY) p[i] = p[i] * decay;
        const float gi = g[i], mi = m[i];
        m[i] = fmaf(coeff, gi - mi, BASE_M ? mi : gi);
        v[i] = fmaf(omb2 * gi, gi, v[i] * beta2);
    }
}

// The weight update of [lo, hi) from the moments and `root`, sqrt(v) of the block (the second loop).
void update(const Args& a, const float* __restrict root, i64 lo, i64 hi) {
    float* __restrict p = a.p;
    const float* __restrict m = a.m;
    const float bc2 = a.bc2_sqrt, eps = a.eps, ns = a.neg_step;
    for (i64 i = lo; i < hi; ++i) {
        const float d = root[i - lo] / bc2 + eps;
        p[i] = p[i] + (ns * m[i]) / d;
    }
}

void run(const Args& a, i64 lo, i64 hi) {
    if (!a.sqrt_fn) {
        if (a.apply_decay) {
            a.base_is_m ? ZA_WHOLE<true, true>(a, lo, hi) : ZA_WHOLE<true, false>(a, lo, hi);
        } else {
            a.base_is_m ? ZA_WHOLE<false, true>(a, lo, hi) : ZA_WHOLE<false, false>(a, lo, hi);
        }
        return;
    }
    alignas(64) float root[BLOCK];
    for (i64 b = lo; b < hi; b += BLOCK) {
        const i64 e = b + BLOCK < hi ? b + BLOCK : hi;
        if (a.apply_decay) {
            a.base_is_m ? moments<true, true>(a, b, e) : moments<true, false>(a, b, e);
        } else {
            a.base_is_m ? moments<false, true>(a, b, e) : moments<false, false>(a, b, e);
        }
        a.sqrt_fn((int)(e - b), a.v + b, root, a.sqrt_mode);
        update(a, root, b, e);
    }
}

// The tile for n elements on `threads` threads: TILE, or for a small range n / (threads *
// TILES_PER_THREAD) rounded up to whole BLOCKs, at least MIN_TILE. With one tile per thread, a
// thread that starts late (woken, or held back by the OS) leaves the other idle for up to a whole
// tile at the end; with several, the counter evens that out. Tiles stay whole BLOCKs, so every
// tile, and with sqrt_fn every block, starts at a multiple of BLOCK whatever n and threads are.
i64 tile_size(i64 n, i64 threads) {
    const i64 want = (n + threads * TILES_PER_THREAD - 1) / (threads * TILES_PER_THREAD);
    const i64 tile = (want + BLOCK - 1) / BLOCK * BLOCK;
    return tile < MIN_TILE ? MIN_TILE : tile > TILE ? TILE : tile;
}

// Takes tiles of `tile` elements from `next` until none is left (each tile is updated by exactly one thread).
void take_tiles(const Args& a, std::atomic<i64>* next, i64 n, i64 tile) {
    for (;;) {
        const i64 lo = next->fetch_add(tile, std::memory_order_relaxed);
        if (lo >= n) return;
        run(a, lo, lo + tile < n ? lo + tile : n);
    }
}

}  // namespace

// Returns 0, or -1 on invalid arguments (n < 0, threads < 1). Elements are independent, so the
// result does not depend on `threads` or on which thread takes which tile.
extern "C" int za_adamw(float* p, const float* g, float* m, float* v, i64 n, int apply_decay, float decay, float coeff,
                        int base_is_m, float beta2, float omb2, float bc2_sqrt, float eps, float neg_step,
                        sqrt_fn_t sqrt_fn, int64_t sqrt_mode, int threads) {
    if (n < 0 || threads < 1) return -1;
    const Args a{p, g, m, v, decay, coeff, beta2, omb2, bc2_sqrt, eps, neg_step, apply_decay, base_is_m, sqrt_fn,
                 sqrt_mode};
    const i64 tile = tile_size(n, threads);
    const i64 tiles = (n + tile - 1) / tile;  // one tile (n <= MIN_TILE): the calling thread alone
    const i64 workers = threads < tiles ? threads : tiles;
    if (workers <= 1) {
        run(a, 0, n);
        return 0;
    }
    std::atomic<i64> next{0};
#pragma omp parallel num_threads((int)workers)
    take_tiles(a, &next, n, tile);
    return 0;
}
