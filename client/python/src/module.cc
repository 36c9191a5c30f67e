// epd._C: a thin pybind11 binding of the C ABI (client/include/epd/epd.h). The pythonic API
// is epd/__init__.py; this module only converts: DLPack tensors in, cached zero-copy views
// out, epd_status_t to the registered exceptions. Links libepdclient only.
#include <epd/epd.h>
#include <pybind11/pybind11.h>

#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "dlpack_io.h"

namespace epd_py {
namespace {

struct OpDeleter {
  void operator()(epd_op_t* op) const { epd_op_destroy(op); }
};
using OpHolder = std::unique_ptr<epd_op_t, OpDeleter>;

OpHolder NewOp() {
  epd_op_t* op = nullptr;
  Check(epd_op_create(&op));
  return OpHolder(op);
}

std::string CString(const char* s, size_t capacity) { return std::string(s, strnlen(s, capacity)); }

// ---- result types ---------------------------------------------------------------------

// Struct sequences (named tuples implemented in C): cheap to build, indexable, unpackable.
struct ResultTypes {
  PyTypeObject* op_mask = nullptr;
  PyTypeObject* layout = nullptr;
  PyTypeObject* dispatch = nullptr;
  PyTypeObject* combine = nullptr;
  PyTypeObject* ll_dispatch = nullptr;
  PyTypeObject* ll_combine = nullptr;
};
ResultTypes g_results;

// The rank mask an op ran with: a named field of each op result (not part of its tuple, so
// results unpack as before).
constexpr const char* kMaskDoc = "epd.OpMask (epoch, num_masked, dropped_pairs) the op ran with.";

PyStructSequence_Field kLayoutFields[] = {
    {"num_tokens_per_rank", "[R] int32: tokens with an expert on each rank."},
    {"num_tokens_per_expert", "[E] int32: tokens routed to each expert."},
    {"is_token_in_rank", "[T, R] uint8 0/1 (.bool() for a mask)."},
    {nullptr, nullptr}};
PyStructSequence_Field kDispatchFields[] = {
    {"recv_x", "[N, H] bfloat16, or float8_e4m3fn (uint8 on torch without float8)."},
    {"recv_scales", "[N, H/128] float32 with FP8 x; else None."},
    {"recv_topk_idx", "[N, K] int64 local expert ids, -1 elsewhere."},
    {"recv_topk_weights", "[N, K] float32."},
    {"num_recv_tokens_per_expert", "[E/R] int32, aligned."},
    {"recv_src_info", "[N] int32: src_rank * M + src_token."},
    {"recv_count", "[1] int32: N, in the endpoint's memory."},
    {"handle", "epd.Handle for combine and cached re-dispatch."},
    {"num_recv_tokens", "N (int); -1 from enqueued()."},
    {"mask", kMaskDoc},
    {nullptr, nullptr}};
PyStructSequence_Field kCombineFields[] = {
    {"combined_x", "[T, H] bfloat16."},
    {"combined_topk_weights", "[T, K] float32 when topk_weights was given; else None."},
    {"mask", kMaskDoc},
    {nullptr, nullptr}};
PyStructSequence_Field kLlDispatchFields[] = {
    {"recv_x", "[E/R, R*Mll, H] bfloat16 or float8_e4m3fn."},
    {"recv_scales",
     "use_fp8: [E/R, R*Mll, H/128] float32, strides (H/128*R*Mll, 1, R*Mll) (token index "
     "fastest); use_ue8m0: [E/R, R*Mll, H/512] int32 packed UE8M0, strides (H/512*R*Mll, 1, "
     "R*Mll); else None."},
    {"recv_count", "[E/R] int32."},
    {"recv_src_info", "[E/R, R*Mll] int32: src_rank * Mll + token."},
    {"handle", "epd.Handle for the matching low-latency combine."},
    {"mask", kMaskDoc},
    {nullptr, nullptr}};
PyStructSequence_Field kLlCombineFields[] = {
    {"combined_x", "[T, H] bfloat16."}, {"mask", kMaskDoc}, {nullptr, nullptr}};
PyStructSequence_Field kOpMaskFields[] = {
    {"epoch", "The group's mask epoch (0 = no rank ever masked)."},
    {"num_masked", "Ranks masked in that epoch."},
    {"dropped_pairs", "This rank's token-expert pairs whose expert was masked."},
    {nullptr, nullptr}};

/// A struct sequence type; its last `named_only` fields are read by name only (not in the
/// tuple: unpacking and len() see the others).
PyTypeObject* MakeResultType(py::module_& m, const char* name, const char* doc,
                             PyStructSequence_Field* fields, int named_only = 0) {
  int n = 0;
  while (fields[n].name != nullptr) ++n;
  static std::vector<std::unique_ptr<PyStructSequence_Desc>> descs;
  descs.push_back(std::make_unique<PyStructSequence_Desc>(
      PyStructSequence_Desc{name, doc, fields, n - named_only}));
  PyTypeObject* type = PyStructSequence_NewType(descs.back().get());
  if (type == nullptr) throw py::error_already_set();
  const char* dot = std::strrchr(name, '.');
  m.attr(dot ? dot + 1 : name) =
      py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(type));
  return type;
}

// Builds a struct sequence of `type` from items, in order (their references move into it).
template <typename... Items>
py::object MakeResult(PyTypeObject* type, Items... items) {
  PyObject* r = PyStructSequence_New(type);
  if (r == nullptr) throw py::error_already_set();
  Py_ssize_t i = 0;
  (PyStructSequence_SetItem(r, i++, py::object(std::move(items)).release().ptr()), ...);
  return py::reinterpret_steal<py::object>(r);
}

/// An op's mask as an epd.OpMask; the all-zero one (no rank ever masked) is shared.
py::object MakeOpMask(const epd_op_mask_t& mask) {
  static PyObject* zero = nullptr;
  const bool is_zero = mask.epoch == 0 && mask.num_masked == 0 && mask.dropped_pairs == 0;
  if (is_zero && zero != nullptr) return py::reinterpret_borrow<py::object>(zero);
  py::object r = MakeResult(g_results.op_mask, py::int_(mask.epoch), py::int_(mask.num_masked),
                            py::int_(mask.dropped_pairs));
  if (is_zero) zero = py::object(r).release().ptr();  // Kept for the process's lifetime.
  return r;
}

/// A mask reply (epd_rank_mask_t, its ranks in `ranks`) as (epoch, [ranks]).
py::tuple RankMaskTuple(const epd_rank_mask_t& out, const std::vector<int32_t>& ranks) {
  py::list list(out.num_masked);
  for (int32_t i = 0; i < out.num_masked; ++i) list[i] = py::int_(ranks[i]);
  return py::make_tuple(py::int_(out.epoch), std::move(list));
}

/// The result of kind R that `op` holds, read by `read` (an epd_op_*_result function).
template <typename R>
R ReadOpResult(const epd_op_t* op, epd_status_t (*read)(const epd_op_t*, R*)) {
  R r{};
  r.struct_size = sizeof(r);
  Check(read(op, &r));
  return r;
}

// ---- handle ---------------------------------------------------------------------------

/// epd.Handle: the routing of a dispatch (epd_handle_t), a plain value.
struct Handle {
  epd_handle_t h{};
};

/// `obj` (an epd.Handle, or None: nullptr unless `required`) as the C handle it holds.
const epd_handle_t* ReadHandle(py::handle obj, const char* op, const char* field,
                               bool required = false) {
  if (obj.is_none()) {
    if (required) {
      RaiseStatus(EPD_INVALID_ARGUMENT, std::string(op) + ": " + field + " is required");
    }
    return nullptr;
  }
  if (!py::isinstance<Handle>(obj)) {
    RaiseStatus(EPD_INVALID_ARGUMENT, std::string(op) + ": " + field + " is a " +
                                          Py_TYPE(obj.ptr())->tp_name +
                                          ", expected an epd.Handle from a dispatch");
  }
  return &obj.cast<const Handle&>().h;
}

/// A sequence of ranks (ints; None = none) as int32s, INVALID_ARGUMENT naming op and field.
std::vector<int32_t> ToRanks(py::handle obj, const char* op, const char* field) {
  std::vector<int32_t> out;
  if (obj.is_none()) return out;
  if (PyLong_Check(obj.ptr()) || !PySequence_Check(obj.ptr()) || PyUnicode_Check(obj.ptr())) {
    RaiseStatus(EPD_INVALID_ARGUMENT, std::string(op) + ": " + field + "=" + ShortRepr(obj) +
                                          " is not a sequence of ranks (ints)");
  }
  const py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
  // The C ABI's bound on a rank list (a group has at most that many ranks): refused before
  // converting millions of items.
  constexpr size_t kMaxRanks = size_t{1} << 20;
  if (seq.size() > kMaxRanks) {
    RaiseStatus(EPD_INVALID_ARGUMENT, std::string(op) + ": " + field + " has " +
                                          std::to_string(seq.size()) + " ranks, more than " +
                                          std::to_string(kMaxRanks));
  }
  out.reserve(seq.size());
  for (size_t i = 0; i < seq.size(); ++i) {
    const std::string item = std::string(field) + "[" + std::to_string(i) + "]";
    const py::object rank = seq[i];
    if (PyBool_Check(rank.ptr())) {  // bool is an int in Python: True would mask rank 1.
      RaiseStatus(EPD_INVALID_ARGUMENT,
                  std::string(op) + ": " + item + "=" + ShortRepr(rank) + " is a bool, not a rank");
    }
    out.push_back(ToInt32(rank, op, item.c_str()));
  }
  return out;
}

// ---- client ---------------------------------------------------------------------------

class Endpoint;

class Client {
 public:
  /// timeout: seconds (None or 0: the C ABI's default, 5 s).
  static std::shared_ptr<Client> Connect(py::handle socket_path, py::handle client_name,
                                         py::handle timeout) {
    static constexpr const char* kOp = "connect";
    std::string path;
    epd_client_options_t options{};
    options.struct_size = sizeof(options);
    if (!socket_path.is_none()) {
      path = ToPath(socket_path, kOp, "socket");
      options.socket_path = path.c_str();
    }
    const std::string name = ToCString(client_name, kOp, "client_name");
    options.client_name = name.c_str();
    options.connect_timeout_ms =
        TimeoutMs(timeout, kOp, 0, static_cast<int64_t>(kMaxTimeoutSeconds * 1000), "5 s");
    epd_client_t* client = nullptr;
    epd_status_t status;
    {
      py::gil_scoped_release release;
      status = epd_client_connect(&options, &client);
    }
    Check(status);
    return std::make_shared<Client>(std::make_shared<ClientCore>(client));
  }

