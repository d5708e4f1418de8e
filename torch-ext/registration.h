// Glue that lets the same sources build under kernel-builder and the local build: the op namespace
// and the Python module name are both TORCH_EXTENSION_NAME (e.g. _attention_int8_<rev>), unique per build
// so that two builds of this package can be loaded into one process side by side.
#pragma once

#include <Python.h>

#define AI8_CONCAT_INNER(a, b) a##b
#define AI8_CONCAT(a, b) AI8_CONCAT_INNER(a, b)
#define AI8_STRINGIFY_INNER(x) #x
#define AI8_STRINGIFY(x) AI8_STRINGIFY_INNER(x)

// TORCH_LIBRARY pastes its first argument literally; these expand TORCH_EXTENSION_NAME first.
#define TORCH_LIBRARY_EXPAND(name, module) TORCH_LIBRARY(name, module)
#define TORCH_LIBRARY_IMPL_EXPAND(name, key, module) TORCH_LIBRARY_IMPL(name, key, module)

// An empty Python module, so `import _attention_int8_<rev>` loads the .so (which registers the ops)
// using only the stable ABI: the .so is abi3 and works with every Python >= 3.9.
#define REGISTER_EXTENSION(name)                                                                   \
  PyMODINIT_FUNC AI8_CONCAT(PyInit_, name)();                                                      \
  PyMODINIT_FUNC AI8_CONCAT(PyInit_, name)() {                                                     \
    static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, AI8_STRINGIFY(name), nullptr, 0, \
                                            nullptr, nullptr, nullptr, nullptr, nullptr};          \
    return PyModule_Create(&module_def);                                                           \
  }
