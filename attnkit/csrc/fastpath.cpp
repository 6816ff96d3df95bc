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

// The dispatcher's per-call cache, read where attnkit.dispatch keeps it (configure() hands over the
// namespaces; each call reads the current objects, so a replaced attribute is seen at once).
struct CallState {
  PyObject* dispatch = nullptr;     // attnkit.dispatch's module dict: _CALLS, _SCOPED, _AUTOTUNE, _CONTEXT_VARS
  PyObject* registry = nullptr;     // attnkit.registry's module dict: _NAMES
  PyObject* calibration = nullptr;  // attnkit.calibration's module dict: _GENERATION
  PyObject* inputs = nullptr;       // attnkit.inputs.AttentionInputs
  PyObject* empty = nullptr;        // ()
  PyObject* names[10] = {};         // interned attribute and field names
} state;

enum { kCalls, kScoped, kAutotune, kContexts, kNames, kGeneration, kQ, kK, kV, kCount };

// configure(dispatch_ns, registry_ns, calibration_ns, inputs_cls): where call() finds the cache.
PyObject* configure(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyDict_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2]) ||
      !PyType_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "configure(dispatch_ns, registry_ns, calibration_ns, inputs_cls)");
    return nullptr;
  }
  static const char* names[kCount] = {"_CALLS", "_SCOPED", "_AUTOTUNE", "_CONTEXT_VARS", "_NAMES",
                                      "_GENERATION", "q", "k", "v"};
  for (int i = 0; i < kCount; ++i) {
    if (state.names[i] == nullptr && (state.names[i] = PyUnicode_InternFromString(names[i])) == nullptr) {
      return nullptr;
    }
  }
  if (state.empty == nullptr && (state.empty = PyTuple_New(0)) == nullptr) {
    return nullptr;
  }
  PyObject* olds[4] = {state.dispatch, state.registry, state.calibration, state.inputs};
  for (int i = 0; i < 4; ++i) {
    Py_INCREF(args[i]);
  }
  state.dispatch = args[0];
  state.registry = args[1];
  state.calibration = args[2];
  state.inputs = args[3];
  for (PyObject* old : olds) {
    Py_XDECREF(old);
  }
  Py_RETURN_NONE;
}

// Item 0 of the list at ns[name], borrowed (nullptr if it is not a non-empty list).
PyObject* first_of(PyObject* ns, int name) {
  PyObject* holder = PyDict_GetItem(ns, state.names[name]);
  return holder != nullptr && PyList_Check(holder) && PyList_GET_SIZE(holder) > 0 ? PyList_GET_ITEM(holder, 0)
                                                                                  : nullptr;
}

