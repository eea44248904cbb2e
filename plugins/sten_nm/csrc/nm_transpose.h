/* Write-out of a row-major accumulator block into the batch-major output, 4 x 4 tiles
 * (4-float vectors: SSE on x86-64, NEON on arm64), instead of one scalar load and store per
 * output (at 1:10 on a 768-wide contraction those were ~30 % of the kernel's instructions).
 *
 *   Y[b * ldy + r] = src[r * lds + b] (+ bias[r])   for r < nr, b < nb
 *
 * Y and bias may sit at any float offset (4-byte aligned loads and stores). */
#ifndef STEN_NM_TRANSPOSE_H
#define STEN_NM_TRANSPOSE_H
#include <stddef.h>
#include <stdint.h>

typedef float nmt_v4 __attribute__((vector_size(16)));
typedef float nmt_v4u __attribute__((vector_size(16), aligned(4)));
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define NMT_SHUF4(a, b, i, j, k, l) __builtin_shufflevector(a, b, i, j, k, l)
#else
typedef int32_t nmt_v4i __attribute__((vector_size(16)));
#define NMT_SHUF4(a, b, i, j, k, l) __builtin_shuffle(a, b, (nmt_v4i){i, j, k, l})
#endif

static inline void nm_store_transposed(const float *src, int64_t lds, int64_t nr, int64_t nb,
                                       float *Y, int64_t ldy, const float *bias)
{
    const int64_t r4 = nr & ~(int64_t)3, b4 = nb & ~(int64_t)3;
    for (int64_t b = 0; b < b4; b += 4) {
        float *y = Y + b * ldy;
        for (int64_t r = 0; r < r4; r += 4) {
            const float *s = src + r * lds + b;
            const nmt_v4 a = *(const nmt_v4u *)s, c = *(const nmt_v4u *)(s + lds);
            const nmt_v4 e = *(const nmt_v4u *)(s + 2 * lds), f = *(const nmt_v4u *)(s + 3 * lds);
            const nmt_v4 t0 = NMT_SHUF4(a, c, 0, 4, 1, 5), t1 = NMT_SHUF4(a, c, 2, 6, 3, 7);
            const nmt_v4 t2 = NMT_SHUF4(e, f, 0, 4, 1, 5), t3 = NMT_SHUF4(e, f, 2, 6, 3, 7);
            const nmt_v4 bv = bias ? *(const nmt_v4u *)(bias + r) : (nmt_v4){0, 0, 0, 0};
            *(nmt_v4u *)(y + r) = NMT_SHUF4(t0, t2, 0, 1, 4, 5) + bv;
            *(nmt_v4u *)(y + ldy + r) = NMT_SHUF4(t0, t2, 2, 3, 6, 7) + bv;
            *(nmt_v4u *)(y + 2 * ldy + r) = NMT_SHUF4(t1, t3, 0, 1, 4, 5) + bv;
            *(nmt_v4u *)(y + 3 * ldy + r) = NMT_SHUF4(t1, t3, 2, 3, 6, 7) + bv;
        }
        for (int64_t r = r4; r < nr; r++)
            for (int64_t k = 0; k < 4; k++)
                y[k * ldy + r] = src[r * lds + b + k] + (bias ? bias[r] : 0.0f);
    }
    for (int64_t b = b4; b < nb; b++)
        for (int64_t r = 0; r < nr; r++)
            Y[b * ldy + r] = src[r * lds + b] + (bias ? bias[r] : 0.0f);
}
#endif
