// DLPack in and out of Python for epd._C: reading a tensor argument (anything with
// __dlpack__, or a "dltensor" capsule) into a DLTensor, and DLView, the object that lends
// one of epd's buffers to torch / numpy through __dlpack__, plus the per-endpoint cache of
// the framework tensors made from them. Needs only epd.h, dlpack.h and pybind11.
#ifndef EPD_PYTHON_DLPACK_IO_H_
#define EPD_PYTHON_DLPACK_IO_H_

#include <epd/epd.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

namespace epd_py {

namespace py = pybind11;

/// The endpoint (and, through it, the client) that owns the memory of a view. Shared by the
/// Python Endpoint and by every DLPack export of its buffers, so a framework tensor made
/// from a view keeps the mapping alive after the Endpoint object is gone.
struct ClientCore {
  explicit ClientCore(epd_client_t* c) : client(c) {}
  ~ClientCore() { epd_client_destroy(client); }
  ClientCore(const ClientCore&) = delete;
  ClientCore& operator=(const ClientCore&) = delete;
  epd_client_t* client;
};

struct EndpointCore {
  EndpointCore(epd_endpoint_t* e, std::shared_ptr<ClientCore> c)
      : endpoint(e), client(std::move(c)) {}
  ~EndpointCore() { epd_endpoint_destroy(endpoint); }
  EndpointCore(const EndpointCore&) = delete;
  EndpointCore& operator=(const EndpointCore&) = delete;
  epd_endpoint_t* endpoint;
  std::shared_ptr<ClientCore> client;
};

/// Raises the epd.EpdError subclass registered for `code` (epd._C._set_error_types) with
/// `message` and the catalog `reason` (docs/ERRORS.md; 0: the generic one of `code`, as for
/// the binding's own checks); falls back to RuntimeError before registration.
[[noreturn]] void RaiseStatus(int code, const std::string& message, int32_t reason = 0);
/// RaiseStatus(status, epd_last_error(), epd_last_error_reason()) unless status is EPD_OK.
inline void Check(epd_status_t status) {
  if (status != EPD_OK) RaiseStatus(status, epd_last_error(), epd_last_error_reason());
}

/// How a tensor argument's dtype may be relabelled before epd checks it: numpy has no
/// bfloat16 and torch 1.x no float8, so raw bits stand in for them.
enum class Relabel {
  kNone,
  kBf16Bits,  ///< uint16 is taken as bfloat16 bits.
  kFp8Bits,   ///< uint8 is taken as float8_e4m3fn bits.
};

/// One tensor argument of a call: the DLTensor epd reads and the object that owns its
/// memory for the duration of the call (the producer's capsule).
struct TensorArg {
  py::object keep;  ///< The capsule (or view) that owns `tensor`'s memory.
  DLTensor tensor{};
  int64_t shape[4] = {};    ///< tensor.shape when it was read from a ViewCache entry.
  int64_t strides[4] = {};  ///< tensor.strides when it was read from a strided entry.
};

/// Reads `obj` (None, a DLView, a "dltensor" / "dltensor_versioned" capsule, or an object
/// with __dlpack__) into `out`; returns &out.tensor, or nullptr for None. A capsule given by
/// the caller is read, not consumed. INVALID_ARGUMENT naming `op` and `field` when `obj` is
/// not a tensor or its export fails.
const DLTensor* ReadTensor(py::handle obj, const char* op, const char* field, TensorArg& out,
                           Relabel relabel = Relabel::kNone);

/// True when `obj` is a torch.Tensor (the type registered by epd._C._set_torch).
bool IsTorch(py::handle obj);

/// Converts a stream argument: None -> NULL, an int (a cudaStream_t), or an object with
/// an int `cuda_stream` attribute (torch.cuda.Stream).
void* ReadStream(py::handle obj, const char* op);

/// A zero-copy view of one of epd's buffers, with the shape and strides (elements) the C
/// ABI gave it, copied into the object (NULL strides: compact row-major). __dlpack__ (any
/// arguments, ignored) returns a legacy "dltensor" capsule over the same memory and strides
/// whose deleter keeps `owner` alive; float8_e4m3fn exports as uint8, and bfloat16 as
/// uint16 in numpy mode (numpy has neither type).
class DLView {
 public:
  static constexpr int kMaxDims = 4;
  DLView(const DLTensor& t, std::shared_ptr<EndpointCore> owner, bool numpy_mode);

  py::object Dlpack(py::args args, py::kwargs kwargs) const;
  py::tuple DlpackDevice() const;
  py::tuple Shape() const;
  /// The strides in elements (compact row-major ones when the C ABI gave none).
  py::tuple Strides() const;
  std::string DtypeName() const;
  uintptr_t DataPtr() const;
  /// The view as a DLTensor whose shape (and strides, when it has any) live in this object.
  DLTensor tensor() const;
  std::string Repr() const;
  /// numpy's __array_interface__ (host memory; AttributeError otherwise).
  py::dict ArrayInterface() const;

 private:
  DLTensor tensor_{};  // shape and strides = nullptr: they are in shape_ and strides_
  DLDataType export_dtype_{};
  int64_t shape_[kMaxDims] = {};
  int64_t strides_[kMaxDims] = {};  // always filled: the C ABI's, else the compact ones
  bool strided_ = false;            // the C ABI gave strides
  std::shared_ptr<EndpointCore> owner_;
};

/// The strides of `t` in elements: its own, or compact row-major ones when it has none.
void EffectiveStrides(const DLTensor& t, int64_t* strides);

/// The name epd gives a DLPack dtype ("bfloat16", "float8_e4m3fn", "int32", ...).
std::string DtypeName(DLDataType t);

/// The framework tensors made from an endpoint's views, keyed by (data pointer, shape,
/// strides, dtype): the same buffer returns the same object, so steady low-latency ops
/// create no tensor objects. Bounded: cleared when it grows past kMaxEntries (normal-mode results
/// change shape with every N).
class ViewCache {
 public:
  static constexpr size_t kMaxEntries = 256;
  /// The cached object for `t`, made by `convert(DLView)` on a miss; None for ndim 0.
  py::object Get(const DLTensor& t, const std::shared_ptr<EndpointCore>& owner, bool numpy_mode,
                 py::handle convert);
  /// When `obj` is one of this cache's objects, fills `out` with its view (no DLPack export:
  /// a result or input region passed back as an op's input) and returns true.
  bool Find(py::handle obj, TensorArg& out) const;
  void Clear() {
    by_object_.clear();
    entries_.clear();
  }
  size_t size() const { return entries_.size(); }

 private:
  struct Key {
    uintptr_t data;
    uint64_t dtype;
    int32_t ndim;
    int64_t shape[DLView::kMaxDims];
    int64_t strides[DLView::kMaxDims];  // effective strides (compact when none were given)
    bool operator==(const Key& o) const;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  std::unordered_map<Key, py::object, KeyHash> entries_;
  struct Stored {
    DLTensor tensor;  // shape, strides = nullptr: they are in `shape` and `strides`
    int64_t shape[DLView::kMaxDims];
    int64_t strides[DLView::kMaxDims];
    bool strided;  // the view had strides of its own
  };
  std::unordered_map<PyObject*, Stored> by_object_;  // the entries' objects (held by entries_)
};

void BindDlpack(py::module_& m);

}  // namespace epd_py

#endif  // EPD_PYTHON_DLPACK_IO_H_
