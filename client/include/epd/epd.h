/* The C ABI of libepdclient: the whole client API (client/include/epd/client.h) over opaque
 * handles, for C callers and language bindings. Valid C11 and C++. Conventions (struct_size,
 * status codes, error messages, lifetimes, threads) are in docs/CLIENT_API.md "C ABI"; the
 * behaviour of each call is the C++ call's, documented there too.
 * Letters: T tokens, H hidden, K top-k, R ranks, E experts, M / Mll max tokens per rank
 * (normal / low-latency), N rows received, C a capacity (rows given, >= T). */
#ifndef EPD_EPD_H_
#define EPD_EPD_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define EPD_API __attribute__((visibility("default")))
#else
#define EPD_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/** The version of this ABI; epd_abi_version() returns the library's. A library accepts
 *  callers built against any header of the same ABI version. */
#define EPD_ABI_VERSION 1

/** Status of every call: the absl::StatusCode numbers. The message of a failed call is
 *  epd_last_error() on the calling thread. */
typedef enum epd_status_t {
  EPD_OK = 0,
  EPD_CANCELLED = 1,
  EPD_UNKNOWN = 2,
  EPD_INVALID_ARGUMENT = 3,  /**< Bad argument; the message names the field and value. */
  EPD_DEADLINE_EXCEEDED = 4, /**< A timeout, or a rank that never arrived. */
  EPD_NOT_FOUND = 5,
  EPD_ALREADY_EXISTS = 6,
  EPD_PERMISSION_DENIED = 7,
  EPD_RESOURCE_EXHAUSTED = 8,
  EPD_FAILED_PRECONDITION = 9, /**< Wrong state: left endpoint, stale handle, no result. */
  EPD_ABORTED = 10,
  EPD_OUT_OF_RANGE = 11, /**< A caller's buffer too small (the size needed is given). */
  EPD_UNIMPLEMENTED = 12,
  EPD_INTERNAL = 13,    /**< A bug, or an exception caught at the boundary. */
  EPD_UNAVAILABLE = 14, /**< The daemon is gone or shutting down. */
  EPD_DATA_LOSS = 15,
  EPD_UNAUTHENTICATED = 16
} epd_status_t;

/** Launch mode of a group's kernels (fixed by its first joiner). */
typedef enum epd_launch_mode_t {
  EPD_LAUNCH_MODE_DEFAULT = 0, /**< The daemon's default. */
  EPD_LAUNCH_MODE_DAEMON = 1,  /**< The daemon's engine runs the kernels. */
  EPD_LAUNCH_MODE_CLIENT = 2   /**< This library launches them on the caller's stream. */
} epd_launch_mode_t;

/** A group's answer to a failed rank (GroupSpec.on_rank_failure; docs/RELIABILITY.md). */
typedef enum epd_rank_failure_t {
  EPD_RANK_FAILURE_DEFAULT = 0, /**< As FAIL. */
  EPD_RANK_FAILURE_FAIL = 1,    /**< The op fails on every rank, naming the rank. */
  EPD_RANK_FAILURE_MASK = 2     /**< The rank is masked; the op completes for the others. */
} epd_rank_failure_t;

/** The kind of a submitted op. */
typedef enum epd_op_kind_t {
  EPD_OP_NONE = 0, /**< An op object that holds no op yet. */
  EPD_OP_GET_DISPATCH_LAYOUT = 1,
  EPD_OP_DISPATCH = 2,
  EPD_OP_COMBINE = 3,
  EPD_OP_LOW_LATENCY_DISPATCH = 4,
  EPD_OP_LOW_LATENCY_COMBINE = 5
} epd_op_kind_t;

/** DLPack >= 1.1's kDLFloat8_e4m3fn type code: FP8 tensors are {EPD_DL_FLOAT8_E4M3FN, 8, 1}. */
#define EPD_DL_FLOAT8_E4M3FN 10

/** A timeout that never expires (any negative value does). */
#define EPD_TIMEOUT_INFINITE (-1)