  explicit Client(std::shared_ptr<ClientCore> core) : core_(std::move(core)) {}

  /// A strong reference to the C client for one call: close() from another thread while
  /// the call runs without the GIL then cannot destroy the client under it.
  std::shared_ptr<ClientCore> Live(const char* what) const {
    if (core_ == nullptr)
      RaiseStatus(EPD_FAILED_PRECONDITION, std::string(what) + ": the client is closed");
    return core_;
  }

  std::string SessionId() const { return epd_client_session_id(Live("session_id")->client); }

  /// `what`: the op named by the closed-client error (join asks for the backend).
  py::dict Stats(const char* what) const {
    epd_stats_t s{};
    s.struct_size = sizeof(s);
    const std::shared_ptr<ClientCore> core = Live(what);  // may raise: before the GIL is released
    epd_status_t status;
    {
      py::gil_scoped_release release;
      status = epd_client_stats(core->client, &s);
    }
    Check(status);
    py::dict d;
    d["version"] = CString(s.version, sizeof(s.version));
    d["backend"] = CString(s.backend, sizeof(s.backend));
    d["serving_status"] = CString(s.serving_status, sizeof(s.serving_status));
    d["mps_active"] = s.mps_active;
    d["num_gpus"] = s.num_gpus;
    d["num_groups"] = s.num_groups;
    d["num_sessions"] = s.num_sessions;
    d["uptime_ms"] = s.uptime_ms;
    d["ops_completed"] = s.ops_completed;
    d["ops_failed"] = s.ops_failed;
    d["pid"] = s.pid;
    return d;
  }

