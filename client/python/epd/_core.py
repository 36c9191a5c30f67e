"""The pythonic core API over epd._C: Client, GroupSpec, Endpoint (docs/CLIENT_API.md "Python")."""

import collections
import json
import os
import sys
import weakref

from . import _C
from ._errors import ERROR_TYPES, InvalidArgumentError

_C._set_error_types(list(ERROR_TYPES))

DEFAULT_SOCKET = "/run/epd/epd.sock"

# DLPack device types epd returns views on.
_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_CUDA_HOST = 3

_LAUNCH_MODES = {"auto": 0, "default": 0, "daemon": 1, "client": 2}
_LAUNCH_MODE_NAMES = {0: "default", 1: "daemon", 2: "client"}
_REGION_KINDS = {"numpy": 0, "torch": 1, "dlpack": 2}
_RANK_FAILURE = {None: 0, "default": 0, "fail": 1, "mask": 2}

# Set up once, at the first join: numpy converters, and torch's once the process has
# imported torch (_Frameworks).
_frameworks = None


class _Frameworks:
    """How views become framework objects: torch tensors for torch inputs, numpy arrays
    (else the DLView itself) for everyone else.

    torch is never imported for a join: importing it takes seconds, and a caller that passes
    torch tensors has imported it already. It is set up when the process has imported it
    (adopt_torch: at the join, and before each op while it is not set up), or imported where
    a call needs it without a torch input (import_torch: a GPU index, a region of kind None
    or "torch")."""

    def __init__(self):
        self.torch = None
        self.fp8 = None
        self._from_dlpack = None
        self._import_tried = False
        self.to_numpy = None
        try:
            import numpy
        except ImportError:
            numpy = None
        if numpy is not None:
            asarray = numpy.asarray
            np_from_dlpack = getattr(numpy, "from_dlpack", None)

            def to_numpy(view):
                # Host memory through __array_interface__: writable on every numpy (numpy
                # 1.x marks DLPack imports read-only).
                if view.__dlpack_device__()[0] in (_KDL_CPU, _KDL_CUDA_HOST) or np_from_dlpack is None:
                    return asarray(view)
                return np_from_dlpack(view)

            self.to_numpy = to_numpy
        self.adopt_torch()

    def to_torch(self, view):
        """The torch tensor of `view` (called by the binding for torch inputs only, which
        exist once torch is set up)."""
        t = self._from_dlpack(view)
        if self.fp8 is not None and view.dtype == "float8_e4m3fn":
            t = t.view(self.fp8)
        return t

    def adopt_torch(self):
        """Sets torch up if this process has imported it (no import here); True when set up."""
        if self.torch is None:
            torch = sys.modules.get("torch")  # None also when blocked (sys.modules["torch"] = None).
            if torch is not None:
                self._set_torch(torch)
        return self.torch is not None

    def import_torch(self):
        """Imports torch (tried once) and sets it up; True when set up, False without torch."""
        if self.torch is None and not self.adopt_torch() and not self._import_tried:
            self._import_tried = True
            try:
                import torch
            except ImportError:
                return False
            self._set_torch(torch)
        return self.torch is not None

    def _set_torch(self, torch):
        import torch.utils.dlpack

        self._from_dlpack = torch.utils.dlpack.from_dlpack
        self.fp8 = getattr(torch, "float8_e4m3fn", None)
        _C._set_torch(torch.Tensor, getattr(torch._C, "_to_dlpack", None))
        self.torch = torch


def _setup_frameworks():
    global _frameworks
    if _frameworks is None:
        _frameworks = _Frameworks()
    return _frameworks


class NodeSpec(collections.namedtuple("NodeSpec", ["peer_address", "num_ranks"])):
    """One node of a group that spans several epd daemons (epd.v1.NodeSpec): its daemon's
    Peer address "host:port" (Client.peer_address on that node) and how many consecutive
    ranks it hosts (>= 1)."""

    __slots__ = ()


