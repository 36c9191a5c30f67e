#include "daemon/core/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/errors/reason.h"
#include "common/os/scoped_fd.h"
#include "common/status_macros.h"
#include "daemon/control/spec_validation.h"
#include "daemon/core/logging.h"
#include "daemon/transport/fault/fault_transport.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

namespace epd::config_internal {

/// The value of one epd flag and whether the command line gave it. absl::ParseCommandLine
/// calls AbslParseFlag only for a flag it finds in argv, so `given` tells "--socket="
/// (given, empty) from no --socket at all, and the flag's default can be the real one, which
/// --help shows (std::optional flags showed "default: ;"). The default is never applied
/// from here: an absent flag leaves the config file's value, or FillDaemonConfigDefaults's.
template <typename T>
struct CommandLineValue {
  T value{};
  bool given = false;
};

template <typename T>
bool AbslParseFlag(absl::string_view text, CommandLineValue<T>* flag, std::string* error) {
  if (!absl::ParseFlag<T>(text, &flag->value, error)) {
    // absl leaves `error` empty for these types; say what a value looks like.
    if (error->empty()) {
      if constexpr (std::is_same_v<T, absl::Duration>) {
        *error = "need a number with its unit, e.g. 10s, 2500ms or 1m";
      } else if constexpr (std::is_same_v<T, uint32_t>) {
        *error = "need a whole number from 0 to 4294967295";
      } else if constexpr (std::is_same_v<T, uint64_t>) {
        *error = "need a whole number from 0 to 18446744073709551615";
      }
    }
    return false;
  }
  flag->given = true;
  return true;
}

/// Text values are quoted, as --help shows plain string flags: `default: "";` rather
/// than `default: ;`.
template <typename T>
std::string AbslUnparseFlag(const CommandLineValue<T>& flag) {
  std::string text = absl::UnparseFlag<T>(flag.value);
  if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::vector<std::string>>) {
    return absl::StrCat("\"", text, "\"");
  }
  return text;
}

using StringFlag = CommandLineValue<std::string>;
using Uint32Flag = CommandLineValue<uint32_t>;
using Uint64Flag = CommandLineValue<uint64_t>;
using DurationFlag = CommandLineValue<absl::Duration>;
using StringListFlag = CommandLineValue<std::vector<std::string>>;

}  // namespace epd::config_internal

using epd::config_internal::DurationFlag;
using epd::config_internal::StringFlag;
using epd::config_internal::StringListFlag;
using epd::config_internal::Uint32Flag;
using epd::config_internal::Uint64Flag;

// Every default below is the DaemonConfig default (shown by --help); a flag overrides the
// config file only when given on the command line.
ABSL_FLAG(StringFlag, config, StringFlag{""},
          "Text-format epd.v1.DaemonConfig to load first; the flags given override its "
          "fields (\"\" = no file: flags and defaults only).");
ABSL_FLAG(StringFlag, socket, StringFlag{epd::kDefaultSocketPath},
          "socket_path: unix socket of the Control and Health services, \"/path\" or "
          "\"unix:///path\". A missing parent directory is created (and logged at info "
          "level); under systemd, RuntimeDirectory=epd makes /run/epd.");
ABSL_FLAG(StringFlag, socket_mode, StringFlag{epd::kDefaultSocketMode},
          "socket_mode: octal file mode of the socket.");
ABSL_FLAG(StringFlag, socket_group, StringFlag{""},
          "socket_group: existing group owning the socket and the shm regions (\"\" = the "
          "daemon's own group).");
ABSL_FLAG(StringFlag, listen, StringFlag{""},
          "listen: optional TCP listener host:port for grpc.health.v1 probes only (Control "
          "stays on the unix socket); \"\" or \"off\" = no listener, also turning off one the "
          "config file sets.");
ABSL_FLAG(StringFlag, backend, StringFlag{"auto"},
          "backend: data-plane backend: auto (CUDA when a GPU is usable, else host), cuda, "
          "host.");
ABSL_FLAG(StringFlag, log_level, StringFlag{epd::kDefaultLogLevel},
          "log_level: trace, debug, info, warn, error, critical or off, optionally followed "
          "by per-subsystem levels, e.g. info,epd.engine=trace,epd.control=debug (loggers: "
          "epd.control, epd.registry, epd.engine, epd.gpu, epd.daemon, epd.config, epd.peer, "
          "epd.transport).");
ABSL_FLAG(DurationFlag, op_timeout, DurationFlag{absl::Milliseconds(epd::kDefaultOpTimeoutMs)},
          "op_timeout_ms: bound on every wait of a data-plane op, a whole number of "
          "milliseconds, e.g. 10s or 2500ms.");
ABSL_FLAG(StringFlag, shm_mode, StringFlag{""},
          "shm_mode: deprecated and ignored (start-up warns): endpoint regions are sealed "
          "memfds with no file mode, handed only to the process that joined.");
ABSL_FLAG(Uint32Flag, engine_idle_us, Uint32Flag{epd::kDefaultEngineIdleUs},
          "engine_idle_us: an engine keeps polling this many microseconds after its last "
          "request, then sleeps until a client rings it; 0 = sleep as soon as its rings are "
          "empty (no spinning: least CPU, each op that finds it asleep pays a wake-up).");
ABSL_FLAG(Uint32Flag, host_threads, Uint32Flag{0},
          "host_threads: threads the host backend uses per op; 0 = the hardware concurrency.");
ABSL_FLAG(StringFlag, cuda_op_graphs, StringFlag{"off"},
          "cuda_op_graphs: CUDA backend: launch each daemon-launched op that a per-GPU op graph "
          "covers (low-latency ops, every rank stream-ordered and unmasked, under MPS) as one "
          "CUDA graph launch per GPU: on or off. Experimental: keep off (docs/CUDA_BACKEND.md).");
ABSL_FLAG(StringFlag, cuda_fused_launch, StringFlag{"on"},
          "cuda_fused_launch: CUDA backend: launch each daemon-launched low-latency op (every "
          "rank stream-ordered and unmasked, under MPS) as one fused kernel per GPU for all the "
          "group's ranks there instead of each rank's launches: on or off.");
ABSL_FLAG(Uint32Flag, max_request_bytes, Uint32Flag{epd::kDefaultMaxRequestBytes},
          "max_request_bytes: largest gRPC message accepted, in bytes, from 65536 to "
          "2147483647 (gRPC's limit is an int).");
ABSL_FLAG(Uint32Flag, max_groups, Uint32Flag{epd::kDefaultMaxGroups},
          "max_groups: maximum number of live groups.");