// A new reference to var's value in the current context, or nullptr (error cleared).
PyObject* context_value(PyObject* var) {
  PyObject* value = nullptr;
  if (!PyContextVar_CheckExact(var) || PyContextVar_Get(var, nullptr, &value) < 0 || value == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  return value;
}

// The cache key of attention()'s common call (args as call()'s), exactly as
// attnkit.dispatch.resolve_call builds it: (key(q, k, v, *scalars), mask, backend, scope, autotune,
// reason-context values). A new reference, or nullptr with no error set where this file does not
// key the call (Python then does).
PyObject* call_key(PyObject* const* args) {
  // q, k, v, then the six scalars: scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite
  PyObject* const key_args[9] = {args[0], args[1], args[2], args[4], args[5], args[6], args[7], args[8], args[9]};
  PyObject* tensors = key(nullptr, key_args, 9);
  if (tensors == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  if (tensors == Py_None) {
    Py_DECREF(tensors);
    return nullptr;
  }
  PyObject* contexts = first_of(state.dispatch, kContexts);  // (registered names, their reason_contexts)
  PyObject* names = first_of(state.registry, kNames);
  PyObject* autotune = first_of(state.dispatch, kAutotune);
  PyObject* scoped_var = PyDict_GetItem(state.dispatch, state.names[kScoped]);
  if (contexts == nullptr || !PyTuple_Check(contexts) || PyTuple_GET_SIZE(contexts) != 2 ||
      PyTuple_GET_ITEM(contexts, 0) != names || autotune == nullptr || scoped_var == nullptr) {
    Py_DECREF(tensors);  // the registry changed since the contexts were listed: Python lists them again
    return nullptr;
  }
  PyObject* vars = PyTuple_GET_ITEM(contexts, 1);
  PyObject* scoped = context_value(scoped_var);
  PyObject* values = nullptr;
  if (scoped != nullptr && PyTuple_Check(vars)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(vars);
    if (n == 0) {  // Python's `contexts and tuple(...)`: the empty tuple itself
      values = vars;
      Py_INCREF(values);
    } else if ((values = PyTuple_New(n)) != nullptr) {
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* value = context_value(PyTuple_GET_ITEM(vars, i));
        if (value == nullptr) {
          Py_CLEAR(values);
          break;
        }
        PyTuple_SET_ITEM(values, i, value);
      }
    }
  }
  PyObject* result = nullptr;
  if (scoped != nullptr && values != nullptr) {
    result = PyTuple_Pack(6, tensors, args[3], args[10], scoped, autotune, values);
  }
  PyErr_Clear();
  Py_DECREF(tensors);
  Py_XDECREF(scoped);
  Py_XDECREF(values);
  return result;
}

// call(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite, backend):
// attnkit.dispatch.resolve_call's cache hit in one C call. Returns (backend, AttentionInputs, host)
// on a hit whose entry was decided under the current calibration generation and registry (the
// inputs rebuilt from the entry's fields, as AttentionInputs.trusted does; host: the tensors are
// plain, so the host may branch on them exactly when they are on the CPU); on a miss the key to
// store the entry under (a 6-tuple); None where this file does not key the call.
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 11) {
    PyErr_SetString(PyExc_TypeError, "call(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, "
                                     "kv_finite, backend): expected 11 arguments");
    return nullptr;
  }
  if (state.dispatch == nullptr) {
    Py_RETURN_NONE;
  }
  PyObject* cache_key = call_key(args);
  if (cache_key == nullptr) {
    Py_RETURN_NONE;
  }
  PyObject* calls = PyDict_GetItem(state.dispatch, state.names[kCalls]);
  if (calls == nullptr || !PyDict_Check(calls)) {
    Py_DECREF(cache_key);
    Py_RETURN_NONE;
  }
  Py_INCREF(calls);  // the mask's __hash__ is Python code: the dict must outlive the lookup
  PyObject* entry = PyDict_GetItemWithError(calls, cache_key);
  Py_XINCREF(entry);
  Py_DECREF(calls);
  if (entry == nullptr) {
    if (PyErr_Occurred()) {  // an unhashable mask: Python's path says what to do
      PyErr_Clear();
      Py_DECREF(cache_key);
      Py_RETURN_NONE;
    }
    return cache_key;  // a miss: Python decides and stores under this key
  }
  PyObject* generation = first_of(state.calibration, kGeneration);
  PyObject* names = first_of(state.registry, kNames);
  if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 5 || generation == nullptr ||
      PyTuple_GET_ITEM(entry, 3) != names || !PyDict_Check(PyTuple_GET_ITEM(entry, 1)) ||
      PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, 2), generation, Py_EQ) != 1) {
    PyErr_Clear();
    Py_DECREF(entry);
    return cache_key;  // decided under another calibration or registry: decided again
  }
  PyObject* result = nullptr;
  PyObject* fields = PyDict_Copy(PyTuple_GET_ITEM(entry, 1));
  PyObject* inputs = nullptr;
  if (fields != nullptr && PyDict_SetItem(fields, state.names[kQ], args[0]) == 0 &&
      PyDict_SetItem(fields, state.names[kK], args[1]) == 0 && PyDict_SetItem(fields, state.names[kV], args[2]) == 0) {
    inputs = PyBaseObject_Type.tp_new(reinterpret_cast<PyTypeObject*>(state.inputs), state.empty, nullptr);
    if (inputs != nullptr && PyObject_GenericSetDict(inputs, fields, nullptr) == 0) {
      result = PyTuple_Pack(3, PyTuple_GET_ITEM(entry, 0), inputs, PyTuple_GET_ITEM(entry, 4));
    }
  }
  Py_XDECREF(fields);
  Py_XDECREF(inputs);
  Py_DECREF(entry);
  if (result == nullptr) {
    PyErr_Clear();
    return cache_key;
  }
  Py_DECREF(cache_key);
  return result;
}

PyObject* guarded_key(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return key(self, args, nargs);
  } catch (const std::exception&) {  // a tensor whose sizes cannot be read here: Python's path
    Py_RETURN_NONE;
  }
}

PyObject* guarded_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return call(self, args, nargs);
  } catch (const std::exception&) {
    PyErr_Clear();
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
    {"configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(configure)), METH_FASTCALL,
     "configure(dispatch_ns, registry_ns, calibration_ns, inputs_cls): where call() finds the per-call cache."},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(guarded_call)), METH_FASTCALL,
     "call(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite, backend) -> "
     "(backend, inputs, host) on a hit | key on a miss | None."},
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