  template <epd_status_t (*Fn)(epd_client_t*, char*, size_t, size_t*)>
  std::string Json(const char* what) const {
    const std::shared_ptr<ClientCore> core = Live(what);
    epd_client_t* c = core->client;
    std::string buf(4096, '\0');
    for (int attempt = 0; attempt < 4; ++attempt) {
      size_t length = 0;
      epd_status_t status;
      {
        py::gil_scoped_release release;
        status = Fn(c, buf.data(), buf.size(), &length);
      }
      if (status == EPD_OK) {
        buf.resize(length);
        return buf;
      }
      if (status != EPD_OUT_OF_RANGE) Check(status);
      buf.assign(length + 1, '\0');
    }
    RaiseStatus(EPD_INTERNAL, std::string(what) + ": the JSON kept growing");
  }

  std::shared_ptr<Endpoint> Join(py::handle name, py::handle num_ranks, py::handle num_experts,
                                 py::handle hidden, py::handle num_topk,
                                 py::handle max_tokens_per_rank, py::handle ll_max_tokens_per_rank,
                                 bool use_fp8, py::handle rank, py::handle gpu_uuid,
                                 int launch_mode, py::bytes join_secret, py::handle nodes,
                                 py::handle transport, int on_rank_failure = 0);

  /// epd_client_reconnect; timeout: seconds (None: 30 s; inf: no limit). The caller (the
  /// epd package) re-reads its endpoints afterwards (Endpoint::Rebound).
  void Reconnect(py::handle timeout) {
    static constexpr const char* kOp = "reconnect";
    const int64_t timeout_ms = TimeoutMs(timeout, kOp, 30000, EPD_TIMEOUT_INFINITE, "30 s");
    const std::shared_ptr<ClientCore> core = Live(kOp);
    epd_status_t status;
    {
      py::gil_scoped_release release;
      status = epd_client_reconnect(core->client, timeout_ms);
    }
    Check(status);
  }

  /// Drops this object's hold on the C client: it is destroyed once the calls running on
  /// other threads and the endpoints (and their views) are gone. Idempotent.
  void Close() { core_.reset(); }
  bool closed() const { return core_ == nullptr; }

 private:
  std::shared_ptr<ClientCore> core_;
};

// ---- endpoint -------------------------------------------------------------------------

class PendingOp;

/// Tensor arguments of one op call (at most four), kept alive for the call (and for a
/// PendingOp, until it is waited for).
struct Inputs {
  explicit Inputs(const ViewCache* caches) : caches(caches) {}
  const ViewCache* caches;  // [3]: an endpoint's own views are read without an export
  std::array<TensorArg, 4> args;
  int used = 0;
  const DLTensor* Read(py::handle obj, const char* op, const char* field,
                       Relabel relabel = Relabel::kNone) {
    TensorArg& arg = args[used++];
    if (caches[1].Find(obj, arg) || caches[0].Find(obj, arg) || caches[2].Find(obj, arg)) {
      return &arg.tensor;
    }
    return ReadTensor(obj, op, field, arg, relabel);
  }
  py::tuple Keep() const {
    py::tuple t(used);
    for (int i = 0; i < used; ++i) {
      t[i] = args[i].keep ? args[i].keep : py::none();
    }
    return t;
  }
};

class Endpoint : public std::enable_shared_from_this<Endpoint> {
 public:
  explicit Endpoint(std::shared_ptr<EndpointCore> core)
      : core_(std::move(core)), sync_op_(NewOp()) {}

  /// One call into the C endpoint (an op, a wait, a leave), made with the GIL held on entry
  /// and exit. It marks the endpoint busy, so a second thread's call raises instead of
  /// sharing the endpoint's op holder and ring (the C ABI takes an endpoint from one thread
  /// at a time), and holds a strong reference to the core: close() from another thread
  /// while the call runs without the GIL cannot destroy the C endpoint under it. A leave
  /// asked for during the call (close() or leave() on another thread) runs when it ends.
  class Call {
   public:
    Call(Endpoint& e, const char* op) : e_(e) {
      e.Live(op);  // raises once closed
      if (e.busy_.exchange(true, std::memory_order_acquire)) {
        RaiseStatus(EPD_FAILED_PRECONDITION,
                    std::string("endpoint used from two threads at once: ") + op +
                        " while another thread's call on it is running; use an Endpoint "
                        "from one thread at a time (docs/CLIENT_API.md section 7)");
      }
      core_ = e.core_;
    }
    ~Call() {
      e_.busy_.store(false, std::memory_order_release);
      if (e_.leave_pending_) {
        e_.leave_pending_ = false;
        py::gil_scoped_release release;
        epd_endpoint_leave(core_->endpoint);
      }
      // core_ goes here: after close(), the last call destroys the C endpoint (unless views
      // of its buffers still hold it).
    }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    epd_endpoint_t* endpoint() const { return core_->endpoint; }

