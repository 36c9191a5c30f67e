// The C ABI's ops (epd/epd.h "ops" and "graph mode") over epd::Endpoint: the op holder
// (epd_op) keeps the submitted PendingOp and, after wait / enqueued, its C++ result, whose
// views' shapes the C results point at.
#include <array>
#include <iterator>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/c_api/c_api_internal.h"
#include "common/status_macros.h"
#include "epd/client.h"
#include "epd/epd.h"

namespace epd::c_api {
namespace {

epd_handle_t ToC(const Handle& h) {
  epd_handle_t c{};
  c.endpoint_id = h.endpoint_id;
  c.seq = h.seq;
  c.num_tokens = h.num_tokens;
  c.num_recv_tokens = h.num_recv_tokens;
  c.buffer = h.buffer;
  c.low_latency = h.low_latency ? 1 : 0;
  c.use_fp8 = h.use_fp8 ? 1 : 0;
  return c;
}

/// INVALID_ARGUMENT "<arg>-><field>[i]=v must be zero ..." for the first nonzero element of
/// a handle's reserved array `values`.
template <typename Array>
absl::Status CheckReservedZero(const Array& values, const char* arg, const char* field) {
  for (size_t i = 0; i < std::size(values); ++i) {
    if (values[i] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(arg, "->", field, "[", i, "]=", values[i],
                       " must be zero (copy handles as epd wrote them)"));
    }
  }
  return absl::OkStatus();
}

/// The C++ handle of `c` (named `arg` in errors); its reserved fields must be zero, so they
/// can carry meaning in a later version.
absl::StatusOr<Handle> FromC(const epd_handle_t& c, const char* arg) {
  EPD_RETURN_IF_ERROR(CheckReservedZero(c.reserved0, arg, "reserved0"));
  EPD_RETURN_IF_ERROR(CheckReservedZero(c.reserved, arg, "reserved"));
  Handle h;
  h.endpoint_id = c.endpoint_id;
  h.seq = c.seq;
  h.num_tokens = c.num_tokens;
  h.num_recv_tokens = c.num_recv_tokens;
  h.buffer = c.buffer;
  h.low_latency = c.low_latency != 0;
  h.use_fp8 = c.use_fp8 != 0;
  return h;
}

/// FromC of a required handle argument: INVALID_ARGUMENT "<arg> is NULL" when `c` is null.
absl::StatusOr<Handle> FromC(const epd_handle_t* c, const char* arg) {
  EPD_RETURN_IF_ERROR(NotNull(c, arg));
  return FromC(*c, arg);
}

epd_op_mask_t ToC(const OpMask& m) {
  epd_op_mask_t c{};
  c.epoch = m.epoch;
  c.num_masked = m.num_masked;
  c.dropped_pairs = m.dropped_pairs;
  return c;
}

// The C result of each C++ result; DLTensors point at the C++ views' shapes.
epd_layout_result_t ToC(const LayoutResult& r) {
  epd_layout_result_t c{};
  c.num_tokens_per_rank = r.num_tokens_per_rank.dl();
  c.num_tokens_per_expert = r.num_tokens_per_expert.dl();
  c.is_token_in_rank = r.is_token_in_rank.dl();
  return c;
}
epd_dispatch_result_t ToC(const DispatchResult& r) {
  epd_dispatch_result_t c{};
  c.recv_x = r.recv_x.dl();
  c.recv_scales = r.recv_scales.dl();
  c.recv_topk_idx = r.recv_topk_idx.dl();
  c.recv_topk_weights = r.recv_topk_weights.dl();
  c.num_recv_tokens_per_expert = r.num_recv_tokens_per_expert.dl();
  c.recv_src_info = r.recv_src_info.dl();
  c.recv_count = r.recv_count.dl();
  c.handle = ToC(r.handle);
  c.num_recv_tokens = r.num_recv_tokens;
  c.mask = ToC(r.mask);
  return c;
}
epd_combine_result_t ToC(const CombineResult& r) {
  epd_combine_result_t c{};
  c.combined_x = r.combined_x.dl();
  c.combined_topk_weights = r.combined_topk_weights.dl();
  c.mask = ToC(r.mask);
  return c;
}
epd_ll_dispatch_result_t ToC(const LowLatencyDispatchResult& r) {
  epd_ll_dispatch_result_t c{};
  c.recv_x = r.recv_x.dl();
  c.recv_scales = r.recv_scales.dl();
  c.recv_count = r.recv_count.dl();
  c.recv_src_info = r.recv_src_info.dl();
  c.handle = ToC(r.handle);
  c.mask = ToC(r.mask);
  return c;
}
epd_ll_combine_result_t ToC(const LowLatencyCombineResult& r) {
  epd_ll_combine_result_t c{};
  c.combined_x = r.combined_x.dl();
  c.mask = ToC(r.mask);
  return c;
}

const char* KindName(size_t index) {
  static constexpr const char* kNames[] = {
      "none",    "get_dispatch_layout",  "dispatch",
      "combine", "low_latency_dispatch", "low_latency_combine"};
  return index < std::size(kNames) ? kNames[index] : "unknown";
}

/// The index of alternative T in a variant.
template <typename T, typename... Ts>
constexpr size_t IndexOf(const std::variant<Ts...>*) {
  constexpr bool matches[] = {std::is_same_v<T, Ts>...};
  for (size_t i = 0; i < sizeof...(Ts); ++i) {
    if (matches[i]) return i;
  }
  return sizeof...(Ts);
}

/// Stores a submitted op (or, on failure, empties the holder).
template <typename Result>
absl::Status Hold(absl::StatusOr<PendingOp<Result>> submitted, epd_op* op) {
  op->result = std::monostate();
  if (!submitted.ok()) {
    op->pending = std::monostate();
    return submitted.status();
  }
  op->pending = *std::move(submitted);
  return absl::OkStatus();
}

/// The op call's common checks: endpoint and holder present, args read.
template <typename T>
absl::Status Prepare(epd_endpoint* endpoint, const T* args, epd_op* op, T* read) {
  EPD_RETURN_IF_ERROR(NotNull(endpoint, "endpoint"));
  EPD_RETURN_IF_ERROR(NotNull(op, "op"));
  return ReadArgs(args, "args", read);
}

/// The held result of kind `Result` into *out.
template <typename Result, typename CResult>
absl::Status GetResult(const epd_op* op, CResult* out) {
  EPD_RETURN_IF_ERROR(NotNull(op, "op"));
  EPD_RETURN_IF_ERROR(CheckOut(out, "out"));
  const Result* result = std::get_if<Result>(&op->result);
  if (result == nullptr) {
    constexpr size_t want = IndexOf<Result>(static_cast<decltype(&op->result)>(nullptr));
    if (op->result.index() == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "op (", KindName(op->pending.index()),
          ") holds no result: call epd_op_wait or epd_op_enqueued first (it returned OK)"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("op holds a ", KindName(op->result.index()), " result, not ", KindName(want)));
  }
  WriteOut(ToC(*result), out);
  return absl::OkStatus();
}

/// Wait (wait = true) or Enqueued on the held op, storing its result.
absl::Status Complete(epd_op* op, bool wait, int64_t timeout_ms) {
  EPD_RETURN_IF_ERROR(epd::c_api::NotNull(op, "op"));
  op->result = std::monostate();
  return std::visit(
      [&](auto& p) -> absl::Status {
        if constexpr (std::is_same_v<std::decay_t<decltype(p)>, std::monostate>) {
          return absl::FailedPreconditionError("op holds no op: submit one into it first");
        } else {
          auto result = wait ? p.Wait(epd::c_api::Timeout(timeout_ms)) : p.Enqueued();
          if (!result.ok()) return result.status();
          op->result = *std::move(result);
          return absl::OkStatus();
        }
      },
      op->pending);
}

// The C++ args of each graph-mode step's C args.
ProgramDispatchArgs FromC(const epd_program_dispatch_args_t& a) {
  ProgramDispatchArgs cpp;
  cpp.x = a.x;
  cpp.topk_idx = a.topk_idx;
  cpp.num_tokens = a.num_tokens;
  cpp.stream = a.stream;
  return cpp;
}
ProgramCombineArgs FromC(const epd_program_combine_args_t& a) {
  ProgramCombineArgs cpp;
  cpp.x = a.x;
  cpp.topk_idx = a.topk_idx;
  cpp.topk_weights = a.topk_weights;
  cpp.stream = a.stream;
  return cpp;
}

/// A graph-mode step: reads `args`, runs it (Endpoint::`run`), keeps the result in the
/// endpoint's next of two slots (so a view's shape outlives the next call) and writes its C
/// form to `out`.
template <typename CArgs, typename CppArgs, typename Result, typename CResult>
absl::Status RunProgramStep(epd_endpoint* endpoint, const CArgs* args, CResult* out,
                            std::array<Result, 2> epd_endpoint::*slots, int epd_endpoint::*next,
                            absl::StatusOr<Result> (Endpoint::*run)(const CppArgs&)) {
  EPD_RETURN_IF_ERROR(NotNull(endpoint, "endpoint"));
  EPD_RETURN_IF_ERROR(CheckOut(out, "out"));
  CArgs a;
  EPD_RETURN_IF_ERROR(ReadArgs(args, "args", &a));
  EPD_ASSIGN_OR_RETURN(Result result, ((*endpoint->endpoint).*run)(FromC(a)));
  int& index = endpoint->*next;
  Result& slot = (endpoint->*slots)[index];
  index ^= 1;
  slot = std::move(result);
  WriteOut(ToC(slot), out);
  return absl::OkStatus();
}

}  // namespace
}  // namespace epd::c_api

