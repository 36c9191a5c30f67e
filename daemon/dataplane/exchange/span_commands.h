// The daemon's side of the command channel of a client-launched rank of a group that spans
// nodes (proto/abi/span_abi.h, DESIGN.md §5.5 "Client-launched"): taking a posted command
// out of the client-writable control block, turning it into the request the lockstep
// validates, and writing the answer (outputs to copy, status, done_seq). Pure functions on
// host memory, backend-neutral, so they are tested without a GPU
// (tests/unit/span_commands_test.cc).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "daemon/dataplane/lockstep_group.h"
#include "epd/kernels/layout.h"
#include "proto/abi/shm_abi.h"
#include "proto/abi/span_abi.h"

namespace epd {

/// Writes the header of a new control block (magic, version, first_seq; everything else
/// zero, done_seq = first_seq - 1 so that no op looks answered).
void InitSpanControl(abi::SpanControl& control, uint64_t first_seq);

/// Takes the command of op `next_seq` out of `control` (client-writable): false while its
/// seq is older than `next_seq`, or newer than `newest` (not posted yet, or garbage: a
/// client that never posts the op lets it time out). A seq of `next_seq` is copied once
/// into `*copy` (acquire after the seq, which the client stores last) and only the copy is
/// used: `*slot` is the request it describes (SlotFromSpanCommand). A seq in (next_seq,
/// newest] means the client gave up on op next_seq (its await kernel timed out) and posted a
/// later op: `*copy` then says so (SpanCommandSkipped) and `*slot` stands for op next_seq,
/// which CheckSpanCommand fails, so the rank catches up one op per call. `newest` is the op
/// the group collects next plus one (LockstepGroup's current op + 1).
bool TakeSpanCommand(const abi::SpanControl& control, uint64_t next_seq, uint64_t newest,
                     abi::SpanCommand* copy, abi::RequestSlot* slot);

/// Whether a command copy stands for an op its client skipped (TakeSpanCommand).
bool SpanCommandSkipped(const abi::SpanCommand& copy);

/// The request a command copy describes, for the lockstep's validation: kRequestMagic, its
/// seq, flags, T, expert_alignment and handle; op 0 (malformed: INVALID_ARGUMENT for the op)
/// unless the magic is kSpanCommandMagic and the op is a data op (1-5). num_sms 0.
abi::RequestSlot SlotFromSpanCommand(const abi::SpanCommand& copy);

/// What the lockstep's validation does not see of a command: kFlagStreamOrdered (the client
/// waits in its own kernel) and, for low-latency ops, client_buffer outside [0, 1]
/// (INVALID_ARGUMENT naming the field and value); an op the client skipped
/// (DEADLINE_EXCEEDED naming the op it posted instead).
absl::Status CheckSpanCommand(const abi::SpanCommand& copy);

/// The copies of the answer to op `plan` at a rank: `spans` (MirrorOutputSpans: offsets in
/// the mirror, whose low-latency buffers are the daemon's, plan.ll_buffer /
/// plan.ll_out_buffer) mapped onto the client's GPU area, where the low-latency dispatch's
/// buffer set (or the combine's ll_combined_x) is `client_buffer` instead; every other range
/// keeps its offset. Writes n <= abi::kMaxSpanCopies copies and returns their number.
int32_t SpanAnswerCopies(const kernels::EndpointLayout& layout, const OpPlan& plan,
                         int32_t client_buffer, const kernels::Region* spans, int32_t n,
                         abi::SpanCopy* copies);

/// Answers op `seq`: the copies (only when `status` is OK), its status and N, the result
/// record the client's host reads (results[seq % kCompletionCapacity], the message cut to
/// fit), then done_seq = seq (release: the client's kernel reads the rest after it).
void WriteSpanAnswer(abi::SpanControl& control, uint64_t seq, const absl::Status& status,
                     int32_t num_recv_tokens, const abi::SpanCopy* copies, int32_t num_copies);

}  // namespace epd