typedef struct epd_client epd_client_t;     /**< A connection and its Session. */
typedef struct epd_endpoint epd_endpoint_t; /**< One rank of a group. */
typedef struct epd_op epd_op_t;             /**< A reusable holder of one submitted op. */

/* ---- library ------------------------------------------------------------------------- */

/** EPD_ABI_VERSION of the library (compare with the header's). */
EPD_API int epd_abi_version(void);
/** epd's version, "MAJOR.MINOR.PATCH"; static storage. */
EPD_API const char* epd_version_string(void);
/** The name of a status ("INVALID_ARGUMENT"); static storage, "UNKNOWN_CODE" if unknown. */
EPD_API const char* epd_status_name(int status);
/** The message of the latest call on this thread that failed, "" after one that succeeded.
 *  Valid until the next epd_* call on this thread. */
EPD_API const char* epd_last_error(void);
/** The error catalog reason (docs/ERRORS.md) of the latest call on this thread that failed:
 *  its number, e.g. 2003 for EPD-2003 CUDA_DRIVER_TOO_OLD; 0 after a call that succeeded.
 *  Every failure has one (9000 + the status code where epd has no specific reason). */
EPD_API int32_t epd_last_error_reason(void);
/** The name of a reason number ("CUDA_DRIVER_TOO_OLD"); static storage; "UNSPECIFIED" for 0,
 *  "UNKNOWN_REASON" for a number this library does not know (from a newer daemon). */
EPD_API const char* epd_reason_name(int32_t reason);

/* ---- client -------------------------------------------------------------------------- */

/** Options of epd_client_connect. */
typedef struct epd_client_options_t {
  size_t struct_size;         /**< sizeof(epd_client_options_t). */
  const char* socket_path;    /**< The daemon's unix socket; NULL = "/run/epd/epd.sock". */
  const char* client_name;    /**< Shown by `epctl groups`; NULL = "". */
  int64_t connect_timeout_ms; /**< <= 0: 5000. */
} epd_client_options_t;

/** Connects and opens the Session; *out is the client (free with epd_client_destroy).
 *  options may be NULL (all defaults). Errors: UNAVAILABLE (no daemon answers on the
 *  socket, named), INVALID_ARGUMENT. */
EPD_API epd_status_t epd_client_connect(const epd_client_options_t* options, epd_client_t** out);
/** Closes the Session (the daemon releases its ranks). Destroy its endpoints first. NULL is a
 *  no-op. */
EPD_API void epd_client_destroy(epd_client_t* client);
/** The Session id (valid while the client lives, until epd_client_reconnect opens a new
 *  Session), or NULL for a NULL client. */
EPD_API const char* epd_client_session_id(const epd_client_t* client);

/** After the daemon restarted (calls give UNAVAILABLE): Client::Reconnect. Opens a new
 *  Session on the same socket (retrying while the daemon restarts, up to timeout_ms;
 *  negative = no limit) and rejoins every endpoint of this client that has not left, with
 *  the options it joined with: the epd_endpoint_t handles stay valid, bound to their new
 *  endpoints. Ops submitted before fail with UNAVAILABLE; result views, handles and
 *  epd_low_latency_*_input views taken before are void (take them again). With the Session
 *  still open it only rejoins endpoints a failed reconnect left unbound (OK when none).
 *  Errors: UNAVAILABLE (no daemon within timeout_ms), PERMISSION_DENIED, a rejoin's error
 *  naming the group and rank (the others are still rejoined; the call may be retried).
 *  Threads: no call on this client's endpoints or their op holders while it runs. */
EPD_API epd_status_t epd_client_reconnect(epd_client_t* client, int64_t timeout_ms);

/** The main figures of the daemon's GetStats. */
typedef struct epd_stats_t {
  size_t struct_size; /**< sizeof(epd_stats_t). */
  char version[32];   /**< NUL-terminated (truncated to fit). */
  char backend[16];   /**< "host" or "cuda". */
  char serving_status[128];
  int32_t mps_active;
  int32_t num_gpus;
  int32_t num_groups;
  int32_t num_sessions;
  uint64_t uptime_ms;
  uint64_t ops_completed;
  uint64_t ops_failed;
  int64_t pid;
} epd_stats_t;

