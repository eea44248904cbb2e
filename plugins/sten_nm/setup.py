"""Build the plain-C kernel library (no torch at build time)."""
import sys

from setuptools import Extension, setup

# -fopenmp: the kernels run in the process's OpenMP pool (PyTorch's libgomp, shared by
# soname) instead of threads of their own; without it they fall back to pthreads.
args = ["-O3", "-std=gnu11", "-pthread", "-fopenmp", "-Wall"]
link = ["-pthread", "-fopenmp"]
if sys.platform == "win32":  # pragma: no cover - MSVC: portable kernels only
    args, link = ["/O2"], []
setup(
    ext_modules=[
        Extension(
            "sten_nm._nmkernel",
            sources=[
                "csrc/module.c",
                "csrc/nm_kernel.c",
                "csrc/nm_generic.c",
                "csrc/nm_avx2.c",
                "csrc/nm_avx512.c",
            ],
            depends=["csrc/nm_kernel.h", "csrc/nm_isa.h", "csrc/nm_impl.h", "csrc/nm_body.h", "csrc/nm_grouped.h"],
            extra_compile_args=args,
            extra_link_args=link,
        )
    ]
)
