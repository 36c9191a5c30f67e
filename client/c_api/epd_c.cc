// The C ABI (epd/epd.h) over the C++ API (epd/client.h): opaque handles own the C++ objects,
// versioned structs are read and written through ReadArgs / WriteOut, and every entry point
// runs inside Guard, which turns a Status into an epd_status_t and the thread's last error
// and keeps exceptions from crossing the boundary (they become INTERNAL).
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "client/c_api/c_api_internal.h"
#include "client/request_text.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "epd/client.h"
#include "epd/epd.h"
#include "google/protobuf/util/json_util.h"

namespace epd::c_api {
namespace {

static_assert(EPD_OK == static_cast<int>(absl::StatusCode::kOk) &&
              EPD_INVALID_ARGUMENT == static_cast<int>(absl::StatusCode::kInvalidArgument) &&
              EPD_FAILED_PRECONDITION == static_cast<int>(absl::StatusCode::kFailedPrecondition) &&
              EPD_UNAUTHENTICATED == static_cast<int>(absl::StatusCode::kUnauthenticated));
static_assert(static_cast<int>(EPD_LAUNCH_MODE_DAEMON) == v1::LAUNCH_MODE_DAEMON &&
              static_cast<int>(EPD_LAUNCH_MODE_CLIENT) == v1::LAUNCH_MODE_CLIENT);
static_assert(EPD_DL_FLOAT8_E4M3FN == kDLFloat8E4m3fnCode);

thread_local std::string last_error;
thread_local int32_t last_error_reason = 0;

}  // namespace

epd_status_t Report(const absl::Status& status) {
  if (status.ok()) {
    last_error.clear();
    last_error_reason = 0;
    return EPD_OK;
  }
  last_error = std::string(status.message());
  last_error_reason = static_cast<int32_t>(errors::ReasonOf(status));
  return static_cast<epd_status_t>(status.code());
}

std::unique_ptr<epd_endpoint> MakeEndpointHandle(std::unique_ptr<Endpoint> endpoint) {
  auto handle = std::make_unique<epd_endpoint>();
  handle->endpoint = std::move(endpoint);
  RefreshRegions(*handle);
  return handle;
}

void RefreshRegions(epd_endpoint& handle) {
  handle.ll_combine_input = handle.endpoint->LowLatencyCombineInput();
  handle.ll_dispatch_input = handle.endpoint->LowLatencyDispatchInput();
  handle.regions_of = &handle.endpoint->impl();
}

namespace {

/// protobuf JSON into the caller's buffer (OUT_OF_RANGE naming the size needed).
absl::Status CopyOutString(const std::string& text, char* buf, size_t capacity, size_t* length) {
  if (length != nullptr) *length = text.size();
  if (capacity < text.size() + 1) {
    return errors::WithReason(
        absl::OutOfRangeError(absl::StrCat(
            "capacity=", capacity, " is too small: ", text.size() + 1, " bytes are needed")),
        errors::Reason::kBufferTooSmall);
  }
  EPD_RETURN_IF_ERROR(NotNull(buf, "buf"));
  std::memcpy(buf, text.data(), text.size());
  buf[text.size()] = '\0';
  return absl::OkStatus();
}

absl::Status ToJson(const google::protobuf::Message& message, std::string* out) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  auto status = google::protobuf::util::MessageToJsonString(message, out, options);
  if (!status.ok()) return absl::InternalError(absl::StrCat("JSON: ", status.ToString()));
  return absl::OkStatus();
}

/// A daemon reply (`reply`, or its error) as protobuf JSON into the caller's buffer.
template <typename Message>
absl::Status JsonOut(absl::StatusOr<Message> reply, char* buf, size_t capacity, size_t* length) {
  if (!reply.ok()) return reply.status();
  std::string json;
  EPD_RETURN_IF_ERROR(ToJson(*reply, &json));
  return CopyOutString(json, buf, capacity, length);
}

/// Most epd_join_options_t.num_nodes taken.
constexpr int32_t kMaxNodes = 4096;

/// Copies the caller's node list into `spec` (its strings read up to the length limit only).
absl::Status ReadNodes(const epd_join_options_t& o, v1::GroupSpec* spec) {
  if (o.num_nodes < 0 || o.num_nodes > kMaxNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.num_nodes=", o.num_nodes, " is outside [0, ", kMaxNodes, "]"));
  }
  if (o.num_nodes > 0) EPD_RETURN_IF_ERROR(NotNull(o.nodes, "options.nodes"));
  for (int32_t i = 0; i < o.num_nodes; ++i) {
    const std::string field = absl::StrCat("options.nodes[", i, "].peer_address");
    const char* address = o.nodes[i].peer_address;
    EPD_RETURN_IF_ERROR(NotNull(address, field.c_str()));
    // One byte past the limit is enough to refuse a longer one without reading all of it.
    const size_t length = strnlen(address, internal::kMaxPeerAddressBytes + 1);
    const absl::string_view text(address, length);
    EPD_RETURN_IF_ERROR(internal::CheckRequestText(field, text, internal::kMaxPeerAddressBytes));
    v1::NodeSpec* node = spec->add_nodes();
    node->set_peer_address(std::string(text));
    node->set_num_ranks(o.nodes[i].num_ranks);
  }
  return absl::OkStatus();
}

/// Most ranks one epd_endpoint_update_rank_mask call takes in each list.
constexpr size_t kMaxMaskRanks = 1 << 20;

/// A caller's list of `count` ranks at `ranks` (argument names `arg` / `count_arg`).
absl::StatusOr<std::vector<int32_t>> ReadRanks(const int32_t* ranks, size_t count, const char* arg,
                                               const char* count_arg) {
  if (count > kMaxMaskRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat(count_arg, "=", count, " is more than ", kMaxMaskRanks));
  }
  if (count > 0) EPD_RETURN_IF_ERROR(NotNull(ranks, arg));
  return count == 0 ? std::vector<int32_t>{} : std::vector<int32_t>(ranks, ranks + count);
}

