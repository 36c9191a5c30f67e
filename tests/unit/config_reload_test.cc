// Config reload's field rules (daemon/core/config_reload.h): which DaemonConfig fields a
// reload applies live, the field-by-field difference of two configs, the config a reload
// leaves in effect, and the text the reload's log lines show for a field.
#include "daemon/core/config_reload.h"

#include <string>
#include <vector>

#include "daemon/core/config.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"

namespace epd {
namespace {

using google::protobuf::FieldDescriptor;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

v1::DaemonConfig Filled() {
  v1::DaemonConfig config;
  config.set_socket_path("/tmp/epd-reload-test/epd.sock");
  FillDaemonConfigDefaults(&config);
  return config;
}

TEST(ConfigReloadTest, TheLiveFieldsAreTheLogLevelTheQuotasAndTheMetricsListener) {
  std::vector<std::string> live(LiveConfigFields().begin(), LiveConfigFields().end());
  EXPECT_THAT(live,
              ElementsAre("log_level", "max_groups", "max_groups_per_uid", "max_endpoints_per_uid",
                          "max_endpoint_bytes_per_uid", "max_sessions_per_uid",
                          "max_connections_per_uid", "metrics_listen"));
  // Each names a real field: a rename in config.proto must not silently make it refused.
  for (const std::string& name : live) {
    EXPECT_NE(v1::DaemonConfig::descriptor()->FindFieldByName(name), nullptr) << name;
  }
  EXPECT_TRUE(IsLiveConfigField("log_level"));
  EXPECT_FALSE(IsLiveConfigField("socket_path"));
  EXPECT_FALSE(IsLiveConfigField("rdma.qps_per_peer"));
}

TEST(ConfigReloadTest, SameConfigHasNoDifference) {
  EXPECT_TRUE(DiffDaemonConfig(Filled(), Filled()).empty());
}

TEST(ConfigReloadTest, LiveAndRefusedFieldsAreSortedByKind) {
  v1::DaemonConfig next = Filled();
  next.set_log_level("debug,epd.engine=trace");
  next.set_max_sessions_per_uid(3);
  next.set_metrics_listen("127.0.0.1:9464");
  next.set_backend(v1::BACKEND_CUDA);
  next.set_socket_mode("0600");
  next.mutable_rdma()->set_qps_per_peer(4);
  next.add_gpu_uuids("GPU-1");
  const ConfigDiff diff = DiffDaemonConfig(Filled(), next);
  // In config.proto's field order.
  EXPECT_THAT(diff.live, ElementsAre("log_level", "max_sessions_per_uid", "metrics_listen"));
  EXPECT_THAT(diff.refused,
              ElementsAre("socket_mode", "backend", "gpu_uuids", "rdma.qps_per_peer"));
}

TEST(ConfigReloadTest, EveryFieldOutsideTheLiveListIsRefused) {
  // Change each singular scalar field alone, whatever its name: a field added to
  // config.proto later needs a restart unless it is put on the live list on purpose.
  const google::protobuf::Descriptor* d = v1::DaemonConfig::descriptor();
  int checked = 0;
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* field = d->field(i);
    v1::DaemonConfig next = Filled();
    const google::protobuf::Reflection* r = next.GetReflection();
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_STRING:
        if (field->is_repeated()) {
          r->AddString(&next, field, "x");
        } else {
          r->SetString(&next, field, r->GetString(next, field) + "x");
        }
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        r->SetUInt32(&next, field, r->GetUInt32(next, field) + 1);
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        r->SetUInt64(&next, field, r->GetUInt64(next, field) + 1);
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        r->SetEnumValue(&next, field, r->GetEnumValue(next, field) == 2 ? 3 : 2);
        break;
      default:
        continue;  // rdma: its fields are compared one by one (above).
    }
    ++checked;
    const ConfigDiff diff = DiffDaemonConfig(Filled(), next);
    if (IsLiveConfigField(field->name())) {
      EXPECT_THAT(diff.live, ElementsAre(field->name()));
      EXPECT_THAT(diff.refused, IsEmpty()) << field->name();
    } else {
      EXPECT_THAT(diff.refused, ElementsAre(field->name()));
      EXPECT_THAT(diff.live, IsEmpty()) << field->name();
    }
  }
  EXPECT_GE(checked, 34);  // Every field but rdma, today.
}

TEST(ConfigReloadTest, PresenceOfAnOptionalFieldCounts) {
  v1::DaemonConfig running;
  v1::DaemonConfig next;
  next.mutable_rdma()->set_gid_index(0);  // Absent = chosen per port; 0 = index 0.
  EXPECT_THAT(DiffDaemonConfig(running, next).refused, ElementsAre("rdma.gid_index"));
}

TEST(ConfigReloadTest, WithLiveFieldsTakesOnlyTheLiveOnes) {
  v1::DaemonConfig running = Filled();
  running.set_metrics_listen("127.0.0.1:9464");
  v1::DaemonConfig next = Filled();
  next.set_log_level("debug");
  next.set_max_endpoint_bytes_per_uid(0);
  next.set_max_groups(7);
  next.set_metrics_listen("");  // Turned off.
  next.set_backend(v1::BACKEND_HOST);
  next.set_op_timeout_ms(1);
  running.set_max_endpoint_bytes_per_uid(1 << 20);

  const v1::DaemonConfig out = WithLiveFields(running, next);
  EXPECT_EQ(out.log_level(), "debug");
  EXPECT_EQ(out.max_groups(), 7u);
  EXPECT_EQ(out.max_endpoint_bytes_per_uid(), 0u);
  EXPECT_EQ(out.metrics_listen(), "");
  EXPECT_EQ(out.backend(), running.backend());
  EXPECT_EQ(out.op_timeout_ms(), running.op_timeout_ms());
  // What is left to differ is what a restart would apply.
  EXPECT_THAT(DiffDaemonConfig(out, next).live, IsEmpty());
  EXPECT_THAT(DiffDaemonConfig(out, next).refused, ElementsAre("backend", "op_timeout_ms"));
}

TEST(ConfigReloadTest, FieldTextForLogLines) {
  v1::DaemonConfig config = Filled();
  config.set_log_level("debug");
  config.add_gpu_uuids("GPU-a");
  config.add_gpu_uuids("GPU-b");
  config.mutable_rdma()->set_qps_per_peer(4);
  EXPECT_EQ(ConfigFieldText(config, "log_level"), "log_level: \"debug\"");
  EXPECT_EQ(ConfigFieldText(config, "backend"), "backend: BACKEND_AUTO");
  EXPECT_EQ(ConfigFieldText(config, "gpu_uuids"), "gpu_uuids: [\"GPU-a\", \"GPU-b\"]");
  EXPECT_EQ(ConfigFieldText(config, "rdma.qps_per_peer"), "rdma.qps_per_peer: 4");
  EXPECT_EQ(ConfigFieldText(config, "rdma.gid_index"), "rdma.gid_index unset");
  EXPECT_EQ(ConfigFieldText(config, "nonsense"), "nonsense (no such field)");
}

}  // namespace
}  // namespace epd