ABSL_FLAG(Uint32Flag, max_groups_per_uid, Uint32Flag{epd::kDefaultMaxGroupsPerUid},
          "max_groups_per_uid: groups one uid may own (first-joined) at a time, root "
          "included; 0 = no limit.");
ABSL_FLAG(Uint32Flag, max_endpoints_per_uid, Uint32Flag{epd::kDefaultMaxEndpointsPerUid},
          "max_endpoints_per_uid: endpoints (joined ranks) one uid's sessions may hold at a "
          "time, root included; 0 = no limit.");
ABSL_FLAG(Uint64Flag, max_endpoint_bytes_per_uid, Uint64Flag{0},
          "max_endpoint_bytes_per_uid: bytes of endpoint buffers (GPU memory, or shared "
          "memory on the host backend) one uid's sessions may hold at a time, root included; "
          "0 = no limit.");
ABSL_FLAG(Uint32Flag, max_sessions_per_uid, Uint32Flag{epd::kDefaultMaxSessionsPerUid},
          "max_sessions_per_uid: open sessions (Session streams) one uid may hold at a time, "
          "root included; 0 = no limit.");
ABSL_FLAG(Uint32Flag, max_connections_per_uid, Uint32Flag{epd::kDefaultMaxConnectionsPerUid},
          "max_connections_per_uid: live connections to the unix socket one uid may hold at a "
          "time (more are closed at once); root and epd's own uid are exempt; 0 = no limit.");
ABSL_FLAG(StringListFlag, gpu_uuids, StringListFlag{},
          "gpu_uuids: comma-separated GPU UUIDs the daemon may use (\"\" = every visible "
          "GPU).");
ABSL_FLAG(StringFlag, peer_listen, StringFlag{""},
          "peer_listen: TCP listener host:port of the Peer service (daemon to daemon, for "
          "groups that span nodes); \"\" or \"off\" = none (such groups are refused). "
          "Needs --peer_secret_file.");
ABSL_FLAG(StringFlag, peer_advertise, StringFlag{""},
          "peer_advertise: the host:port other daemons reach this one at, as specs name it "
          "(\"\" = peer_listen, which must then not be a wildcard address).");
ABSL_FLAG(StringFlag, peer_secret_file, StringFlag{""},
          "peer_secret_file: file with the shared secret of the cluster's daemons (at least "
          "16 bytes; not readable by group or others).");
ABSL_FLAG(StringFlag, peer_tls_cert_file, StringFlag{""},
          "peer_tls_cert_file: PEM certificate of this daemon for mutual TLS between daemons "
          "(with --peer_tls_key_file and --peer_tls_ca_file).");
ABSL_FLAG(StringFlag, peer_tls_key_file, StringFlag{""},
          "peer_tls_key_file: PEM private key of --peer_tls_cert_file.");
ABSL_FLAG(StringFlag, peer_tls_ca_file, StringFlag{""},
          "peer_tls_ca_file: PEM CA certificate that signs every daemon's certificate.");
ABSL_FLAG(Uint32Flag, peer_heartbeat_ms, Uint32Flag{epd::kDefaultPeerHeartbeatMs},
          "peer_heartbeat_ms: liveness probe interval between daemons, in ms (at least 10); "
          "a peer silent for 3 intervals is lost.");
ABSL_FLAG(StringFlag, transport, StringFlag{epd::kDefaultTransport},
          "transport: data transport between daemons for groups whose spec names none: tcp "
          "or rdma (start-up fails when rdma cannot run here).");
ABSL_FLAG(StringFlag, tcp_listen, StringFlag{""},
          "tcp_listen: TCP transport's listener host:port (\"\" = peer_listen's host, any "
          "free port).");
ABSL_FLAG(Uint32Flag, tcp_connections_per_peer, Uint32Flag{epd::kDefaultTcpConnectionsPerPeer},
          "tcp_connections_per_peer: TCP transport connections per peer per group, 1 to 16.");
ABSL_FLAG(StringFlag, rdma_devices, StringFlag{""},
          "rdma.devices: RDMA devices and ports epd may use, comma-separated device or "
          "device:port (\"mlx5_0,mlx5_1:2\"); \"\" = every active port.");
ABSL_FLAG(Uint32Flag, rdma_gid_index, Uint32Flag{0},
          "rdma.gid_index: GID table index (0 to 255); not given = the first RoCE v2 GID with "
          "an IPv4 address on RoCE ports, 0 on InfiniBand.");
ABSL_FLAG(Uint32Flag, rdma_service_level, Uint32Flag{0},
          "rdma.service_level: InfiniBand SL / RoCE priority, 0 to 15.");
ABSL_FLAG(Uint32Flag, rdma_traffic_class, Uint32Flag{0},
          "rdma.traffic_class: RoCE traffic class (DSCP << 2 | ECN), 0 to 255.");
ABSL_FLAG(Uint32Flag, rdma_qps_per_peer, Uint32Flag{epd::kDefaultRdmaQpsPerPeer},
          "rdma.qps_per_peer: RDMA queue pairs per peer node per group, 1 to 16.");
ABSL_FLAG(StringFlag, rdma_gpudirect, StringFlag{"auto"},
          "rdma.gpudirect: register GPU memory with the NIC (dmabuf): auto, on or off.");
ABSL_FLAG(StringFlag, metrics_listen, StringFlag{""},
          "metrics_listen: HTTP listener host:port serving Prometheus metrics at /metrics, "
          "e.g. 127.0.0.1:9464; \"\" or \"off\" = none (the default), also turning off one "
          "the config file sets.");
ABSL_FLAG(StringFlag, metrics_state_file, StringFlag{""},
          "metrics_state_file: file counting epd's starts for epd_restarts_total (\"\" = "
          "epd.starts beside the socket; \"off\" = none).");
ABSL_FLAG(StringFlag, testing_transport_faults, StringFlag{""},
          "testing_transport_faults: for tests only: a fault plan (drop, delay, reset, "
          "partition) wrapped around the transport, e.g. \"delay_ms=5;partition=0|1\".");
ABSL_FLAG(StringFlag, audit_log, StringFlag{""},
          "audit_log: one JSON line per control action: an absolute file path (O_APPEND; "
          "reopened when rotated away), \"journal\" (stderr, prefixed EPD_AUDIT) or \"\" "
          "(off).");