/// A mask call's reply into *out (when not NULL): OUT_OF_RANGE naming the entries needed
/// when the caller's array is too small (epoch and num_masked are still written).
absl::Status RankMaskOut(absl::StatusOr<RankMask> reply, epd_rank_mask_t* out) {
  if (!reply.ok()) return reply.status();
  if (out == nullptr) return absl::OkStatus();
  epd_rank_mask_t c{};
  const size_t size = std::min(out->struct_size, sizeof(c));
  std::memcpy(static_cast<void*>(&c), out, size);  // The caller's array and capacity.
  c.epoch = reply->epoch;
  c.num_masked = static_cast<int32_t>(reply->masked_ranks.size());
  const int32_t capacity = std::max<int32_t>(c.masked_ranks_capacity, 0);
  const bool fits = c.num_masked <= capacity;
  if (c.num_masked > 0 && fits) EPD_RETURN_IF_ERROR(NotNull(c.masked_ranks, "out.masked_ranks"));
  if (fits) std::copy(reply->masked_ranks.begin(), reply->masked_ranks.end(), c.masked_ranks);
  WriteOut(c, out);
  if (!fits) {
    return absl::OutOfRangeError(absl::StrCat("out.masked_ranks_capacity=", c.masked_ranks_capacity,
                                              " is too small: ", c.num_masked,
                                              " ranks are masked"));
  }
  return absl::OkStatus();
}

template <size_t N>
void CopyText(const std::string& text, char (&out)[N]) {
  const size_t n = std::min(text.size(), N - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

}  // namespace
}  // namespace epd::c_api

using epd::c_api::Guard;

