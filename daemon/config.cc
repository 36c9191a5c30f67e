#include "daemon/config.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/logging.h"
#include "epd/common/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

ABSL_FLAG(std::optional<std::string>, config, std::nullopt,
          "Text-format epd.v1.DaemonConfig to load; flags override its fields.");
ABSL_FLAG(std::optional<std::string>, socket, std::nullopt,
          "Unix socket of the Control and Health services (default /run/epd/epd.sock).");
ABSL_FLAG(std::optional<std::string>, socket_mode, std::nullopt,
          "Octal file mode of the socket (default 0660).");
ABSL_FLAG(std::optional<std::string>, socket_group, std::nullopt,
          "Group owning the socket and shm regions (default: the daemon's own).");
ABSL_FLAG(std::optional<std::string>, listen, std::nullopt,
          "Optional TCP listener host:port for grpc.health.v1 probes only (Control stays on "
          "the unix socket); \"off\" turns off a listener the config file sets.");
ABSL_FLAG(std::optional<std::string>, backend, std::nullopt,
          "Data-plane backend: auto (CUDA when a GPU is usable, else host), cuda, host.");
ABSL_FLAG(std::optional<std::string>, log_level, std::nullopt,
          "trace, debug, info, warn, error, critical or off (default info).");
ABSL_FLAG(std::optional<absl::Duration>, op_timeout, std::nullopt,
          "Bound on every wait of a data-plane op, e.g. 10s (default 10s).");
ABSL_FLAG(std::optional<std::string>, shm_mode, std::nullopt,
          "Octal file mode of the endpoint shm regions (default 0600).");
ABSL_FLAG(std::optional<uint32_t>, engine_idle_us, std::nullopt,
          "An engine sleeps after this many idle microseconds (default 100).");
ABSL_FLAG(std::optional<uint32_t>, host_threads, std::nullopt,
          "Threads the host backend uses per op; 0 = hardware concurrency.");
ABSL_FLAG(std::optional<uint32_t>, max_request_bytes, std::nullopt,
          "Largest gRPC message accepted, in bytes (default 4194304).");
ABSL_FLAG(std::optional<uint32_t>, max_groups, std::nullopt,
          "Maximum number of live groups (default 64).");
ABSL_FLAG(std::optional<std::vector<std::string>>, gpu_uuids, std::nullopt,
          "Comma-separated GPU UUIDs the daemon may use (default: every visible GPU).");

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

absl::Status CheckListen(absl::string_view listen) {
  if (listen.empty()) return absl::OkStatus();
  size_t colon = listen.rfind(':');
  uint32_t port = 0;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen: \"", listen, "\" is not host:port (e.g. \"0.0.0.0:50051\", \"[::1]:0\")"));
  }
  return absl::OkStatus();
}

}  // namespace

ConfigFlags ConfigFlagsFromCommandLine() {
  ConfigFlags f;
  f.config_path = absl::GetFlag(FLAGS_config);
  f.socket = absl::GetFlag(FLAGS_socket);
  f.socket_mode = absl::GetFlag(FLAGS_socket_mode);
  f.socket_group = absl::GetFlag(FLAGS_socket_group);
  f.listen = absl::GetFlag(FLAGS_listen);
  f.backend = absl::GetFlag(FLAGS_backend);
  f.log_level = absl::GetFlag(FLAGS_log_level);
  f.op_timeout = absl::GetFlag(FLAGS_op_timeout);
  f.shm_mode = absl::GetFlag(FLAGS_shm_mode);
  f.engine_idle_us = absl::GetFlag(FLAGS_engine_idle_us);
  f.host_threads = absl::GetFlag(FLAGS_host_threads);
  f.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  f.max_groups = absl::GetFlag(FLAGS_max_groups);
  f.gpu_uuids = absl::GetFlag(FLAGS_gpu_uuids);
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
    return absl::InvalidArgumentError(message);
  }
  return config;
}

absl::StatusOr<v1::DaemonConfig> LoadDaemonConfigFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--config: \"", path, "\" is not a regular file (a text-format DaemonConfig)"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    int err = errno;
    std::string message =
        absl::StrCat("--config: cannot read \"", path, "\": ", std::strerror(err));
    if (err == EACCES) return absl::PermissionDeniedError(message);
    return absl::NotFoundError(message);
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseDaemonConfig(buffer.str(), path);
}

