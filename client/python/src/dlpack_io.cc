// DLPack in and out of Python (dlpack_io.h).
#include "dlpack_io.h"

#include <cstring>
#include <utility>

#include "args.h"

namespace epd_py {
namespace {

// Registered by the Python package (epd/_core.py) at import; the module object holds the
// references (as attributes), these are borrowed.
PyObject* g_error_types = nullptr;      // list indexed by status code
PyTypeObject* g_torch_type = nullptr;   // torch.Tensor
PyObject* g_torch_to_dlpack = nullptr;  // torch._C._to_dlpack (no requires_grad check)
PyTypeObject* g_dlview_type = nullptr;  // epd._C.DLView

constexpr DLDataType kBf16{kDLBfloat, 16, 1};
constexpr DLDataType kE4m3{EPD_DL_FLOAT8_E4M3FN, 8, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};
constexpr DLDataType kU16{kDLUInt, 16, 1};

bool Same(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

// DLPack >= 1.0's versioned managed tensor (Debian's dlpack.h 0.6 lacks it); the
// DLTensor inside has the same layout in both versions.
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};

// The memory behind one exported capsule: the managed tensor, its shape and strides, and
// the endpoint that owns the data.
struct ExportCtx {
  DLManagedTensor managed{};
  int64_t shape[DLView::kMaxDims] = {};
  int64_t strides[DLView::kMaxDims] = {};
  std::shared_ptr<EndpointCore> owner;
};

void DeleteExport(DLManagedTensor* m) {
  std::unique_ptr<ExportCtx> ctx(static_cast<ExportCtx*>(m->manager_ctx));
}

// A capsule nobody consumed (still named "dltensor") frees its tensor; a consumer renames
// it "used_dltensor" and calls the deleter itself.
void ExportCapsuleDestructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
}

// Reads a capsule's DLTensor (not consuming it).
const DLTensor* CapsuleTensor(PyObject* capsule, const char* op, const char* field) {
  const char* name = PyCapsule_GetName(capsule);
  if (name != nullptr && std::strcmp(name, "dltensor") == 0) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, name));
    if (m != nullptr) return &m->dl_tensor;
  } else if (name != nullptr && std::strcmp(name, "dltensor_versioned") == 0) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, name));
    if (m != nullptr) {
      if (m->version.major != 1) {
        RaiseStatus(EPD_INVALID_ARGUMENT, std::string(op) + ": " + field + " is a DLPack " +
                                              std::to_string(m->version.major) +
                                              ".x tensor; epd reads DLPack 1.x");
      }
      return &m->dl_tensor;
    }
  }
  PyErr_Clear();
  RaiseStatus(EPD_INVALID_ARGUMENT, std::string(op) + ": " + field + " is a capsule named '" +
                                        (name ? name : "") +
                                        "', expected an unconsumed 'dltensor' capsule");
}

}  // namespace

[[noreturn]] void RaiseStatus(int code, const std::string& message, int32_t reason) {
  PyObject* cls = PyExc_RuntimeError;
  if (g_error_types != nullptr && code >= 0 && code < PyList_GET_SIZE(g_error_types)) {
    cls = PyList_GET_ITEM(g_error_types, code);
  }
  if (reason == 0) reason = 9000 + code;  // The catalog's unclassified reason of the code.
  py::object exc = py::reinterpret_borrow<py::object>(cls)(code, epd_status_name(code), message,
                                                           "EPD-" + std::to_string(reason),
                                                           epd_reason_name(reason));
  PyErr_SetObject(cls, exc.ptr());
  throw py::error_already_set();
}

bool IsTorch(py::handle obj) {
  return g_torch_type != nullptr && PyObject_TypeCheck(obj.ptr(), g_torch_type);
}

