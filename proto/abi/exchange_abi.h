// The byte layout of the host backend's exchange between the nodes of a group that spans
// nodes (DESIGN.md §5.1): what one daemon writes into another daemon's receive region
// (transport::GroupLink::PostWrite) and the immediate that follows. Every struct is a
// fixed-size POD with static_asserts; the receiver copies magic, version, seq, node, every
// count and every index out of its receive region (which the peer may write again at any
// time) and checks the copy before it uses one as a size or index (a peer daemon's bytes
// are untrusted).
// Bump kExchangeAbiVersion when a byte moves or a meaning changes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace epd::abi {

inline constexpr uint32_t kExchangeAbiVersion = 3;
inline constexpr uint32_t kExchangeMagic = 0x45584831;  // "EXH1"
inline constexpr uint32_t kExchangeMessageBytes = 432;  // Error text in a header.
/// Low bits of an immediate: the phase of the op (one phase per op today: the message).
inline constexpr uint32_t kExchangePhaseBits = 4;
inline constexpr uint32_t kExchangePhaseOp = 1;
/// An op's seq modulo this travels in the immediate (the header carries all 64 bits).
inline constexpr uint64_t kExchangeImmSeqModulo = uint64_t{1} << (32 - kExchangePhaseBits);

/// The immediate announcing op `seq`'s message of phase `phase` (`seq`: the op's number on
/// the link between the two nodes, counted from 0 when the link was last (re)built).
constexpr uint32_t ExchangeImm(uint64_t seq, uint32_t phase) {
  return static_cast<uint32_t>((seq % kExchangeImmSeqModulo) << kExchangePhaseBits) | phase;
}
constexpr uint64_t ExchangeImmSeq(uint32_t imm) { return imm >> kExchangePhaseBits; }
constexpr uint32_t ExchangeImmPhase(uint32_t imm) { return imm & ((1u << kExchangePhaseBits) - 1); }

/// The head of one node's message to another for one op (at offset 0 of its slot).
/// status_code != 0: the op failed at the sender (a bad request of rank status_rank, ranks
/// disagreeing, a rank missing there); the receiver fails it with the same error and reads
/// nothing else of the slot.
struct ExchangeHeader {
  uint32_t magic = kExchangeMagic;
  uint32_t version = kExchangeAbiVersion;
  uint64_t seq = 0;              ///< The op's number on this link (ops since it was built).
  uint32_t op = 0;               ///< abi::OpKind.
  uint32_t flags = 0;            ///< The op's request flags (every rank agrees).
  int32_t expert_alignment = 0;  ///< Dispatch.
  int32_t source_node = 0;       ///< The sender's node index.
  int32_t first_rank = 0;        ///< The sender's ranks: [first_rank, first_rank + num_ranks).
  int32_t num_ranks = 0;
  uint64_t handle_seq = 0;     ///< LowLatencyCombine: its dispatch ran this many ops before.
  int32_t status_code = 0;     ///< absl::StatusCode; 0 = OK.
  int32_t status_rank = -1;    ///< The rank the error is of, or -1 (the node's).
  uint32_t message_bytes = 0;  ///< <= kExchangeMessageBytes.
  /// The error's catalog reason (proto/epd/v1/errors.proto ErrorReason); 0 when OK or none.
  /// Untrusted like the rest: an unknown number is carried and printed as UNKNOWN_REASON.
  uint32_t reason = 0;
  /// Rank masking (GroupSpec.on_rank_failure = MASK; 0 otherwise): the sender's mask epoch
  /// as the op started. Its mask, [mask_words] bits after the header (ExchangeSlotLayout::
  /// mask), travels with every OK message of an op that exchanges data.
  uint32_t mask_epoch = 0;
  uint32_t mask_words = 0;  ///< ExchangeMaskWords(R) when the message carries a mask, else 0.
  uint64_t reserved = 0;
  char message[kExchangeMessageBytes] = {};
};
static_assert(std::is_trivially_copyable_v<ExchangeHeader>);
static_assert(sizeof(ExchangeHeader) == 512);
static_assert(offsetof(ExchangeHeader, seq) == 8);
static_assert(offsetof(ExchangeHeader, handle_seq) == 40);
static_assert(offsetof(ExchangeHeader, mask_epoch) == 64);
static_assert(offsetof(ExchangeHeader, message) == 80);

/// 64-bit words of a rank mask of `num_ranks` ranks (bit r % 64 of word r / 64 = rank r).
constexpr uint64_t ExchangeMaskWords(int64_t num_ranks) {
  return static_cast<uint64_t>((num_ranks + 63) / 64);
}

/// The group's shape as the exchange needs it (a copy of kernels::GroupShape's numbers, so
/// that this header depends on nothing).
struct ExchangeShape {
  int64_t num_ranks = 0, num_experts = 0, hidden = 0, num_topk = 0;
  int64_t max_tokens = 0, ll_max_tokens = 0;  ///< M, Mll.
  int64_t num_scales() const { return (hidden + 127) / 128; }
};