extern "C" {

int epd_abi_version(void) { return EPD_ABI_VERSION; }
const char* epd_version_string(void) { return epd::kEpdVersion; }

const char* epd_status_name(int status) {
  static const std::array<std::string, 17> names = [] {
    std::array<std::string, 17> n;
    for (int i = 0; i < 17; ++i) n[i] = absl::StatusCodeToString(static_cast<absl::StatusCode>(i));
    return n;
  }();
  const int i = status;
  return i >= 0 && i < 17 ? names[i].c_str() : "UNKNOWN_CODE";
}

const char* epd_last_error(void) { return epd::c_api::last_error.c_str(); }
int32_t epd_last_error_reason(void) { return epd::c_api::last_error_reason; }
const char* epd_reason_name(int32_t reason) {
  // Catalog names are string literals: NUL-terminated, static storage.
  return epd::errors::ReasonName(static_cast<epd::errors::Reason>(reason)).data();
}

// ---- client ----------------------------------------------------------------------------

epd_status_t epd_client_connect(const epd_client_options_t* options, epd_client_t** out) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(out, "out"));
    *out = nullptr;
    epd_client_options_t o{};
    o.struct_size = sizeof(o);
    if (options != nullptr) EPD_RETURN_IF_ERROR(epd::c_api::ReadArgs(options, "options", &o));
    epd::ClientOptions cpp;
    if (o.socket_path != nullptr) cpp.socket_path = o.socket_path;
    if (o.client_name != nullptr) cpp.client_name = o.client_name;
    if (o.connect_timeout_ms > 0) cpp.connect_timeout = absl::Milliseconds(o.connect_timeout_ms);
    EPD_ASSIGN_OR_RETURN(std::unique_ptr<epd::Client> client, epd::Client::Connect(cpp));
    auto handle = std::make_unique<epd_client>();
    handle->client = std::move(client);
    *out = handle.release();
    return absl::OkStatus();
  });
}

void epd_client_destroy(epd_client_t* client) {
  Guard(__func__, [&] {
    std::unique_ptr<epd_client> owned(client);
    return absl::OkStatus();
  });
}

const char* epd_client_session_id(const epd_client_t* client) {
  return client == nullptr ? nullptr : client->client->session_id().c_str();
}

epd_status_t epd_client_reconnect(epd_client_t* client, int64_t timeout_ms) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(client, "client"));
    return client->client->Reconnect(epd::c_api::Timeout(timeout_ms));
  });
}

epd_status_t epd_client_stats(epd_client_t* client, epd_stats_t* out) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(client, "client"));
    EPD_RETURN_IF_ERROR(epd::c_api::CheckOut(out, "out"));
    EPD_ASSIGN_OR_RETURN(epd::v1::GetStatsResponse stats, client->client->GetStats());
    epd_stats_t c{};
    epd::c_api::CopyText(stats.version(), c.version);
    epd::c_api::CopyText(stats.backend(), c.backend);
    epd::c_api::CopyText(stats.serving_status(), c.serving_status);
    c.mps_active = stats.mps_active() ? 1 : 0;
    c.num_gpus = stats.gpus_size();
    c.num_groups = stats.num_groups();
    c.num_sessions = stats.num_sessions();
    c.uptime_ms = stats.uptime_ms();
    c.ops_completed = stats.ops_completed();
    c.ops_failed = stats.ops_failed();
    c.pid = stats.pid();
    epd::c_api::WriteOut(c, out);
    return absl::OkStatus();
  });
}

epd_status_t epd_client_stats_json(epd_client_t* client, char* buf, size_t capacity,
                                   size_t* length) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(client, "client"));
    return epd::c_api::JsonOut(client->client->GetStats(), buf, capacity, length);
  });
}

epd_status_t epd_client_list_groups_json(epd_client_t* client, char* buf, size_t capacity,
                                         size_t* length) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(client, "client"));
    return epd::c_api::JsonOut(client->client->ListGroups(), buf, capacity, length);
  });
}

epd_status_t epd_client_peer_address(epd_client_t* client, char* buf, size_t capacity,
                                     size_t* length) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(client, "client"));
    EPD_ASSIGN_OR_RETURN(std::string address, client->client->PeerAddress());
    return epd::c_api::CopyOutString(address, buf, capacity, length);
  });
}