absl::Status ApplyConfigFlags(const ConfigFlags& flags, v1::DaemonConfig* config) {
  if (flags.socket) config->set_socket_path(*flags.socket);
  if (flags.socket_mode) config->set_socket_mode(*flags.socket_mode);
  if (flags.socket_group) config->set_socket_group(*flags.socket_group);
  // "--listen=" reads as an absent flag (absl optional<string>), so "off" is the way to
  // turn off a listener the config file sets.
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
      return absl::InvalidArgumentError(
          absl::StrCat("--backend: \"", *flags.backend, "\" is not one of auto, cuda, host"));
    }
  }
  if (flags.log_level) config->set_log_level(*flags.log_level);
  if (flags.op_timeout) {
    int64_t ms = absl::ToInt64Milliseconds(*flags.op_timeout);
    if (ms < 1 || ms > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("--op_timeout: ", absl::FormatDuration(*flags.op_timeout),
                       " is out of range [1ms, ", UINT32_MAX, "ms]"));
    }
    if (*flags.op_timeout != absl::Milliseconds(ms)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--op_timeout: ", absl::FormatDuration(*flags.op_timeout),
                       " is not a whole number of milliseconds (the config's unit)"));
    }
    config->set_op_timeout_ms(static_cast<uint32_t>(ms));
  }
  if (flags.shm_mode) config->set_shm_mode(*flags.shm_mode);
  if (flags.engine_idle_us) config->set_engine_idle_us(*flags.engine_idle_us);
  if (flags.host_threads) config->set_host_threads(*flags.host_threads);
  if (flags.max_request_bytes) config->set_max_request_bytes(*flags.max_request_bytes);
  if (flags.max_groups) {
    // Checked here: a 0 in the config would read as "absent" and take the default.
    if (*flags.max_groups == 0) {
      return absl::InvalidArgumentError("--max_groups: 0 (at least 1 group must be allowed)");
    }
    config->set_max_groups(*flags.max_groups);
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
  if (config->socket_path().empty()) config->set_socket_path(kDefaultSocketPath);
  if (config->socket_mode().empty()) config->set_socket_mode(kDefaultSocketMode);
  if (config->backend() == v1::BACKEND_UNSPECIFIED) config->set_backend(v1::BACKEND_AUTO);
  if (config->log_level().empty()) config->set_log_level(kDefaultLogLevel);
  if (!config->has_op_timeout_ms()) config->set_op_timeout_ms(kDefaultOpTimeoutMs);
  if (config->shm_mode().empty()) config->set_shm_mode(kDefaultShmMode);
  if (config->engine_idle_us() == 0) config->set_engine_idle_us(kDefaultEngineIdleUs);
  if (!config->has_max_request_bytes()) config->set_max_request_bytes(kDefaultMaxRequestBytes);
  if (!config->has_max_groups()) config->set_max_groups(kDefaultMaxGroups);
}

absl::Status ValidateDaemonConfig(const v1::DaemonConfig& config) {
  std::string path = SocketFilePath(config.socket_path());
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("socket_path: \"", config.socket_path(),
                     "\" must be an absolute path (\"/run/epd/epd.sock\")"));
  }
  if (path.size() > kMaxSocketPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat("socket_path: \"", config.socket_path(),
                                                   "\" is longer than ", kMaxSocketPathBytes,
                                                   " bytes (the unix socket limit)"));
  }
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"socket_mode", &config.socket_mode()},
        {"shm_mode", &config.shm_mode()}}) {
    EPD_ASSIGN_OR_RETURN(uint32_t mode, ParseFileMode(field, *value));
    if (mode & ~0777u) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": \"", *value,
                       "\" sets setuid, setgid or sticky bits; give permissions only "
                       "(e.g. \"0660\")"));
    }
    if ((mode & 0600u) != 0600u) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": \"", *value, "\" does not let the owner read and write (needs 0600)"));
    }
  }
  EPD_RETURN_IF_ERROR(CheckListen(config.listen()));
  if (!v1::Backend_IsValid(config.backend())) {
    return absl::InvalidArgumentError(
        absl::StrCat("backend: ", static_cast<int>(config.backend()), " is not a Backend"));
  }
  EPD_RETURN_IF_ERROR(ParseLogLevel(config.log_level()).status());
  if (config.op_timeout_ms() == 0) {
    return absl::InvalidArgumentError("op_timeout_ms: 0 is not a timeout (>= 1 ms)");
  }
  if (config.max_request_bytes() < kMinMaxRequestBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_request_bytes: ", config.max_request_bytes(), " is below the minimum ",
                     kMinMaxRequestBytes));
  }
  if (config.max_groups() == 0) {
    return absl::InvalidArgumentError("max_groups: 0 (at least 1 group must be allowed)");
  }
  if (config.host_threads() > kMaxHostThreads) {
    return absl::InvalidArgumentError(absl::StrCat("host_threads: ", config.host_threads(),
                                                   " is above the maximum ", kMaxHostThreads,
                                                   " (0 = the hardware concurrency)"));
  }
  for (const std::string& uuid : config.gpu_uuids()) {
    if (uuid.empty()) return absl::InvalidArgumentError("gpu_uuids: an entry is empty");
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::DaemonConfig> ResolveDaemonConfig(const ConfigFlags& flags) {
  v1::DaemonConfig config;
  if (flags.config_path && !flags.config_path->empty()) {
    EPD_ASSIGN_OR_RETURN(config, LoadDaemonConfigFile(*flags.config_path));
  }
  EPD_RETURN_IF_ERROR(ApplyConfigFlags(flags, &config));
  FillDaemonConfigDefaults(&config);
  EPD_RETURN_IF_ERROR(ValidateDaemonConfig(config));
  return config;
}

absl::StatusOr<uint32_t> ParseFileMode(absl::string_view field, absl::string_view value) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": \"", value, "\" is not an octal file mode (e.g. \"0660\")"));
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

}  // namespace epd
