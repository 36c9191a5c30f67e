// The error catalog: the absl::Status payload (common/errors/reason.h), its agreement with
// proto/epd/v1/errors.proto, the gRPC round trip (common/errors/grpc_status.h) and
// `epctl explain`'s output (client/epctl/explain.h).
#include <set>
#include <string>

#include "absl/status/status.h"
#include "client/control_channel.h"
#include "client/epctl/explain.h"
#include "common/errors/grpc_status.h"
#include "common/errors/reason.h"
#include "epd/v1/errors.pb.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "google/rpc/status.pb.h"
#include "gtest/gtest.h"

namespace epd::errors {
namespace {

TEST(ErrorReasonTest, WithReasonAndReasonOfRoundTrip) {
  absl::Status s =
      WithReason(absl::FailedPreconditionError("driver 470"), Reason::kCudaDriverTooOld);
  EXPECT_EQ(ReasonOf(s), Reason::kCudaDriverTooOld);
  EXPECT_EQ(static_cast<int>(ReasonOf(s)), 2003);
  EXPECT_TRUE(HasReason(s));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "driver 470");
  // Replaced by a later WithReason; kept by WithDefaultReason.
  EXPECT_EQ(ReasonOf(WithReason(s, Reason::kCudaError)), Reason::kCudaError);
  EXPECT_EQ(ReasonOf(WithDefaultReason(s, Reason::kCudaError)), Reason::kCudaDriverTooOld);
  EXPECT_EQ(ReasonOf(WithDefaultReason(absl::InternalError("x"), Reason::kCudaError)),
            Reason::kCudaError);
}

TEST(ErrorReasonTest, OkHasNoReasonAndUnclassifiedGetsTheGenericOfItsCode) {
  absl::Status ok = WithReason(absl::OkStatus(), Reason::kSpecInvalid);
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ReasonOf(ok), Reason::kUnspecified);
  EXPECT_FALSE(HasReason(ok));
  for (int code = 1; code <= 16; ++code) {
    absl::Status s(static_cast<absl::StatusCode>(code), "m");
    EXPECT_FALSE(HasReason(s));
    const Reason r = ReasonOf(s);
    EXPECT_EQ(static_cast<int>(r), 9000 + code);
    const ReasonInfo* info = FindReason(static_cast<int32_t>(r));
    ASSERT_NE(info, nullptr) << code;
    EXPECT_EQ(info->code, s.code()) << info->name;
  }
  EXPECT_EQ(ReasonName(Reason::kInvalidArgument), "INVALID_ARGUMENT");
}

TEST(ErrorReasonTest, PayloadIsErrorInfoInProtobufWireFormat) {
  EXPECT_EQ(kErrorInfoTypeUrl, "type.googleapis.com/" + v1::ErrorInfo::descriptor()->full_name());
  for (int32_t n : {1, 127, 128, 2003, 9016, 65535, -1}) {
    v1::ErrorInfo info;
    info.set_reason(static_cast<v1::ErrorReason>(n));
    EXPECT_EQ(EncodeErrorInfo(static_cast<Reason>(n)), info.SerializeAsString()) << n;
    Reason parsed = Reason::kUnspecified;
    ASSERT_TRUE(ParseErrorInfo(info.SerializeAsString(), &parsed)) << n;
    EXPECT_EQ(static_cast<int32_t>(parsed), n);
    v1::ErrorInfo back;
    ASSERT_TRUE(back.ParseFromString(EncodeErrorInfo(static_cast<Reason>(n))));
    EXPECT_EQ(static_cast<int32_t>(back.reason()), n);
  }
  // Unknown fields (a newer ErrorInfo) are skipped.
  std::string newer = EncodeErrorInfo(Reason::kRankTaken) +
                      std::string(
                          "\x12\x03"
                          "abc",
                          5) +
                      std::string("\x1d\x01\x02\x03\x04", 5);
  Reason parsed = Reason::kUnspecified;
  ASSERT_TRUE(ParseErrorInfo(newer, &parsed));
  EXPECT_EQ(parsed, Reason::kRankTaken);
}