const DLTensor* ReadTensor(py::handle obj, const char* op, const char* field, TensorArg& out,
                           Relabel relabel) {
  PyObject* o = obj.ptr();
  if (o == Py_None) return nullptr;
  const DLTensor* src = nullptr;
  if (Py_TYPE(o) == g_dlview_type) {
    const DLView& view = obj.cast<const DLView&>();
    out.tensor = view.tensor();
    out.keep = py::reinterpret_borrow<py::object>(obj);
    src = &out.tensor;
  } else if (PyCapsule_CheckExact(o)) {
    src = CapsuleTensor(o, op, field);
    out.keep = py::reinterpret_borrow<py::object>(obj);
  } else {
    PyObject* capsule = nullptr;
    if (g_torch_to_dlpack != nullptr && IsTorch(obj)) {
      capsule = PyObject_CallOneArg(g_torch_to_dlpack, o);
    } else {
      static PyObject* const kDlpack = PyUnicode_InternFromString("__dlpack__");
      PyObject* method = PyObject_GetAttr(o, kDlpack);
      if (method == nullptr) {
        PyErr_Clear();
        RaiseStatus(EPD_INVALID_ARGUMENT,
                    std::string(op) + ": " + field + " is a " + TypeNameOf(obj) +
                        ", which has no __dlpack__ (expected a torch.Tensor, a numpy.ndarray or "
                        "another DLPack tensor)");
      }
      capsule = PyObject_CallNoArgs(method);
      Py_DECREF(method);
    }
    if (capsule == nullptr) {
      RaiseStatus(EPD_INVALID_ARGUMENT,
                  std::string(op) + ": " + field + " (a " + TypeNameOf(obj) +
                      ") cannot be exported through DLPack: " + FetchErrorText());
    }
    out.keep = py::reinterpret_steal<py::object>(capsule);
    if (!PyCapsule_CheckExact(capsule)) {
      RaiseStatus(EPD_INVALID_ARGUMENT, std::string(op) + ": " + field +
                                            ".__dlpack__() returned a " + TypeNameOf(out.keep) +
                                            ", not a capsule");
    }
    src = CapsuleTensor(capsule, op, field);
  }
  if (src != &out.tensor) out.tensor = *src;
  // An empty tensor is compact whatever strides its producer gives it (torch gives some
  // empty tensors strides of 1).
  for (int i = 0; i < out.tensor.ndim && out.tensor.shape != nullptr; ++i) {
    if (out.tensor.shape[i] == 0) {
      out.tensor.strides = nullptr;
      break;
    }
  }
  if (relabel == Relabel::kBf16Bits && Same(out.tensor.dtype, kU16)) out.tensor.dtype = kBf16;
  if (relabel == Relabel::kFp8Bits && Same(out.tensor.dtype, kU8)) out.tensor.dtype = kE4m3;
  return &out.tensor;
}

void* ReadStream(py::handle obj, const char* op) {
  PyObject* o = obj.ptr();
  if (o == Py_None) return nullptr;
  py::object value = py::reinterpret_borrow<py::object>(obj);
  if (!PyLong_Check(o)) {
    if (!py::hasattr(obj, "cuda_stream")) {
      RaiseStatus(EPD_INVALID_ARGUMENT,
                  std::string(op) + ": stream is a " + TypeNameOf(obj) +
                      "; expected None, an int (a cudaStream_t) or an object with cuda_stream");
    }
    value = obj.attr("cuda_stream");
  }
  void* stream = PyLong_AsVoidPtr(value.ptr());
  if (stream == nullptr && PyErr_Occurred()) {
    RaiseStatus(EPD_INVALID_ARGUMENT,
                std::string(op) + ": stream is not a valid cudaStream_t: " + FetchErrorText());
  }
  return stream;
}

std::string DtypeName(DLDataType t) {
  if (Same(t, kBf16)) return "bfloat16";
  if (Same(t, kE4m3)) return "float8_e4m3fn";
  const char* base = t.code == kDLInt     ? "int"
                     : t.code == kDLUInt  ? "uint"
                     : t.code == kDLFloat ? "float"
                                          : nullptr;
  if (base == nullptr || t.lanes != 1) {
    return "dtype(code=" + std::to_string(t.code) + ",bits=" + std::to_string(t.bits) +
           ",lanes=" + std::to_string(t.lanes) + ")";
  }
  return base + std::to_string(t.bits);
}

