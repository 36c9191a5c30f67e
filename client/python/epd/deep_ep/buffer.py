"""Buffer: DeepEP V1's deep_ep.Buffer API over epd's core Python API.

A Buffer is one rank's share of an expert-parallel group on a torch.distributed group. It
joins up to two epd groups, each created at its first op from that op's shapes within the
Buffer's byte budgets: one for normal (high-throughput) ops within num_nvl_bytes, one for
low-latency ops within num_rdma_bytes. docs/DEEP_EP.md is the full story (what maps onto
what, what each result is, what is not supported).

Every op runs on torch.cuda.current_stream() (CUDA) or synchronously (epd's host backend,
CPU tensors). Every rank must issue the same ops in the same order, as with DeepEP.
"""

import operator
import os
import secrets
import socket
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import _core as _epd_core
from .. import _errors as _epd_errors
from . import _sizes
from ._pending import PendingOps
from ._errors import invalid, precondition, too_small, unsupported
from .config import Config
from .event import EventHandle, EventOverlap

__all__ = ["Buffer", "DispatchHandle", "LowLatencyHandle", "topk_idx_t"]

topk_idx_t = torch.int64

# cudaStreamLegacy: the handle epd takes for torch's default stream (cuda_stream 0, which
# epd would read as "no stream").
_CUDA_STREAM_LEGACY = 1
# Low-latency ops not given a hook are not waited for per op: their errors are collected
# every this many ops (docs/DEEP_EP.md "Errors of low-latency ops").
_LL_CHECK_EVERY = 32
# The top-k the low-latency size hint provisions for (min(num_experts, this)).
_LL_HINT_TOPK = 32


class _Group:
    """One joined epd group of a Buffer: the endpoint and the shape it was created with."""

    def __init__(self, ep):
        self.ep = ep
        self.spec = ep.spec
        # Its ops submitted without a CPU wait (CUDA backend), not waited for yet.
        self.pending = PendingOps(ep.info.launch_mode == "client", _LL_CHECK_EVERY)

    def bytes_for(self, **changes) -> int:
        s = self.spec
        shape = dict(num_ranks=s.num_ranks, num_experts=s.num_experts, hidden=s.hidden,
                     num_topk=s.num_topk, max_tokens_per_rank=s.max_tokens_per_rank,
                     ll_max_tokens_per_rank=s.max_dispatch_tokens_per_rank, use_fp8=s.use_fp8)
        shape.update(changes)
        return _sizes.endpoint_bytes(**shape)


class DispatchHandle(tuple):
    """The handle of a normal dispatch, a 6-tuple like DeepEP's intranode handle:

    (rank_prefix_matrix [R, R] int32, None, None, recv_src_idx [N] int32,
     is_token_in_rank [T, R] bool, None).

    rank_prefix_matrix[i][rank] is exact (rows received here from ranks 0..i, cumulative);
    the other columns belong to the other ranks and are -1. recv_src_idx is each received
    row's token index on its source rank. The routing is kept so that the handle serves
    combine and cached dispatch after later dispatches (docs/DEEP_EP.md "Handles").
    """

    def __new__(cls, items, owner, group, ep_handle, generation, routing):
        self = super().__new__(cls, items)
        self._owner = owner
        self._group = group
        self._ep_handle = ep_handle
        self._generation = generation
        self._routing = routing
        return self


