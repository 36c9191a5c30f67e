// The TCP transport's bytes between daemons (daemon/transport/tcp/, DESIGN.md §5.2): the
// descriptor a node hands each peer node of a group (through the Peer service), the
// handshake a connecting node sends first on each data connection, the listener's acknowledgement,
// and the frame header that precedes every piece and every end-of-write marker. Every struct is a
// fixed-size POD in host byte order (little-endian; the transport refuses to build on a big-endian
// host) with static_asserts on its size and offsets; the reader checks `magic` and `version` and
// treats every other field as untrusted until checked. Bump kTcpWireVersion when a byte moves or a
// meaning changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace epd::abi {

inline constexpr uint16_t kTcpWireVersion = 2;
inline constexpr uint32_t kTcpDescriptorMagic = 0x44504354;  // "TCPD"
inline constexpr uint32_t kTcpHandshakeMagic = 0x48504354;   // "TCPH"
inline constexpr uint32_t kTcpAckMagic = 0x41504354;         // "TCPA"
inline constexpr uint32_t kTcpFrameMagic = 0x46504354;       // "TCPF"
inline constexpr size_t kTcpTokenBytes = 16;                 // Tokens and proofs.
inline constexpr uint32_t kTcpMaxConnections = 16;           // Connections per peer.
inline constexpr size_t kTcpHostBytes = 256;                 // Host name, NUL-padded.

/// What a node hands one peer node of a group (GroupLink::LocalDescriptorFor): where to
/// connect, and the token of that peer node alone:
///   token = HMAC-SHA256(link secret, "epd-tcp-peer-token-v2" 0 node for_node)[0, 16)
/// where the link secret is 16 random bytes that never leave the node (each part of an HMAC
/// input here is a 4-byte little-endian length and the bytes; integers little-endian).
struct TcpDescriptor {
  uint32_t magic;                 ///< kTcpDescriptorMagic.
  uint16_t version;               ///< kTcpWireVersion.
  uint16_t num_connections;       ///< Connections a peer opens, [1, kTcpMaxConnections].
  int32_t node;                   ///< The publishing node's index in the group.
  uint16_t port;                  ///< Data listener port (host byte order), != 0.
  uint16_t reserved;              ///< 0.
  uint64_t recv_bytes;            ///< Size of the publishing node's receive region.
  uint64_t incarnation;           ///< The publishing link's random id, != 0 (new per link).
  int32_t for_node;               ///< The node this descriptor was made for (-1: none).
  uint32_t reserved2;             ///< 0.
  uint8_t token[kTcpTokenBytes];  ///< for_node's token (zero when for_node is -1).
  char host[kTcpHostBytes];       ///< Host name or address, NUL-terminated and NUL-padded.
};
static_assert(std::is_trivially_copyable_v<TcpDescriptor>);
static_assert(sizeof(TcpDescriptor) == 312);
static_assert(offsetof(TcpDescriptor, node) == 8);
static_assert(offsetof(TcpDescriptor, port) == 12);
static_assert(offsetof(TcpDescriptor, recv_bytes) == 16);
static_assert(offsetof(TcpDescriptor, incarnation) == 24);
static_assert(offsetof(TcpDescriptor, for_node) == 32);
static_assert(offsetof(TcpDescriptor, token) == 40);
static_assert(offsetof(TcpDescriptor, host) == 56);

/// The first bytes a connecting node sends on each data connection. Only the node the
/// target's descriptor was made for knows its token, so only it can make the proof:
///   proof = HMAC-SHA256(token, "epd-tcp-handshake-v2" 0 from_node to_node incarnation)[0, 16)
struct TcpHandshake {
  uint32_t magic;                 ///< kTcpHandshakeMagic.
  uint16_t version;               ///< kTcpWireVersion.
  uint16_t num_connections;       ///< Connections the sender opens (the descriptor's count).
  uint8_t proof[kTcpTokenBytes];  ///< See above.
  int32_t from_node;              ///< The sender's node index.
  int32_t to_node;                ///< The node the sender believes it connects to.
  uint32_t connection;            ///< This connection's index, [0, num_connections).
  uint32_t reserved;              ///< 0.
  uint64_t incarnation;           ///< The sender's link's (its descriptors' incarnation).
};
static_assert(std::is_trivially_copyable_v<TcpHandshake>);
static_assert(sizeof(TcpHandshake) == 48);
static_assert(offsetof(TcpHandshake, proof) == 8);
static_assert(offsetof(TcpHandshake, from_node) == 24);
static_assert(offsetof(TcpHandshake, connection) == 32);
static_assert(offsetof(TcpHandshake, incarnation) == 40);

/// The listener's answer to an accepted handshake (a refused one is closed instead).
struct TcpAck {
  uint32_t magic;       ///< kTcpAckMagic.
  uint16_t version;     ///< kTcpWireVersion.
  uint16_t reserved;    ///< 0.
  int32_t node;         ///< The accepting node's index (the handshake's to_node).
  uint32_t connection;  ///< The handshake's connection index.
};
static_assert(std::is_trivially_copyable_v<TcpAck>);
static_assert(sizeof(TcpAck) == 16);

/// TcpFrameHeader::kind.
enum class TcpFrameKind : uint16_t {
  kPiece = 1,  ///< `bytes` payload bytes follow, for receive-region offset `offset`.
  kDone = 2,   ///< This connection's part of write `seq` is complete; `imm` is its immediate.
};

/// Precedes every piece and every end-of-write marker on a data connection. Write `seq`
/// (0, 1, ... per direction of a peer pair) is striped over the connections: each carries
/// its pieces of the write, then a kDone frame; the receiver delivers `imm` once every
/// connection's kDone of that write arrived.
struct TcpFrameHeader {
  uint32_t magic;     ///< kTcpFrameMagic.
  uint16_t version;   ///< kTcpWireVersion.
  uint16_t kind;      ///< TcpFrameKind.
  uint32_t imm;       ///< kDone: the write's immediate; kPiece: 0.
  uint32_t reserved;  ///< 0.
  uint64_t seq;       ///< The write's sequence number.
  uint64_t offset;    ///< kPiece: byte offset in the receiver's region; kDone: 0.
  uint64_t bytes;     ///< kPiece: payload bytes that follow; kDone: 0.
};
static_assert(std::is_trivially_copyable_v<TcpFrameHeader>);
static_assert(sizeof(TcpFrameHeader) == 40);
static_assert(offsetof(TcpFrameHeader, imm) == 8);
static_assert(offsetof(TcpFrameHeader, seq) == 16);
static_assert(offsetof(TcpFrameHeader, offset) == 24);
static_assert(offsetof(TcpFrameHeader, bytes) == 32);

/// A frame header with magic and version set.
inline TcpFrameHeader MakeTcpFrame(TcpFrameKind kind, uint64_t seq, uint64_t offset, uint64_t bytes,
                                   uint32_t imm) {
  TcpFrameHeader h{};
  h.magic = kTcpFrameMagic;
  h.version = kTcpWireVersion;
  h.kind = static_cast<uint16_t>(kind);
  h.imm = imm;
  h.seq = seq;
  h.offset = offset;
  h.bytes = bytes;
  return h;
}

}  // namespace epd::abi
