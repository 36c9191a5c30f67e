// Fuzz target: DaemonConfig text (the --config file) and GroupSpec values. Parsing and
// validation must return a Status for any input — never crash, hang or throw — and a
// config that parses must survive validation and re-parsing of its own text form.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "daemon/control/spec_validation.h"
#include "daemon/core/config.h"
#include "google/protobuf/text_format.h"
#include "spdlog/spdlog.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = [] {
    spdlog::set_level(spdlog::level::off);
    return true;
  }();
  (void)quiet;
  // Half the inputs are spliced into a config skeleton so field values get exercised.
  std::string text(reinterpret_cast<const char*>(data), size);
  if (size > 0 && (data[0] & 1)) {
    static const char* kFields[] = {"socket_path", "socket_mode",   "listen",   "backend",
                                    "log_level",   "op_timeout_ms", "shm_mode", "max_groups"};
    text = std::string(kFields[data[0] % 8]) + ": " + text.substr(1);
  }
  auto config = epd::ParseDaemonConfig(text, "fuzz");
  if (config.ok()) {
    (void)epd::ValidateDaemonConfig(*config);
    std::string again;
    google::protobuf::TextFormat::PrintToString(*config, &again);
    if (!epd::ParseDaemonConfig(again, "fuzz-reprint").ok()) std::abort();
  }
  // GroupSpec from raw bytes: every field value, including negatives and overflows.
  if (size >= 28) {
    epd::v1::GroupSpec spec;
    int32_t v[7];
    std::memcpy(v, data, sizeof(v));
    spec.set_name(std::string(reinterpret_cast<const char*>(data) + 28, (size - 28) % 70));
    spec.set_num_ranks(v[0]);
    spec.set_num_experts(v[1]);
    spec.set_hidden(v[2]);
    spec.set_num_topk(v[3]);
    spec.set_max_tokens_per_rank(v[4]);
    spec.set_ll_max_tokens_per_rank(v[5]);
    spec.set_use_fp8(v[6] & 1);
    (void)epd::ValidateGroupSpec(spec);
    (void)epd::ValidateRank(spec, v[6]);
  }
  return 0;
}