/** GetStats into *out (out->struct_size set by the caller). Safe from several threads. */
EPD_API epd_status_t epd_client_stats(epd_client_t* client, epd_stats_t* out);
/** GetStats (everything) or ListGroups (the groups this uid owns or holds a rank of) as
 *  protobuf JSON into buf[capacity], NUL-terminated; *length (optional) = its length without
 *  the NUL. OUT_OF_RANGE naming the size needed (also in *length) when capacity is too
 *  small; buf may then be NULL. */
EPD_API epd_status_t epd_client_stats_json(epd_client_t* client, char* buf, size_t capacity,
                                           size_t* length);
EPD_API epd_status_t epd_client_list_groups_json(epd_client_t* client, char* buf, size_t capacity,
                                                 size_t* length);

/** One node of a group that spans several epd daemons (epd.v1.NodeSpec). */
typedef struct epd_node_t {
  const char* peer_address; /**< Its daemon's Peer address "host:port" (epd_client_peer_address
                                 there), UTF-8, at most 255 bytes. */
  int32_t num_ranks;        /**< Consecutive ranks it hosts, >= 1. */
} epd_node_t;

/** This daemon's advertised Peer address ("host:port", what an epd_node_t names it by in a
 *  group across daemons), "" when its Peer listener is off, into buf[capacity] NUL-terminated;
 *  *length (optional) = its length without the NUL. OUT_OF_RANGE naming the size needed
 *  (also in *length) when capacity is too small; buf may then be NULL. */
EPD_API epd_status_t epd_client_peer_address(epd_client_t* client, char* buf, size_t capacity,
                                             size_t* length);

/** Options of epd_client_join: the group's spec (epd.v1.GroupSpec) and this rank's join. */
typedef struct epd_join_options_t {
  size_t struct_size;             /**< sizeof(epd_join_options_t). */
  const char* name;               /**< Group name, [A-Za-z0-9_.-]{1,64}. */
  int32_t num_ranks;              /**< R >= 1. */
  int32_t num_experts;            /**< E, a multiple of R. */
  int32_t hidden;                 /**< H; a multiple of 128 with use_fp8. */
  int32_t num_topk;               /**< K, 1 <= K <= E. */
  int32_t max_tokens_per_rank;    /**< M >= 1. */
  int32_t ll_max_tokens_per_rank; /**< Mll; 0 = no low-latency ops. */
  int32_t use_fp8;                /**< Nonzero: FP8 data allowed (normal dispatch, LL dispatch). */
  int32_t rank;                   /**< This endpoint's rank, [0, R). */
  const char* gpu_uuid;           /**< GPU UUID or PCI bus id; NULL or "" on the host backend. */
  int32_t launch_mode; /**< An epd_launch_mode_t (int32_t: any value a caller stores is defined). */
  const void* join_secret; /**< The group's secret bytes (at most 256); NULL = none. */
  size_t join_secret_len;
  /* Fields added later: a caller built before them passes the smaller struct_size (then
   * they are 0: a one-node group). */
  /** The group's nodes in order: node i hosts the num_ranks ranks after nodes 0..i-1's (their
   *  sum is num_ranks); read during the call only. NULL with num_nodes 0 = every rank on
   *  this daemon (a one-node group). Every joiner on every node passes the same list; a rank
   *  joins its own node's daemon. */
  const epd_node_t* nodes;
  int32_t num_nodes; /**< Entries of nodes, 0 to 4096. */
  int32_t reserved0; /**< The tail padding of the version that added nodes; ignored. */
  /** The transport between the daemons of a group across nodes (spec.transport): "tcp",
   *  "rdma", or NULL / "" = each daemon's configured default; read during the call only.
   *  Set only with nodes. Appended after num_nodes: an older struct_size reads NULL. */
  const char* transport;
  /** An epd_rank_failure_t: the group's answer to a failed rank (every joiner passes the
   *  same). Added after transport: a shorter struct_size reads 0 (DEFAULT). */
  int32_t on_rank_failure;
} epd_join_options_t;