/// The byte layout of one slot: node `sender`'s message to node `receiver` for one op, for
/// a sender of `sender_ranks` ranks and a receiver of `receiver_ranks`. Offsets from the
/// slot's start, 64-byte aligned. After the header:
///  - mask [ExchangeMaskWords(R)] uint64: the sender's rank mask (bit r = rank r masked;
///    the sender's own ranks as it masked them, the others as the last op it finished ran
///    them); every bit at or past R is 0;
///  - tokens [sender_ranks] int32: each sender rank's num_tokens;
///  - counts [sender_ranks, E] int32: Dispatch: tokens of each sender rank to each rank
///    (first R of the row used); LowLatencyDispatch: to each expert;
///  - rows [sender_ranks * E] int32: rows sent per block (dispatch: per source rank; combine:
///    per sender rank; low-latency combine: per sender expert);
///  - payload (dispatches): one block per sender rank of C = max(M, Mll) rows: token ids
///    [C] int32, topk_idx [C, K] int64, send_pos [C, R] int32 (cached), weights [C, K] f32,
///    scales [C, S] f32, x [C, 2H] bytes.
/// The combines' rows go to the receiver's combine area (ExchangeCombineLayout), shared by
/// every sender.
struct ExchangeSlotLayout {
  uint64_t mask = 0, tokens = 0, counts = 0, rows = 0, payload = 0;
  uint64_t block_rows = 0, block_bytes = 0;                            ///< Dispatch blocks.
  uint64_t ids = 0, idx = 0, pos = 0, weights = 0, scales = 0, x = 0;  ///< In a block.
  uint64_t total = 0;

  static constexpr uint64_t Align(uint64_t n) { return (n + 63) / 64 * 64; }

  static ExchangeSlotLayout Compute(const ExchangeShape& s, int64_t sender_ranks,
                                    int64_t receiver_ranks) {
    ExchangeSlotLayout l;
    const uint64_t R = s.num_ranks, E = s.num_experts, K = s.num_topk, H = s.hidden;
    const uint64_t S = s.num_scales(), n = sender_ranks;
    uint64_t at = Align(sizeof(ExchangeHeader));
    l.mask = at;
    at = Align(at + ExchangeMaskWords(s.num_ranks) * 8);
    l.tokens = at;
    at = Align(at + n * 4);
    l.counts = at;
    at = Align(at + n * E * 4);
    l.rows = at;
    at = Align(at + n * E * 4);
    l.payload = at;
    const uint64_t C = static_cast<uint64_t>(std::max(s.max_tokens, s.ll_max_tokens));
    l.block_rows = C;
    uint64_t b = 0;
    l.ids = b;
    b = Align(b + C * 4);
    l.idx = b;
    b = Align(b + C * K * 8);
    l.pos = b;
    b = Align(b + C * R * 4);
    l.weights = b;
    b = Align(b + C * K * 4);
    l.scales = b;
    b = Align(b + C * S * 4);
    l.x = b;
    b = Align(b + C * 2 * H);
    l.block_bytes = b;
    (void)receiver_ranks;
    (void)E;
    l.total = Align(at + n * l.block_bytes);
    return l;
  }
};

/// The combine area of a receiver of `receiver_ranks` ranks, one per op parity after its
/// slots: the rows other nodes' ranks send back for this node's tokens, count-addressed.
/// Normal combine: blocks per remote rank r, ascending, of the rows r received from this
/// node's ranks (sum of the dispatch's counts), x [rows, H] bf16 at `x`, weights [rows, K]
/// f32 at `weights`, row offsets the prefix sums of the blocks. A token comes back from at
/// most min(K, remote ranks) ranks: rows <= receiver_ranks * M * min(K, R - receiver_ranks).
/// Low-latency combine: blocks per remote expert, ascending, of the rows it holds of this
/// node's tokens, [rows, H] bf16 at `x`: rows <= receiver_ranks * Mll * K.
struct ExchangeCombineLayout {
  uint64_t rows = 0, ll_rows = 0;  ///< Capacities in rows.
  uint64_t x = 0, weights = 0;     ///< Offsets in the area.
  uint64_t total = 0;

  static ExchangeCombineLayout Compute(const ExchangeShape& s, int64_t receiver_ranks) {
    ExchangeCombineLayout l;
    const uint64_t K = s.num_topk, H = s.hidden;
    const uint64_t remote =
        static_cast<uint64_t>(std::max<int64_t>(s.num_ranks - receiver_ranks, 0));
    l.rows = static_cast<uint64_t>(receiver_ranks) * s.max_tokens * std::min(K, remote);
    l.ll_rows = static_cast<uint64_t>(receiver_ranks) * s.ll_max_tokens * K;
    l.x = 0;
    l.weights = ExchangeSlotLayout::Align(l.rows * 2 * H);
    l.total = ExchangeSlotLayout::Align(std::max(l.weights + l.rows * K * 4, l.ll_rows * 2 * H));
    return l;
  }
};

}  // namespace epd::abi