namespace epd {
namespace {

/// Collects the parser's messages with the offending source line.
class CollectingErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  CollectingErrorCollector(absl::string_view text, absl::string_view source)
      : lines_(absl::StrSplit(text, '\n')), source_(source) {}

  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    // Some errors (e.g. an unknown enum value) are reported at the start of the token after
    // the offending one; point at the last non-blank line at or before it.
    while (line > 0 && (static_cast<size_t>(line) >= lines_.size() ||
                        absl::StripAsciiWhitespace(lines_[line]).empty())) {
      --line;
      column = static_cast<int>(lines_[line].size());
    }
    std::string where = absl::StrCat(source_, ":", line + 1, ":", column + 1, ": ", message);
    if (line >= 0 && static_cast<size_t>(line) < lines_.size()) {
      absl::StrAppend(&where, " (in: `", absl::StripAsciiWhitespace(lines_[line]), "`)");
    }
    errors_.push_back(std::move(where));
  }
  void AddWarning(int line, google::protobuf::io::ColumnNumber column,
                  const std::string& message) override {
    AddError(line, column, message);
  }
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::vector<std::string> lines_;
  std::string source_;
  std::vector<std::string> errors_;
};

absl::Status CheckListen(absl::string_view listen, absl::string_view field = "listen") {
  if (listen.empty()) return absl::OkStatus();
  size_t colon = listen.rfind(':');
  uint32_t port = 0;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port > 65535) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(field, ": \"", listen,
                                                "\" is not host:port (e.g. \"0.0.0.0:50051\", "
                                                "\"[::1]:0\")")),
        errors::Reason::kConfigInvalid);
  }
  return absl::OkStatus();
}

bool IsWildcardListen(absl::string_view listen) {
  absl::string_view host = listen.substr(0, listen.rfind(':'));
  return host == "0.0.0.0" || host == "[::]" || host == "::" || host == "[::0]" || host == "*";
}

absl::Status CheckRange(absl::string_view field, uint32_t value, uint32_t lo, uint32_t hi) {
  if (value < lo || value > hi) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  field, ": ", value, " is outside [", lo, ", ", hi, "]")),
                              errors::Reason::kConfigInvalid);
  }
  return absl::OkStatus();
}

/// The longest RDMA device name (the kernel's IB_DEVICE_NAME_MAX is 64 with the NUL).
constexpr size_t kMaxRdmaDeviceNameBytes = 63;
/// What IsDeviceName accepts, for error messages.
constexpr char kDeviceNameRule[] = "letters, digits, '_', '-', '.', 1 to 63 characters";

/// An RDMA device name as ibv_devices prints it (kDeviceNameRule).
bool IsDeviceName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxRdmaDeviceNameBytes) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') {
      return false;
    }
  }
  return true;
}

/// rdma.* of a filled config (ranges as documented in config.proto RdmaConfig).
absl::Status ValidateRdmaConfig(const v1::RdmaConfig& rdma) {
  for (int i = 0; i < rdma.devices_size(); ++i) {
    const v1::RdmaDevicePort& d = rdma.devices(i);
    if (!IsDeviceName(d.device())) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    "rdma.devices[", i, "].device: \"", absl::CEscape(d.device()),
                                    "\" is not an RDMA device name (", kDeviceNameRule,
                                    ", e.g. \"mlx5_0\", as ibv_devices lists)")),
                                errors::Reason::kConfigInvalid);
    }
    EPD_RETURN_IF_ERROR(
        CheckRange(absl::StrCat("rdma.devices[", i, "].port"), d.port(), 0, kMaxRdmaPort));
    for (int j = 0; j < i; ++j) {
      const v1::RdmaDevicePort& e = rdma.devices(j);
      if (e.device() == d.device() && std::max(e.port(), 1u) == std::max(d.port(), 1u)) {
        return errors::WithReason(
            absl::InvalidArgumentError(absl::StrCat("rdma.devices[", i, "]: ", d.device(), ":",
                                                    std::max(d.port(), 1u),
                                                    " is listed twice (also at [", j, "])")),
            errors::Reason::kConfigInvalid);
      }
    }
  }
  if (rdma.has_gid_index()) {
    EPD_RETURN_IF_ERROR(CheckRange("rdma.gid_index", rdma.gid_index(), 0, kMaxRdmaGidIndex));
  }
  EPD_RETURN_IF_ERROR(CheckRange("rdma.service_level", rdma.service_level(), 0, 15));
  EPD_RETURN_IF_ERROR(CheckRange("rdma.traffic_class", rdma.traffic_class(), 0, 255));
  EPD_RETURN_IF_ERROR(CheckRange("rdma.timeout", rdma.timeout(), 1, 31));
  EPD_RETURN_IF_ERROR(CheckRange("rdma.retry_count", rdma.retry_count(), 0, 7));
  EPD_RETURN_IF_ERROR(CheckRange("rdma.rnr_retry", rdma.rnr_retry(), 0, 7));
  EPD_RETURN_IF_ERROR(CheckRange("rdma.qps_per_peer", rdma.qps_per_peer(), 1, kMaxRdmaQpsPerPeer));
  EPD_RETURN_IF_ERROR(
      CheckRange("rdma.max_send_wr", rdma.max_send_wr(), kMinRdmaMaxSendWr, kMaxRdmaMaxSendWr));
  EPD_RETURN_IF_ERROR(
      CheckRange("rdma.cq_depth", rdma.cq_depth(), kMinRdmaCqDepth, kMaxRdmaCqDepth));
  if (rdma.has_mtu()) {
    const uint32_t m = rdma.mtu();
    if (m != 256 && m != 512 && m != 1024 && m != 2048 && m != 4096) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("rdma.mtu: ", m,
                           " is not a path MTU (256, 512, 1024, 2048 or 4096; absent = the "
                           "port's active MTU)")),
          errors::Reason::kConfigInvalid);
    }
  }
  if (rdma.gpudirect() != "auto" && rdma.gpudirect() != "on" && rdma.gpudirect() != "off") {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "rdma.gpudirect: \"", absl::CEscape(rdma.gpudirect()), "\" is not auto, on or off")),
        errors::Reason::kConfigInvalid);
  }
  return absl::OkStatus();
}