void EffectiveStrides(const DLTensor& t, int64_t* strides) {
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    strides[i] = t.strides != nullptr ? t.strides[i] : stride;
    stride *= t.shape[i];
  }
}

DLView::DLView(const DLTensor& t, std::shared_ptr<EndpointCore> owner, bool numpy_mode)
    : tensor_(t), export_dtype_(t.dtype), strided_(t.strides != nullptr), owner_(std::move(owner)) {
  if (t.ndim < 0 || t.ndim > kMaxDims) {
    RaiseStatus(EPD_INTERNAL, "a view with " + std::to_string(t.ndim) + " dimensions");
  }
  for (int i = 0; i < t.ndim; ++i) shape_[i] = t.shape[i];
  EffectiveStrides(t, strides_);
  tensor_.shape = nullptr;
  tensor_.strides = nullptr;
  if (Same(t.dtype, kE4m3)) export_dtype_ = kU8;
  if (numpy_mode && Same(t.dtype, kBf16)) export_dtype_ = kU16;
}

DLTensor DLView::tensor() const {
  DLTensor t = tensor_;
  t.shape = const_cast<int64_t*>(shape_);
  t.strides = strided_ ? const_cast<int64_t*>(strides_) : nullptr;
  return t;
}

py::object DLView::Dlpack(py::args, py::kwargs) const {
  auto ctx = std::make_unique<ExportCtx>();
  ctx->owner = owner_;
  DLTensor& t = ctx->managed.dl_tensor;
  t = tensor_;
  t.dtype = export_dtype_;
  for (int i = 0; i < tensor_.ndim; ++i) {
    ctx->shape[i] = shape_[i];
    ctx->strides[i] = strides_[i];
  }
  t.shape = ctx->shape;
  t.strides = ctx->strides;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &DeleteExport;
  PyObject* capsule = PyCapsule_New(&ctx->managed, "dltensor", &ExportCapsuleDestructor);
  if (capsule == nullptr) throw py::error_already_set();
  ctx.release();  // owned by the capsule (or its consumer) from here on
  return py::reinterpret_steal<py::object>(capsule);
}

py::tuple DLView::DlpackDevice() const {
  return py::make_tuple(static_cast<int>(tensor_.device.device_type), tensor_.device.device_id);
}

py::tuple DLView::Shape() const {
  py::tuple shape(tensor_.ndim);
  for (int i = 0; i < tensor_.ndim; ++i) shape[i] = py::int_(shape_[i]);
  return shape;
}

py::tuple DLView::Strides() const {
  py::tuple strides(tensor_.ndim);
  for (int i = 0; i < tensor_.ndim; ++i) strides[i] = py::int_(strides_[i]);
  return strides;
}

std::string DLView::DtypeName() const { return epd_py::DtypeName(tensor_.dtype); }

uintptr_t DLView::DataPtr() const {
  return reinterpret_cast<uintptr_t>(tensor_.data) + tensor_.byte_offset;
}

py::dict DLView::ArrayInterface() const {
  const DLDeviceType device = tensor_.device.device_type;
  if (device != kDLCPU && device != kDLCUDAHost) {
    throw py::attribute_error("__array_interface__: the view is not in host memory");
  }
  const char kind = export_dtype_.code == kDLInt     ? 'i'
                    : export_dtype_.code == kDLUInt  ? 'u'
                    : export_dtype_.code == kDLFloat ? 'f'
                                                     : 'V';
  if (kind == 'V' || export_dtype_.lanes != 1) {
    throw py::attribute_error("__array_interface__: numpy has no dtype " + DtypeName());
  }
  py::dict d;
  d["shape"] = Shape();
  d["typestr"] = std::string("<") + kind + std::to_string(export_dtype_.bits / 8);
  d["data"] = py::make_tuple(DataPtr(), false);
  if (strided_) {  // numpy's strides are in bytes; None means compact
    py::tuple strides(tensor_.ndim);
    for (int i = 0; i < tensor_.ndim; ++i) {
      strides[i] = py::int_(strides_[i] * static_cast<int64_t>(export_dtype_.bits / 8));
    }
    d["strides"] = strides;
  } else {
    d["strides"] = py::none();
  }
  d["version"] = 3;
  return d;
}

