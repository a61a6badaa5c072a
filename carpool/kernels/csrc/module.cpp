// The ops register themselves (TORCH_LIBRARY_*) when this library loads; importing it as the Python module
// carpool.kernels._C is how it gets loaded.
#include <Python.h>

static PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_C", "carpool's CPU kernels (torch.ops.carpool)", -1};

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&kernels_module); }