class LowLatencyHandle:
    """The handle of a low-latency dispatch; indexes and unpacks like DeepEP's 5-tuple:

    (recv_src_info [E/R, R*Mll] int32: each row's token index on its source rank,
     recv_layout_range [E/R, R] int64: (first row << 32) | rows, per source rank,
     num_max_dispatch_tokens_per_rank, hidden, num_experts).

    The two tensors are computed at their first access from epd's recv_src_info
    (src_rank * Mll + token) and recv_count, so an op that never reads them allocates
    nothing. Valid as the dispatch's results: until the low-latency dispatch after next.
    """

    __slots__ = ("_owner", "_group", "_ep_handle", "_src_info", "_recv_count", "_src_idx",
                 "_layout", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")

    def __init__(self, owner, group, ep_handle, src_info, recv_count, mll, hidden, num_experts):
        self._owner = owner
        self._group = group
        self._ep_handle = ep_handle
        self._src_info = src_info
        self._recv_count = recv_count
        self._src_idx = None
        self._layout = None
        self.num_max_dispatch_tokens_per_rank = mll
        self.hidden = hidden
        self.num_experts = num_experts

    @property
    def recv_src_info(self) -> torch.Tensor:
        if self._src_idx is None:
            self._src_idx = self._src_info % self.num_max_dispatch_tokens_per_rank
        return self._src_idx

    @property
    def recv_layout_range(self) -> torch.Tensor:
        if self._layout is None:
            self._layout = _layout_range(self._src_info, self._recv_count,
                                         self.num_max_dispatch_tokens_per_rank,
                                         self._group.spec.num_ranks)
        return self._layout

    def _items(self):
        return (self.recv_src_info, self.recv_layout_range, self.num_max_dispatch_tokens_per_rank,
                self.hidden, self.num_experts)

    def __len__(self):
        return 5

    def __getitem__(self, index):
        return self._items()[index]

    def __iter__(self):
        return iter(self._items())


def _layout_range(src_info: torch.Tensor, recv_count: torch.Tensor, mll: int, num_ranks: int):
    """[E/R, R] int64 (first row << 32) | rows from each source rank: rows of a source are
    contiguous and sources ascend (epd packs by source rank, then token)."""
    num_local, rows = src_info.shape
    valid = torch.arange(rows, device=src_info.device).unsqueeze(0) < recv_count.view(-1, 1)
    src = torch.where(valid, src_info.long() // mll, torch.full_like(src_info, num_ranks, dtype=torch.long))
    counts = torch.zeros((num_local, num_ranks + 1), dtype=torch.long, device=src_info.device)
    counts.scatter_add_(1, src, torch.ones_like(src))
    counts = counts[:, :num_ranks]
    begin = counts.cumsum(dim=1) - counts
    return (begin << 32) | counts


def _non_negative_int(op: str, name: str, value) -> int:
    """value as a Python int >= 0 (anything with __index__, e.g. numpy integers; not bool or
    float), else InvalidArgumentError naming op, the argument and the value."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise invalid(f"{op}: {name} = {value!r} ({type(value).__name__}) must be an int >= 0")
    value = operator.index(value)
    if value < 0:
        raise invalid(f"{op}: {name} = {value} must be an int >= 0")
    return value


def _check_tensor(t, name: str, op: str, dims: int, dtype: Optional[torch.dtype] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise invalid(f"{op}: {name} is a {type(t).__name__}, expected a torch.Tensor")
    if t.dim() != dims:
        raise invalid(f"{op}: {name} has shape {tuple(t.shape)}, expected {dims} dims")
    if dtype is not None and t.dtype != dtype:
        raise invalid(f"{op}: {name} is {t.dtype}, expected {dtype}")


def _pad_columns(t: Optional[torch.Tensor], width: int, fill) -> Optional[torch.Tensor]:
    """t [rows, k] widened to `width` columns of `fill` (t itself when already that wide)."""
    if t is None or t.dim() != 2 or t.size(1) >= width:
        return t
    pad = torch.full((t.size(0), width - t.size(1)), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def _ranks_to_routing(is_token_in_rank: torch.Tensor, num_local_experts: int, width: int):
    """A topk_idx [T, width] routing token t to the first local expert of each rank r with
    is_token_in_rank[t, r] (-1 elsewhere), for dispatches given no topk_idx."""
    mask = is_token_in_rank.bool()
    num_ranks = mask.size(1)
    first = torch.arange(num_ranks, device=mask.device, dtype=torch.int64) * num_local_experts
    idx = torch.where(mask, first.unsqueeze(0), torch.full_like(first, -1).unsqueeze(0))
    return _pad_columns(idx, width, -1).contiguous()


def _layout_torch(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """get_dispatch_layout computed with torch (before the Buffer has an epd group)."""
    if topk_idx.numel() and (int(topk_idx.max()) >= num_experts or int(topk_idx.min()) < -1):
        raise invalid(f"get_dispatch_layout: topk_idx holds ids outside [-1, {num_experts})")
    num_tokens = topk_idx.size(0)
    hit = torch.zeros((num_tokens, num_experts + 1), dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, topk_idx.masked_fill(topk_idx < 0, num_experts), True)
    hit = hit[:, :num_experts]
    per_expert = hit.sum(dim=0, dtype=torch.int32)
    in_rank = hit.view(num_tokens, num_ranks, num_experts // num_ranks).any(dim=2)
    per_rank = in_rank.sum(dim=0, dtype=torch.int32)
    return per_rank, per_expert, in_rank


def _nodes_of(addresses: List[str], hosts: List[str]) -> List[Tuple[str, int]]:
    """The epd nodes of a group from each rank's daemon Peer address (index = rank):
    consecutive ranks with one address form a node; [] when every rank has the same daemon
    address (or none), a one-node group. Raises InvalidArgumentError naming the ranks when a
    node's ranks are not contiguous, and UnimplementedError when ranks on several hosts have
    daemons without a Peer listener."""
    if len(set(addresses)) <= 1:
        if len(set(addresses)) == 1 and addresses[0] == "" and len(set(hosts)) > 1:
            raise unsupported(
                "a group spanning several hosts whose epd daemons have no Peer listener",
                f"the group spans {', '.join(sorted(set(hosts)))}; start each host's epd with "
                "--peer_listen=HOST:PORT and --peer_secret_file=FILE (README \"Two nodes\")")
        return []
    nodes: List[Tuple[str, int]] = []
    for rank, address in enumerate(addresses):
        if address == "":
            raise invalid(f"Buffer: rank {rank}'s epd daemon (host {hosts[rank]}) has no Peer "
                          "listener while other ranks' daemons have one: start every epd with "
                          "--peer_listen")
        if nodes and nodes[-1][0] == address:
            nodes[-1] = (address, nodes[-1][1] + 1)
            continue
        if any(a == address for a, _ in nodes):
            raise invalid(f"Buffer: rank {rank}'s epd daemon {address} also serves earlier ranks "
                          f"but not rank {rank - 1}: the ranks of a node must be contiguous "
                          "(number the ranks node by node)")
        nodes.append((address, 1))
    return nodes


class Buffer:
    """DeepEP's Buffer on epd: normal and low-latency dispatch/combine for one rank.

    Arguments as DeepEP's; group's rank() and size() and all_gather_object are all that is
    used of it (NCCL or gloo). num_nvl_bytes bounds the normal-mode epd group, num_rdma_bytes
    the low-latency one (each created at its first op; an op that does not fit raises
    BufferTooSmallError naming the bytes it needs). num_qps_per_rank is accepted and unused.
    enable_shrink=True makes the low-latency group mask a failed rank instead of failing
    every op (its on_rank_failure "mask", docs/RELIABILITY.md); low_latency_update_mask_buffer
    and its siblings mask ranks by hand. Not supported (UnimplementedError naming the
    option): allow_nvlink_for_low_latency_mode=False, allow_mnnvl=True. The epd daemon is
    $EPD_SOCKET;
    EPD_LAUNCH_MODE (auto|daemon|client) and EPD_JOIN_SECRET are read too. Ranks whose daemons
    differ (several nodes) form a group across those daemons: each rank's daemon Peer address
    is gathered over `group` here, ranks of one daemon must be contiguous, and every daemon
    needs its Peer listener (README "Two nodes"). Such a group uses rank 0's EPD_TRANSPORT
    (tcp|rdma; unset = each daemon's configured default) between the daemons.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None) -> None:
        self._client = None
        self._normal: Optional[_Group] = None
        self._ll: Optional[_Group] = None
        self.explicitly_destroy = explicitly_destroy
        if allow_mnnvl:
            raise unsupported("allow_mnnvl=True", "epd serves the GPUs of one node")
        if not allow_nvlink_for_low_latency_mode:
            raise unsupported("allow_nvlink_for_low_latency_mode=False",
                              "epd moves low-latency data over the node's own GPU links")
        num_nvl_bytes = _non_negative_int("Buffer", "num_nvl_bytes", num_nvl_bytes)
        num_rdma_bytes = _non_negative_int("Buffer", "num_rdma_bytes", num_rdma_bytes)
        if group is not None:
            self.group = group
            self.rank, self.group_size = group.rank(), group.size()

            def all_gather_object(obj):
                out = [None] * self.group_size
                dist.all_gather_object(out, obj, group)
                return out
        elif comm is not None:
            self.group = comm
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
            all_gather_object = comm.allgather
        else:
            raise invalid("Buffer: pass a torch.distributed group (or an mpi4py comm)")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.enable_shrink = enable_shrink
        self._launch_mode = os.environ.get("EPD_LAUNCH_MODE", "auto")
        secret = os.environ.get("EPD_JOIN_SECRET", "").encode()
        # Every rank's daemon and its Peer address, gathered once: a failure to connect is
        # gathered too, so that every rank raises instead of the others waiting for it.
        address, error = "", None
        try:
            self._client = _epd_core.Client.connect(client_name=f"deep_ep rank {self.rank}")
            address = self._client.peer_address
        except _epd_errors.EpdError as e:
            error = e
        mine = (socket.gethostname(), secrets.token_hex(8), secret or secrets.token_bytes(16),
                address, None if error is None else str(error),
                os.environ.get("EPD_TRANSPORT", ""))
        peers = all_gather_object(mine)
        if error is not None:
            raise error
        failed = [r for r, p in enumerate(peers) if p[4] is not None]
        if failed:
            raise precondition(f"Buffer: rank {failed[0]} could not reach its epd daemon: "
                               f"{peers[failed[0]][4]}")
        self._nodes = _nodes_of([p[3] for p in peers], [p[0] for p in peers])
        self._name = f"deep_ep-{peers[0][1]}"
        self._secret = peers[0][2]
        # A one-node group has no transport between daemons (a spec naming one is refused).
        self._transport = peers[0][5] if self._nodes else ""
        # CUDA tensors, streams and a GPU to join with on epd's CUDA backend; CPU tensors and
        # synchronous ops on its host backend (also where torch sees a GPU).
        self._cuda = self._client.stats_summary()["backend"] == "cuda"
        # Normal mode: non-cached dispatches so far (handles remember theirs), the largest
        # top-k get_dispatch_layout saw (the group's top-k), zero rows for _restore.
        self._generation = 0
        self._topk_seen = 0
        self._zero_x = {}

    # ---- lifetime --------------------------------------------------------------------------

    def destroy(self) -> None:
        """Leaves the epd groups and closes the connection (explicitly_destroy=True only).
        Later calls raise FailedPreconditionError."""
        if not self.explicitly_destroy:
            raise precondition("destroy: the Buffer was created with explicitly_destroy=False "
                               "(it is released when garbage-collected)")
        self._release()

    def _release(self) -> None:
        """Waits for the low-latency ops not waited for yet, leaves, closes; then raises the
        first error those ops had, if any."""
        first_error = None
        for g in (self._normal, self._ll):
            if g is not None:
                try:
                    g.pending.drain()
                except _epd_errors.EpdError as e:
                    first_error = first_error or e
        if self._cuda:
            torch.cuda.synchronize()
        for g in (self._normal, self._ll):
            if g is not None:
                g.ep.close()
        self._normal = self._ll = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if first_error is not None:
            raise first_error

    def __del__(self):
        if not getattr(self, "explicitly_destroy", True) and getattr(self, "_client", None):
            try:
                self._release()
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass

    def _live(self, op: str) -> None:
        if self._client is None:
            raise precondition(f"{op}: the Buffer was destroyed")

    # ---- static API ------------------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True when torch sees CUDA (epd's CUDA backend serves FP8 and every op)."""
        return torch.cuda.is_available()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SM budget of normal-mode kernels (an even number)."""
        if new_num_sms % 2 != 0:
            raise invalid(f"set_num_sms: {new_num_sms} must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream now."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """num_rdma_bytes for low-latency ops of up to num_max_dispatch_tokens_per_rank tokens
        of `hidden` channels over num_ranks ranks and num_experts experts (top-k up to 32;
        FP8 included when hidden % 128 == 0): the size of that epd endpoint."""
        return _sizes.endpoint_bytes(num_ranks=num_ranks, num_experts=num_experts, hidden=hidden,
                                     num_topk=min(num_experts, _LL_HINT_TOPK),
                                     max_tokens_per_rank=1,
                                     ll_max_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                     use_fp8=hidden % 128 == 0)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The default normal dispatch Config (num_sms = Buffer.num_sms)."""
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The default normal combine Config (num_sms = Buffer.num_sms)."""
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    def get_comm_stream(self):
        """The stream epd.deep_ep runs ops on: the current stream."""
        return torch.cuda.current_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, size=None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """Not supported: epd's buffers are typed regions, not one raw byte buffer."""
        raise unsupported("get_local_buffer_tensor",
                          "epd exposes typed regions (get_next_low_latency_combine_buffer), "
                          "not a raw buffer")

    # ---- rank masking (low-latency group; docs/RELIABILITY.md) ------------------------------

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """Masks (mask=True) or unmasks (mask=False) rank_to_mask in the low-latency group:
        a masked rank is neither sent to nor received from; tokens routed to its experts are
        dropped and combine to zeros. Needs enable_shrink=True and the low-latency group, set
        up by the first low_latency_dispatch (FailedPreconditionError otherwise).
        InvalidArgumentError for a rank outside [0, group size)."""
        op = "low_latency_update_mask_buffer"
        self._shrinkable(op)
        rank = _non_negative_int(op, "rank_to_mask", rank_to_mask)
        if rank >= self.group_size:
            raise invalid(f"{op}: rank_to_mask {rank} is not a rank of the {self.group_size}-rank "
                          "group")
        g = self._mask_group(op)
        if mask:
            g.ep.update_rank_mask(mask=[rank])
        else:
            g.ep.update_rank_mask(unmask=[rank])

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        """Writes the low-latency group's mask into mask_status, a [group size] torch.int
        tensor: 1 for a masked rank, 0 otherwise (all 0 before the first low-latency op).
        Needs enable_shrink=True (FailedPreconditionError otherwise)."""
        op = "low_latency_query_mask_buffer"
        self._shrinkable(op)
        _check_tensor(mask_status, "mask_status", op, 1, torch.int32)
        if mask_status.size(0) != self.group_size:
            raise invalid(f"{op}: mask_status has {mask_status.size(0)} entries; the group has "
                          f"{self.group_size} ranks")
        masked = () if self._ll is None else self._ll.ep.query_rank_mask().masked_ranks
        status = torch.zeros(self.group_size, dtype=torch.int32)
        if masked:
            status[list(masked)] = 1
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank of the low-latency group (a rank that left stays masked until
        a process rejoins it). A no-op before the first low-latency op. Needs
        enable_shrink=True (FailedPreconditionError otherwise)."""
        op = "low_latency_clean_mask_buffer"
        self._shrinkable(op)
        if self._ll is not None:
            self._ll.ep.clean_rank_mask()

    def _shrinkable(self, op: str) -> None:
        self._live(op)
        if not self.enable_shrink:
            raise precondition(f"{op}: the Buffer was created with enable_shrink=False (rank "
                               "masking needs enable_shrink=True)")

    def _mask_group(self, op: str) -> "_Group":
        if self._ll is None:
            raise precondition(f"{op}: the low-latency group is set up by the first "
                               "low_latency_dispatch; mask ranks after it")
        return self._ll

    # ---- helpers ---------------------------------------------------------------------------

    def _stream(self):
        if not self._cuda:
            return None
        s = torch.cuda.current_stream().cuda_stream
        return s if s != 0 else _CUDA_STREAM_LEGACY

    def _event(self, async_finish: bool) -> EventOverlap:
        return EventOverlap(EventHandle()) if async_finish else EventOverlap()

    def _join(self, suffix: str, shape: dict, on_rank_failure=None) -> _Group:
        """Joins the epd group of `shape` (_sizes.endpoint_bytes' keywords; num_ranks is the
        Buffer's group size)."""
        spec = _epd_core.GroupSpec(
            name=f"{self._name}-{suffix}", num_ranks=self.group_size, hidden=shape["hidden"],
            num_topk=shape["num_topk"], num_experts=shape["num_experts"],
            max_tokens_per_rank=shape["max_tokens_per_rank"],
            max_dispatch_tokens_per_rank=shape["ll_max_tokens_per_rank"],
            use_fp8=shape["use_fp8"], nodes=self._nodes, transport=self._transport,
            on_rank_failure=on_rank_failure)
        gpu = torch.cuda.current_device() if self._cuda else None
        ep = self._client.join(spec, self.rank, gpu=gpu, launch_mode=self._launch_mode,
                               join_secret=self._secret)
        return _Group(ep)

    def _normal_group(self, op: str, hidden: int, num_topk: int, num_experts: int,
                      num_tokens: int) -> _Group:
        """The normal-mode epd group, created at the first normal op within num_nvl_bytes."""
        g = self._normal
        if g is None:
            if num_experts % self.group_size != 0:
                raise invalid(f"{op}: num_experts {num_experts} is not a multiple of the "
                              f"{self.group_size} ranks")
            shape = dict(num_ranks=self.group_size, num_experts=num_experts, hidden=hidden,
                         num_topk=max(num_topk, self._topk_seen, self.group_size),
                         ll_max_tokens_per_rank=0, use_fp8=hidden % 128 == 0)
            m = min(_sizes.max_tokens_within(self.num_nvl_bytes, **shape), 1 << 20)
            if m < max(num_tokens, 1):
                needed = _sizes.endpoint_bytes(max_tokens_per_rank=max(num_tokens, 1), **shape)
                raise too_small("num_nvl_bytes", needed, self.num_nvl_bytes,
                                f"{op} of {num_tokens} tokens x {hidden} channels over "
                                f"{self.group_size} ranks")
            self._normal = g = self._join("n", dict(shape, max_tokens_per_rank=m))
            return g
        s = g.spec
        if hidden != s.hidden or num_experts != s.num_experts or num_topk > s.num_topk:
            raise invalid(
                f"{op}: hidden {hidden}, num_experts {num_experts}, top-k {num_topk} do not fit "
                f"this Buffer's normal mode, set up by its first op for hidden {s.hidden}, "
                f"num_experts {s.num_experts}, top-k <= {s.num_topk}; use another Buffer")
        return g

    def _explain_too_many(self, g: _Group, op: str, num_tokens: int, err: Exception):
        """Re-raises an epd error of an op whose T exceeds the group's M as
        BufferTooSmallError naming the bytes needed; else re-raises err."""
        if num_tokens > g.spec.max_tokens_per_rank:
            needed = g.bytes_for(max_tokens_per_rank=num_tokens)
            raise too_small("num_nvl_bytes", needed, self.num_nvl_bytes,
                            f"{op} of {num_tokens} tokens") from err
        raise err

    def _own_handle(self, handle, kind, op: str):
        if not isinstance(handle, kind):
            raise invalid(f"{op}: handle is a {type(handle).__name__}, expected the "
                          f"{kind.__name__} a dispatch of this Buffer returned")
        if handle._owner is not self:
            raise precondition(f"{op}: the handle comes from another Buffer")
        group = self._normal if kind is DispatchHandle else self._ll
        if handle._group is not group:
            raise precondition(f"{op}: the handle's epd group is gone (Buffer destroyed?)")
        return handle

    def _restore(self, h: DispatchHandle, op: str, num_sms: int) -> None:
        """Makes h's routing the normal group's current one: epd keeps one routing (the
        latest non-cached dispatch's), so a handle from before re-dispatches its routing
        once, with zero rows (every rank does so at the same op: they issue the same ops)."""
        if h._generation == self._generation:
            return
        g = self._normal
        num_tokens = h._routing.size(0)
        zero = self._zero_x.get(num_tokens)
        if zero is None:
            zero = torch.zeros((num_tokens, g.spec.hidden), dtype=torch.bfloat16,
                               device=h._routing.device)
            self._zero_x = {num_tokens: zero}
        try:
            res = g.ep.dispatch(zero, topk_idx=h._routing, num_sms=num_sms, stream=self._stream())
        finally:
            self._generation += 1
        if res.num_recv_tokens != h._ep_handle.num_recv_tokens:
            raise _epd_errors.InternalError(
                13, "INTERNAL", f"{op}: re-dispatching a handle's routing received "
                f"{res.num_recv_tokens} rows, the handle's dispatch {h._ep_handle.num_recv_tokens}")
        h._ep_handle = res.handle
        h._generation = self._generation

    # ---- normal mode -----------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Routing statistics of topk_idx [T, K] int64 (-1 = none): returns
        (num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event), tensors owned by the caller. Computed by epd
        once the Buffer's normal group exists, by torch before (it is a local computation)."""
        op = "get_dispatch_layout"
        self._live(op)
        _check_tensor(topk_idx, "topk_idx", op, 2, torch.int64)
        if num_experts <= 0 or num_experts % self.group_size != 0:
            raise invalid(f"{op}: num_experts {num_experts} is not a positive multiple of the "
                          f"{self.group_size} ranks")
        if previous_event is not None:
            previous_event.current_stream_wait()
        num_topk = topk_idx.size(1)
        g = self._normal
        if g is None:
            self._topk_seen = max(self._topk_seen, num_topk)
            per_rank, per_expert, in_rank = _layout_torch(topk_idx, num_experts, self.group_size)
        else:
            if num_experts != g.spec.num_experts or num_topk > g.spec.num_topk:
                raise invalid(f"{op}: num_experts {num_experts} / top-k {num_topk} do not fit "
                              f"this Buffer's normal mode (num_experts {g.spec.num_experts}, "
                              f"top-k <= {g.spec.num_topk})")
            padded = _pad_columns(topk_idx, g.spec.num_topk, -1)
            try:
                res = g.ep.get_dispatch_layout(padded, stream=self._stream())
            except _epd_errors.EpdError as e:
                self._explain_too_many(g, op, topk_idx.size(0), e)
            per_rank = res.num_tokens_per_rank.clone()
            per_expert = res.num_tokens_per_expert.clone()
            in_rank = res.is_token_in_rank.to(torch.bool, copy=True)
        return per_rank, None, per_expert, in_rank, self._event(async_finish)

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Normal dispatch of x [T, H] bf16 or (x [T, H] float8_e4m3fn, scales [T, H/128]
        f32). Returns (recv_x or (recv_x, recv_scales), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event); received rows ordered by source rank,
        then token; tensors owned by the caller. With handle: cached re-dispatch of x with
        that dispatch's routing (returns (recv_x, None, None, None, None, event)). Without
        topk_idx the routing is is_token_in_rank's (recv_topk_* None). num_worst_tokens > 0:
        outputs padded to that many rows (top-k ids -1, weights 0), list empty.
        docs/DEEP_EP.md "dispatch" gives every detail."""
        op = "dispatch"
        self._live(op)
        if num_tokens_per_rdma_rank is not None:
            raise unsupported("num_tokens_per_rdma_rank", "internode dispatch")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        _check_tensor(x, "x", op, 2)
        if x_scales is not None:
            _check_tensor(x_scales, "x scales", op, 2)
            x_scales = x_scales.contiguous()
        expert_alignment = _non_negative_int(op, "expert_alignment", expert_alignment)
        if expert_alignment < 1:
            raise invalid(f"{op}: expert_alignment {expert_alignment} must be >= 1")
        num_sms = (config or self.get_dispatch_config(self.group_size)).num_sms
        if previous_event is not None:
            previous_event.current_stream_wait()
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise invalid(f"{op}: a cached dispatch (handle given) takes no topk_idx or "
                              "topk_weights")
            h = self._own_handle(handle, DispatchHandle, op)
            self._restore(h, op, num_sms)
            res = h._group.ep.dispatch(x, x_scales=x_scales, handle=h._ep_handle, num_sms=num_sms,
                                       stream=self._stream())
            recv_x = res.recv_x.clone()
            out = (recv_x, res.recv_scales.clone()) if x_scales is not None else recv_x
            return out, None, None, None, None, self._event(async_finish)

        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise invalid(f"{op}: a non-cached dispatch needs num_tokens_per_rank, "
                          "is_token_in_rank and num_tokens_per_expert (get_dispatch_layout)")
        _check_tensor(is_token_in_rank, "is_token_in_rank", op, 2)
        num_tokens, hidden = x.shape
        num_experts = num_tokens_per_expert.numel()
        with_topk = topk_idx is not None
        if with_topk:
            _check_tensor(topk_idx, "topk_idx", op, 2, torch.int64)
        if tuple(is_token_in_rank.shape) != (num_tokens, self.group_size):
            raise invalid(f"{op}: is_token_in_rank has shape {tuple(is_token_in_rank.shape)}, "
                          f"expected ({num_tokens}, {self.group_size})")
        user_topk = topk_idx.size(1) if with_topk else 0
        g = self._normal_group(op, hidden, max(user_topk, self.group_size), num_experts, num_tokens)
        width = g.spec.num_topk
        num_local = num_experts // self.group_size
        if with_topk:
            routing = _pad_columns(topk_idx, width, -1).clone()
            weights = _pad_columns(topk_weights, width, 0.0)
        else:
            routing = _ranks_to_routing(is_token_in_rank, num_local, width)
            weights = None
        try:
            res = g.ep.dispatch(x, x_scales=x_scales, topk_idx=routing, topk_weights=weights,
                                expert_alignment=expert_alignment, num_sms=num_sms,
                                stream=self._stream())
        except _epd_errors.EpdError as e:
            self._explain_too_many(g, op, num_tokens, e)
        finally:
            # Any dispatch that reached epd may have replaced the group's routing.
            self._generation += 1
        n = res.num_recv_tokens
        m = g.spec.max_tokens_per_rank
        src_info = res.recv_src_info
        src_rank = (src_info // m).long()
        prefix = torch.bincount(src_rank, minlength=self.group_size).cumsum(0).to(torch.int32)
        rank_prefix = torch.full((self.group_size, self.group_size), -1, dtype=torch.int32,
                                 device=src_info.device)
        rank_prefix[:, self.rank] = prefix
        new_handle = DispatchHandle(
            (rank_prefix, None, None, (src_info % m).to(torch.int32), is_token_in_rank.bool(), None),
            self, g, res.handle, self._generation, routing)

        rows = num_worst_tokens if num_worst_tokens > 0 else n
        if num_worst_tokens > 0 and num_worst_tokens < n:
            raise invalid(f"{op}: num_worst_tokens {num_worst_tokens} < the {n} rows received")

        def owned(view, fill=0):
            if view is None:
                return None
            if rows == n:
                return view.clone()
            shape = (rows,) + tuple(view.shape[1:])
            if view.element_size() == 1 and view.dtype not in (torch.uint8, torch.int8, torch.bool):
                out = torch.zeros(shape, dtype=torch.uint8, device=view.device).view(view.dtype)
            else:
                out = torch.full(shape, fill, dtype=view.dtype, device=view.device)
            out[:n] = view
            return out

        recv_x = owned(res.recv_x)
        out = (recv_x, owned(res.recv_scales)) if x_scales is not None else recv_x
        recv_topk_idx = recv_topk_weights = None
        if with_topk:
            recv_topk_idx = owned(res.recv_topk_idx[:, :user_topk], -1)
            recv_topk_weights = owned(res.recv_topk_weights[:, :user_topk], 0)
        if num_worst_tokens > 0:
            per_expert_list: List[int] = []
        elif with_topk:
            per_expert_list = res.num_recv_tokens_per_expert.tolist()
        else:
            # The routing given (ranks only) names no experts: the counts are DeepEP's, the
            # group-wide sum of num_tokens_per_expert, from one all_reduce.
            total = num_tokens_per_expert.to(torch.int64).clone()
            dist.all_reduce(total, group=self.group)
            mine = total.view(self.group_size, -1)[self.rank]
            mine = (mine + expert_alignment - 1) // expert_alignment * expert_alignment
            per_expert_list = mine.tolist()
        return (out, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle,
                self._event(async_finish))

    def combine(self, x: torch.Tensor, handle: DispatchHandle,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Normal combine of x [N, H] bf16 (rows as dispatch received them) back to the
        tokens' ranks: combined_x[t] = sum of the rows of t (f32, rounded once to bf16),
        plus bias (one [T, H] bf16 tensor or a pair), added in f32 and rounded again.
        topk_weights [N, K] f32 are summed the same way. Returns (combined_x [T, H],
        combined_topk_weights [T, K] or None, event); tensors owned by the caller."""
        op = "combine"
        self._live(op)
        h = self._own_handle(handle, DispatchHandle, op)
        _check_tensor(x, "x", op, 2)
        biases = [] if bias is None else list(bias) if isinstance(bias, (tuple, list)) else [bias]
        num_tokens = h._routing.size(0)
        for i, b in enumerate(biases):
            if b is not None and (not isinstance(b, torch.Tensor) or
                                  tuple(b.shape) != (num_tokens, h._group.spec.hidden)):
                raise invalid(f"{op}: bias[{i}] must be a [{num_tokens}, {h._group.spec.hidden}] "
                              f"tensor, got {getattr(b, 'shape', type(b).__name__)}")
        num_sms = (config or self.get_combine_config(self.group_size)).num_sms
        if previous_event is not None:
            previous_event.current_stream_wait()
        self._restore(h, op, num_sms)
        weights = None
        if topk_weights is not None:
            _check_tensor(topk_weights, "topk_weights", op, 2)
            if topk_weights.size(1) > h._group.spec.num_topk:
                raise invalid(f"{op}: topk_weights has {topk_weights.size(1)} columns > the "
                              f"group's top-k {h._group.spec.num_topk}")
            weights = _pad_columns(topk_weights, h._group.spec.num_topk, 0.0)
        res = h._group.ep.combine(x, h._ep_handle, topk_weights=weights, num_sms=num_sms,
                                  stream=self._stream())
        biases = [b for b in biases if b is not None]
        if biases:
            acc = res.combined_x.float()
            for b in biases:
                acc += b.float()
            combined = acc.to(torch.bfloat16)
        else:
            combined = res.combined_x.clone()
        combined_weights = None
        if weights is not None:
            combined_weights = res.combined_topk_weights[:, :topk_weights.size(1)].clone()
        return combined, combined_weights, self._event(async_finish)

    # ---- low-latency mode ------------------------------------------------------------------

    def _ll_group(self, op: str, hidden: int, num_topk: int, num_experts: int, mll: int) -> _Group:
        g = self._ll
        if g is not None:
            s = g.spec
            if (hidden, num_topk, num_experts, mll) != (s.hidden, s.num_topk, s.num_experts,
                                                        s.max_dispatch_tokens_per_rank):
                raise invalid(
                    f"{op}: hidden {hidden}, top-k {num_topk}, num_experts {num_experts}, "
                    f"num_max_dispatch_tokens_per_rank {mll} differ from this Buffer's "
                    f"low-latency mode (set up by its first low-latency op: {s.hidden}, "
                    f"{s.num_topk}, {s.num_experts}, {s.max_dispatch_tokens_per_rank})")
            return g
        if not self.low_latency_mode:
            raise invalid(f"{op}: the Buffer was created with low_latency_mode=False")
        if mll < 1 or num_experts <= 0 or num_experts % self.group_size != 0:
            raise invalid(f"{op}: num_max_dispatch_tokens_per_rank {mll} must be >= 1 and "
                          f"num_experts {num_experts} a positive multiple of {self.group_size}")
        shape = dict(num_ranks=self.group_size, num_experts=num_experts, hidden=hidden,
                     num_topk=num_topk, max_tokens_per_rank=1, ll_max_tokens_per_rank=mll,
                     use_fp8=hidden % 128 == 0)
        needed = _sizes.endpoint_bytes(**shape)
        if needed > self.num_rdma_bytes:
            raise too_small("num_rdma_bytes", needed, self.num_rdma_bytes,
                            f"{op} of up to {mll} tokens x {hidden} channels, top-k {num_topk}, "
                            f"{num_experts} experts over {self.group_size} ranks")
        self._ll = g = self._join("ll", shape, "mask" if self.enable_shrink else None)
        return g

    def _ll_submit(self, g: _Group, submit: Callable, hook_wanted: bool):
        """Runs a low-latency op: on CPU waits for it; on CUDA returns its stream-ordered
        result and a hook that waits for it. Ops not waited through a hook are waited
        _LL_CHECK_EVERY ops later (their errors raised then) or by destroy (g.pending)."""
        if not self._cuda:
            return submit(True), _no_hook
        pending = submit(False)
        hook = g.pending.add(pending, hook_wanted)  # tracked before anything can raise
        return pending.enqueued(), hook or _no_hook

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Low-latency dispatch of x [T, H] bf16 (T <= num_max_dispatch_tokens_per_rank)
        routed by topk_idx [T, K] int64. Returns (recv_x, recv_count, handle, event, hook):
        recv_x [E/R, R*Mll, H] bf16, or with use_fp8 (x_e4m3, scales) where scales are
        [E/R, R*Mll, H/128] f32 (power-of-two with round_scale) or, with use_ue8m0, packed
        int32 [E/R, R*Mll, H/512] (byte i of word j: the exponent of block 4j + i), last two
        dims column-major as DeepEP's (strides (S*R*Mll, 1, R*Mll) for S scales a row);
        recv_count [E/R] int32. Views of epd's buffers, valid until the low-latency dispatch
        after next. cumulative_local_expert_recv_stats [E/R] int32 += recv_count.
        hook() waits for the op (return_recv_hook); event is set with async_finish."""
        op = "low_latency_dispatch"
        self._live(op)
        if dispatch_wait_recv_cost_stats is not None:
            raise unsupported("dispatch_wait_recv_cost_stats", "epd records no per-rank wait times")
        if use_ue8m0 and not round_scale:
            raise invalid(f"{op}: use_ue8m0=True needs round_scale=True")
        if round_scale and not use_fp8:
            raise invalid(f"{op}: round_scale=True needs use_fp8=True")
        _check_tensor(x, "x", op, 2)
        _check_tensor(topk_idx, "topk_idx", op, 2)
        mll = num_max_dispatch_tokens_per_rank
        g = self._ll_group(op, x.size(1), topk_idx.size(1), num_experts, mll)
        if use_ue8m0 and x.size(1) % 512 != 0:
            raise invalid(f"{op}: use_ue8m0 packs 4 scales of 128 channels per int32: hidden "
                          f"{x.size(1)} must be a multiple of 512")
        stream = self._stream()

        def submit(wait):
            return g.ep.low_latency_dispatch(x, topk_idx, use_fp8=use_fp8, round_scale=round_scale,
                                             use_ue8m0=use_ue8m0, stream=stream, wait=wait,
                                             max_dispatch_tokens_per_rank=mll)

        res, hook = self._ll_submit(g, submit, return_recv_hook)
        recv_x = res.recv_x
        if use_fp8:
            recv_x = (recv_x, res.recv_scales)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(res.recv_count)
        handle = LowLatencyHandle(self, g, res.handle, res.recv_src_info, res.recv_count, mll,
                                  x.size(1), num_experts)
        return recv_x, res.recv_count, handle, self._event(async_finish), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Low-latency combine of x [E/R, R*Mll, H] bf16 (expert outputs in the dispatch's
        layout) with topk_idx / topk_weights [T, K] as dispatched: combined_x[t] =
        sum_k w[t,k] * y_k(t) (f32, rounded once to bf16). zero_copy: x is ignored and
        get_next_low_latency_combine_buffer(handle) is combined in place. Returns
        (combined_x [T, H] bf16, event, hook); combined_x is `out` when given (copied
        into), else a view of epd's buffer valid until the low-latency combine after next."""
        op = "low_latency_combine"
        self._live(op)
        if use_logfmt:
            raise unsupported("use_logfmt=True", "epd combines in bf16")
        if combine_wait_recv_cost_stats is not None:
            raise unsupported("combine_wait_recv_cost_stats", "epd records no per-rank wait times")
        h = self._own_handle(handle, LowLatencyHandle, op)
        g = h._group
        src = g.ep.low_latency_combine_input() if zero_copy else x
        stream = self._stream()

        def submit(wait):
            return g.ep.low_latency_combine(src, topk_idx, topk_weights, h._ep_handle,
                                            stream=stream, wait=wait)

        res, hook = self._ll_submit(g, submit, return_recv_hook)
        combined = res.combined_x
        if out is not None:
            out.copy_(combined)
            combined = out
        return combined, self._event(async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """epd's low-latency combine input [E/R, R*Mll, H] bf16, writable: expert outputs
        written here and combined with zero_copy=True skip a copy. Write it only after the
        dispatch of `handle` is done (stream order does that)."""
        h = self._own_handle(handle, LowLatencyHandle, "get_next_low_latency_combine_buffer")
        return h._group.ep.low_latency_combine_input()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """A no-op on epd (its low-latency buffers need no cleaning); the arguments are
        checked against the Buffer's low-latency mode once it exists."""
        self._live("clean_low_latency_buffer")
        g = self._ll
        if g is not None:
            s = g.spec
            if (num_max_dispatch_tokens_per_rank, hidden, num_experts) != (
                    s.max_dispatch_tokens_per_rank, s.hidden, s.num_experts):
                raise invalid(
                    f"clean_low_latency_buffer: ({num_max_dispatch_tokens_per_rank}, {hidden}, "
                    f"{num_experts}) differ from the low-latency mode's ("
                    f"{s.max_dispatch_tokens_per_rank}, {s.hidden}, {s.num_experts})")


def _no_hook() -> None:
    return None