/** Joins a group and maps the endpoint; *out is the endpoint (epd_endpoint_destroy). Errors
 *  (the daemon's): INVALID_ARGUMENT (a spec field, rank, secret), PERMISSION_DENIED,
 *  FAILED_PRECONDITION (spec differs from the live group's), ALREADY_EXISTS (rank taken),
 *  NOT_FOUND (GPU), RESOURCE_EXHAUSTED, UNAVAILABLE. */
EPD_API epd_status_t epd_client_join(epd_client_t* client, const epd_join_options_t* options,
                                     epd_endpoint_t** out);

/* ---- endpoint ------------------------------------------------------------------------ */

/** What the daemon granted an endpoint. */
typedef struct epd_endpoint_info_t {
  size_t struct_size; /**< sizeof(epd_endpoint_info_t). */
  uint64_t endpoint_id;
  int32_t rank;
  int32_t num_ranks, num_experts, hidden, num_topk, max_tokens_per_rank, ll_max_tokens_per_rank,
      use_fp8;         /**< The group's spec. */
  int32_t launch_mode; /**< The epd_launch_mode_t granted (never DEFAULT). */
  uint32_t op_timeout_ms;
  int32_t cuda;      /**< 1 on the CUDA backend (tensors kDLCUDA), 0 on the host backend. */
  char group[72];    /**< The group's name, NUL-terminated. */
  char gpu_uuid[64]; /**< The endpoint's GPU ("" on the host backend), NUL-terminated. */
} epd_endpoint_info_t;

/** The endpoint's info into *out. */
EPD_API epd_status_t epd_endpoint_info(const epd_endpoint_t* endpoint, epd_endpoint_info_t* out);
/** Leaves the group (the daemon frees the rank); later ops give FAILED_PRECONDITION.
 *  Idempotent. */
EPD_API epd_status_t epd_endpoint_leave(epd_endpoint_t* endpoint);
/** Leaves and unmaps. CUDA: wait for every op (or sync its stream) first. Ops of this
 *  endpoint then give FAILED_PRECONDITION ("endpoint destroyed"). NULL is a no-op. */
EPD_API void epd_endpoint_destroy(epd_endpoint_t* endpoint);

/** The low-latency combine input region [E/R, R*Mll, H] bf16 (pass it as the combine's x to
 *  skip a copy) or the dispatch input region [Mll, H] bf16; valid while the endpoint lives;
 *  ndim 0 without low-latency mode. When to write them: docs/CLIENT_API.md §9. */
EPD_API epd_status_t epd_low_latency_combine_input(const epd_endpoint_t* endpoint, DLTensor* out);
EPD_API epd_status_t epd_low_latency_dispatch_input(const epd_endpoint_t* endpoint, DLTensor* out);

/* ---- rank masking (docs/RELIABILITY.md) ------------------------------------------------- */

/** A group's rank mask. The caller provides the array: masked_ranks (capacity
 *  masked_ranks_capacity entries, may be NULL with 0) receives the masked ranks, ascending. */
typedef struct epd_rank_mask_t {
  size_t struct_size;            /**< sizeof(epd_rank_mask_t). */
  uint32_t epoch;                /**< The group's mask epoch (0 = no rank ever masked). */
  int32_t num_masked;            /**< Ranks masked (set even when they do not fit). */
  int32_t* masked_ranks;         /**< The caller's array, or NULL. */
  int32_t masked_ranks_capacity; /**< Its entries. */
} epd_rank_mask_t;

/** Masks num_mask ranks of `mask` and unmasks num_unmask of `unmask` (each in [0, R); either
 *  array may be NULL with 0) between two ops of the group: Endpoint::UpdateRankMask. The new
 *  mask goes to *out when out is not NULL. Errors: INVALID_ARGUMENT naming the rank,
 *  FAILED_PRECONDITION (left endpoint, or the group's on_rank_failure is not MASK),
 *  UNAVAILABLE; OUT_OF_RANGE when out->masked_ranks_capacity < num_masked (the update is
 *  done; out->num_masked says how many entries are needed). */