epd_status_t epd_client_join(epd_client_t* client, const epd_join_options_t* options,
                             epd_endpoint_t** out) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(out, "out"));
    *out = nullptr;
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(client, "client"));
    epd_join_options_t o;
    EPD_RETURN_IF_ERROR(epd::c_api::ReadArgs(options, "options", &o));
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(o.name, "options.name"));
    if (o.join_secret == nullptr && o.join_secret_len != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.join_secret is NULL with options.join_secret_len=", o.join_secret_len));
    }
    // Checked before the secret is copied: a larger length would read past the caller's buffer.
    if (o.join_secret_len > epd::internal::kMaxJoinSecretBytes) {
      return absl::InvalidArgumentError(absl::StrCat("options.join_secret_len=", o.join_secret_len,
                                                     " is more than ",
                                                     epd::internal::kMaxJoinSecretBytes, " bytes"));
    }
    epd::JoinOptions join;
    join.spec.set_name(o.name);
    join.spec.set_num_ranks(o.num_ranks);
    join.spec.set_num_experts(o.num_experts);
    join.spec.set_hidden(o.hidden);
    join.spec.set_num_topk(o.num_topk);
    join.spec.set_max_tokens_per_rank(o.max_tokens_per_rank);
    join.spec.set_ll_max_tokens_per_rank(o.ll_max_tokens_per_rank);
    join.spec.set_use_fp8(o.use_fp8 != 0);
    if (!epd::v1::RankFailurePolicy_IsValid(o.on_rank_failure)) {
      return absl::InvalidArgumentError(absl::StrCat("options.on_rank_failure=", o.on_rank_failure,
                                                     " is not an epd_rank_failure_t"));
    }
    join.spec.set_on_rank_failure(static_cast<epd::v1::RankFailurePolicy>(o.on_rank_failure));
    EPD_RETURN_IF_ERROR(epd::c_api::ReadNodes(o, &join.spec));
    if (o.transport != nullptr) {
      // One byte past the longest transport name is enough to refuse a longer one.
      constexpr size_t kMaxTransportBytes = 16;
      const absl::string_view transport(o.transport, strnlen(o.transport, kMaxTransportBytes + 1));
      EPD_RETURN_IF_ERROR(
          epd::internal::CheckRequestText("options.transport", transport, kMaxTransportBytes));
      join.spec.set_transport(std::string(transport));
    }
    join.rank = o.rank;
    if (o.gpu_uuid != nullptr) join.gpu_uuid = o.gpu_uuid;
    if (!epd::v1::LaunchMode_IsValid(o.launch_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.launch_mode=", static_cast<int>(o.launch_mode), " is not an epd_launch_mode_t"));
    }
    join.launch_mode = static_cast<epd::v1::LaunchMode>(o.launch_mode);
    if (o.join_secret != nullptr) {
      join.join_secret.assign(static_cast<const char*>(o.join_secret), o.join_secret_len);
    }
    EPD_ASSIGN_OR_RETURN(std::unique_ptr<epd::Endpoint> endpoint, client->client->Join(join));
    *out = epd::c_api::MakeEndpointHandle(std::move(endpoint)).release();
    return absl::OkStatus();
  });
}

// ---- endpoint --------------------------------------------------------------------------

