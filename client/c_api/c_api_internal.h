// Internal to client/c_api: the C ABI's opaque handles (the C++ objects they own) and the
// helpers every entry point uses: Guard (Status -> epd_status_t and the thread's last error;
// exceptions -> INTERNAL), ReadArgs / CheckOut / WriteOut (versioned structs).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <variant>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "epd/client.h"
#include "epd/epd.h"

struct epd_client {
  std::unique_ptr<epd::Client> client;
};

struct epd_endpoint {
  std::unique_ptr<epd::Endpoint> endpoint;
  /// The low-latency input regions, taken for the binding `regions_of` (the endpoint's
  /// Impl: a reconnect re-binds the endpoint to a new one, and epd_low_latency_*_input take
  /// them again; endpoint ids of a restarted daemon may repeat).
  epd::TensorView ll_combine_input;
  epd::TensorView ll_dispatch_input;
  const void* regions_of = nullptr;
  // Graph-mode step results: two of each, so a view's shape outlives the next call.
  std::array<epd::LowLatencyDispatchResult, 2> program_dispatch;
  std::array<epd::LowLatencyCombineResult, 2> program_combine;
  int next_program_dispatch = 0;
  int next_program_combine = 0;
};

struct epd_op {
  std::variant<std::monostate, epd::PendingOp<epd::LayoutResult>,
               epd::PendingOp<epd::DispatchResult>, epd::PendingOp<epd::CombineResult>,
               epd::PendingOp<epd::LowLatencyDispatchResult>,
               epd::PendingOp<epd::LowLatencyCombineResult>>
      pending;
  std::variant<std::monostate, epd::LayoutResult, epd::DispatchResult, epd::CombineResult,
               epd::LowLatencyDispatchResult, epd::LowLatencyCombineResult>
      result;
};

namespace epd::c_api {

/// The C handle of an endpoint (its low-latency region views taken once).
std::unique_ptr<epd_endpoint> MakeEndpointHandle(std::unique_ptr<Endpoint> endpoint);
/// Takes the endpoint's low-latency region views (again, after a reconnect re-bound it).
void RefreshRegions(epd_endpoint& handle);

/// Sets the calling thread's last error from `status` (cleared on OK) and returns its code.
epd_status_t Report(const absl::Status& status);

/// Runs `fn` (returning absl::Status) and reports its status; an exception becomes INTERNAL.
template <typename Fn>
epd_status_t Guard(const char* function, Fn&& fn) {
  try {
    return Report(fn());
  } catch (const std::exception& e) {
    return Report(absl::InternalError(absl::StrCat(function, ": exception: ", e.what())));
  } catch (...) {
    return Report(absl::InternalError(absl::StrCat(function, ": unknown exception")));
  }
}

/// INVALID_ARGUMENT "<arg> is NULL" when `p` is null.
inline absl::Status NotNull(const void* p, const char* arg) {
  if (p != nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(arg, " is NULL"));
}

// The name and first-version size of each versioned struct: a caller's struct_size below it
// is refused. EPD_C_STRUCT: the first version is the whole struct; EPD_C_STRUCT_GREW: fields
// from `first_added` on came later (a caller built before them passes the shorter size).
template <typename T>
struct StructName;
#define EPD_C_STRUCT(T)                           \
  template <>                                     \
  struct StructName<T> {                          \
    static constexpr const char* kName = #T;      \
    static constexpr size_t kMinSize = sizeof(T); \
  }
#define EPD_C_STRUCT_GREW(T, first_added)                        \
  template <>                                                    \
  struct StructName<T> {                                         \
    static constexpr const char* kName = #T;                     \
    static constexpr size_t kMinSize = offsetof(T, first_added); \
  }
EPD_C_STRUCT(epd_client_options_t);
EPD_C_STRUCT(epd_stats_t);
EPD_C_STRUCT_GREW(epd_join_options_t, nodes);  // then on_rank_failure
EPD_C_STRUCT(epd_endpoint_info_t);
EPD_C_STRUCT(epd_layout_args_t);
EPD_C_STRUCT(epd_layout_result_t);
EPD_C_STRUCT(epd_dispatch_args_t);
EPD_C_STRUCT_GREW(epd_dispatch_result_t, mask);
EPD_C_STRUCT(epd_combine_args_t);
EPD_C_STRUCT_GREW(epd_combine_result_t, mask);
EPD_C_STRUCT_GREW(epd_ll_dispatch_args_t, use_ue8m0);
EPD_C_STRUCT_GREW(epd_ll_dispatch_result_t, mask);
EPD_C_STRUCT(epd_ll_combine_args_t);
EPD_C_STRUCT_GREW(epd_ll_combine_result_t, mask);
EPD_C_STRUCT_GREW(epd_program_step_t, use_ue8m0);
EPD_C_STRUCT(epd_program_dispatch_args_t);
EPD_C_STRUCT(epd_program_combine_args_t);
EPD_C_STRUCT(epd_rank_mask_t);
#undef EPD_C_STRUCT
#undef EPD_C_STRUCT_GREW

template <typename T>
absl::Status CheckSize(size_t struct_size, const char* arg) {
  if (struct_size >= StructName<T>::kMinSize) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(arg, ": ", StructName<T>::kName, ".struct_size=", struct_size,
                   " is smaller than ", StructName<T>::kMinSize,
                   ", its first version's size (set it to sizeof(", StructName<T>::kName, "))"));
}

/// Copies the part of `*in` its struct_size covers over a zeroed T (the defaults).
template <typename T>
absl::Status ReadArgs(const T* in, const char* arg, T* out) {
  EPD_RETURN_IF_ERROR(NotNull(in, arg));
  EPD_RETURN_IF_ERROR(CheckSize<T>(in->struct_size, arg));
  *out = T{};
  std::memcpy(static_cast<void*>(out), in, std::min(in->struct_size, sizeof(T)));
  return absl::OkStatus();
}

/// Checks an output struct's pointer and struct_size before the call fills it.
template <typename T>
absl::Status CheckOut(const T* out, const char* arg) {
  EPD_RETURN_IF_ERROR(NotNull(out, arg));
  return CheckSize<T>(out->struct_size, arg);
}

/// Writes the part of `value` the caller's out->struct_size covers (keeping that size).
template <typename T>
void WriteOut(T value, T* out) {
  const size_t size = std::min(out->struct_size, sizeof(T));
  value.struct_size = out->struct_size;
  std::memcpy(static_cast<void*>(out), &value, size);
}

/// A C timeout in ms (negative = none) as a Duration.
inline absl::Duration Timeout(int64_t timeout_ms) {
  return timeout_ms < 0 ? absl::InfiniteDuration() : absl::Milliseconds(timeout_ms);
}

}  // namespace epd::c_api