/// peer_* / transport / tcp_* fields of a filled config.
absl::Status ValidatePeerConfig(const v1::DaemonConfig& config) {
  EPD_RETURN_IF_ERROR(CheckListen(config.peer_listen(), "peer_listen"));
  EPD_RETURN_IF_ERROR(CheckListen(config.tcp_listen(), "tcp_listen"));
  const bool on = !config.peer_listen().empty();
  if (!config.peer_advertise().empty()) {
    if (!on) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat("peer_advertise: \"", config.peer_advertise(),
                                                  "\" is set but peer_listen is not")),
          errors::Reason::kConfigInvalid);
    }
    if (!PeerAddressIsWellFormed(config.peer_advertise()) ||
        IsWildcardListen(config.peer_advertise())) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              "peer_advertise: \"", config.peer_advertise(),
              "\" is not a host:port other daemons can reach (a name or address, port 1-65535)")),
          errors::Reason::kConfigInvalid);
    }
  }
  if (on && config.peer_advertise().empty() && IsWildcardListen(config.peer_listen())) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "peer_listen: \"", config.peer_listen(),
            "\" is a wildcard address, which other daemons cannot reach: set peer_advertise to "
            "this node's address (e.g. \"10.0.0.2:7100\")")),
        errors::Reason::kConfigInvalid);
  }
  if (on && config.peer_secret_file().empty()) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat("peer_secret_file: required with peer_listen \"", config.peer_listen(),
                         "\" (the shared secret every daemon of the cluster presents)")),
        errors::Reason::kConfigInvalid);
  }
  const int tls = !config.peer_tls_cert_file().empty() + !config.peer_tls_key_file().empty() +
                  !config.peer_tls_ca_file().empty();
  if (tls != 0 && tls != 3) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "peer_tls_cert_file, peer_tls_key_file, peer_tls_ca_file: give all three or none (",
            tls, " given)")),
        errors::Reason::kConfigInvalid);
  }
  if (config.peer_heartbeat_ms() < kMinPeerHeartbeatMs) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat("peer_heartbeat_ms: ", config.peer_heartbeat_ms(),
                                                " is below ", kMinPeerHeartbeatMs)),
        errors::Reason::kConfigInvalid);
  }
  if (config.transport() != "tcp" && config.transport() != "rdma") {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat("transport: \"", config.transport(),
                                                "\" is not a transport (tcp or rdma)")),
        errors::Reason::kConfigInvalid);
  }
  EPD_RETURN_IF_ERROR(ValidateRdmaConfig(config.rdma()));
  if (!config.audit_log().empty() && config.audit_log() != "journal" &&
      config.audit_log().front() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("audit_log: \"", config.audit_log(),
                     "\" is neither an absolute path nor \"journal\" (or \"\" for no audit log)"));
  }
  if (!config.testing_transport_faults().empty()) {
    absl::StatusOr<transport::FaultPlan> plan =
        transport::ParseFaultPlan(config.testing_transport_faults());
    if (!plan.ok()) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat("testing_transport_faults: \"",
                                                  config.testing_transport_faults(),
                                                  "\": ", plan.status().message())),
          errors::Reason::kConfigInvalid);
    }
  }
  if (config.tcp_connections_per_peer() < 1 ||
      config.tcp_connections_per_peer() > kMaxTcpConnectionsPerPeer) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "tcp_connections_per_peer: ", config.tcp_connections_per_peer(),
                                  " is outside [1, ", kMaxTcpConnectionsPerPeer, "]")),
                              errors::Reason::kConfigInvalid);
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

/// The flag's value when the command line gave it, else nullopt.
template <typename T>
std::optional<T> GivenValue(const absl::Flag<config_internal::CommandLineValue<T>>& flag) {
  config_internal::CommandLineValue<T> v = absl::GetFlag(flag);
  if (!v.given) return std::nullopt;
  return std::move(v.value);
}

}  // namespace

absl::StatusOr<std::vector<v1::RdmaDevicePort>> ParseRdmaDevices(absl::string_view text,
                                                                 absl::string_view field) {
  std::vector<v1::RdmaDevicePort> devices;
  if (absl::StripAsciiWhitespace(text).empty()) return devices;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    v1::RdmaDevicePort d;
    const size_t colon = item.find(':');
    absl::string_view name = item.substr(0, colon);
    uint32_t port = 1;
    if (colon != absl::string_view::npos &&
        (!absl::SimpleAtoi(item.substr(colon + 1), &port) || port == 0 || port > kMaxRdmaPort)) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    field, ": \"", item, "\": the port after ':' must be 1 to ",
                                    kMaxRdmaPort, " (\"mlx5_0\" or \"mlx5_0:2\")")),
                                errors::Reason::kConfigInvalid);
    }
    if (!IsDeviceName(name)) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              field, ": \"", absl::CEscape(item),
              "\" is not device or device:port (\"mlx5_0\", \"mlx5_0:2\"; a device name has ",
              kDeviceNameRule, ")")),
          errors::Reason::kConfigInvalid);
    }
    d.set_device(std::string(name));
    d.set_port(port);
    devices.push_back(std::move(d));
  }
  return devices;
}

ConfigFlags ConfigFlagsFromCommandLine() {
  ConfigFlags f;
  f.config_path = GivenValue(FLAGS_config);
  f.socket = GivenValue(FLAGS_socket);
  f.socket_mode = GivenValue(FLAGS_socket_mode);
  f.socket_group = GivenValue(FLAGS_socket_group);
  f.listen = GivenValue(FLAGS_listen);
  f.backend = GivenValue(FLAGS_backend);
  f.log_level = GivenValue(FLAGS_log_level);
  f.op_timeout = GivenValue(FLAGS_op_timeout);
  f.shm_mode = GivenValue(FLAGS_shm_mode);
  f.engine_idle_us = GivenValue(FLAGS_engine_idle_us);
  f.host_threads = GivenValue(FLAGS_host_threads);
  f.cuda_op_graphs = GivenValue(FLAGS_cuda_op_graphs);
  f.cuda_fused_launch = GivenValue(FLAGS_cuda_fused_launch);
  f.max_request_bytes = GivenValue(FLAGS_max_request_bytes);
  f.max_groups = GivenValue(FLAGS_max_groups);
  f.max_groups_per_uid = GivenValue(FLAGS_max_groups_per_uid);
  f.max_endpoints_per_uid = GivenValue(FLAGS_max_endpoints_per_uid);
  f.max_endpoint_bytes_per_uid = GivenValue(FLAGS_max_endpoint_bytes_per_uid);
  f.max_sessions_per_uid = GivenValue(FLAGS_max_sessions_per_uid);
  f.max_connections_per_uid = GivenValue(FLAGS_max_connections_per_uid);
  f.gpu_uuids = GivenValue(FLAGS_gpu_uuids);
  f.peer_listen = GivenValue(FLAGS_peer_listen);
  f.peer_advertise = GivenValue(FLAGS_peer_advertise);
  f.peer_secret_file = GivenValue(FLAGS_peer_secret_file);
  f.peer_tls_cert_file = GivenValue(FLAGS_peer_tls_cert_file);
  f.peer_tls_key_file = GivenValue(FLAGS_peer_tls_key_file);
  f.peer_tls_ca_file = GivenValue(FLAGS_peer_tls_ca_file);
  f.peer_heartbeat_ms = GivenValue(FLAGS_peer_heartbeat_ms);
  f.transport = GivenValue(FLAGS_transport);
  f.tcp_listen = GivenValue(FLAGS_tcp_listen);
  f.tcp_connections_per_peer = GivenValue(FLAGS_tcp_connections_per_peer);
  f.testing_transport_faults = GivenValue(FLAGS_testing_transport_faults);
  f.metrics_listen = GivenValue(FLAGS_metrics_listen);
  f.metrics_state_file = GivenValue(FLAGS_metrics_state_file);
  f.rdma_devices = GivenValue(FLAGS_rdma_devices);
  f.rdma_gid_index = GivenValue(FLAGS_rdma_gid_index);
  f.rdma_service_level = GivenValue(FLAGS_rdma_service_level);
  f.rdma_traffic_class = GivenValue(FLAGS_rdma_traffic_class);
  f.rdma_qps_per_peer = GivenValue(FLAGS_rdma_qps_per_peer);
  f.rdma_gpudirect = GivenValue(FLAGS_rdma_gpudirect);
  f.audit_log = GivenValue(FLAGS_audit_log);
  return f;
}

