// attention()'s per-call path in C: the key of a call's tensors and the finiteness scan of the
// NaN/Inf policy, each one C call instead of a dozen tensor attribute reads or two dispatched
// torch ops (a sum and .item()), which cost more than a decode step's whole kernel launch.
//
// Exposed as a small Python module built on first request by attnkit_fastpath_module() (loaded
// through ctypes from this library; see attnkit/csrc/loader.py). Both functions answer None for
// anything they do not handle (a tensor subclass, a functorch or functionalization wrapper, a
// symbolic or non-CPU tensor, a layout with holes), and Python then takes its own path.
#include <Python.h>

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

// A tensor this file may read: exactly torch.Tensor (no subclass, no Parameter), dense, and no
// transform or Python dispatch in its keys.
const at::Tensor* plain(PyObject* obj) {
  if (THPVariableClass == nullptr || Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined()) {
    return nullptr;
  }
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::FuncTorchGradWrapper,
                                            c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::Functionalize,
                                            c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot});
  if (impl->key_set().has_any(wrapped) || impl->has_symbolic_sizes_strides() ||
      impl->layout() != c10::kStrided) {
    return nullptr;
  }
  return &t;
}

// One scalar argument packed with its type, so 1, 1.0 and True (equal as Python keys) never share a
// key: None, exactly bool, exactly int (within int64) or exactly float (its bits). False for any
// other type (a subclass, a tensor, a huge int): the caller then keys in Python.
bool pack_scalar(PyObject* obj, int64_t* tag, int64_t* value) {
  if (obj == Py_None) {
    *tag = 0;
    *value = 0;
  } else if (obj == Py_True || obj == Py_False) {
    *tag = 1;
    *value = obj == Py_True;
  } else if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    *tag = 2;
    *value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0 || (*value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
  } else if (PyFloat_CheckExact(obj)) {
    const double x = PyFloat_AS_DOUBLE(obj);
    *tag = 3;
    std::memcpy(value, &x, sizeof x);
  } else {
    return false;
  }
  return true;
}

constexpr Py_ssize_t kMaxScalars = 8;

// key(q, k, v, *scalars) -> bytes | None: shapes, dtypes, devices and requires_grad of the three
// tensors, whether gradients are recorded at all, torch's thread count, then up to 8 scalar
// arguments with their types (pack_scalar), packed exactly (a bytes key is compared byte for byte,
// never by a lossy hash).
PyObject* key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 3 || nargs > 3 + kMaxScalars) {
    PyErr_SetString(PyExc_TypeError, "key(q, k, v, *scalars): expected 3 tensors and at most 8 scalars");
    return nullptr;
  }
  int64_t words[3 * 10 + 2 + 2 * kMaxScalars];
  size_t n = 0;
  bool grad = false;
  for (Py_ssize_t i = 0; i < 3; ++i) {
    const at::Tensor* t = plain(args[i]);
    if (t == nullptr || t->dim() > 8) {
      Py_RETURN_NONE;
    }
    c10::TensorImpl* impl = t->unsafeGetTensorImpl();
    const auto sizes = impl->sizes();
    words[n++] = static_cast<int64_t>(sizes.size());
    for (int64_t s : sizes) {
      words[n++] = s;
    }
    const c10::Device device = impl->device();
    const bool requires_grad = t->requires_grad();
    grad = grad || requires_grad;
    words[n++] = static_cast<int64_t>(impl->dtype().toScalarType()) |
                 (static_cast<int64_t>(device.type()) << 8) | (static_cast<int64_t>(device.index() + 1) << 24) |
                 (static_cast<int64_t>(requires_grad) << 40);
  }
  words[n++] = static_cast<int64_t>(grad && c10::GradMode::is_enabled());
  words[n++] = static_cast<int64_t>(at::get_num_threads());
  for (Py_ssize_t i = 3; i < nargs; ++i) {
    if (!pack_scalar(args[i], &words[n], &words[n + 1])) {
      Py_RETURN_NONE;
    }
    n += 2;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words), static_cast<Py_ssize_t>(n * sizeof(int64_t)));
}

// Whether any of the n elements at p has an all-ones exponent (NaN or +-Inf): a bit test, exact
// and independent of the order in which the elements are read.
template <typename Bits>
bool any_nonfinite(const void* p, int64_t n, Bits exponent) {
  const Bits* x = static_cast<const Bits*>(p);
  bool found = false;
  at::parallel_for(0, n, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    Bits bad = 0;
    for (int64_t i = begin; i < end; ++i) {
      bad |= static_cast<Bits>((x[i] & exponent) == exponent);
    }
    if (bad) {
      found = true;  // several chunks may store true; none stores false
    }
  });
  return found;
}

// finite(x) -> True | False | None: whether every element of a CPU floating tensor is finite,
// read in memory order (any dense layout, a transposed one too); None for what it does not read.
PyObject* finite(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) {
    PyErr_SetString(PyExc_TypeError, "finite(x): expected 1 tensor");
    return nullptr;
  }
  const at::Tensor* t = plain(args[0]);
  if (t == nullptr) {
    Py_RETURN_NONE;
  }
  c10::TensorImpl* impl = t->unsafeGetTensorImpl();
  if (impl->device_type() != c10::kCPU || !impl->has_storage() || !impl->is_non_overlapping_and_dense()) {
    Py_RETURN_NONE;
  }
  const int64_t n = impl->numel();
  if (n == 0) {
    Py_RETURN_TRUE;
  }
  const void* data = impl->data();
  bool bad;
  {
    // Large tensors are read on torch's threads without the GIL (as torch's own ops do).
    PyThreadState* state = n >= (int64_t{1} << 16) ? PyEval_SaveThread() : nullptr;
    switch (impl->dtype().toScalarType()) {
      case c10::ScalarType::Float: bad = any_nonfinite<uint32_t>(data, n, 0x7f800000u); break;
      case c10::ScalarType::Double: bad = any_nonfinite<uint64_t>(data, n, 0x7ff0000000000000ull); break;
      case c10::ScalarType::BFloat16: bad = any_nonfinite<uint16_t>(data, n, 0x7f80u); break;
      case c10::ScalarType::Half: bad = any_nonfinite<uint16_t>(data, n, 0x7c00u); break;
      default:
        if (state != nullptr) {
          PyEval_RestoreThread(state);
        }
        Py_RETURN_NONE;
    }
    if (state != nullptr) {
      PyEval_RestoreThread(state);
    }
  }
  if (bad) {
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyObject* guarded_key(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return key(self, args, nargs);
  } catch (const std::exception&) {  // a tensor whose sizes cannot be read here: Python's path
    Py_RETURN_NONE;
  }
}

PyObject* guarded_finite(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return finite(self, args, nargs);
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
}

PyMethodDef methods[] = {
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(guarded_key)), METH_FASTCALL,
     "key(q, k, v, *scalars) -> bytes | None: the exact per-call key of three plain tensors and scalars."},
    {"finite", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(guarded_finite)), METH_FASTCALL,
     "finite(x) -> bool | None: whether a dense CPU floating tensor holds finite values only."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "attnkit_fastpath", "attention()'s per-call path in C.", -1,
                          methods};

}  // namespace

// The module, created once and kept (the caller gets a new reference through ctypes' py_object).
extern "C" PyObject* attnkit_fastpath_module() {
  static PyObject* module = PyModule_Create(&module_def);
  return module;
}