class GroupSpec(
    collections.namedtuple(
        "GroupSpec",
        [
            "name",
            "num_ranks",
            "hidden",
            "num_topk",
            "num_experts",
            "max_tokens_per_rank",
            "max_dispatch_tokens_per_rank",
            "use_fp8",
            "nodes",
            "transport",
            "on_rank_failure",
        ],
        defaults=(0, False, (), "", None),
    )
):
    """A group's shape (epd.v1.GroupSpec); every rank joins with the same one.

    name: [A-Za-z0-9_.-]{1,64}; num_ranks R; hidden H (a multiple of 128 with use_fp8);
    num_topk K; num_experts E (a multiple of R); max_tokens_per_rank M (normal mode);
    max_dispatch_tokens_per_rank Mll (low-latency mode; 0 = no low-latency ops);
    use_fp8: FP8 data allowed (normal dispatch with x_scales, low-latency use_fp8);
    nodes: for a group across several epd daemons, its nodes in order, each a NodeSpec or a
    ("host:port", num_ranks) pair: node i hosts the num_ranks ranks after nodes 0..i-1's
    (their sum is num_ranks), and each rank joins its own node's daemon. () = every rank on
    this daemon (a one-node group).
    transport: the transport between the nodes' daemons, "tcp" or "rdma"; "" = each daemon's
    configured default. Set only with nodes.
    on_rank_failure: the group's answer to a failed rank (docs/RELIABILITY.md): None (the
    daemon's default, "fail"), "fail" (the op fails on every rank) or "mask" (the rank is
    masked and the op completes for the others).

        epd.GroupSpec("moe0", num_ranks=8, ..., nodes=[("10.0.0.1:7300", 4), ("10.0.0.2:7300", 4)],
                      transport="rdma")
    """

    __slots__ = ()


def _node_list(nodes):
    """GroupSpec.nodes as a list of (str, int) pairs for epd._C; InvalidArgumentError naming
    the entry for anything else."""
    if nodes is None:
        return []
    if isinstance(nodes, (str, bytes)):
        raise InvalidArgumentError(
            3, "INVALID_ARGUMENT", "join: spec.nodes is a %s, expected a list of "
            "(peer_address, num_ranks) pairs" % type(nodes).__name__)
    try:
        entries = list(nodes)
    except TypeError:
        raise InvalidArgumentError(
            3, "INVALID_ARGUMENT", "join: spec.nodes is a %s, expected a list of "
            "(peer_address, num_ranks) pairs" % type(nodes).__name__) from None
    out = []
    for i, node in enumerate(entries):
        if isinstance(node, (str, bytes)) or not isinstance(node, (tuple, list)) or len(node) != 2:
            raise InvalidArgumentError(
                3, "INVALID_ARGUMENT", "join: spec.nodes[%d]=%r, expected a NodeSpec or a "
                "(peer_address, num_ranks) pair" % (i, node))
        out.append((node[0], node[1]))
    return out


class RankMask(collections.namedtuple("RankMask", ["epoch", "masked_ranks"])):
    """A group's rank mask: epoch (int, 0 = no rank ever masked) and masked_ranks (a tuple
    of ints, ascending)."""

    __slots__ = ()


EndpointInfo = collections.namedtuple(
    "EndpointInfo",
    [
        "endpoint_id",
        "rank",
        "group",
        "launch_mode",
        "op_timeout_ms",
        "cuda",
        "gpu_uuid",
    ],
)
EndpointInfo.__doc__ = (
    "What the daemon granted an endpoint: endpoint_id, rank, group name, launch_mode "
    "('daemon' or 'client'), op_timeout_ms, cuda (True on the CUDA backend), gpu_uuid."
)