   private:
    Endpoint& e_;
    std::shared_ptr<EndpointCore> core_;
  };

  EndpointCore& Live(const char* op) const {
    if (core_ == nullptr) {
      RaiseStatus(EPD_FAILED_PRECONDITION,
                  std::string(op) + ": the endpoint is closed (close() was called)");
    }
    return *core_;
  }

  py::dict Info() const {
    epd_endpoint_info_t i{};
    i.struct_size = sizeof(i);
    Check(epd_endpoint_info(Live("info").endpoint, &i));
    py::dict d;
    d["endpoint_id"] = i.endpoint_id;
    d["rank"] = i.rank;
    d["num_ranks"] = i.num_ranks;
    d["num_experts"] = i.num_experts;
    d["hidden"] = i.hidden;
    d["num_topk"] = i.num_topk;
    d["max_tokens_per_rank"] = i.max_tokens_per_rank;
    d["ll_max_tokens_per_rank"] = i.ll_max_tokens_per_rank;
    d["use_fp8"] = i.use_fp8 != 0;
    d["launch_mode"] = i.launch_mode;
    d["op_timeout_ms"] = i.op_timeout_ms;
    d["cuda"] = i.cuda != 0;
    d["group"] = CString(i.group, sizeof(i.group));
    d["gpu_uuid"] = CString(i.gpu_uuid, sizeof(i.gpu_uuid));
    return d;
  }

  /// Leaves the group. A no-op once closed (close() left); while another thread's call
  /// runs, the leave happens when that call returns. Idempotent.
  void Leave() {
    if (core_ == nullptr) return;
    if (busy_.load(std::memory_order_acquire)) {
      leave_pending_ = true;
      return;
    }
    Call call(*this, "leave");
    epd_status_t status;
    {
      py::gil_scoped_release release;
      status = epd_endpoint_leave(call.endpoint());
    }
    Check(status);
  }

  /// Leaves (best effort) and drops this object's hold on the mapping: it is unmapped once
  /// the last view made from it, and the last call running on another thread, are gone
  /// (that call leaves when it returns). Later calls raise FailedPreconditionError.
  /// Idempotent.
  void Close() {
    if (core_ == nullptr) return;
    std::shared_ptr<EndpointCore> core = std::move(core_);  // from here on: closed
    for (ViewCache& cache : caches_) cache.Clear();
    free_ops_.clear();
    if (busy_.load(std::memory_order_acquire)) {
      leave_pending_ = true;
      return;
    }
    py::gil_scoped_release release;
    epd_endpoint_leave(core->endpoint);
  }
  bool closed() const { return core_ == nullptr; }

  /// The low-latency combine (or dispatch) input region as a cached view (mode: 0 numpy
  /// converter, 1 torch converter, 2 the DLView itself); None without low-latency mode.
  py::object InputRegion(bool combine, int mode) {
    const char* op = combine ? "low_latency_combine_input" : "low_latency_dispatch_input";
    EndpointCore& c = Live(op);
    DLTensor t{};
    Check(combine ? epd_low_latency_combine_input(c.endpoint, &t)
                  : epd_low_latency_dispatch_input(c.endpoint, &t));
    if (mode < 0 || mode > 2) {
      RaiseStatus(EPD_INVALID_ARGUMENT, std::string(op) + ": mode " + std::to_string(mode));
    }
    return caches_[mode].Get(t, core_, mode == 0, mode == 2 ? py::none() : converters_[mode]);
  }

  py::object View(const DLTensor& t, bool torch_mode) {
    return caches_[torch_mode].Get(t, core_, !torch_mode, converters_[torch_mode]);
  }

  void SetConverters(py::object numpy_convert, py::object torch_convert) {
    converters_[0] = std::move(numpy_convert);
    converters_[1] = std::move(torch_convert);
  }

  size_t CacheSize() const { return caches_[0].size() + caches_[1].size() + caches_[2].size(); }

  /// After a reconnect re-bound the C endpoint to new buffers: drops the cached views (of
  /// the old buffers; views the caller holds stay valid memory, with stale data).
  void Rebound() {
    for (ViewCache& cache : caches_) cache.Clear();
  }

  /// update_rank_mask / query / clean as (epoch, [masked ranks]). `kind`: 0 update, 1
  /// query, 2 clean.
  py::tuple RankMaskCall(int kind, py::handle mask, py::handle unmask) {
    const char* op = kind == 0   ? "update_rank_mask"
                     : kind == 1 ? "query_rank_mask"
                                 : "clean_rank_mask";
    std::vector<int32_t> masked, unmasked;
    if (kind == 0) {
      masked = ToRanks(mask, op, "mask");
      unmasked = ToRanks(unmask, op, "unmask");
    }
    Call call(*this, op);
    std::vector<int32_t> ranks(static_cast<size_t>(Info()["num_ranks"].cast<int32_t>()));
    epd_rank_mask_t out{};
    out.struct_size = sizeof(out);
    out.masked_ranks = ranks.data();
    out.masked_ranks_capacity = static_cast<int32_t>(ranks.size());
    epd_status_t status;
    {
      py::gil_scoped_release release;
      if (kind == 0) {
        status = epd_endpoint_update_rank_mask(call.endpoint(), masked.data(), masked.size(),
                                               unmasked.data(), unmasked.size(), &out);
      } else if (kind == 1) {
        status = epd_endpoint_query_rank_mask(call.endpoint(), &out);
      } else {
        status = epd_endpoint_clean_rank_mask(call.endpoint(), &out);
      }
    }
    Check(status);
    return RankMaskTuple(out, ranks);
  }

