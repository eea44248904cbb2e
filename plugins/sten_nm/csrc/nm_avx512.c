/* AVX-512F kernels (16 floats per vector); selected at run time. */
#include <stdint.h>
#if defined(__GNUC__) && defined(__x86_64__)
#pragma GCC target("avx512f,avx2,fma")
#define VW 16
#define SUF avx512
#define TABLE nm_table_avx512
#include "nm_impl.h"
#endif