def _gpu_uuid(gpu, client):
    """The GPU argument of join as the UUID string the daemon takes ("" on the host backend)."""
    if gpu is None:
        if client._c.stats("join")["backend"] != "cuda":
            return ""
        fw = _setup_frameworks()
        if not fw.import_torch() or not fw.torch.cuda.is_available():
            raise InvalidArgumentError(
                3, "INVALID_ARGUMENT", "join: gpu=None on the CUDA backend needs torch.cuda to "
                "name the current device; pass gpu= a UUID or PCI bus id")
        gpu = fw.torch.cuda.current_device()
    if isinstance(gpu, int):
        fw = _setup_frameworks()
        if not fw.import_torch() or not fw.torch.cuda.is_available():
            raise InvalidArgumentError(
                3, "INVALID_ARGUMENT",
                "join: gpu=%d is a device index, which needs torch.cuda; pass a UUID" % gpu)
        uuid = getattr(fw.torch.cuda.get_device_properties(gpu), "uuid", None)
        if uuid is None:
            raise InvalidArgumentError(
                3, "INVALID_ARGUMENT",
                "join: gpu=%d: this torch has no device UUIDs; pass a UUID or PCI bus id" % gpu)
        text = str(uuid)
        return text if text.startswith("GPU-") else "GPU-" + text
    if isinstance(gpu, str):
        return gpu
    raise InvalidArgumentError(
        3, "INVALID_ARGUMENT",
        "join: gpu is a %s; expected None, a device index or a UUID string" % type(gpu).__name__)


