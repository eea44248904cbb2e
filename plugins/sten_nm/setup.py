"""Build the plain-C kernel library (no torch at build time).

The extension is optional: without a working C compiler the package still installs, and
the plugin reports itself unavailable with the reason (the layouts then run through the
dense fallback). ``-fopenmp`` is used only where a test program compiles and links with it
(Apple clang has no OpenMP); without it the kernels use threads of their own (pthreads).
"""
import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OMP_PROBE = "#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n"


def compiler_has_openmp(compiler) -> bool:
    """Whether ``compiler`` compiles and links an OpenMP program with ``-fopenmp``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp_probe.c")
        with open(src, "w") as f:
            f.write(OMP_PROBE)
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=["-fopenmp"])
            compiler.link_executable(objs, "omp_probe", output_dir=tmp, extra_postargs=["-fopenmp"])
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    """Adds the OpenMP flags only where the compiler has them; a failed build is reported
    (the extension is optional) instead of failing the install."""

    def build_extensions(self):
        if self.compiler.compiler_type == "unix":
            omp = os.environ.get("STEN_NM_OPENMP", "auto")
            use = compiler_has_openmp(self.compiler) if omp == "auto" else omp == "1"
            self.announce(f"sten_nm: OpenMP {'on' if use else 'off (pthreads)'}", level=2)
            for ext in self.extensions:
                ext.extra_compile_args = ["-O3", "-std=gnu11", "-pthread", "-Wall"] + (["-fopenmp"] if use else [])
                ext.extra_link_args = ["-pthread"] + (["-fopenmp"] if use else [])
                ext.libraries = ["dl"] if sys.platform.startswith("linux") else []
        super().build_extensions()


setup(
    cmdclass={"build_ext": BuildExt},
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
            depends=["csrc/nm_kernel.h", "csrc/nm_isa.h", "csrc/nm_impl.h", "csrc/nm_body.h", "csrc/nm_transpose.h", "csrc/nm_grouped.h",
                     "csrc/nm_ggather_body.h", "csrc/nm_colgrouped.h", "csrc/nm_colgrouped_bwd.h", "csrc/nm_cgbwd_body.h", "csrc/nm_bf16.h",
                     "csrc/nm_grouped_bf16.h", "csrc/nm_cg_bf16x.h", "csrc/nm_bf16_bwd.h", "csrc/nm_bf16_pack.h"],
            extra_compile_args=["/O2"] if sys.platform == "win32" else [],
            optional=True,  # no compiler: install anyway, report `available: false`
        )
    ],
)