  // The five ops. Each reads its tensors, submits into the endpoint's reusable holder
  // (wait=True: waits with the GIL released and returns the result) or into a holder of its
  // own (wait=False: returns a PendingOp).
  py::object Layout(py::handle topk_idx, py::handle stream, bool wait) {
    static constexpr const char* kOp = "get_dispatch_layout";
    Call call(*this, kOp);
    Inputs in(caches_);
    epd_layout_args_t a{};
    a.struct_size = sizeof(a);
    a.topk_idx = in.Read(topk_idx, kOp, "topk_idx");
    a.stream = ReadStream(stream, kOp);
    return Submit(kOp, in, IsTorch(topk_idx), wait,
                  [&](epd_op_t* op) { return epd_get_dispatch_layout(call.endpoint(), &a, op); });
  }

  py::object Dispatch(py::handle x, py::handle x_scales, py::handle topk_idx,
                      py::handle topk_weights, py::handle expert_alignment, py::handle num_sms,
                      py::handle handle, py::handle stream, bool wait) {
    static constexpr const char* kOp = "dispatch";
    Call call(*this, kOp);
    Inputs in(caches_);
    epd_dispatch_args_t a{};
    a.struct_size = sizeof(a);
    a.x_scales = in.Read(x_scales, kOp, "x_scales");
    a.x = in.Read(x, kOp, "x", a.x_scales != nullptr ? Relabel::kFp8Bits : Relabel::kBf16Bits);
    a.topk_idx = in.Read(topk_idx, kOp, "topk_idx");
    a.topk_weights = in.Read(topk_weights, kOp, "topk_weights");
    a.expert_alignment = ToInt32(expert_alignment, kOp, "expert_alignment");
    a.num_sms = ToInt32(num_sms, kOp, "num_sms");
    a.cached = ReadHandle(handle, kOp, "handle");
    a.stream = ReadStream(stream, kOp);
    return Submit(kOp, in, IsTorch(x), wait,
                  [&](epd_op_t* op) { return epd_dispatch(call.endpoint(), &a, op); });
  }

  py::object Combine(py::handle x, py::handle handle, py::handle topk_weights, py::handle num_sms,
                     py::handle stream, bool wait) {
    static constexpr const char* kOp = "combine";
    Call call(*this, kOp);
    Inputs in(caches_);
    epd_combine_args_t a{};
    a.struct_size = sizeof(a);
    a.x = in.Read(x, kOp, "x", Relabel::kBf16Bits);
    a.handle = ReadHandle(handle, kOp, "handle", /*required=*/true);
    a.topk_weights = in.Read(topk_weights, kOp, "topk_weights");
    a.num_sms = ToInt32(num_sms, kOp, "num_sms");
    a.stream = ReadStream(stream, kOp);
    return Submit(kOp, in, IsTorch(x), wait,
                  [&](epd_op_t* op) { return epd_combine(call.endpoint(), &a, op); });
  }

  py::object LowLatencyDispatch(py::handle x, py::handle topk_idx, py::handle max_dispatch_tokens,
                                bool use_fp8, bool round_scale, bool use_ue8m0,
                                py::handle num_tokens, py::handle stream, bool wait) {
    static constexpr const char* kOp = "low_latency_dispatch";
    Call call(*this, kOp);
    Inputs in(caches_);
    epd_ll_dispatch_args_t a{};
    a.struct_size = sizeof(a);
    a.x = in.Read(x, kOp, "x", Relabel::kBf16Bits);
    a.topk_idx = in.Read(topk_idx, kOp, "topk_idx");
    a.max_dispatch_tokens_per_rank =
        ToInt32(max_dispatch_tokens, kOp, "max_dispatch_tokens_per_rank");
    a.use_fp8 = use_fp8;
    a.round_scale = round_scale;
    a.use_ue8m0 = use_ue8m0;
    if (PyLong_Check(num_tokens.ptr())) {
      RaiseStatus(EPD_INVALID_ARGUMENT,
                  std::string(kOp) + ": num_tokens=" + ShortRepr(num_tokens) +
                      " is an int; num_tokens is a [1] int32 tensor on the endpoint's GPU "
                      "holding T (client-launched endpoints only); leave it None to take T "
                      "from x's rows");
    }
    a.num_tokens = in.Read(num_tokens, kOp, "num_tokens");
    a.stream = ReadStream(stream, kOp);
    return Submit(kOp, in, IsTorch(x) || IsTorch(topk_idx), wait,
                  [&](epd_op_t* op) { return epd_low_latency_dispatch(call.endpoint(), &a, op); });
  }

  py::object LowLatencyCombine(py::handle x, py::handle topk_idx, py::handle topk_weights,
                               py::handle handle, py::handle stream, bool wait) {
    static constexpr const char* kOp = "low_latency_combine";
    Call call(*this, kOp);
    Inputs in(caches_);
    epd_ll_combine_args_t a{};
    a.struct_size = sizeof(a);
    a.x = in.Read(x, kOp, "x", Relabel::kBf16Bits);
    a.topk_idx = in.Read(topk_idx, kOp, "topk_idx");
    a.topk_weights = in.Read(topk_weights, kOp, "topk_weights");
    a.handle = ReadHandle(handle, kOp, "handle", /*required=*/true);
    a.stream = ReadStream(stream, kOp);
    return Submit(kOp, in, IsTorch(x) || IsTorch(topk_idx), wait,
                  [&](epd_op_t* op) { return epd_low_latency_combine(call.endpoint(), &a, op); });
  }

