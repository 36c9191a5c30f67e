// _epd_bench_ll: the C++ side of tests/bench/python/py_overhead.py. One rank's low-latency
// dispatch + combine loop straight through the C ABI (epd.h), no Python between ops, on the
// caller's tensors (DLPack capsules of the same torch tensors the Python loop uses), timing
// each call the way the Python loop times its own. Built by py_overhead.py against the
// libepdclient that epd._C loaded; links libepdclient only.
#include <dlpack/dlpack.h>
#include <epd/epd.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sched.h>
#include <time.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

[[noreturn]] void Fail(const std::string& what, epd_status_t status) {
  throw std::runtime_error(what + ": " + epd_status_name(status) + ": " + epd_last_error());
}
void Check(const std::string& what, epd_status_t status) {
  if (status != EPD_OK) Fail(what, status);
}

struct ClientDeleter {
  void operator()(epd_client_t* c) const { epd_client_destroy(c); }
};
struct EndpointDeleter {
  void operator()(epd_endpoint_t* e) const { epd_endpoint_destroy(e); }
};
struct OpDeleter {
  void operator()(epd_op_t* o) const { epd_op_destroy(o); }
};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void SleepUs(int us) {
  timespec ts{us / 1000000, static_cast<long>(us % 1000000) * 1000};
  nanosleep(&ts, nullptr);
}

/// A DLPack capsule ("dltensor", as torch.utils.dlpack.to_dlpack makes) held for the loop's
/// lifetime; the tensor it wraps is the caller's.
class Capsule {
 public:
  explicit Capsule(py::capsule c) : capsule_(std::move(c)) {
    if (std::string(capsule_.name() ? capsule_.name() : "") != "dltensor") {
      throw std::invalid_argument("expected a 'dltensor' capsule (torch.utils.dlpack.to_dlpack)");
    }
    tensor_ = capsule_.get_pointer<DLManagedTensor>()->dl_tensor;
    // An empty tensor's strides are arbitrary in DLPack: pass it as compact (as epd._C does).
    for (int i = 0; i < tensor_.ndim; ++i) {
      if (tensor_.shape[i] == 0) tensor_.strides = nullptr;
    }
  }
  const DLTensor* tensor() const { return &tensor_; }

 private:
  py::capsule capsule_;
  DLTensor tensor_;
};

/// Per-op timings of one loop, in ns: submit = the op call (arguments already prepared);
/// complete = the epd_op_wait that found the op done plus reading its result (split mode),
/// or the blocking wait plus the result (end-to-end mode, then total = submit + complete).
struct Timings {
  std::vector<int64_t> dispatch_submit, dispatch_complete, dispatch_total;
  std::vector<int64_t> combine_submit, combine_complete, combine_total;
};

/// One rank of a group joined through the C ABI: its own client and endpoint, with the
/// spec the Python endpoint has.
class LlLoop {
 public:
  LlLoop(const std::string& socket, const std::string& group, int num_ranks, int hidden,
         int num_topk, int num_experts, int max_tokens, int ll_max_tokens, int rank,
         const std::string& gpu_uuid, int launch_mode) {
    epd_client_options_t co{};
    co.struct_size = sizeof(co);
    co.socket_path = socket.c_str();
    co.client_name = "py_overhead-c";
    co.connect_timeout_ms = 5000;
    epd_client_t* c = nullptr;
    {
      py::gil_scoped_release release;
      Check("epd_client_connect", epd_client_connect(&co, &c));
    }
    client_.reset(c);
    epd_join_options_t o{};
    o.struct_size = sizeof(o);
    o.name = group.c_str();
    o.num_ranks = num_ranks;
    o.num_experts = num_experts;
    o.hidden = hidden;
    o.num_topk = num_topk;
    o.max_tokens_per_rank = max_tokens;
    o.ll_max_tokens_per_rank = ll_max_tokens;
    o.rank = rank;
    o.gpu_uuid = gpu_uuid.c_str();
    o.launch_mode = launch_mode;
    epd_endpoint_t* e = nullptr;
    {
      py::gil_scoped_release release;
      Check("epd_client_join " + group, epd_client_join(client_.get(), &o, &e));
    }
    endpoint_.reset(e);
    for (auto* op : {&dispatch_op_, &combine_op_}) {
      epd_op_t* raw = nullptr;
      Check("epd_op_create", epd_op_create(&raw));
      op->reset(raw);
    }
    Check("epd_low_latency_combine_input",
          epd_low_latency_combine_input(endpoint_.get(), &combine_input_));
  }