absl::StatusOr<v1::DaemonConfig> ParseDaemonConfig(absl::string_view text,
                                                   absl::string_view source) {
  v1::DaemonConfig config;
  CollectingErrorCollector collector(text, source);
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&collector);
  // Unknown fields and enum values are errors (the parser's default); say so explicitly.
  parser.AllowUnknownField(false);
  parser.AllowUnknownExtension(false);
  if (!parser.ParseFromString(std::string(text), &config)) {
    std::string message = collector.errors().empty()
                              ? absl::StrCat(source, ": not a text-format epd.v1.DaemonConfig")
                              : absl::StrJoin(collector.errors(), "; ");
    return errors::WithReason(absl::InvalidArgumentError(message), errors::Reason::kConfigInvalid);
  }
  return config;
}

absl::StatusOr<v1::DaemonConfig> LoadDaemonConfigFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "--config: \"", path, "\" is not a regular file (a text-format DaemonConfig)")),
        errors::Reason::kConfigInvalid);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    int err = errno;
    std::string message =
        absl::StrCat("--config: cannot read \"", path, "\": ", std::strerror(err));
    if (err == EACCES) {
      return errors::WithReason(absl::PermissionDeniedError(message),
                                errors::Reason::kConfigInvalid);
    }
    return errors::WithReason(absl::NotFoundError(message), errors::Reason::kConfigInvalid);
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseDaemonConfig(buffer.str(), path);
}

absl::Status ApplyConfigFlags(const ConfigFlags& flags, v1::DaemonConfig* config) {
  // Given empty ("--socket="), these would read as absent and silently take the config
  // file's value or the default: refuse instead. (--socket_group= and --listen= are
  // meaningful empty: the daemon's own group, no listener.)
  for (const auto& [name, field, value, default_value] :
       {std::tuple<const char*, const char*, const std::optional<std::string>*, const char*>{
            "socket", "socket_path", &flags.socket, kDefaultSocketPath},
        {"socket_mode", "socket_mode", &flags.socket_mode, kDefaultSocketMode},
        {"log_level", "log_level", &flags.log_level, kDefaultLogLevel}}) {
    if (value->has_value() && (*value)->empty()) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    "--", name,
                                    ": \"\" (given empty) is not a value; give one, or leave "
                                    "the flag out for the config file's ",
                                    field, " or the default \"", default_value, "\"")),
                                errors::Reason::kConfigInvalid);
    }
  }
  if (flags.socket) config->set_socket_path(*flags.socket);
  if (flags.socket_mode) config->set_socket_mode(*flags.socket_mode);
  if (flags.socket_group) config->set_socket_group(*flags.socket_group);
  // "--listen=" and "--listen=off" both turn off a listener the config file sets.
  if (flags.listen) config->set_listen(*flags.listen == "off" ? "" : *flags.listen);
  if (flags.backend) {
    std::string b = absl::AsciiStrToLower(*flags.backend);
    if (b == "auto") {
      config->set_backend(v1::BACKEND_AUTO);
    } else if (b == "cuda") {
      config->set_backend(v1::BACKEND_CUDA);
    } else if (b == "host") {
      config->set_backend(v1::BACKEND_HOST);
    } else {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("--backend: \"", *flags.backend, "\" is not one of auto, cuda, host")),
          errors::Reason::kConfigInvalid);
    }
  }
  if (flags.log_level) config->set_log_level(*flags.log_level);
  if (flags.op_timeout) {
    int64_t ms = absl::ToInt64Milliseconds(*flags.op_timeout);
    if (ms < 1 || ms > UINT32_MAX) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    "--op_timeout: ", absl::FormatDuration(*flags.op_timeout),
                                    " is out of range [1ms, ", UINT32_MAX, "ms]")),
                                errors::Reason::kConfigInvalid);
    }
    if (*flags.op_timeout != absl::Milliseconds(ms)) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    "--op_timeout: ", absl::FormatDuration(*flags.op_timeout),
                                    " is not a whole number of milliseconds (the config's unit)")),
                                errors::Reason::kConfigInvalid);
    }
    config->set_op_timeout_ms(static_cast<uint32_t>(ms));
  }
  if (flags.shm_mode) config->set_shm_mode(*flags.shm_mode);
  if (flags.engine_idle_us) config->set_engine_idle_us(*flags.engine_idle_us);
  if (flags.host_threads) config->set_host_threads(*flags.host_threads);
  if (flags.cuda_op_graphs)
    config->set_cuda_op_graphs(absl::AsciiStrToLower(*flags.cuda_op_graphs));
  if (flags.cuda_fused_launch)
    config->set_cuda_fused_launch(absl::AsciiStrToLower(*flags.cuda_fused_launch));
  if (flags.max_request_bytes) config->set_max_request_bytes(*flags.max_request_bytes);
  if (flags.max_groups) {
    // Checked here: a 0 in the config would read as "absent" and take the default.
    if (*flags.max_groups == 0) {
      return errors::WithReason(
          absl::InvalidArgumentError("--max_groups: 0 (at least 1 group must be allowed)"),
          errors::Reason::kConfigInvalid);
    }
    config->set_max_groups(*flags.max_groups);
  }
  if (flags.max_groups_per_uid) config->set_max_groups_per_uid(*flags.max_groups_per_uid);
  if (flags.max_endpoints_per_uid) {
    config->set_max_endpoints_per_uid(*flags.max_endpoints_per_uid);
  }
  if (flags.max_endpoint_bytes_per_uid) {
    config->set_max_endpoint_bytes_per_uid(*flags.max_endpoint_bytes_per_uid);
  }
  if (flags.max_sessions_per_uid) config->set_max_sessions_per_uid(*flags.max_sessions_per_uid);
  if (flags.max_connections_per_uid) {
    config->set_max_connections_per_uid(*flags.max_connections_per_uid);
  }
  // "--peer_listen=" and "--peer_listen=off" turn off a Peer listener the file sets.
  if (flags.peer_listen) {
    config->set_peer_listen(*flags.peer_listen == "off" ? "" : *flags.peer_listen);
  }
  if (flags.peer_advertise) config->set_peer_advertise(*flags.peer_advertise);
  if (flags.peer_secret_file) config->set_peer_secret_file(*flags.peer_secret_file);
  if (flags.peer_tls_cert_file) config->set_peer_tls_cert_file(*flags.peer_tls_cert_file);
  if (flags.peer_tls_key_file) config->set_peer_tls_key_file(*flags.peer_tls_key_file);
  if (flags.peer_tls_ca_file) config->set_peer_tls_ca_file(*flags.peer_tls_ca_file);
  if (flags.peer_heartbeat_ms) config->set_peer_heartbeat_ms(*flags.peer_heartbeat_ms);
  if (flags.transport) {
    if (flags.transport->empty()) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              "--transport: \"\" (given empty) is not a value; give one, or leave the flag out for "
              "the config file's transport or the default \"tcp\""),
          errors::Reason::kConfigInvalid);
    }
    config->set_transport(absl::AsciiStrToLower(*flags.transport));
  }
  if (flags.tcp_listen) config->set_tcp_listen(*flags.tcp_listen);
  if (flags.audit_log) config->set_audit_log(*flags.audit_log);
  if (flags.testing_transport_faults) {
    config->set_testing_transport_faults(*flags.testing_transport_faults);
  }
  // "--metrics_listen=" and "--metrics_listen=off" turn off a listener the file sets.
  if (flags.metrics_listen) {
    config->set_metrics_listen(*flags.metrics_listen == "off" ? "" : *flags.metrics_listen);
  }
  if (flags.metrics_state_file) config->set_metrics_state_file(*flags.metrics_state_file);
  if (flags.tcp_connections_per_peer) {
    config->set_tcp_connections_per_peer(*flags.tcp_connections_per_peer);
  }
  if (flags.rdma_devices) {
    EPD_ASSIGN_OR_RETURN(std::vector<v1::RdmaDevicePort> devices,
                         ParseRdmaDevices(*flags.rdma_devices, "--rdma_devices"));
    config->mutable_rdma()->clear_devices();
    for (v1::RdmaDevicePort& d : devices) *config->mutable_rdma()->add_devices() = std::move(d);
  }
  if (flags.rdma_gid_index) config->mutable_rdma()->set_gid_index(*flags.rdma_gid_index);
  if (flags.rdma_service_level)
    config->mutable_rdma()->set_service_level(*flags.rdma_service_level);
  if (flags.rdma_traffic_class)
    config->mutable_rdma()->set_traffic_class(*flags.rdma_traffic_class);
  if (flags.rdma_qps_per_peer) config->mutable_rdma()->set_qps_per_peer(*flags.rdma_qps_per_peer);
  if (flags.rdma_gpudirect) {
    config->mutable_rdma()->set_gpudirect(absl::AsciiStrToLower(*flags.rdma_gpudirect));
  }
  if (flags.gpu_uuids) {
    config->clear_gpu_uuids();
    for (const std::string& uuid : *flags.gpu_uuids) {
      if (!uuid.empty()) config->add_gpu_uuids(uuid);
    }
  }
  return absl::OkStatus();
}