TEST(ErrorReasonTest, MalformedPayloadFallsBackToTheGenericReason) {
  for (std::string bad : {std::string("\x08", 1),
                          std::string("\x12\x09"
                                      "ab",
                                      4),
                          std::string("\x0f", 1), std::string("\x00", 1),
                          std::string("\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 12)}) {
    Reason r = Reason::kUnspecified;
    EXPECT_FALSE(ParseErrorInfo(bad, &r));
    absl::Status s = absl::NotFoundError("x");
    s.SetPayload(kErrorInfoTypeUrl, absl::Cord(bad));
    EXPECT_EQ(ReasonOf(s), Reason::kNotFound);
  }
}

TEST(ErrorReasonTest, CatalogMatchesTheProtoEnum) {
  const google::protobuf::EnumDescriptor* d = v1::ErrorReason_descriptor();
  std::set<int32_t> numbers;
  for (const ReasonInfo& r : AllReasons()) numbers.insert(static_cast<int32_t>(r.reason));
  EXPECT_EQ(numbers.size(), AllReasons().size());
  EXPECT_EQ(static_cast<int>(AllReasons().size()), d->value_count() - 1);  // Less UNSPECIFIED.
  for (int i = 0; i < d->value_count(); ++i) {
    const google::protobuf::EnumValueDescriptor* v = d->value(i);
    if (v->number() == 0) continue;
    const ReasonInfo* r = FindReason(v->number());
    ASSERT_NE(r, nullptr) << v->name();
    EXPECT_EQ("ERROR_REASON_" + std::string(r->name), v->name());
    EXPECT_EQ(absl::StatusCodeToString(r->code), v->options().GetExtension(v1::status_code));
    EXPECT_EQ(r->cause, v->options().GetExtension(v1::cause));
    EXPECT_EQ(r->next_step, v->options().GetExtension(v1::next_step));
    const int family = v->number() / 1000;
    EXPECT_TRUE(family >= 1 && family <= 5 || family == 9) << v->name();
  }
  EXPECT_EQ(FindReason(0), nullptr);
  EXPECT_EQ(ReasonName(static_cast<Reason>(8888)), "UNKNOWN_REASON");
  EXPECT_EQ(ReasonName(Reason::kUnspecified), "UNSPECIFIED");
  EXPECT_EQ(ReasonCode(Reason::kCudaDriverTooOld), "EPD-2003");
}

TEST(ErrorReasonTest, StatusTextNamesSpecificReasonsWithoutRawPayload) {
  EXPECT_EQ(StatusText(absl::OkStatus()), "OK");
  EXPECT_EQ(StatusText(absl::NotFoundError("gpu")), "NOT_FOUND: gpu");
  EXPECT_EQ(StatusText(WithReason(absl::NotFoundError("gpu"), Reason::kGpuNotFound)),
            "NOT_FOUND: gpu [EPD-1011 GPU_NOT_FOUND]");
  // An explicit unclassified reason says nothing the code does not.
  EXPECT_EQ(StatusText(WithReason(absl::NotFoundError("x"), Reason::kNotFound)), "NOT_FOUND: x");
  // absl's ToString shows the payload's bytes; StatusText does not.
  const absl::Status s = WithReason(absl::InternalError("x"), Reason::kCudaError);
  EXPECT_NE(s.ToString().find(std::string(kErrorInfoTypeUrl)), std::string::npos);
  EXPECT_EQ(StatusText(s).find("type.googleapis.com"), std::string::npos);
}

TEST(ErrorReasonTest, CopyReasonKeepsTheOriginalsReasonOnly) {
  const absl::Status from = WithReason(absl::InternalError("a"), Reason::kGpuKernelFault);
  EXPECT_EQ(ReasonOf(CopyReason(from, absl::InternalError("rank 1: a"))), Reason::kGpuKernelFault);
  EXPECT_FALSE(HasReason(CopyReason(absl::InternalError("a"), absl::InternalError("b"))));
}

TEST(ErrorReasonTest, LookupByCodeNumberOrName) {
  for (const char* text : {"EPD-2003", "epd-2003", "2003", "CUDA_DRIVER_TOO_OLD",
                           "cuda_driver_too_old", "ERROR_REASON_CUDA_DRIVER_TOO_OLD", " 2003 "}) {
    const ReasonInfo* r = LookupReason(text);
    ASSERT_NE(r, nullptr) << text;
    EXPECT_EQ(r->reason, Reason::kCudaDriverTooOld) << text;
  }
  for (const char* text : {"", "EPD-", "EPD-0", "EPD-2", "8888", "NOPE", "EPD-2003x"}) {
    EXPECT_EQ(LookupReason(text), nullptr) << text;
  }
}

TEST(ErrorReasonGrpcTest, ReasonSurvivesTheRoundTrip) {
  const absl::Status s = WithReason(absl::PermissionDeniedError("join_secret: not the group's"),
                                    Reason::kJoinSecretMismatch);
  const grpc::Status g = ToGrpcStatus(s);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(g.error_message(), "join_secret: not the group's");
  // The details are a standard google.rpc.Status with one Any(ErrorInfo).
  google::rpc::Status detail;
  ASSERT_TRUE(detail.ParseFromString(g.error_details()));
  EXPECT_EQ(detail.code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  ASSERT_EQ(detail.details_size(), 1);
  EXPECT_EQ(detail.details(0).type_url(), kErrorInfoTypeUrl);
  v1::ErrorInfo info;
  ASSERT_TRUE(detail.details(0).UnpackTo(&info));
  EXPECT_EQ(info.reason(), v1::ERROR_REASON_JOIN_SECRET_MISMATCH);

  const absl::Status back = FromGrpcStatus(g);
  EXPECT_EQ(back.code(), s.code());
  EXPECT_EQ(back.message(), s.message());
  EXPECT_EQ(ReasonOf(back), Reason::kJoinSecretMismatch);

  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(ErrorReasonGrpcTest, UnclassifiedAndForeignDetails) {
  // No reason: the generic one travels.
  EXPECT_EQ(ReasonOf(FromGrpcStatus(ToGrpcStatus(absl::DeadlineExceededError("t")))),
            Reason::kDeadlineExceeded);
  // No details (an older peer, gRPC itself): no payload, the generic reason.
  const absl::Status plain = FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "gone"));
  EXPECT_FALSE(HasReason(plain));
  EXPECT_EQ(ReasonOf(plain), Reason::kUnavailable);
  // Details that do not parse are ignored.
  const absl::Status junk =
      FromGrpcStatus(grpc::Status(grpc::StatusCode::INTERNAL, "x", std::string("\xff\xff", 2)));
  EXPECT_EQ(junk.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(ReasonOf(junk), Reason::kInternalUnclassified);
}

TEST(ErrorReasonGrpcTest, ClientNamesAGrpcUnavailableTheDaemonsAbsence) {
  // gRPC's own UNAVAILABLE (nothing answers): DAEMON_UNAVAILABLE; epd's own reason is kept.
  EXPECT_EQ(ReasonOf(internal::FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "x"))),
            Reason::kDaemonUnavailable);
  EXPECT_EQ(ReasonOf(internal::FromGrpcStatus(ToGrpcStatus(
                WithReason(absl::UnavailableError("draining"), Reason::kDaemonDraining)))),
            Reason::kDaemonDraining);
  EXPECT_EQ(ReasonOf(internal::FromGrpcStatus(grpc::Status(grpc::StatusCode::INTERNAL, "x"))),
            Reason::kInternalUnclassified);
}

TEST(EpctlExplainTest, OneReasonAndTheList) {
  const ReasonInfo* r = LookupReason("EPD-2003");
  ASSERT_NE(r, nullptr);
  const std::string text = epctl::FormatReason(*r);
  EXPECT_EQ(text.rfind("EPD-2003 CUDA_DRIVER_TOO_OLD (FAILED_PRECONDITION)\n", 0), 0u) << text;
  EXPECT_NE(text.find("  cause:     The NVIDIA driver is older"), std::string::npos) << text;
  EXPECT_NE(text.find("  next step: Upgrade the driver"), std::string::npos) << text;

  const std::string list = epctl::FormatReasonList();
  for (const ReasonInfo& e : AllReasons()) {
    EXPECT_NE(list.find(ReasonCode(e.reason) + "  "), std::string::npos) << e.name;
    EXPECT_NE(list.find(std::string(e.name)), std::string::npos) << e.name;
  }
}

TEST(EpctlExplainTest, JsonParsesAndHoldsEveryField) {
  google::protobuf::Struct one;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(epctl::ReasonJson(*LookupReason("1001")), &one)
          .ok());
  EXPECT_EQ(one.fields().at("code").string_value(), "EPD-1001");
  EXPECT_EQ(one.fields().at("number").number_value(), 1001);
  EXPECT_EQ(one.fields().at("name").string_value(), "SPEC_INVALID");
  EXPECT_EQ(one.fields().at("status").string_value(), "INVALID_ARGUMENT");
  EXPECT_EQ(one.fields().at("cause").string_value(), LookupReason("1001")->cause);
  EXPECT_EQ(one.fields().at("next_step").string_value(), LookupReason("1001")->next_step);

  google::protobuf::Struct all;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(epctl::ReasonListJson(), &all).ok());
  EXPECT_EQ(all.fields().at("reasons").list_value().values_size(),
            static_cast<int>(AllReasons().size()));
}

}  // namespace
}  // namespace epd::errors