using epd::c_api::Guard;

extern "C" {

// ---- ops -------------------------------------------------------------------------------

epd_status_t epd_op_create(epd_op_t** out) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(out, "out"));
    *out = std::make_unique<epd_op>().release();
    return absl::OkStatus();
  });
}

void epd_op_destroy(epd_op_t* op) {
  Guard(__func__, [&] {
    std::unique_ptr<epd_op> owned(op);
    return absl::OkStatus();
  });
}

epd_op_kind_t epd_op_kind(const epd_op_t* op) {
  return op == nullptr ? EPD_OP_NONE : static_cast<epd_op_kind_t>(op->pending.index());
}

uint64_t epd_op_seq(const epd_op_t* op) {
  if (op == nullptr) return 0;
  return std::visit(
      [](const auto& p) -> uint64_t {
        if constexpr (std::is_same_v<std::decay_t<decltype(p)>, std::monostate>) {
          return 0;
        } else {
          return p.seq();
        }
      },
      op->pending);
}

epd_status_t epd_op_wait(epd_op_t* op, int64_t timeout_ms) {
  return Guard(__func__, [&] { return epd::c_api::Complete(op, true, timeout_ms); });
}

epd_status_t epd_op_enqueued(epd_op_t* op) {
  return Guard(__func__, [&] { return epd::c_api::Complete(op, false, 0); });
}