void FillDaemonConfigDefaults(v1::DaemonConfig* config) {
  // "off" turns a listener off in the file as on the command line (ApplyConfigFlags).
  if (config->listen() == "off") config->clear_listen();
  if (config->peer_listen() == "off") config->clear_peer_listen();
  if (config->metrics_listen() == "off") config->clear_metrics_listen();
  if (config->socket_path().empty()) config->set_socket_path(kDefaultSocketPath);
  if (config->socket_mode().empty()) config->set_socket_mode(kDefaultSocketMode);
  if (config->backend() == v1::BACKEND_UNSPECIFIED) config->set_backend(v1::BACKEND_AUTO);
  if (config->log_level().empty()) config->set_log_level(kDefaultLogLevel);
  if (!config->has_op_timeout_ms()) config->set_op_timeout_ms(kDefaultOpTimeoutMs);
  if (!config->has_engine_idle_us()) config->set_engine_idle_us(kDefaultEngineIdleUs);
  if (!config->has_max_request_bytes()) config->set_max_request_bytes(kDefaultMaxRequestBytes);
  if (!config->has_max_groups()) config->set_max_groups(kDefaultMaxGroups);
  if (!config->has_min_free_fds()) config->set_min_free_fds(kDefaultMinFreeFds);
  if (!config->has_unmapped_endpoint_timeout_ms()) {
    const uint64_t after_op_timeout =
        static_cast<uint64_t>(config->op_timeout_ms()) + kUnmappedEndpointSlackMs;
    config->set_unmapped_endpoint_timeout_ms(static_cast<uint32_t>(std::clamp<uint64_t>(
        after_op_timeout, kDefaultUnmappedEndpointTimeoutMs, kMaxUnmappedEndpointTimeoutMs)));
  }
  if (!config->has_max_groups_per_uid()) config->set_max_groups_per_uid(kDefaultMaxGroupsPerUid);
  if (!config->has_max_endpoints_per_uid()) {
    config->set_max_endpoints_per_uid(kDefaultMaxEndpointsPerUid);
  }
  if (!config->has_max_sessions_per_uid()) {
    config->set_max_sessions_per_uid(kDefaultMaxSessionsPerUid);
  }
  if (!config->has_max_connections_per_uid()) {
    config->set_max_connections_per_uid(kDefaultMaxConnectionsPerUid);
  }
  if (!config->has_peer_heartbeat_ms()) config->set_peer_heartbeat_ms(kDefaultPeerHeartbeatMs);
  // The word-valued transport settings take any case, in the file as on the command line
  // (ApplyConfigFlags); epd keeps them lower-case.
  config->set_transport(absl::AsciiStrToLower(config->transport()));
  if (config->transport().empty()) config->set_transport(kDefaultTransport);
  if (!config->has_tcp_connections_per_peer()) {
    config->set_tcp_connections_per_peer(kDefaultTcpConnectionsPerPeer);
  }
  // gid_index and mtu stay absent when absent (chosen per port at start-up).
  v1::RdmaConfig* rdma = config->mutable_rdma();
  if (!rdma->has_timeout()) rdma->set_timeout(kDefaultRdmaTimeout);
  if (!rdma->has_retry_count()) rdma->set_retry_count(kDefaultRdmaRetryCount);
  if (!rdma->has_rnr_retry()) rdma->set_rnr_retry(kDefaultRdmaRnrRetry);
  if (!rdma->has_qps_per_peer()) rdma->set_qps_per_peer(kDefaultRdmaQpsPerPeer);
  if (!rdma->has_max_send_wr()) rdma->set_max_send_wr(kDefaultRdmaMaxSendWr);
  if (!rdma->has_cq_depth()) rdma->set_cq_depth(kDefaultRdmaCqDepth);
  rdma->set_gpudirect(absl::AsciiStrToLower(rdma->gpudirect()));
  if (rdma->gpudirect().empty()) rdma->set_gpudirect("auto");
  config->set_cuda_op_graphs(absl::AsciiStrToLower(config->cuda_op_graphs()));
  if (config->cuda_op_graphs().empty()) config->set_cuda_op_graphs("off");
  config->set_cuda_fused_launch(absl::AsciiStrToLower(config->cuda_fused_launch()));
  if (config->cuda_fused_launch().empty()) config->set_cuda_fused_launch("on");
}