  /// The result `op` holds (after a successful wait or enqueued), as a result object of
  /// cached views. Called inside a Call. `what` names the call for the closed error.
  py::object Result(const epd_op_t* op, bool torch_mode, const char* what) {
    // Closed by another thread during the call: its buffers may be unmapped, and its
    // caches are gone. The op itself ran.
    if (core_ == nullptr) {
      RaiseStatus(EPD_FAILED_PRECONDITION,
                  std::string(what) +
                      ": the endpoint was closed (close() on another thread) while the call "
                      "ran; its result is not readable");
    }
    switch (epd_op_kind(op)) {
      case EPD_OP_GET_DISPATCH_LAYOUT: {
        const epd_layout_result_t r = ReadOpResult(op, &epd_op_layout_result);
        return MakeResult(g_results.layout, View(r.num_tokens_per_rank, torch_mode),
                          View(r.num_tokens_per_expert, torch_mode),
                          View(r.is_token_in_rank, torch_mode));
      }
      case EPD_OP_DISPATCH: {
        const epd_dispatch_result_t r = ReadOpResult(op, &epd_op_dispatch_result);
        return MakeResult(
            g_results.dispatch, View(r.recv_x, torch_mode), View(r.recv_scales, torch_mode),
            View(r.recv_topk_idx, torch_mode), View(r.recv_topk_weights, torch_mode),
            View(r.num_recv_tokens_per_expert, torch_mode), View(r.recv_src_info, torch_mode),
            View(r.recv_count, torch_mode), py::cast(Handle{r.handle}), py::int_(r.num_recv_tokens),
            MakeOpMask(r.mask));
      }
      case EPD_OP_COMBINE: {
        const epd_combine_result_t r = ReadOpResult(op, &epd_op_combine_result);
        return MakeResult(g_results.combine, View(r.combined_x, torch_mode),
                          View(r.combined_topk_weights, torch_mode), MakeOpMask(r.mask));
      }
      case EPD_OP_LOW_LATENCY_DISPATCH: {
        const epd_ll_dispatch_result_t r = ReadOpResult(op, &epd_op_ll_dispatch_result);
        return MakeResult(g_results.ll_dispatch, View(r.recv_x, torch_mode),
                          View(r.recv_scales, torch_mode), View(r.recv_count, torch_mode),
                          View(r.recv_src_info, torch_mode), py::cast(Handle{r.handle}),
                          MakeOpMask(r.mask));
      }
      case EPD_OP_LOW_LATENCY_COMBINE: {
        const epd_ll_combine_result_t r = ReadOpResult(op, &epd_op_ll_combine_result);
        return MakeResult(g_results.ll_combine, View(r.combined_x, torch_mode), MakeOpMask(r.mask));
      }
      case EPD_OP_NONE:
        break;
    }
    RaiseStatus(EPD_FAILED_PRECONDITION, std::string(what) + ": the op holds no op");
  }

  OpHolder TakeOp() {
    if (free_ops_.empty()) return NewOp();
    OpHolder op = std::move(free_ops_.back());
    free_ops_.pop_back();
    return op;
  }
  void ReturnOp(OpHolder op) {
    if (core_ != nullptr && free_ops_.size() < kMaxFreeOps) free_ops_.push_back(std::move(op));
  }

 private:
  static constexpr size_t kMaxFreeOps = 64;

  template <typename SubmitFn>
  py::object Submit(const char* op_name, const Inputs& in, bool torch_mode, bool wait,
                    SubmitFn submit);

  std::shared_ptr<EndpointCore> core_;  // null once closed
  // Set by a Call for its duration; read and written with the GIL held, atomic so that the
  // check stays sound without it.
  std::atomic<bool> busy_{false};
  bool leave_pending_ = false;  // close() or leave() during a Call: the Call leaves at its end
  OpHolder sync_op_;
  ViewCache caches_[3];  // [0] numpy mode, [1] torch mode, [2] DLViews
  py::object converters_[2] = {py::none(), py::none()};
  std::vector<OpHolder> free_ops_;
};

/// epd._C.PendingOp: a submitted op with its own holder; keeps its endpoint and its input
/// tensors alive until it is waited for.
class PendingOp {
 public:
  PendingOp(std::shared_ptr<Endpoint> endpoint, OpHolder op, py::tuple inputs, bool torch_mode)
      : endpoint_(std::move(endpoint)),
        op_(std::move(op)),
        inputs_(std::move(inputs)),
        torch_mode_(torch_mode) {}
  PendingOp(PendingOp&&) = default;
  PendingOp& operator=(PendingOp&&) = delete;
  ~PendingOp() {
    if (op_ != nullptr && endpoint_ != nullptr) endpoint_->ReturnOp(std::move(op_));
  }

  /// timeout: None (no limit) or seconds (inf or above ~31 years: no limit).
  py::object Wait(py::handle timeout) {
    static constexpr const char* kOp = "wait";
    const int64_t timeout_ms =
        TimeoutMs(timeout, kOp, EPD_TIMEOUT_INFINITE, EPD_TIMEOUT_INFINITE, "no limit");
    Endpoint::Call call(*endpoint_, kOp);
    epd_status_t status;
    {
      py::gil_scoped_release release;
      status = epd_op_wait(op_.get(), timeout_ms);
    }
    Check(status);
    inputs_ = py::tuple();
    return endpoint_->Result(op_.get(), torch_mode_, kOp);
  }

  py::object Enqueued() {
    static constexpr const char* kOp = "enqueued";
    Endpoint::Call call(*endpoint_, kOp);
    Check(epd_op_enqueued(op_.get()));
    return endpoint_->Result(op_.get(), torch_mode_, kOp);
  }

  uint64_t seq() const { return epd_op_seq(op_.get()); }
  int kind() const { return epd_op_kind(op_.get()); }

