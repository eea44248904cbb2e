/* AVX2 + FMA kernels (8 floats per vector); selected at run time. */
#include <stdint.h>
#if defined(__GNUC__) && defined(__x86_64__)
#pragma GCC target("avx2,fma")
#define VW 8
#define SUF avx2
#define TABLE nm_table_avx2
#include "nm_impl.h"
#endif
