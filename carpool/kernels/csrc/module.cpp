// The ops register themselves (TORCH_LIBRARY_*) when this library loads; importing it as a Python module is how
// it gets loaded. setup.py builds these sources once per instruction-set path (carpool.kernels._C_avx512,
// _C_avx2, _C_portable), so the module's name comes from the build: TORCH_EXTENSION_NAME.
#include <Python.h>

#define CARPOOL_STRINGIFY(x) #x
#define CARPOOL_NAME(x) CARPOOL_STRINGIFY(x)
#define CARPOOL_INIT(name) CARPOOL_INIT_(name)
#define CARPOOL_INIT_(name) PyInit_##name

static PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, CARPOOL_NAME(TORCH_EXTENSION_NAME),
                                     "carpool's CPU kernels (torch.ops.carpool)", -1};

PyMODINIT_FUNC CARPOOL_INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&kernels_module); }
