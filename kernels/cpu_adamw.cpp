// One AdamW step over fp32 flat buffers in one pass: the arithmetic of torch.optim.AdamW's
// single-tensor path (foreach=False), element for element. Built by kernels/cpu_adamw.py at first
// use (g++ -O3 -march=native -ffp-contract=off -fno-math-errno -pthread, no fast-math) and called
// through ctypes; the range is split over `threads` std::threads (the caller's thread runs the
// first part). With the IEEE square root, one loop does the whole update; with torch's (sqrt_fn),
// each part goes in blocks of BLOCK elements that stay in L1 across the moments loop, the call
// that takes the block's roots and the weight loop.
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
#include <thread>
#include <vector>

typedef int64_t i64;
typedef void (*sqrt_fn_t)(int n, const float* in, float* out, int64_t mode);  // MKL's vmsSqrt

namespace {

constexpr i64 BLOCK = 1024;  // 4 KiB per array: p, g, m, v and the roots of a block stay in L1

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
            a.base_is_m ? whole<true, true>(a, lo, hi) : whole<true, false>(a, lo, hi);
        } else {
            a.base_is_m ? whole<false, true>(a, lo, hi) : whole<false, false>(a, lo, hi);
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

}  // namespace

// Returns 0, or -1 on invalid arguments (n < 0, threads < 1). Elements are independent, so the
// result does not depend on `threads` or on where the parts are cut.
extern "C" int za_adamw(float* p, const float* g, float* m, float* v, i64 n, int apply_decay, float decay, float coeff,
                        int base_is_m, float beta2, float omb2, float bc2_sqrt, float eps, float neg_step,
                        sqrt_fn_t sqrt_fn, int64_t sqrt_mode, int threads) {
    if (n < 0 || threads < 1) return -1;
    const Args a{p, g, m, v, decay, coeff, beta2, omb2, bc2_sqrt, eps, neg_step, apply_decay, base_is_m, sqrt_fn,
                 sqrt_mode};
    const i64 min_part = 1 << 15;  // below this a thread costs more than it saves
    i64 parts = threads;
    if (parts > n / min_part) parts = n / min_part > 0 ? n / min_part : 1;
    if (parts <= 1) {
        run(a, 0, n);
        return 0;
    }
    // parts cut at multiples of 16 elements (one 64-byte cache line): no line is written by two threads
    const i64 step = ((n + parts - 1) / parts + 15) / 16 * 16;
    std::vector<std::thread> pool;
    pool.reserve(parts - 1);
    try {
        for (i64 t = 1; t < parts; ++t) {
            const i64 lo = t * step, hi = lo + step < n ? lo + step : n;
            if (lo < hi) pool.emplace_back(run, std::cref(a), lo, hi);
        }
    } catch (...) {  // a thread could not be started: do the rest of the range here (same result)
        const i64 done = (i64)(pool.size() + 1) * step;
        if (done < n) run(a, done, n);
    }
    run(a, 0, step < n ? step : n);
    for (auto& th : pool) th.join();
    return 0;
}