epd_status_t epd_endpoint_info(const epd_endpoint_t* endpoint, epd_endpoint_info_t* out) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(endpoint, "endpoint"));
    EPD_RETURN_IF_ERROR(epd::c_api::CheckOut(out, "out"));
    const epd::v1::EndpointInfo& info = endpoint->endpoint->info();
    const epd::v1::GroupSpec& spec = endpoint->endpoint->spec();
    epd_endpoint_info_t c{};
    c.endpoint_id = info.endpoint_id();
    c.rank = endpoint->endpoint->rank();
    c.num_ranks = spec.num_ranks();
    c.num_experts = spec.num_experts();
    c.hidden = spec.hidden();
    c.num_topk = spec.num_topk();
    c.max_tokens_per_rank = spec.max_tokens_per_rank();
    c.ll_max_tokens_per_rank = spec.ll_max_tokens_per_rank();
    c.use_fp8 = spec.use_fp8() ? 1 : 0;
    c.launch_mode = static_cast<int32_t>(info.launch_mode());
    c.op_timeout_ms = info.op_timeout_ms();
    c.cuda = info.backend() == "cuda" ? 1 : 0;
    epd::c_api::CopyText(spec.name(), c.group);
    epd::c_api::CopyText(info.gpu_uuid(), c.gpu_uuid);
    epd::c_api::WriteOut(c, out);
    return absl::OkStatus();
  });
}

epd_status_t epd_endpoint_leave(epd_endpoint_t* endpoint) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(endpoint, "endpoint"));
    return endpoint->endpoint->Leave();
  });
}

void epd_endpoint_destroy(epd_endpoint_t* endpoint) {
  Guard(__func__, [&] {
    std::unique_ptr<epd_endpoint> owned(endpoint);
    return absl::OkStatus();
  });
}

static epd_status_t RegionView(const char* function, const epd_endpoint_t* endpoint,
                               const epd::TensorView epd_endpoint::*view, DLTensor* out) {
  return Guard(function, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(endpoint, "endpoint"));
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(out, "out"));
    // An endpoint is driven by one thread at a time: the refresh after a reconnect is too.
    epd_endpoint& handle = const_cast<epd_endpoint&>(*endpoint);
    if (handle.regions_of != &handle.endpoint->impl()) {
      epd::c_api::RefreshRegions(handle);
    }
    *out = (endpoint->*view).dl();
    return absl::OkStatus();
  });
}

epd_status_t epd_low_latency_combine_input(const epd_endpoint_t* endpoint, DLTensor* out) {
  return RegionView(__func__, endpoint, &epd_endpoint::ll_combine_input, out);
}

epd_status_t epd_low_latency_dispatch_input(const epd_endpoint_t* endpoint, DLTensor* out) {
  return RegionView(__func__, endpoint, &epd_endpoint::ll_dispatch_input, out);
}

// ---- rank masking ----------------------------------------------------------------------

epd_status_t epd_endpoint_update_rank_mask(epd_endpoint_t* endpoint, const int32_t* mask,
                                           size_t num_mask, const int32_t* unmask,
                                           size_t num_unmask, epd_rank_mask_t* out) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(endpoint, "endpoint"));
    if (out != nullptr) EPD_RETURN_IF_ERROR(epd::c_api::CheckOut(out, "out"));
    EPD_ASSIGN_OR_RETURN(std::vector<int32_t> masked,
                         epd::c_api::ReadRanks(mask, num_mask, "mask", "num_mask"));
    EPD_ASSIGN_OR_RETURN(std::vector<int32_t> unmasked,
                         epd::c_api::ReadRanks(unmask, num_unmask, "unmask", "num_unmask"));
    return epd::c_api::RankMaskOut(endpoint->endpoint->UpdateRankMask(masked, unmasked), out);
  });
}

epd_status_t epd_endpoint_query_rank_mask(epd_endpoint_t* endpoint, epd_rank_mask_t* out) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(endpoint, "endpoint"));
    EPD_RETURN_IF_ERROR(epd::c_api::CheckOut(out, "out"));
    return epd::c_api::RankMaskOut(endpoint->endpoint->QueryRankMask(), out);
  });
}

epd_status_t epd_endpoint_clean_rank_mask(epd_endpoint_t* endpoint, epd_rank_mask_t* out) {
  return Guard(__func__, [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(epd::c_api::NotNull(endpoint, "endpoint"));
    if (out != nullptr) EPD_RETURN_IF_ERROR(epd::c_api::CheckOut(out, "out"));
    return epd::c_api::RankMaskOut(endpoint->endpoint->CleanRankMask(), out);
  });
}

}  // extern "C"