  /// `iters` low-latency dispatch + combine ops of x [T, H] bf16 routed by topk_idx [T, K]
  /// int64 with topk_weights [T, K] f32 (capsules), the combine reading this endpoint's
  /// combine input region. split: submit, then poll epd_op_wait(op, 0) every poll_us (0: spin with
  /// sched_yield) and time the call that finds the op done (with its result); else block in
  /// epd_op_wait. stream: a cudaStream_t as an int (0 = none). Returns a dict of ns lists.
  py::dict Run(py::capsule x, py::capsule topk_idx, py::capsule topk_weights, int iters, bool split,
               int poll_us, uintptr_t stream) {
    Capsule cx(std::move(x)), ci(std::move(topk_idx)), cw(std::move(topk_weights));
    epd_ll_dispatch_args_t d{};
    d.struct_size = sizeof(d);
    d.x = cx.tensor();
    d.topk_idx = ci.tensor();
    d.stream = reinterpret_cast<void*>(stream);
    epd_ll_combine_args_t c{};
    c.struct_size = sizeof(c);
    c.x = &combine_input_;
    c.topk_idx = ci.tensor();
    c.topk_weights = cw.tensor();
    c.stream = reinterpret_cast<void*>(stream);

    Timings t;
    epd_status_t failed = EPD_OK;
    const char* where = "";
    {
      py::gil_scoped_release release;
      epd_ll_dispatch_result_t dr{};
      epd_ll_combine_result_t cr{};
      for (int i = 0; i < iters && failed == EPD_OK; ++i) {
        failed = TimeOp(
            [&] { return epd_low_latency_dispatch(endpoint_.get(), &d, dispatch_op_.get()); },
            dispatch_op_.get(), split, poll_us,
            [&] {
              dr.struct_size = sizeof(dr);
              return epd_op_ll_dispatch_result(dispatch_op_.get(), &dr);
            },
            t.dispatch_submit, t.dispatch_complete, t.dispatch_total);
        where = "low-latency dispatch";
        if (failed != EPD_OK) break;
        c.handle = &dr.handle;
        failed =
            TimeOp([&] { return epd_low_latency_combine(endpoint_.get(), &c, combine_op_.get()); },
                   combine_op_.get(), split, poll_us,
                   [&] {
                     cr.struct_size = sizeof(cr);
                     return epd_op_ll_combine_result(combine_op_.get(), &cr);
                   },
                   t.combine_submit, t.combine_complete, t.combine_total);
        where = "low-latency combine";
      }
    }
    if (failed != EPD_OK) Fail(where, failed);
    py::dict out;
    out["dispatch_submit"] = t.dispatch_submit;
    out["dispatch_complete"] = t.dispatch_complete;
    out["dispatch_total"] = t.dispatch_total;
    out["combine_submit"] = t.combine_submit;
    out["combine_complete"] = t.combine_complete;
    out["combine_total"] = t.combine_total;
    return out;
  }

  void Leave() {
    if (endpoint_ != nullptr) epd_endpoint_leave(endpoint_.get());
  }

 private:
  /// Submits one op (submit() into `op`), waits for it and reads its result (read()),
  /// appending the submit, complete and total times.
  template <typename Submit, typename ReadResult>
  static epd_status_t TimeOp(Submit submit, epd_op_t* op, bool split, int poll_us, ReadResult read,
                             std::vector<int64_t>& submit_ns, std::vector<int64_t>& complete_ns,
                             std::vector<int64_t>& total_ns) {
    const int64_t t0 = NowNs();
    epd_status_t s = submit();
    const int64_t t1 = NowNs();
    if (s != EPD_OK) return s;
    int64_t done = 0;
    s = Complete(op, split, poll_us, &done, read);
    const int64_t t2 = NowNs();
    if (s != EPD_OK) return s;
    submit_ns.push_back(t1 - t0);
    complete_ns.push_back(done);
    total_ns.push_back(t2 - t0);
    return EPD_OK;
  }

  /// Waits for `op` and reads its result; *done_ns = the time of the wait call that found
  /// it done plus the result read.
  template <typename ReadResult>
  static epd_status_t Complete(epd_op_t* op, bool split, int poll_us, int64_t* done_ns,
                               ReadResult read) {
    for (;;) {
      int64_t t0 = NowNs();
      epd_status_t s = epd_op_wait(op, split ? 0 : EPD_TIMEOUT_INFINITE);
      if (s == EPD_OK) s = read();
      int64_t t1 = NowNs();
      if (s != EPD_DEADLINE_EXCEEDED || !split) {
        *done_ns = t1 - t0;
        return s;
      }
      if (poll_us > 0) {
        SleepUs(poll_us);
      } else {
        sched_yield();
      }
    }
  }

  std::unique_ptr<epd_client_t, ClientDeleter> client_;
  std::unique_ptr<epd_endpoint_t, EndpointDeleter> endpoint_;
  std::unique_ptr<epd_op_t, OpDeleter> dispatch_op_, combine_op_;
  DLTensor combine_input_{};
};

}  // namespace

PYBIND11_MODULE(_epd_bench_ll, m) {
  m.doc() = "The C++ low-latency loop of tests/bench/python/py_overhead.py (C ABI only).";
  py::class_<LlLoop>(m, "LlLoop")
      .def(py::init<const std::string&, const std::string&, int, int, int, int, int, int, int,
                    const std::string&, int>(),
           py::arg("socket"), py::arg("group"), py::arg("num_ranks"), py::arg("hidden"),
           py::arg("num_topk"), py::arg("num_experts"), py::arg("max_tokens"),
           py::arg("ll_max_tokens"), py::arg("rank"), py::arg("gpu_uuid"), py::arg("launch_mode"))
      .def("run", &LlLoop::Run, py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::arg("iters"), py::arg("split"), py::arg("poll_us"), py::arg("stream"))
      .def("leave", &LlLoop::Leave);
}