 private:
  std::shared_ptr<Endpoint> endpoint_;
  OpHolder op_;
  py::tuple inputs_;
  bool torch_mode_;
};

template <typename SubmitFn>
py::object Endpoint::Submit(const char* op_name, const Inputs& in, bool torch_mode, bool wait,
                            SubmitFn submit) {
  // The GIL is released while epd works: a submit can block (a client-launched endpoint's
  // first op waits for its peers to join), and a wait always does; ranks driven by threads
  // of one process need each other's progress. The arguments are C structs over memory
  // that `in` keeps alive; the caller's Call keeps the C endpoint alive and this thread
  // its only user. epd_last_error() stays this thread's.
  epd_status_t status;
  if (wait) {
    {
      py::gil_scoped_release release;
      status = submit(sync_op_.get());
      if (status == EPD_OK) status = epd_op_wait(sync_op_.get(), EPD_TIMEOUT_INFINITE);
    }
    Check(status);
    return Result(sync_op_.get(), torch_mode, op_name);
  }
  OpHolder op = TakeOp();
  {
    py::gil_scoped_release release;
    status = submit(op.get());
  }
  if (status != EPD_OK) {
    std::string message = epd_last_error();
    const int32_t reason = epd_last_error_reason();
    ReturnOp(std::move(op));
    RaiseStatus(status, message, reason);
  }
  return py::cast(PendingOp(shared_from_this(), std::move(op), in.Keep(), torch_mode));
}

std::shared_ptr<Endpoint> Client::Join(py::handle name, py::handle num_ranks,
                                       py::handle num_experts, py::handle hidden,
                                       py::handle num_topk, py::handle max_tokens_per_rank,
                                       py::handle ll_max_tokens_per_rank, bool use_fp8,
                                       py::handle rank, py::handle gpu_uuid, int launch_mode,
                                       py::bytes join_secret, py::handle nodes,
                                       py::handle transport, int on_rank_failure) {
  static constexpr const char* kOp = "join";
  const std::shared_ptr<ClientCore> core = Live(kOp);
  const std::string group = ToCString(name, kOp, "spec.name");
  const std::string gpu = gpu_uuid.is_none() ? "" : ToCString(gpu_uuid, kOp, "gpu");
  std::string secret = join_secret;
  const std::string transport_name =
      transport.is_none() ? "" : ToCString(transport, kOp, "spec.transport");
  epd_join_options_t o{};
  o.struct_size = sizeof(o);
  o.name = group.c_str();
  o.num_ranks = ToInt32(num_ranks, kOp, "spec.num_ranks");
  o.num_experts = ToInt32(num_experts, kOp, "spec.num_experts");
  o.hidden = ToInt32(hidden, kOp, "spec.hidden");
  o.num_topk = ToInt32(num_topk, kOp, "spec.num_topk");
  o.max_tokens_per_rank = ToInt32(max_tokens_per_rank, kOp, "spec.max_tokens_per_rank");
  o.ll_max_tokens_per_rank =
      ToInt32(ll_max_tokens_per_rank, kOp, "spec.max_dispatch_tokens_per_rank");
  o.use_fp8 = use_fp8;
  o.rank = ToInt32(rank, kOp, "rank");
  o.gpu_uuid = gpu.c_str();
  o.launch_mode = launch_mode;
  o.join_secret = secret.empty() ? nullptr : secret.data();
  o.join_secret_len = secret.size();
  o.on_rank_failure = on_rank_failure;
  // The node list: (peer_address, num_ranks) pairs; the strings live until the call returns.
  std::vector<std::string> addresses;
  std::vector<epd_node_t> node_list;
  if (!nodes.is_none()) {
    const py::sequence list = py::reinterpret_borrow<py::sequence>(nodes);
    addresses.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      const py::sequence node = py::reinterpret_borrow<py::sequence>(list[i]);
      const std::string field = "spec.nodes[" + std::to_string(i) + "]";
      if (node.size() != 2) {
        RaiseStatus(EPD_INVALID_ARGUMENT,
                    std::string(kOp) + ": " + field + " must be (peer_address, num_ranks)");
      }
      addresses.push_back(ToCString(node[0], kOp, (field + ".peer_address").c_str()));
      node_list.push_back({nullptr, ToInt32(node[1], kOp, (field + ".num_ranks").c_str())});
    }
    for (size_t i = 0; i < node_list.size(); ++i) node_list[i].peer_address = addresses[i].c_str();
  }
  o.nodes = node_list.empty() ? nullptr : node_list.data();
  o.num_nodes = static_cast<int32_t>(node_list.size());
  o.transport = transport_name.empty() ? nullptr : transport_name.c_str();
  epd_endpoint_t* e = nullptr;
  epd_status_t status;
  {
    py::gil_scoped_release release;
    status = epd_client_join(core->client, &o, &e);
  }
  Check(status);
  auto endpoint_core = std::make_shared<EndpointCore>(e, core);
  if (core_ == nullptr) {  // close() ran on another thread during the join: leave again
    RaiseStatus(EPD_FAILED_PRECONDITION, "join: the client was closed while joining");
  }
  return std::make_shared<Endpoint>(std::move(endpoint_core));
}

std::string HandleRepr(const Handle& h) {
  const epd_handle_t& x = h.h;
  return "epd.Handle(endpoint_id=" + std::to_string(x.endpoint_id) +
         ", seq=" + std::to_string(x.seq) + ", num_tokens=" + std::to_string(x.num_tokens) +
         ", num_recv_tokens=" + std::to_string(x.num_recv_tokens) +
         ", low_latency=" + (x.low_latency ? "True" : "False") +
         ", buffer=" + std::to_string(x.buffer) + ", use_fp8=" + (x.use_fp8 ? "True" : "False") +
         ")";
}

}  // namespace
}  // namespace epd_py