EPD_API epd_status_t epd_endpoint_update_rank_mask(epd_endpoint_t* endpoint, const int32_t* mask,
                                                   size_t num_mask, const int32_t* unmask,
                                                   size_t num_unmask, epd_rank_mask_t* out);
/** The group's current mask into *out (required). Errors as epd_endpoint_update_rank_mask. */
EPD_API epd_status_t epd_endpoint_query_rank_mask(epd_endpoint_t* endpoint, epd_rank_mask_t* out);
/** Unmasks every rank (those not joined stay masked until they rejoin); the new mask to *out
 *  when not NULL. Errors as epd_endpoint_update_rank_mask. */
EPD_API epd_status_t epd_endpoint_clean_rank_mask(epd_endpoint_t* endpoint, epd_rank_mask_t* out);

/** The rank mask an op ran with (the C++ epd::OpMask), in every op result but the layout's. */
typedef struct epd_op_mask_t {
  uint32_t epoch;        /**< The group's mask epoch (0 = no rank ever masked). */
  int32_t num_masked;    /**< Ranks masked in that epoch. */
  int32_t dropped_pairs; /**< This rank's token-expert pairs whose expert was masked. */
  int32_t reserved;      /**< Zero. */
} epd_op_mask_t;

/* ---- ops ----------------------------------------------------------------------------- */

/** What combine and cached re-dispatch need from a dispatch (the C++ epd::Handle): copy it
 *  freely; usable until the next non-cached normal dispatch (normal) or the low-latency
 *  dispatch after next; a stale or foreign one gives FAILED_PRECONDITION. */
typedef struct epd_handle_t {
  uint64_t endpoint_id;
  uint64_t seq;
  int32_t num_tokens;      /**< T (or C) of the dispatch. */
  int32_t num_recv_tokens; /**< N (normal mode). */
  int32_t buffer;          /**< Low-latency buffer set, 0 or 1. */
  uint8_t low_latency;
  uint8_t use_fp8;
  uint8_t reserved0[2]; /**< Zero (else INVALID_ARGUMENT). */
  uint64_t reserved[2]; /**< Zero (else INVALID_ARGUMENT). */
} epd_handle_t;

/** Creates an empty op holder (*out; free with epd_op_destroy). An op call fills it with its
 *  op, replacing (and invalidating the results of) the op it held: reuse one per in-flight
 *  op to submit without allocating. */
EPD_API epd_status_t epd_op_create(epd_op_t** out);
/** Frees the holder and its result views' shape and strides arrays. NULL is a no-op. */
EPD_API void epd_op_destroy(epd_op_t* op);
/** The kind of op held (EPD_OP_NONE for an empty or NULL op). */
EPD_API epd_op_kind_t epd_op_kind(const epd_op_t* op);
/** The op's sequence number on its endpoint (0 for an empty op). */
EPD_API uint64_t epd_op_seq(const epd_op_t* op);
/** Blocks until every rank's part of the op is done, or timeout_ms (negative = no limit)
 *  passes: DEADLINE_EXCEEDED, the op stays pending. On OK the op holds its result (read it
 *  with the epd_op_*_result call of its kind). Errors: the op's own; FAILED_PRECONDITION for
 *  an empty op, an endpoint destroyed, an op older than the endpoint's latest 64. */
EPD_API epd_status_t epd_op_wait(epd_op_t* op, int64_t timeout_ms);
/** Stores the op's result without a CPU wait, for work enqueued after it on its stream
 *  (CUDA backend; FAILED_PRECONDITION on the host backend or with no stream). */
EPD_API epd_status_t epd_op_enqueued(epd_op_t* op);

