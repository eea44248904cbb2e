/* Minimal CPython module so that setuptools builds a normal extension; the kernels
 * are called through ctypes on this same shared object (no torch at build time). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef nm_module = {PyModuleDef_HEAD_INIT, "_nmkernel",
                                       "sten_nm C kernels (called via ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__nmkernel(void) { return PyModule_Create(&nm_module); }