PYBIND11_MODULE(_C, m) {
  using namespace epd_py;
  m.doc() = "epd._C: the binding of libepdclient's C ABI (epd.h). Use the epd package.";
  if (epd_abi_version() != EPD_ABI_VERSION) {
    throw py::import_error("libepdclient has C ABI " + std::to_string(epd_abi_version()) +
                           ", epd._C was built against " + std::to_string(EPD_ABI_VERSION));
  }
  m.attr("ABI_VERSION") = EPD_ABI_VERSION;
  m.attr("TIMEOUT_INFINITE") = EPD_TIMEOUT_INFINITE;
  m.def(
      "version", [] { return std::string(epd_version_string()); }, "epd's version string.");
  m.def("abi_version", &epd_abi_version, "The library's C ABI version.");
  m.def("status_name", [](int code) { return std::string(epd_status_name(code)); });
  m.def(
      "reason_name", [](int32_t reason) { return std::string(epd_reason_name(reason)); },
      "The error catalog's name of a reason number (docs/ERRORS.md).");

  BindDlpack(m);
  g_results.op_mask =
      MakeResultType(m, "epd.OpMask", "The rank mask an op ran with.", kOpMaskFields);
  g_results.layout =
      MakeResultType(m, "epd.LayoutResult", "Result of get_dispatch_layout.", kLayoutFields);
  g_results.dispatch = MakeResultType(m, "epd.DispatchResult", "Result of a normal dispatch.",
                                      kDispatchFields, /*named_only=*/1);
  g_results.combine = MakeResultType(m, "epd.CombineResult", "Result of a normal combine.",
                                     kCombineFields, /*named_only=*/1);
  g_results.ll_dispatch =
      MakeResultType(m, "epd.LowLatencyDispatchResult", "Result of a low-latency dispatch.",
                     kLlDispatchFields, /*named_only=*/1);
  g_results.ll_combine =
      MakeResultType(m, "epd.LowLatencyCombineResult", "Result of a low-latency combine.",
                     kLlCombineFields, /*named_only=*/1);

  py::class_<Handle>(m, "Handle",
                     "The routing of a dispatch, for combine and cached re-dispatch: a value, "
                     "bound to its endpoint and dispatch (stale or foreign: "
                     "FailedPreconditionError).")
      .def_property_readonly("endpoint_id", [](const Handle& h) { return h.h.endpoint_id; })
      .def_property_readonly("seq", [](const Handle& h) { return h.h.seq; })
      .def_property_readonly("num_tokens", [](const Handle& h) { return h.h.num_tokens; })
      .def_property_readonly("num_recv_tokens", [](const Handle& h) { return h.h.num_recv_tokens; })
      .def_property_readonly("buffer", [](const Handle& h) { return h.h.buffer; })
      .def_property_readonly("low_latency", [](const Handle& h) { return h.h.low_latency != 0; })
      .def_property_readonly("use_fp8", [](const Handle& h) { return h.h.use_fp8 != 0; })
      .def("__eq__",
           [](const Handle& a, py::object b) {
             if (!py::isinstance<Handle>(b)) return false;
             return std::memcmp(&a.h, &b.cast<const Handle&>().h, sizeof(epd_handle_t)) == 0;
           })
      .def("__hash__",
           [](const Handle& h) { return py::hash(py::make_tuple(h.h.endpoint_id, h.h.seq)); })
      .def("__repr__", &HandleRepr);

  py::class_<PendingOp>(m, "PendingOp",
                        "A submitted op (wait=False). wait(timeout=None) blocks until every "
                        "rank's part is done (timeout in seconds: DeadlineExceededError, the op "
                        "stays pending; NaN or negative: InvalidArgumentError; inf: no limit) "
                        "and returns the result; enqueued() returns it without a "
                        "CPU wait (CUDA backend, op given a stream).")
      .def("wait", &PendingOp::Wait, py::arg("timeout") = py::none())
      .def("enqueued", &PendingOp::Enqueued)
      .def_property_readonly("seq", &PendingOp::seq)
      .def_property_readonly("kind", &PendingOp::kind, "The epd_op_kind_t of the op (an int).")
      .def("__repr__", [](const PendingOp& p) {
        return "epd.PendingOp(kind=" + std::to_string(p.kind()) +
               ", seq=" + std::to_string(p.seq()) + ")";
      });

  py::class_<Endpoint, std::shared_ptr<Endpoint>>(m, "Endpoint")
      .def("info", &Endpoint::Info)
      .def("leave", &Endpoint::Leave)
      .def("close", &Endpoint::Close)
      .def_property_readonly("closed", &Endpoint::closed)
      .def("input_region", &Endpoint::InputRegion)
      .def("set_converters", &Endpoint::SetConverters)
      .def("cache_size", &Endpoint::CacheSize)
      .def("rebound", &Endpoint::Rebound)
      .def("rank_mask", &Endpoint::RankMaskCall, py::arg("kind"), py::arg("mask") = py::none(),
           py::arg("unmask") = py::none())
      .def("layout", &Endpoint::Layout)
      .def("dispatch", &Endpoint::Dispatch)
      .def("combine", &Endpoint::Combine)
      .def("ll_dispatch", &Endpoint::LowLatencyDispatch)
      .def("ll_combine", &Endpoint::LowLatencyCombine);

  py::class_<Client, std::shared_ptr<Client>>(m, "Client")
      .def_static("connect", &Client::Connect)
      .def_property_readonly("session_id", &Client::SessionId)
      .def("stats", &Client::Stats, py::arg("what") = "stats")
      .def("stats_json", &Client::Json<&epd_client_stats_json>, py::arg("what") = "stats")
      .def("list_groups_json", &Client::Json<&epd_client_list_groups_json>,
           py::arg("what") = "list_groups")
      .def("peer_address", &Client::Json<&epd_client_peer_address>,
           py::arg("what") = "peer_address")
      .def("join", &Client::Join)
      .def("reconnect", &Client::Reconnect, py::arg("timeout") = py::none())
      .def("close", &Client::Close)
      .def_property_readonly("closed", &Client::closed);
}
