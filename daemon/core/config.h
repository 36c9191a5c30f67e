// DaemonConfig loading (DESIGN.md §3.1): the config file is the text format of
// epd.v1.DaemonConfig (proto/epd/v1/config.proto), and command-line flags (defined in
// config.cc) override the fields they set. An absent field takes the proto's default; a
// present but invalid value is an error naming the field and the value. The flag table and
// the optional-field rules are in docs/DEPLOYMENT.md §1.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "epd/v1/config.pb.h"

namespace epd {

/// Defaults of the DaemonConfig fields (as documented in config.proto).
inline constexpr char kDefaultSocketPath[] = "/run/epd/epd.sock";
inline constexpr char kDefaultSocketMode[] = "0660";
inline constexpr char kDefaultLogLevel[] = "info";
inline constexpr uint32_t kDefaultOpTimeoutMs = 10000;
inline constexpr uint32_t kDefaultEngineIdleUs = 100;
inline constexpr uint32_t kDefaultMaxRequestBytes = 4u << 20;
inline constexpr uint32_t kDefaultMaxGroups = 64;
inline constexpr uint32_t kDefaultMinFreeFds = 64;
inline constexpr uint32_t kMaxMinFreeFds = 1u << 20;
/// unmapped_endpoint_timeout_ms: the default is the larger of this and op_timeout_ms +
/// kUnmappedEndpointSlackMs; accepted values lie in [kMinUnmappedEndpointTimeoutMs,
/// kMaxUnmappedEndpointTimeoutMs].
inline constexpr uint32_t kDefaultUnmappedEndpointTimeoutMs = 30000;
inline constexpr uint32_t kUnmappedEndpointSlackMs = 10000;
inline constexpr uint32_t kMinUnmappedEndpointTimeoutMs = 100;
inline constexpr uint32_t kMaxUnmappedEndpointTimeoutMs = 86400000;
/// Per-uid quotas: one uid may own every group a default daemon allows, and hold 256
/// endpoints (a 32-rank job in 8 groups); bytes are not limited by default (0).
inline constexpr uint32_t kDefaultMaxGroupsPerUid = 64;
inline constexpr uint32_t kDefaultMaxEndpointsPerUid = 256;
inline constexpr uint32_t kDefaultMaxSessionsPerUid = 256;
inline constexpr uint32_t kDefaultMaxConnectionsPerUid = 128;
/// Smallest accepted max_request_bytes: every control message fits in far less.
inline constexpr uint32_t kMinMaxRequestBytes = 64u << 10;
/// Largest accepted max_request_bytes: gRPC takes the limit as an int (INT32_MAX).
inline constexpr uint32_t kMaxMaxRequestBytes = 2147483647u;
/// Peer service (docs/DESIGN.md §5.3): heartbeat interval default and minimum (ms), the
/// smallest shared secret (bytes), and the TCP transport's connections per peer.
inline constexpr uint32_t kDefaultPeerHeartbeatMs = 500;
inline constexpr uint32_t kMinPeerHeartbeatMs = 10;
inline constexpr size_t kMinPeerSecretBytes = 16;
/// Largest peer secret file read, in bytes.
inline constexpr size_t kMaxPeerSecretBytes = 4096;
inline constexpr char kDefaultTransport[] = "tcp";
inline constexpr uint32_t kDefaultTcpConnectionsPerPeer = 2;
inline constexpr uint32_t kMaxTcpConnectionsPerPeer = 16;
/// RdmaConfig defaults and bounds (config.proto RdmaConfig).
inline constexpr uint32_t kDefaultRdmaTimeout = 14;
inline constexpr uint32_t kDefaultRdmaRetryCount = 7;
inline constexpr uint32_t kDefaultRdmaRnrRetry = 7;
inline constexpr uint32_t kDefaultRdmaQpsPerPeer = 2;
inline constexpr uint32_t kMaxRdmaQpsPerPeer = 16;
inline constexpr uint32_t kDefaultRdmaMaxSendWr = 1024;
inline constexpr uint32_t kMinRdmaMaxSendWr = 16;
inline constexpr uint32_t kMaxRdmaMaxSendWr = 32768;
inline constexpr uint32_t kDefaultRdmaCqDepth = 4096;
inline constexpr uint32_t kMinRdmaCqDepth = 64;
inline constexpr uint32_t kMaxRdmaCqDepth = 1048576;
inline constexpr uint32_t kMaxRdmaGidIndex = 255;
inline constexpr uint32_t kMaxRdmaPort = 255;
/// Most host-backend threads per op (host_threads).
inline constexpr uint32_t kMaxHostThreads = 1024;
/// Longest socket_path epd can listen on, in bytes. sockaddr_un.sun_path holds 107 bytes
/// and the NUL, but gRPC 1.51's server resolves a "unix:" address as everything after
/// "unix:", so the "unix:///path" epd listens on becomes "//" + path (two bytes longer, the
/// same file to the kernel), and a 106- or 107-byte path fails with "Path name should not
/// have more than 107 characters" at listen time.
inline constexpr size_t kMaxSocketPathBytes = 105;

/// Values given on the command line; nullopt = flag not given (the config file's value,
/// or the default, stands), whatever the flag's default. Tests build one directly; epd
/// builds it from its flags.
struct ConfigFlags {
  std::optional<std::string> config_path;
  std::optional<std::string> socket;
  std::optional<std::string> socket_mode;
  std::optional<std::string> socket_group;
  std::optional<std::string> listen;
  std::optional<std::string> backend;  ///< "auto", "cuda" or "host".
  std::optional<std::string> log_level;
  std::optional<absl::Duration> op_timeout;  ///< Whole milliseconds, >= 1 ms.
  std::optional<std::string> shm_mode;
  std::optional<uint32_t> engine_idle_us;
  std::optional<uint32_t> host_threads;
  std::optional<std::string> cuda_op_graphs;     ///< "on" or "off".
  std::optional<std::string> cuda_fused_launch;  ///< "on" or "off".
  std::optional<uint32_t> max_request_bytes;
  std::optional<uint32_t> max_groups;
  std::optional<uint32_t> max_groups_per_uid;
  std::optional<uint32_t> max_endpoints_per_uid;
  std::optional<uint64_t> max_endpoint_bytes_per_uid;
  std::optional<uint32_t> max_sessions_per_uid;
  std::optional<uint32_t> max_connections_per_uid;
  std::optional<std::vector<std::string>> gpu_uuids;
  std::optional<std::string> peer_listen;  ///< "" or "off" = no Peer listener.
  std::optional<std::string> peer_advertise;
  std::optional<std::string> peer_secret_file;
  std::optional<std::string> peer_tls_cert_file;
  std::optional<std::string> peer_tls_key_file;
  std::optional<std::string> peer_tls_ca_file;
  std::optional<uint32_t> peer_heartbeat_ms;
  std::optional<std::string> transport;
  std::optional<std::string> tcp_listen;
  std::optional<uint32_t> tcp_connections_per_peer;
  std::optional<std::string> testing_transport_faults;
  std::optional<std::string> metrics_listen;  ///< "" or "off" = no metrics listener.
  std::optional<std::string> metrics_state_file;
  std::optional<std::string> rdma_devices;  ///< "mlx5_0,mlx5_1:2"; "" = every active port.
  std::optional<uint32_t> rdma_gid_index;
  std::optional<uint32_t> rdma_service_level;
  std::optional<uint32_t> rdma_traffic_class;
  std::optional<uint32_t> rdma_qps_per_peer;
  std::optional<std::string> rdma_gpudirect;
  std::optional<std::string> audit_log;  ///< "" = off, "journal", or an absolute path.
};

/// Parses an RDMA device list, comma-separated "device" or "device:port" items
/// ("mlx5_0,mlx5_1:2"; a port defaults to 1; "" = empty list). INVALID_ARGUMENT naming
/// `field` and the offending item.
absl::StatusOr<std::vector<v1::RdmaDevicePort>> ParseRdmaDevices(absl::string_view text,
                                                                 absl::string_view field);

/// Reads the --config, --socket, ... flags of this process (after absl::ParseCommandLine):
/// a field is set exactly when its flag was given ("--socket=" gives an empty value).
ConfigFlags ConfigFlagsFromCommandLine();

/// Parses `text` as a text-format DaemonConfig. `source` names the text in errors (a file
/// path). INVALID_ARGUMENT on an unknown field or a malformed value, with
/// "source:line:column: parser message (in: `offending line`)".
absl::StatusOr<v1::DaemonConfig> ParseDaemonConfig(absl::string_view text,
                                                   absl::string_view source);

/// Reads and parses the file at `path`. NOT_FOUND / PERMISSION_DENIED when it cannot be
/// read (naming the path), else as ParseDaemonConfig.
absl::StatusOr<v1::DaemonConfig> LoadDaemonConfigFile(const std::string& path);

/// Writes every flag that was given into `config`. INVALID_ARGUMENT naming the flag and
/// the value for a value that does not convert (e.g. --backend=gpu, --op_timeout=0s), and
/// for --socket, --socket_mode or --log_level given empty (an explicit "" is
/// never read as "use the default"; the same field left empty in the config file is unset
/// and takes the default). --socket_group="" (the daemon's own group), --listen="" (no
/// listener) and --gpu_uuids="" (every GPU) are meaningful and override the file.
absl::Status ApplyConfigFlags(const ConfigFlags& flags, v1::DaemonConfig* config);

/// Replaces every absent field (proto3 default: "" or BACKEND_UNSPECIFIED; not set for the
/// `optional` numbers) by its documented default; a listen, peer_listen or metrics_listen
/// of "off" becomes "" (off), as the flags take it. host_threads 0, a present
/// engine_idle_us 0 (sleep at once) and empty socket_group/listen/gpu_uuids are meaningful
/// and stay; a present op_timeout_ms or max_groups 0 stays for ValidateDaemonConfig to
/// refuse. `transport` and `rdma.gpudirect` are lower-cased (any case is accepted, in the
/// file as in the flags).
void FillDaemonConfigDefaults(v1::DaemonConfig* config);

/// Checks every field of a filled config. INVALID_ARGUMENT naming the field and the value
/// (and the bound it breaks: e.g. max_request_bytes outside [kMinMaxRequestBytes,
/// kMaxMaxRequestBytes]).
absl::Status ValidateDaemonConfig(const v1::DaemonConfig& config);

/// What start-up should warn about in a filled, valid config (Daemon::Start logs each at
/// warn level on epd.config; none refuses the start): today, a shm_mode (deprecated and
/// ignored: endpoint regions are sealed memfds with no file mode). Empty for the defaults.
std::vector<std::string> DaemonConfigWarnings(const v1::DaemonConfig& config);

/// Reads the Peer service's shared secret from `path` (peer_secret_file): its bytes, one
/// trailing newline ("\n" or "\r\n") stripped. FAILED_PRECONDITION naming the file when it
/// is not a regular file, is readable or writable by group or others (mode & 077), holds
/// fewer than kMinPeerSecretBytes bytes or more than kMaxPeerSecretBytes; NOT_FOUND /
/// PERMISSION_DENIED when it cannot be read.
absl::StatusOr<std::string> ReadPeerSecretFile(const std::string& path);

/// Reads a PEM file named by `field` (peer_tls_*_file). NOT_FOUND / PERMISSION_DENIED naming
/// the field and path; FAILED_PRECONDITION when empty.
absl::StatusOr<std::string> ReadPemFile(absl::string_view field, const std::string& path);

/// The effective config: --config file (if given), then flags, then defaults, validated.
/// The fields whose flag overrides the file: ResolveDaemonConfigWithOverrides
/// (config_overrides.h).
absl::StatusOr<v1::DaemonConfig> ResolveDaemonConfig(const ConfigFlags& flags);

/// ResolveDaemonConfig on `file`, the DaemonConfig a --config file holds as read (empty
/// without one): the flags applied (ApplyConfigFlags), then FillDaemonConfigDefaults, then
/// ValidateDaemonConfig. Errors: theirs.
absl::StatusOr<v1::DaemonConfig> ResolveDaemonConfigFrom(v1::DaemonConfig file,
                                                         const ConfigFlags& flags);

/// Parses an octal file mode ("0660", "660", "0o660" is rejected) into its bits (<= 07777).
/// INVALID_ARGUMENT naming `field` and the value otherwise.
absl::StatusOr<uint32_t> ParseFileMode(absl::string_view field, absl::string_view value);

/// The filesystem path of a socket_path value: "unix:///p" and "unix:/p" → "/p"; "/p" → "/p".
std::string SocketFilePath(absl::string_view socket_path);

/// Names where a config value came from, for start-up messages: "<flag_text> on the
/// command line" when `flag_given` (e.g. "--backend=host on the command line"), else
/// "`<field_text>` in the config file <config_path>" when a --config file was loaded
/// (`config_path` set and non-empty), else "`<field_text>` in the DaemonConfig" (built
/// in-process, e.g. by a test). `field_text` is the field as the file spells it
/// ("backend: BACKEND_HOST").
std::string ConfigValueSource(absl::string_view flag_text, bool flag_given,
                              absl::string_view field_text,
                              const std::optional<std::string>& config_path);

/// Name of a backend enum value as flags spell it: "auto", "cuda" or "host".
std::string BackendFlagName(v1::Backend backend);

/// Where `config`'s backend came from (ConfigValueSource for the backend field): the
/// command line (`given.backend` set), the config file `given.config_path`, or an
/// in-process DaemonConfig. For DaemonOptions::backend_source.
std::string BackendSource(const v1::DaemonConfig& config, const ConfigFlags& given);

}  // namespace epd