class Client:
    """A connection to the daemon and its Session (closed when the process exits).

    Use Client.connect(). Safe to use from several threads. close() (or the end of a with
    block) leaves every endpoint this client joined; the Session itself ends once the last
    endpoint and the last view of its buffers are gone.
    """

    def __init__(self, c):
        self._c = c
        self._endpoints = weakref.WeakSet()

    @classmethod
    def connect(cls, socket=None, client_name="", timeout=5.0):
        """Connects to the daemon on `socket` (a path: None: $EPD_SOCKET, else
        /run/epd/epd.sock). timeout in seconds (None or 0: 5 s). Raises UnavailableError naming
        the socket when no daemon answers; InvalidArgumentError for a NUL in socket or
        client_name, or a negative or NaN timeout."""
        if socket is None:
            socket = os.environ.get("EPD_SOCKET") or None
        return cls(_C.Client.connect(socket, client_name, timeout))

    @property
    def session_id(self):
        """The Session id the daemon assigned (str)."""
        return self._c.session_id

    def stats(self):
        """The daemon's GetStats as a dict (protobuf JSON)."""
        return json.loads(self._c.stats_json())

    def stats_summary(self):
        """The main figures of GetStats: version, backend, serving_status, num_gpus,
        num_groups, num_sessions, uptime_ms, ops_completed, ops_failed, pid, ..."""
        return self._c.stats()

    @property
    def peer_address(self):
        """This daemon's advertised Peer address "host:port" (str): what a NodeSpec names it
        by in a group across daemons; "" when its Peer listener is off (one-node groups
        only). Asked of the daemon (GetStats) at each read."""
        return self._c.peer_address()

    def list_groups(self):
        """The groups this uid owns or holds a rank of: a list of dicts (protobuf JSON)."""
        return json.loads(self._c.list_groups_json()).get("groups", [])

    def join(self, spec, rank, gpu=None, launch_mode="auto", join_secret=b""):
        """Joins `spec` (a GroupSpec) as `rank` and returns its Endpoint.

        gpu: None (host backend; on the CUDA backend torch's current device), a device index
        (needs torch.cuda) or a GPU UUID / PCI bus id string. launch_mode: "auto", "daemon"
        or "client" (fixed by the group's first joiner). join_secret: bytes (at most 256)
        every rank of the group presents. Raises InvalidArgumentError (a spec field or the
        rank not an int32, a str field not a str or holding a NUL; the daemon's checks),
        PermissionDeniedError, FailedPreconditionError (spec differs from the live
        group's), AlreadyExistsError (rank taken), NotFoundError (GPU),
        ResourceExhaustedError, UnavailableError.
        """
        if not isinstance(spec, GroupSpec):
            raise InvalidArgumentError(
                3, "INVALID_ARGUMENT", "join: spec is a %s, expected an epd.GroupSpec" % type(spec).__name__)
        mode = _LAUNCH_MODES.get(launch_mode)
        if mode is None:
            raise InvalidArgumentError(
                3, "INVALID_ARGUMENT",
                "join: launch_mode=%r, expected one of %s" % (launch_mode, sorted(_LAUNCH_MODES)))
        if isinstance(join_secret, str):
            join_secret = join_secret.encode()
        policy = _RANK_FAILURE.get(spec.on_rank_failure) if isinstance(
            spec.on_rank_failure, (str, type(None))) else None
        if policy is None:
            raise InvalidArgumentError(
                3, "INVALID_ARGUMENT", "join: spec.on_rank_failure=%r, expected None, 'fail' or "
                "'mask'" % (spec.on_rank_failure,))
        fw = _setup_frameworks()
        nodes = _node_list(spec.nodes)
        c_ep = self._c.join(
            spec.name,
            spec.num_ranks,
            spec.num_experts,
            spec.hidden,
            spec.num_topk,
            spec.max_tokens_per_rank,
            spec.max_dispatch_tokens_per_rank,
            bool(spec.use_fp8),
            rank,
            _gpu_uuid(gpu, self),
            mode,
            bytes(join_secret),
            nodes,
            spec.transport,
            policy,
        )
        ep = Endpoint(self, c_ep, fw, tuple(NodeSpec(*n) for n in nodes), spec.transport or "",
                      spec.on_rank_failure)
        self._endpoints.add(ep)
        return ep

    def reconnect(self, timeout=30.0):
        """After the daemon restarted (calls raise UnavailableError): opens a new Session on the
        same socket (retrying while the daemon restarts, up to `timeout` seconds; None: 30 s,
        inf: no limit) and rejoins every endpoint of this client that was not left or
        closed, with the spec and rank it joined with. The Endpoint objects stay valid, bound
        to new buffers: ops (PendingOps) from before raise UnavailableError, and results,
        views and handles from before are stale (views still read, old data); a new
        session_id and endpoint_id. With the Session still open it only rejoins endpoints a
        failed reconnect left behind. Every rank of a group must reconnect. Raises
        UnavailableError (no daemon within timeout), PermissionDeniedError, or a rejoin's
        error (its code, naming the group and rank; the others are still rejoined and
        reconnect may be called again). Do not use this client's endpoints from other
        threads while it runs."""
        try:
            self._c.reconnect(timeout)
        finally:
            for ep in list(self._endpoints):
                ep._rebound()

    def close(self):
        """Leaves every endpoint of this client and releases the connection. Idempotent."""
        for ep in list(self._endpoints):
            ep.close()
        self._c.close()

    @property
    def closed(self):
        return self._c.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Endpoint:
    """One rank of a group: runs the group's ops (every rank issues the same ops in the
    same order). Use from one thread at a time: a call (op, PendingOp.wait) while another
    thread's is running raises FailedPreconditionError ("endpoint used from two threads at
    once"). close() may come from any thread: a call running then finishes or raises
    FailedPreconditionError / UnavailableError, and the endpoint leaves once it returns.

    Results are zero-copy views of the endpoint's buffers (torch tensors for torch inputs,
    numpy arrays otherwise), valid until the op that overwrites them (docs/CLIENT_API.md
    section 7) and cached: an op returns the same tensor objects as an earlier op whose
    result lay in the same buffer with the same shape and strides (the C ABI's: low-latency
    FP8 recv_scales are token-index fastest). Do not resize or re-stride them in
    place. A view keeps the endpoint's memory mapped after close().
    """

    def __init__(self, client, c_ep, fw, nodes=(), transport="", on_rank_failure=None):
        self._c = c_ep
        self.client = client
        c_ep.set_converters(fw.to_numpy, fw.to_torch)
        self._fw = fw
        self._nodes = nodes
        self._transport = transport
        self._on_rank_failure = on_rank_failure
        self._read_info()
        # Bound methods of the binding, looked up once.
        self._layout = c_ep.layout
        self._dispatch = c_ep.dispatch
        self._combine = c_ep.combine
        self._ll_dispatch = c_ep.ll_dispatch
        self._ll_combine = c_ep.ll_combine

    def _read_info(self):
        i = self._c.info()
        self.rank = i["rank"]
        self.spec = GroupSpec(
            i["group"],
            i["num_ranks"],
            i["hidden"],
            i["num_topk"],
            i["num_experts"],
            i["max_tokens_per_rank"],
            i["ll_max_tokens_per_rank"],
            i["use_fp8"],
            self._nodes,
            self._transport,
            self._on_rank_failure,
        )
        self.info = EndpointInfo(
            i["endpoint_id"],
            i["rank"],
            i["group"],
            _LAUNCH_MODE_NAMES.get(i["launch_mode"], str(i["launch_mode"])),
            i["op_timeout_ms"],
            i["cuda"],
            i["gpu_uuid"],
        )

    def _rebound(self):
        """Client.reconnect re-bound the C endpoint: new endpoint_id, new buffers."""
        if self._c.closed:
            return
        self._c.rebound()
        self._read_info()

    def __repr__(self):
        return "epd.Endpoint(group=%r, rank=%d, endpoint_id=%d%s)" % (
            self.info.group, self.rank, self.info.endpoint_id, ", closed" if self.closed else "")

    # ---- lifetime ------------------------------------------------------------------------

    def leave(self):
        """Leaves the group (the daemon frees the rank); later ops raise
        FailedPreconditionError. Idempotent; a no-op after close() (which left). While
        another thread's call on this endpoint runs, the leave happens when it returns."""
        self._c.leave()

    def close(self):
        """Leaves and drops this object's caches; later ops raise FailedPreconditionError.
        The buffers stay mapped while views of them live. Idempotent. From another thread
        while an op runs: the op finishes or raises, and the endpoint leaves once it returns.
        On the CUDA backend wait for (or synchronise) every op first."""
        self._c.close()

    @property
    def closed(self):
        return self._c.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- rank masking (docs/RELIABILITY.md) ----------------------------------------------

    def update_rank_mask(self, mask=(), unmask=()):
        """Masks the ranks in `mask` and unmasks those in `unmask` (ints in [0, R)) between
        two ops of the group; returns the new RankMask. Raises InvalidArgumentError naming a
        bad rank, FailedPreconditionError (left, or the group's on_rank_failure is not
        "mask"), UnavailableError."""
        return RankMask(*self._mask_reply(self._c.rank_mask(0, mask, unmask)))

    def query_rank_mask(self):
        """The group's current RankMask (errors as update_rank_mask)."""
        return RankMask(*self._mask_reply(self._c.rank_mask(1)))

    def clean_rank_mask(self):
        """Unmasks every rank (those not joined stay masked until they rejoin); returns the
        new RankMask (errors as update_rank_mask)."""
        return RankMask(*self._mask_reply(self._c.rank_mask(2)))

    @staticmethod
    def _mask_reply(reply):
        epoch, ranks = reply
        return epoch, tuple(ranks)

    # ---- ops -----------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, stream=None, wait=True):
        """Routing statistics of topk_idx [T, K] int64 (-1 = none): a LayoutResult
        (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank
        [T, R] uint8 0/1), which unpacks as that 3-tuple. wait=False: a PendingOp."""
        if self._fw.torch is None:
            self._fw.adopt_torch()
        return self._layout(topk_idx, stream, wait)

    def dispatch(self, x, x_scales=None, topk_idx=None, topk_weights=None, expert_alignment=1,
                 handle=None, num_sms=0, stream=None, wait=True):
        """Normal (high-throughput) dispatch of x [T, H] bfloat16, or FP8 x [T, H]
        (torch.float8_e4m3fn or uint8 bits) with x_scales [T, H/128] float32.

        topk_idx [T, K] int64 and topk_weights [T, K] float32 (optional) route the tokens;
        handle: re-dispatch x with an earlier dispatch's routing (topk_* not read).
        Returns a DispatchResult (recv_x, recv_scales, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert, recv_src_info, recv_count, handle, num_recv_tokens),
        valid until the next normal dispatch; wait=False: a PendingOp.
        """
        if self._fw.torch is None:
            self._fw.adopt_torch()
        if x_scales is not None:
            fp8 = self._fw.fp8
            if fp8 is not None and getattr(x, "dtype", None) is fp8:
                x = x.view(self._fw.torch.uint8)
        return self._dispatch(x, x_scales, topk_idx, topk_weights, expert_alignment, num_sms,
                              handle, stream, wait)

    def combine(self, x, handle, topk_weights=None, num_sms=0, stream=None, wait=True):
        """Normal combine of x [N, H] bfloat16 (rows as received) with the dispatch's
        handle; topk_weights [N, K] float32 optional. Returns a CombineResult (combined_x
        [T, H] bfloat16, combined_topk_weights [T, K] float32 or None), valid until the
        next normal combine; wait=False: a PendingOp."""
        if self._fw.torch is None:
            self._fw.adopt_torch()
        return self._combine(x, handle, topk_weights, num_sms, stream, wait)

    def low_latency_dispatch(self, x, topk_idx, use_fp8=False, round_scale=False,
                             use_ue8m0=False, num_tokens=None, stream=None, wait=True,
                             max_dispatch_tokens_per_rank=0):
        """Low-latency dispatch of x [T, H] bfloat16 (T <= Mll) routed by topk_idx [T, K]
        int64 into [E/R, R*Mll, H]. use_fp8: float8_e4m3fn out with float32 scales per 128
        channels, recv_scales [E/R, R*Mll, H/128] with strides (H/128*R*Mll, 1, R*Mll)
        (token index fastest, DeepEP's layout); round_scale: power-of-two scales;
        use_ue8m0 (needs both, and H % 512 == 0): recv_scales packed UE8M0 int32
        [E/R, R*Mll, H/512] (four exponent bytes per word, block 4j + i in byte i), strides
        (H/512*R*Mll, 1, R*Mll). num_tokens: None (T = x's rows) or, on a client-launched
        endpoint only, a [1] int32 tensor on the endpoint's GPU holding T (not an int).
        max_dispatch_tokens_per_rank: 0 or the spec's Mll.
        Returns a LowLatencyDispatchResult (recv_x, recv_scales, recv_count, recv_src_info,
        handle), valid until the low-latency dispatch after next; wait=False: a PendingOp.
        InvalidArgumentError names use_ue8m0 when it lacks use_fp8, round_scale or
        H % 512 == 0."""
        if self._fw.torch is None:
            self._fw.adopt_torch()
        return self._ll_dispatch(x, topk_idx, max_dispatch_tokens_per_rank, use_fp8,
                                 round_scale, use_ue8m0, num_tokens, stream, wait)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, stream=None, wait=True):
        """Low-latency combine of x [E/R, R*Mll, H] bfloat16 (pass
        low_latency_combine_input() to skip a copy) with topk_idx [T, K] int64 and
        topk_weights [T, K] float32 as dispatched, and the dispatch's handle. Returns a
        LowLatencyCombineResult (combined_x [T, H] bfloat16), valid until the low-latency
        combine after next; wait=False: a PendingOp."""
        if self._fw.torch is None:
            self._fw.adopt_torch()
        return self._ll_combine(x, topk_idx, topk_weights, handle, stream, wait)

    def low_latency_combine_input(self, kind=None):
        """The endpoint's low-latency combine input region [E/R, R*Mll, H] bfloat16, writable
        and zero-copy; None without low-latency mode. kind: None (torch when importable, else
        numpy), "torch", "numpy" (uint16 bf16 bits) or "dlpack" (the epd.DLView). The same
        object every call. Valid while the endpoint's memory is mapped; write it only once
        this rank's next low-latency dispatch is done."""
        return self._c.input_region(True, self._region_kind(kind))

    def low_latency_dispatch_input(self, kind=None):
        """The low-latency dispatch input region [Mll, H] bfloat16 (as
        low_latency_combine_input); rows [0, T) of it passed as x skip a copy."""
        return self._c.input_region(False, self._region_kind(kind))

    def _region_kind(self, kind):
        if kind is None:
            return 1 if self._fw.import_torch() else 0
        mode = _REGION_KINDS.get(kind)
        if mode is None or (mode == 1 and not self._fw.import_torch()) or (mode == 0 and self._fw.to_numpy is None):
            raise InvalidArgumentError(
                3, "INVALID_ARGUMENT",
                "kind=%r: expected None, 'torch' (needs torch), 'numpy' (needs numpy) or 'dlpack'" % (kind,))
        return mode


def version():
    """epd's version ("MAJOR.MINOR.PATCH") as libepdclient reports it."""
    return _C.version()