epd_status_t epd_get_dispatch_layout(epd_endpoint_t* endpoint, const epd_layout_args_t* args,
                                     epd_op_t* op) {
  return Guard(__func__, [&]() -> absl::Status {
    epd_layout_args_t a;
    EPD_RETURN_IF_ERROR(epd::c_api::Prepare(endpoint, args, op, &a));
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(a.topk_idx, "args.topk_idx"));
    return epd::c_api::Hold(endpoint->endpoint->GetDispatchLayout(*a.topk_idx, a.stream), op);
  });
}

epd_status_t epd_dispatch(epd_endpoint_t* endpoint, const epd_dispatch_args_t* args, epd_op_t* op) {
  return Guard(__func__, [&]() -> absl::Status {
    epd_dispatch_args_t a;
    EPD_RETURN_IF_ERROR(epd::c_api::Prepare(endpoint, args, op, &a));
    epd::DispatchArgs cpp;
    cpp.x = a.x;
    cpp.x_scales = a.x_scales;
    cpp.topk_idx = a.topk_idx;
    cpp.topk_weights = a.topk_weights;
    cpp.expert_alignment = a.expert_alignment == 0 ? 1 : a.expert_alignment;
    if (a.cached != nullptr) {
      EPD_ASSIGN_OR_RETURN(cpp.cached, epd::c_api::FromC(*a.cached, "args.cached"));
    }
    cpp.num_sms = a.num_sms;
    cpp.stream = a.stream;
    return epd::c_api::Hold(endpoint->endpoint->Dispatch(cpp), op);
  });
}