std::string DLView::Repr() const {
  std::string s = "epd.DLView(shape=(";
  for (int i = 0; i < tensor_.ndim; ++i) s += (i ? ", " : "") + std::to_string(shape_[i]);
  if (tensor_.ndim == 1) s += ",";
  if (strided_) {
    s += "), strides=(";
    for (int i = 0; i < tensor_.ndim; ++i) s += (i ? ", " : "") + std::to_string(strides_[i]);
    if (tensor_.ndim == 1) s += ",";
  }
  return s + "), dtype=" + DtypeName() + ", device=" + std::to_string(tensor_.device.device_type) +
         ":" + std::to_string(tensor_.device.device_id) + ")";
}

bool ViewCache::Key::operator==(const Key& o) const {
  if (data != o.data || dtype != o.dtype || ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] != o.shape[i] || strides[i] != o.strides[i]) return false;
  }
  return true;
}

size_t ViewCache::KeyHash::operator()(const Key& k) const {
  uint64_t h = k.data * 0x9E3779B97F4A7C15ull ^ (k.dtype + 0x632BE59BD9B4E019ull * k.ndim);
  for (int i = 0; i < k.ndim; ++i) {
    h = (h ^ static_cast<uint64_t>(k.shape[i])) * 0x100000001B3ull;
    h = (h ^ static_cast<uint64_t>(k.strides[i])) * 0x100000001B3ull;
  }
  return static_cast<size_t>(h);
}

py::object ViewCache::Get(const DLTensor& t, const std::shared_ptr<EndpointCore>& owner,
                          bool numpy_mode, py::handle convert) {
  if (t.ndim == 0) return py::none();
  if (t.ndim > DLView::kMaxDims) {
    RaiseStatus(EPD_INTERNAL, "a view with " + std::to_string(t.ndim) + " dimensions");
  }
  Key key{};
  key.data = reinterpret_cast<uintptr_t>(t.data) + t.byte_offset;
  key.dtype = static_cast<uint64_t>(t.dtype.code) | static_cast<uint64_t>(t.dtype.bits) << 8 |
              static_cast<uint64_t>(t.dtype.lanes) << 16 |
              static_cast<uint64_t>(t.device.device_type) << 32 |
              static_cast<uint64_t>(t.device.device_id) << 48;
  key.ndim = t.ndim;
  for (int i = 0; i < t.ndim; ++i) key.shape[i] = t.shape[i];
  EffectiveStrides(t, key.strides);
  auto it = entries_.find(key);
  if (it != entries_.end()) return it->second;
  if (entries_.size() >= kMaxEntries) Clear();
  py::object view = py::cast(DLView(t, owner, numpy_mode));
  py::object obj =
      !convert || convert.is_none() ? view : py::reinterpret_borrow<py::object>(convert)(view);
  entries_.emplace(key, obj);
  Stored& stored = by_object_[obj.ptr()];
  stored.tensor = t;
  stored.tensor.shape = nullptr;
  stored.tensor.strides = nullptr;
  for (int i = 0; i < t.ndim; ++i) stored.shape[i] = t.shape[i];
  for (int i = 0; i < t.ndim; ++i) stored.strides[i] = key.strides[i];
  stored.strided = t.strides != nullptr;
  return obj;
}

bool ViewCache::Find(py::handle obj, TensorArg& out) const {
  if (by_object_.empty()) return false;
  auto it = by_object_.find(obj.ptr());
  if (it == by_object_.end()) return false;
  const Stored& stored = it->second;
  out.tensor = stored.tensor;
  for (int i = 0; i < out.tensor.ndim; ++i) {
    out.shape[i] = stored.shape[i];
    out.strides[i] = stored.strides[i];
  }
  out.tensor.shape = out.shape;
  out.tensor.strides = stored.strided ? out.strides : nullptr;
  out.keep = py::reinterpret_borrow<py::object>(obj);
  return true;
}