absl::Status ValidateDaemonConfig(const v1::DaemonConfig& config) {
  std::string path = SocketFilePath(config.socket_path());
  if (path.empty() || path[0] != '/') {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "socket_path: \"", config.socket_path(),
                                  "\" must be an absolute path (\"/run/epd/epd.sock\")")),
                              errors::Reason::kConfigInvalid);
  }
  if (path.size() > kMaxSocketPathBytes) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "socket_path: \"", config.socket_path(), "\" is ", path.size(),
            " bytes long; the most epd can listen on is ", kMaxSocketPathBytes,
            " bytes (the unix socket limit of 107, less the two that gRPC adds to the "
            "\"unix:///path\" it listens on); use a shorter path, e.g. /run/epd/epd.sock")),
        errors::Reason::kConfigInvalid);
  }
  {
    EPD_ASSIGN_OR_RETURN(uint32_t mode, ParseFileMode("socket_mode", config.socket_mode()));
    if (mode & ~0777u) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    "socket_mode: \"", config.socket_mode(),
                                    "\" sets setuid, setgid or sticky bits; give permissions only "
                                    "(e.g. \"0660\")")),
                                errors::Reason::kConfigInvalid);
    }
    if ((mode & 0600u) != 0600u) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    "socket_mode: \"", config.socket_mode(),
                                    "\" does not let the owner read and write (needs 0600)")),
                                errors::Reason::kConfigInvalid);
    }
  }
  EPD_RETURN_IF_ERROR(CheckListen(config.listen()));
  EPD_RETURN_IF_ERROR(CheckListen(config.metrics_listen(), "metrics_listen"));
  if (!v1::Backend_IsValid(config.backend())) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat("backend: ", static_cast<int>(config.backend()), " is not a Backend")),
        errors::Reason::kConfigInvalid);
  }
  EPD_RETURN_IF_ERROR(ParseLogLevels(config.log_level()).status());
  if (config.op_timeout_ms() == 0) {
    return errors::WithReason(
        absl::InvalidArgumentError("op_timeout_ms: 0 is not a timeout (>= 1 ms)"),
        errors::Reason::kConfigInvalid);
  }
  if (config.max_request_bytes() < kMinMaxRequestBytes) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat("max_request_bytes: ", config.max_request_bytes(),
                                                " is below the minimum ", kMinMaxRequestBytes)),
        errors::Reason::kConfigInvalid);
  }
  if (config.max_request_bytes() > kMaxMaxRequestBytes) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat("max_request_bytes: ", config.max_request_bytes(),
                                                " is above the maximum ", kMaxMaxRequestBytes,
                                                " (gRPC takes the message size limit as an int)")),
        errors::Reason::kConfigInvalid);
  }
  if (config.max_groups() == 0) {
    return errors::WithReason(
        absl::InvalidArgumentError("max_groups: 0 (at least 1 group must be allowed)"),
        errors::Reason::kConfigInvalid);
  }
  if (config.min_free_fds() > kMaxMinFreeFds) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat("min_free_fds: ", config.min_free_fds(),
                                                " is above the maximum ", kMaxMinFreeFds)),
        errors::Reason::kConfigInvalid);
  }
  if (config.unmapped_endpoint_timeout_ms() < kMinUnmappedEndpointTimeoutMs ||
      config.unmapped_endpoint_timeout_ms() > kMaxUnmappedEndpointTimeoutMs) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "unmapped_endpoint_timeout_ms: ", config.unmapped_endpoint_timeout_ms(),
            " is outside [", kMinUnmappedEndpointTimeoutMs, ", ", kMaxUnmappedEndpointTimeoutMs,
            "] (milliseconds a client has to map an endpoint it joined)")),
        errors::Reason::kConfigInvalid);
  }
  if (config.host_threads() > kMaxHostThreads) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "host_threads: ", config.host_threads(), " is above the maximum ",
                                  kMaxHostThreads, " (0 = the hardware concurrency)")),
                              errors::Reason::kConfigInvalid);
  }
  if (!config.cuda_op_graphs().empty() && config.cuda_op_graphs() != "on" &&
      config.cuda_op_graphs() != "off") {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "cuda_op_graphs: \"", absl::CEscape(config.cuda_op_graphs()), "\" is not on or off")),
        errors::Reason::kConfigInvalid);
  }
  if (!config.cuda_fused_launch().empty() && config.cuda_fused_launch() != "on" &&
      config.cuda_fused_launch() != "off") {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat("cuda_fused_launch: \"",
                                                absl::CEscape(config.cuda_fused_launch()),
                                                "\" is not on or off")),
        errors::Reason::kConfigInvalid);
  }
  for (const std::string& uuid : config.gpu_uuids()) {
    if (uuid.empty()) {
      return errors::WithReason(absl::InvalidArgumentError("gpu_uuids: an entry is empty"),
                                errors::Reason::kConfigInvalid);
    }
  }
  return ValidatePeerConfig(config);
}