epd_status_t epd_combine(epd_endpoint_t* endpoint, const epd_combine_args_t* args, epd_op_t* op) {
  return Guard(__func__, [&]() -> absl::Status {
    epd_combine_args_t a;
    EPD_RETURN_IF_ERROR(epd::c_api::Prepare(endpoint, args, op, &a));
    EPD_ASSIGN_OR_RETURN(const epd::Handle handle, epd::c_api::FromC(a.handle, "args.handle"));
    epd::CombineArgs cpp;
    cpp.x = a.x;
    cpp.handle = &handle;
    cpp.topk_weights = a.topk_weights;
    cpp.num_sms = a.num_sms;
    cpp.stream = a.stream;
    return epd::c_api::Hold(endpoint->endpoint->Combine(cpp), op);
  });
}

epd_status_t epd_low_latency_dispatch(epd_endpoint_t* endpoint, const epd_ll_dispatch_args_t* args,
                                      epd_op_t* op) {
  return Guard(__func__, [&]() -> absl::Status {
    epd_ll_dispatch_args_t a;
    EPD_RETURN_IF_ERROR(epd::c_api::Prepare(endpoint, args, op, &a));
    epd::LowLatencyDispatchArgs cpp;
    cpp.x = a.x;
    cpp.topk_idx = a.topk_idx;
    cpp.max_dispatch_tokens_per_rank = a.max_dispatch_tokens_per_rank;
    cpp.use_fp8 = a.use_fp8 != 0;
    cpp.round_scale = a.round_scale != 0;
    cpp.use_ue8m0 = a.use_ue8m0 != 0;
    cpp.stream = a.stream;
    cpp.num_tokens = a.num_tokens;
    return epd::c_api::Hold(endpoint->endpoint->LowLatencyDispatch(cpp), op);
  });
}

epd_status_t epd_low_latency_combine(epd_endpoint_t* endpoint, const epd_ll_combine_args_t* args,
                                     epd_op_t* op) {
  return Guard(__func__, [&]() -> absl::Status {
    epd_ll_combine_args_t a;
    EPD_RETURN_IF_ERROR(epd::c_api::Prepare(endpoint, args, op, &a));
    EPD_ASSIGN_OR_RETURN(const epd::Handle handle, epd::c_api::FromC(a.handle, "args.handle"));
    epd::LowLatencyCombineArgs cpp;
    cpp.x = a.x;
    cpp.topk_idx = a.topk_idx;
    cpp.topk_weights = a.topk_weights;
    cpp.handle = &handle;
    cpp.stream = a.stream;
    return epd::c_api::Hold(endpoint->endpoint->LowLatencyCombine(cpp), op);
  });
}

epd_status_t epd_op_layout_result(const epd_op_t* op, epd_layout_result_t* out) {
  return Guard(__func__, [&] { return epd::c_api::GetResult<epd::LayoutResult>(op, out); });
}

epd_status_t epd_op_dispatch_result(const epd_op_t* op, epd_dispatch_result_t* out) {
  return Guard(__func__, [&] { return epd::c_api::GetResult<epd::DispatchResult>(op, out); });
}