namespace {

// A ViewCache of its own over caller tensors, for the suites: what Get returns for a
// tensor, and what Find gives back for an object it returned.
class ViewCacheProbe {
 public:
  py::object Get(py::handle tensor) {
    TensorArg arg;
    const DLTensor* t = ReadTensor(tensor, "_ViewCacheProbe.get", "tensor", arg);
    if (t == nullptr) RaiseStatus(EPD_INVALID_ARGUMENT, "_ViewCacheProbe.get: None");
    return cache_.Get(*t, nullptr, false, py::none());
  }
  /// (shape, strides or None) of the DLTensor an op would read for `obj`; None if not cached.
  py::object Find(py::handle obj) const {
    TensorArg arg;
    if (!cache_.Find(obj, arg)) return py::none();
    py::tuple shape(arg.tensor.ndim);
    py::tuple strides(arg.tensor.ndim);
    for (int i = 0; i < arg.tensor.ndim; ++i) {
      shape[i] = py::int_(arg.tensor.shape[i]);
      if (arg.tensor.strides != nullptr) strides[i] = py::int_(arg.tensor.strides[i]);
    }
    return py::make_tuple(shape, arg.tensor.strides != nullptr ? py::object(strides) : py::none());
  }
  size_t size() const { return cache_.size(); }

 private:
  ViewCache cache_;
};

}  // namespace

void BindDlpack(py::module_& m) {
  py::class_<ViewCacheProbe>(m, "_ViewCacheProbe",
                             "Test hook: a view cache over caller tensors (memory they own).")
      .def(py::init<>())
      .def("get", &ViewCacheProbe::Get)
      .def("find", &ViewCacheProbe::Find)
      .def("size", &ViewCacheProbe::size);
  py::class_<DLView>(m, "DLView",
                     "A zero-copy view of an epd buffer. torch.from_dlpack(view) and "
                     "numpy.from_dlpack(view) give tensors over the same memory; the memory "
                     "stays mapped while any of them lives. float8_e4m3fn exports as uint8, "
                     "and bfloat16 as uint16 for numpy.")
      .def("__dlpack__", &DLView::Dlpack,
           "A legacy 'dltensor' capsule over the view (arguments accepted and ignored).")
      .def("__dlpack_device__", &DLView::DlpackDevice, "(device_type, device_id)")
      .def_property_readonly("shape", &DLView::Shape)
      .def_property_readonly("strides", &DLView::Strides,
                             "Strides in elements, as the C ABI gave them (compact when none).")
      .def_property_readonly("dtype", &DLView::DtypeName, "epd's dtype name, e.g. 'bfloat16'")
      .def_property_readonly("data_ptr", &DLView::DataPtr, "Address of the first element.")
      .def_property_readonly("__array_interface__", &DLView::ArrayInterface,
                             "numpy's array interface (host memory only): numpy.asarray(view) "
                             "is a writable array over the view.")
      .def("__repr__", &DLView::Repr);
  g_dlview_type = reinterpret_cast<PyTypeObject*>(m.attr("DLView").ptr());

  m.def(
      "_set_error_types",
      [m](py::list types) mutable {
        m.attr("_error_types") = types;
        g_error_types = types.ptr();
      },
      "Registers the exception class raised per status code (a list indexed by code).");
  m.def(
      "_set_torch",
      [m](py::object tensor_type, py::object to_dlpack) mutable {
        if (!PyType_Check(tensor_type.ptr())) throw py::type_error("tensor_type is not a type");
        m.attr("_torch_tensor_type") = tensor_type;
        m.attr("_torch_to_dlpack") = to_dlpack;
        g_torch_type = reinterpret_cast<PyTypeObject*>(tensor_type.ptr());
        g_torch_to_dlpack = to_dlpack.is_none() ? nullptr : to_dlpack.ptr();
      },
      "Registers torch.Tensor and a function returning its DLPack capsule.");
}

}  // namespace epd_py