namespace {

/// The whole of a regular file, at most `max_bytes`; errors name `field` and `path`.
absl::StatusOr<std::string> ReadSmallFile(absl::string_view field, const std::string& path,
                                          size_t max_bytes, struct stat* st) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) {
    const int err = errno;
    std::string message = absl::StrCat(field, ": cannot read \"", path, "\": ", std::strerror(err));
    if (err == EACCES || err == EPERM) {
      return errors::WithReason(absl::PermissionDeniedError(message),
                                errors::Reason::kConfigInvalid);
    }
    if (err == ENOENT) {
      return errors::WithReason(absl::NotFoundError(message), errors::Reason::kConfigInvalid);
    }
    return errors::WithReason(absl::FailedPreconditionError(message),
                              errors::Reason::kConfigInvalid);
  }
  if (::fstat(fd.get(), st) != 0 || !S_ISREG(st->st_mode)) {
    return errors::WithReason(absl::FailedPreconditionError(
                                  absl::StrCat(field, ": \"", path, "\" is not a regular file")),
                              errors::Reason::kConfigInvalid);
  }
  if (static_cast<uint64_t>(st->st_size) > max_bytes) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(field, ": \"", path, "\" has ", st->st_size,
                                                   " bytes, more than ", max_bytes)),
        errors::Reason::kConfigInvalid);
  }
  std::string data(static_cast<size_t>(st->st_size), '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t n = ::read(fd.get(), data.data() + got, data.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(field, ": reading \"", path, "\" failed")),
          errors::Reason::kConfigInvalid);
    }
    got += static_cast<size_t>(n);
  }
  return data;
}

}  // namespace

absl::StatusOr<std::string> ReadPeerSecretFile(const std::string& path) {
  struct stat st {};
  EPD_ASSIGN_OR_RETURN(std::string secret,
                       ReadSmallFile("peer_secret_file", path, kMaxPeerSecretBytes, &st));
  if ((st.st_mode & 077) != 0) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrFormat(
            "peer_secret_file: \"%s\" has mode %04o: group or others may read or write it; "
            "chmod 600 it (the secret admits a daemon to the cluster)",
            path, st.st_mode & 07777)),
        errors::Reason::kConfigInvalid);
  }
  if (absl::EndsWith(secret, "\r\n")) {
    secret.resize(secret.size() - 2);
  } else if (absl::EndsWith(secret, "\n")) {
    secret.resize(secret.size() - 1);
  }
  if (secret.size() < kMinPeerSecretBytes) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "peer_secret_file: \"", path, "\" holds ", secret.size(), " bytes, fewer than ",
            kMinPeerSecretBytes, " (e.g. `head -c 32 /dev/urandom | base64 > file`)")),
        errors::Reason::kConfigInvalid);
  }
  return secret;
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view field, const std::string& path) {
  struct stat st {};
  EPD_ASSIGN_OR_RETURN(std::string pem, ReadSmallFile(field, path, 1 << 20, &st));
  if (pem.empty()) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(field, ": \"", path, "\" is empty")),
        errors::Reason::kConfigInvalid);
  }
  return pem;
}

std::vector<std::string> DaemonConfigWarnings(const v1::DaemonConfig& config) {
  std::vector<std::string> warnings;
  if (!config.shm_mode().empty()) {
    warnings.push_back(absl::StrCat(
        "shm_mode: \"", config.shm_mode(),
        "\" is deprecated and ignored: endpoint regions are sealed memfds with no name and no "
        "file mode, handed only to the process that joined the rank (docs/SECURITY.md); "
        "remove shm_mode from the config file or --shm_mode from the command line"));
  }
  if (static_cast<uint64_t>(config.unmapped_endpoint_timeout_ms()) <
      static_cast<uint64_t>(config.op_timeout_ms()) + 5000) {
    warnings.push_back(absl::StrCat(
        "unmapped_endpoint_timeout_ms: ", config.unmapped_endpoint_timeout_ms(),
        " is shorter than op_timeout_ms + 5000 = ", config.op_timeout_ms() + 5000ull,
        ": a client-launched rank maps its endpoint only once every rank of its group has "
        "joined, which it may wait for that long, so a slow group's ranks can expire; raise "
        "it above ",
        config.op_timeout_ms() + 5000ull));
  }
  return warnings;
}

absl::StatusOr<v1::DaemonConfig> ResolveDaemonConfig(const ConfigFlags& flags) {
  v1::DaemonConfig file;
  if (flags.config_path && !flags.config_path->empty()) {
    EPD_ASSIGN_OR_RETURN(file, LoadDaemonConfigFile(*flags.config_path));
  }
  return ResolveDaemonConfigFrom(std::move(file), flags);
}

absl::StatusOr<v1::DaemonConfig> ResolveDaemonConfigFrom(v1::DaemonConfig file,
                                                         const ConfigFlags& flags) {
  EPD_RETURN_IF_ERROR(ApplyConfigFlags(flags, &file));
  FillDaemonConfigDefaults(&file);
  EPD_RETURN_IF_ERROR(ValidateDaemonConfig(file));
  return file;
}

absl::StatusOr<uint32_t> ParseFileMode(absl::string_view field, absl::string_view value) {
  auto bad = [&] {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat(field, ": \"", value, "\" is not an octal file mode (e.g. \"0660\")")),
        errors::Reason::kConfigInvalid);
  };
  if (value.empty() || value.size() > 5) return bad();
  uint32_t mode = 0;
  for (char c : value) {
    if (c < '0' || c > '7') return bad();
    mode = mode * 8 + static_cast<uint32_t>(c - '0');
  }
  if (mode > 07777) return bad();
  return mode;
}

std::string SocketFilePath(absl::string_view socket_path) {
  absl::string_view p = socket_path;
  if (p.substr(0, 7) == "unix://") {
    p.remove_prefix(7);
  } else if (p.substr(0, 5) == "unix:") {
    p.remove_prefix(5);
  }
  return std::string(p);
}

std::string ConfigValueSource(absl::string_view flag_text, bool flag_given,
                              absl::string_view field_text,
                              const std::optional<std::string>& config_path) {
  if (flag_given) return absl::StrCat(flag_text, " on the command line");
  if (config_path && !config_path->empty()) {
    return absl::StrCat("`", field_text, "` in the config file ", *config_path);
  }
  return absl::StrCat("`", field_text, "` in the DaemonConfig");
}

std::string BackendFlagName(v1::Backend backend) {
  switch (backend) {
    case v1::BACKEND_CUDA:
      return "cuda";
    case v1::BACKEND_HOST:
      return "host";
    default:
      return "auto";
  }
}

std::string BackendSource(const v1::DaemonConfig& config, const ConfigFlags& given) {
  return ConfigValueSource(
      absl::StrCat("--backend=", BackendFlagName(config.backend())), given.backend.has_value(),
      absl::StrCat("backend: ", v1::Backend_Name(config.backend())), given.config_path);
}

}  // namespace epd