/** Arguments of epd_get_dispatch_layout. */
typedef struct epd_layout_args_t {
  size_t struct_size;       /**< sizeof(epd_layout_args_t). */
  const DLTensor* topk_idx; /**< [T, K] int64, -1 = none. */
  void* stream;             /**< CUDA backend: the cudaStream_t; NULL = none. */
} epd_layout_args_t;
/** Result of a GetDispatchLayout; valid until the next one on the endpoint. */
typedef struct epd_layout_result_t {
  size_t struct_size;
  DLTensor num_tokens_per_rank;   /**< [R] int32. */
  DLTensor num_tokens_per_expert; /**< [E] int32. */
  DLTensor is_token_in_rank;      /**< [T, R] uint8 0/1. */
} epd_layout_result_t;

/** Arguments of epd_dispatch (normal mode). */
typedef struct epd_dispatch_args_t {
  size_t struct_size;           /**< sizeof(epd_dispatch_args_t). */
  const DLTensor* x;            /**< [T, H] bf16, or [T, H] e4m3 with x_scales. */
  const DLTensor* x_scales;     /**< [T, H/128] f32 with e4m3 x; else NULL. */
  const DLTensor* topk_idx;     /**< [T, K] int64; not read with `cached`. */
  const DLTensor* topk_weights; /**< [T, K] f32 or NULL; not read with `cached`. */
  int32_t expert_alignment;     /**< Per-expert counts rounded up to it; 0 = 1. */
  int32_t num_sms;              /**< Kernel SM budget; 0 = default. */
  const epd_handle_t* cached;   /**< Re-dispatch x with this handle's routing; NULL = no. */
  void* stream;                 /**< CUDA backend: the cudaStream_t. */
} epd_dispatch_args_t;
/** Result of a normal dispatch; valid until the next normal dispatch on the endpoint. */
typedef struct epd_dispatch_result_t {
  size_t struct_size;
  DLTensor recv_x;                     /**< [N, H] bf16 or e4m3. */
  DLTensor recv_scales;                /**< [N, H/128] f32 (FP8; else ndim 0). */
  DLTensor recv_topk_idx;              /**< [N, K] int64 local expert ids, -1 elsewhere. */
  DLTensor recv_topk_weights;          /**< [N, K] f32. */
  DLTensor num_recv_tokens_per_expert; /**< [E/R] int32, aligned. */
  DLTensor recv_src_info;              /**< [N] int32: src_rank * M + src_token. */
  DLTensor recv_count;                 /**< [1] int32: N, in the endpoint's memory. */
  epd_handle_t handle;
  int32_t num_recv_tokens; /**< N; -1 from enqueued (views of R*M rows). */
  /** The mask the op ran with (set by epd_op_wait; zero from enqueued). Added after the first
   *  version: a shorter struct_size does not receive it. */
  epd_op_mask_t mask;
} epd_dispatch_result_t;

/** Arguments of epd_combine (normal mode). */
typedef struct epd_combine_args_t {
  size_t struct_size;           /**< sizeof(epd_combine_args_t). */
  const DLTensor* x;            /**< [N, H] bf16 expert outputs, rows as received. */
  const epd_handle_t* handle;   /**< From the matching dispatch. */
  const DLTensor* topk_weights; /**< [N, K] f32 or NULL. */
  int32_t num_sms;
  void* stream;
} epd_combine_args_t;
/** Result of a normal combine; valid until the next normal combine on the endpoint. */
typedef struct epd_combine_result_t {
  size_t struct_size;
  DLTensor combined_x;            /**< [T, H] bf16. */
  DLTensor combined_topk_weights; /**< [T, K] f32 (with topk_weights; else ndim 0). */
  epd_op_mask_t mask;             /**< As epd_dispatch_result_t.mask (added later too). */
} epd_combine_result_t;

