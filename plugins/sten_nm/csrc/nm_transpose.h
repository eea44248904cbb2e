/* Write-out of a row-major accumulator block into the batch-major output, 4 x 4 tiles
 * (4-float vectors: SSE on x86-64, NEON on arm64), instead of one scalar load and store per
 * output (at 1:10 on a 768-wide contraction those were ~30 % of the kernel's instructions);
 * on x86-64 with AVX, 8 x 8 tiles (nm_store_transposed_avx8, the paper format's output).
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

/* float32 -> bfloat16 bits, round to nearest even, NaN -> 0x7fc0 (torch's scalar
 * rounding; its vectorised one gives 0xffff, also a NaN); branch-free so loops vectorise */
static inline uint16_t f32_to_bf16_rne(uint32_t u)
{
    const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? 0x7fc0u : r);
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
/* o[j][i] = r[i][j] for i, j < 8: an AVX 8 x 8 transpose (three shuffle stages); only where
 * the AVX2 or AVX-512 table runs. */
__attribute__((target("avx2"), always_inline)) static inline void nm_transpose8(const __m256 r[8], __m256 o[8])
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    o[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    o[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    o[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    o[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    o[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    o[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    o[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    o[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* d[j * ldd + i] = r[i][j] (+ add[i], add NULL: nothing added) for i, j < 8 */
__attribute__((target("avx2"), always_inline)) static inline void store_transposed8(const __m256 r[8], float *d,
                                                                                    int64_t ldd, const float *add)
{
    __m256 o[8];
    nm_transpose8(r, o);
    const __m256 a = add ? _mm256_loadu_ps(add) : _mm256_setzero_ps();
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(d + j * ldd, add ? _mm256_add_ps(o[j], a) : o[j]);
}

/* f32_to_bf16_rne of 8 floats (the same bits) */
__attribute__((target("avx2"), always_inline)) static inline __m128i nm_bf16_rne8(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i y = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m256i p = _mm256_packus_epi32(y, y);   /* per lane: y0..y3 y0..y3 | y4..y7 y4..y7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));   /* quadwords 0 and 2 */
}

/* store_transposed8 rounded to bfloat16 bits (f32_to_bf16_rne) */
__attribute__((target("avx2"), always_inline)) static inline void store_transposed8_bf16(const __m256 r[8],
                                                                                         uint16_t *d, int64_t ldd,
                                                                                         const float *add)
{
    __m256 o[8];
    nm_transpose8(r, o);
    const __m256 a = add ? _mm256_loadu_ps(add) : _mm256_setzero_ps();
    for (int j = 0; j < 8; j++)
        _mm_storeu_si128((__m128i *)(void *)(d + j * ldd), nm_bf16_rne8(add ? _mm256_add_ps(o[j], a) : o[j]));
}

/* nm_store_transposed with AVX 8 x 8 transposes on whole 8 x 8 blocks into Y, or into Y16
 * (Y NULL) rounded to bfloat16 bits (f32_to_bf16_rne) as each block is written; the edges by
 * the 4 x 4 code, or one value at a time into Y16; only where the AVX2 or AVX-512 table runs.
 * The paper format's output at 3072x768 1:10 (1 thread): 0.54-0.72 -> 0.38-0.46 ms. */
__attribute__((target("avx2"))) static inline void nm_store_transposed_avx8(const float *src, int64_t lds,
                                                                            int64_t nr, int64_t nb, float *Y,
                                                                            uint16_t *Y16, int64_t ldy,
                                                                            const float *bias)
{
    const int64_t r8 = nr & ~(int64_t)7, b8 = nb & ~(int64_t)7;
    for (int64_t b = 0; b < b8; b += 8)
        for (int64_t r = 0; r < r8; r += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_ps(src + (r + i) * lds + b);
            if (Y16) store_transposed8_bf16(v, Y16 + b * ldy + r, ldy, bias ? bias + r : NULL);
            else store_transposed8(v, Y + b * ldy + r, ldy, bias ? bias + r : NULL);
        }
    if (!Y16) {
        if (r8 < nr) nm_store_transposed(src + r8 * lds, lds, nr - r8, b8, Y + r8, ldy, bias ? bias + r8 : NULL);
        if (b8 < nb) nm_store_transposed(src + b8, lds, nr, nb - b8, Y + b8 * ldy, ldy, bias);
        return;
    }
    for (int64_t b = 0; b < nb; b++)
        for (int64_t r = b < b8 ? r8 : 0; r < nr; r++) {
            const float f = src[r * lds + b] + (bias ? bias[r] : 0.0f);
            uint32_t u;
            __builtin_memcpy(&u, &f, sizeof u);
            Y16[b * ldy + r] = f32_to_bf16_rne(u);
        }
}
#endif
#endif
