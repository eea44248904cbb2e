/* Portable kernels (GCC vector extensions, 4 floats: SSE2 on x86-64, NEON elsewhere). */
#include <stdint.h>
#define VW 4
#define SUF generic
#define TABLE nm_table_generic
#include "nm_impl.h"