/** Arguments of epd_low_latency_dispatch. */
typedef struct epd_ll_dispatch_args_t {
  size_t struct_size;                   /**< sizeof(epd_ll_dispatch_args_t). */
  const DLTensor* x;                    /**< [T, H] bf16, T <= Mll. */
  const DLTensor* topk_idx;             /**< [T, K] int64. */
  int32_t max_dispatch_tokens_per_rank; /**< Mll; 0 = the spec's. */
  int32_t use_fp8;                      /**< Nonzero: e4m3 out, f32 scale per 128 channels. */
  int32_t round_scale;                  /**< Nonzero: power-of-two scales (with use_fp8). */
  void* stream;
  const DLTensor* num_tokens; /**< Client-launched: [1] int32 on the GPU holding T; or NULL. */
  /** Nonzero: recv_scales as int32 words of four UE8M0 exponent bytes (DeepEP's use_ue8m0;
   *  needs use_fp8, round_scale, hidden % 512 == 0). Added after the first version: a
   *  struct_size that stops before it reads 0. */
  int32_t use_ue8m0;
} epd_ll_dispatch_args_t;
/** Result of a low-latency dispatch (double-buffered: valid until the low-latency dispatch
 *  after next), also of a program's dispatch step. */
typedef struct epd_ll_dispatch_result_t {
  size_t struct_size;
  DLTensor recv_x; /**< [E/R, R*Mll, H] bf16 or e4m3. */
  /** FP8 only (else ndim 0), stored token index fastest: shape [E/R, R*Mll, H/128] f32 with
   *  strides {H/128 * R*Mll, 1, R*Mll}; with use_ue8m0 [E/R, R*Mll, H/512] int32 with strides
   *  {H/512 * R*Mll, 1, R*Mll}. The strides array lives with the shape array. */
  DLTensor recv_scales;
  DLTensor recv_count;    /**< [E/R] int32. */
  DLTensor recv_src_info; /**< [E/R, R*Mll] int32: src_rank * Mll + token. */
  epd_handle_t handle;
  epd_op_mask_t mask; /**< As epd_dispatch_result_t.mask (added later too). */
} epd_ll_dispatch_result_t;

/** Arguments of epd_low_latency_combine. */
typedef struct epd_ll_combine_args_t {
  size_t struct_size;           /**< sizeof(epd_ll_combine_args_t). */
  const DLTensor* x;            /**< [E/R, R*Mll, H] bf16 expert outputs. */
  const DLTensor* topk_idx;     /**< [T, K] int64, as dispatched. */
  const DLTensor* topk_weights; /**< [T, K] f32. */
  const epd_handle_t* handle;
  void* stream;
} epd_ll_combine_args_t;
/** Result of a low-latency combine (valid until the low-latency combine after next), also
 *  of a program's combine step. */
typedef struct epd_ll_combine_result_t {
  size_t struct_size;
  DLTensor combined_x; /**< [T, H] bf16 ([C, H] in a program, rows [0, T) written). */
  epd_op_mask_t mask;  /**< As epd_dispatch_result_t.mask (added later too). */
} epd_ll_combine_result_t;

/** Submit an op into `op` (an epd_op_create holder); its result comes from epd_op_wait or
 *  epd_op_enqueued, then the epd_op_*_result call of its kind. Errors (§6 of
 *  docs/CLIENT_API.md): INVALID_ARGUMENT (a tensor's shape, dtype, device or value, named),
 *  FAILED_PRECONDITION (left endpoint, stale or foreign handle), DEADLINE_EXCEEDED,
 *  UNAVAILABLE. */
EPD_API epd_status_t epd_get_dispatch_layout(epd_endpoint_t* endpoint,
                                             const epd_layout_args_t* args, epd_op_t* op);
EPD_API epd_status_t epd_dispatch(epd_endpoint_t* endpoint, const epd_dispatch_args_t* args,
                                  epd_op_t* op);
EPD_API epd_status_t epd_combine(epd_endpoint_t* endpoint, const epd_combine_args_t* args,
                                 epd_op_t* op);
EPD_API epd_status_t epd_low_latency_dispatch(epd_endpoint_t* endpoint,
                                              const epd_ll_dispatch_args_t* args, epd_op_t* op);
EPD_API epd_status_t epd_low_latency_combine(epd_endpoint_t* endpoint,
                                             const epd_ll_combine_args_t* args, epd_op_t* op);

/** The result an op holds after a successful epd_op_wait / epd_op_enqueued, into *out. The
 *  DLTensors' data is valid until the point its result type names; their shape (and strides)
 *  arrays live in the op holder (until it is reused or destroyed). FAILED_PRECONDITION when the op
 * holds no result or is of another kind (both named). */
