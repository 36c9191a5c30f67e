// The daemon's side of a client-launched spanning rank's command channel (span_commands.h).
#include "daemon/dataplane/exchange/span_commands.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "epd/kernels/op_rules.h"

namespace epd {
namespace {

/// Moves `offset` from region `from` onto `to` when it lies in `from`; true if it did.
bool Remap(const kernels::Region& from, const kernels::Region& to, uint64_t offset, uint64_t bytes,
           uint64_t* out) {
  if (offset < from.offset || offset + bytes > from.offset + from.bytes) return false;
  *out = to.offset + (offset - from.offset);
  return true;
}

/// SpanCommand::reserved[0] of a daemon copy that stands for a skipped op.
constexpr uint64_t kSkippedMarker = 0x534b4950;  // "SKIP"

}  // namespace

static_assert(abi::kMaxSpanCopies == kernels::kMaxAreaSpans);

void InitSpanControl(abi::SpanControl& control, uint64_t first_seq) {
  std::memset(&control, 0, sizeof(control));
  control.magic = abi::kSpanControlMagic;
  control.version = abi::kSpanControlVersion;
  control.first_seq = first_seq;
  control.command.seq = first_seq - 1;
  abi::Atomic(control.done_seq).store(first_seq - 1, std::memory_order_release);
}

abi::RequestSlot SlotFromSpanCommand(const abi::SpanCommand& c) {
  abi::RequestSlot slot{};
  slot.magic = abi::kRequestMagic;
  const bool data_op = c.op >= static_cast<uint32_t>(abi::OpKind::kGetDispatchLayout) &&
                       c.op <= static_cast<uint32_t>(abi::OpKind::kLowLatencyCombine);
  slot.op = c.magic == abi::kSpanCommandMagic && data_op ? c.op : 0;
  slot.seq = c.seq;
  slot.flags = c.flags;
  slot.num_tokens = c.num_tokens;
  slot.expert_alignment = c.expert_alignment;
  slot.num_sms = 0;
  slot.handle_seq = c.handle_seq;
  return slot;
}

bool TakeSpanCommand(const abi::SpanControl& control, uint64_t next_seq, uint64_t newest,
                     abi::SpanCommand* copy, abi::RequestSlot* slot) {
  auto& word = const_cast<uint64_t&>(control.command.seq);
  const uint64_t posted = abi::Atomic(word).load(std::memory_order_acquire);
  if (posted < next_seq || posted > newest) return false;
  std::memcpy(copy, &control.command, sizeof(*copy));
  copy->seq = next_seq;  // The value compared, whatever the client wrote since.
  copy->reserved[0] = 0;
  copy->reserved[1] = 0;
  if (posted != next_seq) {
    // The daemon's own marker in its private copy: op next_seq was skipped for `posted`.
    copy->reserved[0] = kSkippedMarker;
    copy->reserved[1] = posted;
  }
  *slot = SlotFromSpanCommand(*copy);
  return true;
}

bool SpanCommandSkipped(const abi::SpanCommand& copy) { return copy.reserved[0] == kSkippedMarker; }

absl::Status CheckSpanCommand(const abi::SpanCommand& c) {
  if (SpanCommandSkipped(c)) {
    return absl::DeadlineExceededError(absl::StrCat("its client never posted op ", c.seq,
                                                    " (its kernel gave up waiting and posted op ",
                                                    c.reserved[1], ")"));
  }
  if (c.flags & abi::kFlagStreamOrdered) {
    return absl::InvalidArgumentError(absl::StrCat(
        "command flags 0x", absl::Hex(c.flags),
        ": kFlagStreamOrdered is not used by a client-launched endpoint (its kernel waits)"));
  }
  if (rules::IsLowLatency(static_cast<abi::OpKind>(c.op)) &&
      (c.client_buffer < 0 || c.client_buffer >= kernels::kLowLatencyBuffers)) {
    return absl::InvalidArgumentError(absl::StrCat("command client_buffer ", c.client_buffer,
                                                   " is outside [0, ", kernels::kLowLatencyBuffers,
                                                   ")"));
  }
  return absl::OkStatus();
}

int32_t SpanAnswerCopies(const kernels::EndpointLayout& L, const OpPlan& plan,
                         int32_t client_buffer, const kernels::Region* spans, int32_t n,
                         abi::SpanCopy* copies) {
  n = std::clamp<int32_t>(n, 0, static_cast<int32_t>(abi::kMaxSpanCopies));
  const int cb = std::clamp<int32_t>(client_buffer, 0, kernels::kLowLatencyBuffers - 1);
  for (int32_t i = 0; i < n; ++i) {
    const uint64_t off = spans[i].offset, bytes = spans[i].bytes;
    uint64_t dst = off;
    if (plan.op == abi::OpKind::kLowLatencyDispatch) {
      const int db = plan.ll_buffer;
      Remap(L.ll_recv_x[db], L.ll_recv_x[cb], off, bytes, &dst) ||
          Remap(L.ll_recv_scales[db], L.ll_recv_scales[cb], off, bytes, &dst) ||
          Remap(L.ll_recv_count[db], L.ll_recv_count[cb], off, bytes, &dst) ||
          Remap(L.ll_recv_src_info[db], L.ll_recv_src_info[cb], off, bytes, &dst) ||
          Remap(L.ll_handle_pos[db], L.ll_handle_pos[cb], off, bytes, &dst);
    } else if (plan.op == abi::OpKind::kLowLatencyCombine) {
      Remap(L.ll_combined_x[plan.ll_out_buffer], L.ll_combined_x[cb], off, bytes, &dst);
    }
    copies[i] = {off, dst, bytes};
  }
  return n;
}

void WriteSpanAnswer(abi::SpanControl& control, uint64_t seq, const absl::Status& status,
                     int32_t num_recv_tokens, const abi::SpanCopy* copies, int32_t num_copies) {
  const uint32_t n =
      status.ok() ? static_cast<uint32_t>(std::clamp<int32_t>(num_copies, 0, abi::kMaxSpanCopies))
                  : 0;
  if (n > 0) std::memcpy(control.copies, copies, sizeof(abi::SpanCopy) * n);
  control.num_copies = n;
  control.done_status_code = static_cast<int32_t>(status.code());
  control.done_num_recv_tokens = num_recv_tokens;
  abi::SpanResult& r = control.results[seq % abi::kCompletionCapacity];
  r.seq = seq;
  r.status_code = static_cast<int32_t>(status.code());
  r.num_recv_tokens = num_recv_tokens;
  const absl::string_view msg = status.message();
  const size_t len = std::min(msg.size(), static_cast<size_t>(abi::kCompletionMessageBytes - 1));
  if (len > 0) std::memcpy(r.message, msg.data(), len);
  r.message[len] = '\0';
  abi::Atomic(control.done_seq).store(seq, std::memory_order_release);
}

}  // namespace epd