epd_status_t epd_op_combine_result(const epd_op_t* op, epd_combine_result_t* out) {
  return Guard(__func__, [&] { return epd::c_api::GetResult<epd::CombineResult>(op, out); });
}

epd_status_t epd_op_ll_dispatch_result(const epd_op_t* op, epd_ll_dispatch_result_t* out) {
  return Guard(__func__,
               [&] { return epd::c_api::GetResult<epd::LowLatencyDispatchResult>(op, out); });
}

epd_status_t epd_op_ll_combine_result(const epd_op_t* op, epd_ll_combine_result_t* out) {
  return Guard(__func__,
               [&] { return epd::c_api::GetResult<epd::LowLatencyCombineResult>(op, out); });
}

// ---- graph mode ------------------------------------------------------------------------

epd_status_t epd_register_program(epd_endpoint_t* endpoint, const epd_program_step_t* steps,
                                  size_t num_steps, int64_t timeout_ms) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(endpoint, "endpoint"));
    std::vector<epd::ProgramStep> program;
    if (num_steps > 0) {
      EPD_RETURN_IF_ERROR(epd::c_api::NotNull(steps, "steps"));
      EPD_RETURN_IF_ERROR(
          epd::c_api::CheckSize<epd_program_step_t>(steps[0].struct_size, "steps[0]"));
    }
    const size_t stride = num_steps > 0 ? steps[0].struct_size : 0;
    for (size_t i = 0; i < num_steps; ++i) {
      const auto* in = reinterpret_cast<const epd_program_step_t*>(
          reinterpret_cast<const char*>(steps) + i * stride);
      epd_program_step_t s;
      const std::string name = absl::StrCat("steps[", i, "]");
      EPD_RETURN_IF_ERROR(epd::c_api::ReadArgs(in, name.c_str(), &s));
      epd::ProgramStep step;
      if (s.op == EPD_OP_LOW_LATENCY_DISPATCH) {
        step.op = epd::ProgramStep::Op::kLowLatencyDispatch;
      } else if (s.op == EPD_OP_LOW_LATENCY_COMBINE) {
        step.op = epd::ProgramStep::Op::kLowLatencyCombine;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ".op=", static_cast<int>(s.op),
            " is not EPD_OP_LOW_LATENCY_DISPATCH (4) or EPD_OP_LOW_LATENCY_COMBINE (5)"));
      }
      step.use_fp8 = s.use_fp8 != 0;
      step.round_scale = s.round_scale != 0;
      step.use_ue8m0 = s.use_ue8m0 != 0;
      program.push_back(step);
    }
    return endpoint->endpoint->RegisterProgram(program, epd::c_api::Timeout(timeout_ms));
  });
}

epd_status_t epd_run_program_dispatch(epd_endpoint_t* endpoint,
                                      const epd_program_dispatch_args_t* args,
                                      epd_ll_dispatch_result_t* out) {
  return Guard(__func__, [&] {
    return epd::c_api::RunProgramStep(endpoint, args, out, &epd_endpoint::program_dispatch,
                                      &epd_endpoint::next_program_dispatch,
                                      &epd::Endpoint::RunProgramDispatch);
  });
}

epd_status_t epd_run_program_combine(epd_endpoint_t* endpoint,
                                     const epd_program_combine_args_t* args,
                                     epd_ll_combine_result_t* out) {
  return Guard(__func__, [&] {
    return epd::c_api::RunProgramStep(endpoint, args, out, &epd_endpoint::program_combine,
                                      &epd_endpoint::next_program_combine,
                                      &epd::Endpoint::RunProgramCombine);
  });
}

epd_status_t epd_program_status(epd_endpoint_t* endpoint) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(endpoint, "endpoint"));
    return endpoint->endpoint->ProgramStatus();
  });
}

epd_status_t epd_unregister_program(epd_endpoint_t* endpoint, int64_t timeout_ms) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(endpoint, "endpoint"));
    return endpoint->endpoint->UnregisterProgram(epd::c_api::Timeout(timeout_ms));
  });
}

}  // extern "C"