EPD_API epd_status_t epd_op_layout_result(const epd_op_t* op, epd_layout_result_t* out);
EPD_API epd_status_t epd_op_dispatch_result(const epd_op_t* op, epd_dispatch_result_t* out);
EPD_API epd_status_t epd_op_combine_result(const epd_op_t* op, epd_combine_result_t* out);
EPD_API epd_status_t epd_op_ll_dispatch_result(const epd_op_t* op, epd_ll_dispatch_result_t* out);
EPD_API epd_status_t epd_op_ll_combine_result(const epd_op_t* op, epd_ll_combine_result_t* out);

/* ---- graph mode (CUDA backend, daemon-launched; docs/CLIENT_API.md §11) --------------- */

/** One program step. */
typedef struct epd_program_step_t {
  size_t struct_size;  /**< sizeof(epd_program_step_t); the array's stride is steps[0]'s. */
  int32_t op;          /**< EPD_OP_LOW_LATENCY_DISPATCH or EPD_OP_LOW_LATENCY_COMBINE. */
  int32_t use_fp8;     /**< Dispatch: e4m3 out. */
  int32_t round_scale; /**< Dispatch: power-of-two scales (needs use_fp8). */
  int32_t reserved0;   /**< The first version's tail padding; ignored. */
  /** Dispatch: UE8M0-packed scales (needs use_fp8, round_scale, hidden % 512 == 0). Added
   *  after the first version (a shorter struct_size reads 0). */
  int32_t use_ue8m0;
} epd_program_step_t;

/** Inputs of a program's dispatch step: kDLCUDA, read at run time. */
typedef struct epd_program_dispatch_args_t {
  size_t struct_size;         /**< sizeof(epd_program_dispatch_args_t). */
  const DLTensor* x;          /**< [C, H] bf16, C <= Mll. */
  const DLTensor* topk_idx;   /**< [C, K] int64. */
  const DLTensor* num_tokens; /**< [1] int32: T <= C. */
  void* stream;
} epd_program_dispatch_args_t;
/** Inputs of a program's combine step: kDLCUDA, read at run time. */
typedef struct epd_program_combine_args_t {
  size_t struct_size;           /**< sizeof(epd_program_combine_args_t). */
  const DLTensor* x;            /**< [E/R, R*Mll, H] bf16. */
  const DLTensor* topk_idx;     /**< [C, K] int64, as dispatched. */
  const DLTensor* topk_weights; /**< [C, K] f32. */
  void* stream;
} epd_program_combine_args_t;

/** Registers num_steps (1..16) steps; blocks until every rank registered the same program
 *  and the daemon armed it, or timeout_ms (negative = no limit). Errors: FAILED_PRECONDITION,
 *  UNIMPLEMENTED (host backend), INVALID_ARGUMENT, DEADLINE_EXCEEDED, UNAVAILABLE. */
EPD_API epd_status_t epd_register_program(epd_endpoint_t* endpoint, const epd_program_step_t* steps,
                                          size_t num_steps, int64_t timeout_ms);
/** Enqueue the next program step on args->stream; *out's views are valid for work after it
 *  on the stream until the program's next step into the same buffer; their shape and strides
 *  arrays until the second next call of the same function on the endpoint. */
EPD_API epd_status_t epd_run_program_dispatch(epd_endpoint_t* endpoint,
                                              const epd_program_dispatch_args_t* args,
                                              epd_ll_dispatch_result_t* out);
EPD_API epd_status_t epd_run_program_combine(epd_endpoint_t* endpoint,
                                             const epd_program_combine_args_t* args,
                                             epd_ll_combine_result_t* out);
/** The latest device-side error of the program's checked instances, or OK. Blocks. */
EPD_API epd_status_t epd_program_status(epd_endpoint_t* endpoint);
/** Disarms the program; blocks until every rank unregistered it or timeout_ms. */
EPD_API epd_status_t epd_unregister_program(epd_endpoint_t* endpoint, int64_t timeout_ms);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EPD_EPD_H_ */
