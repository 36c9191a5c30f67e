"""epd.deep_ep across two epd daemons (two nodes on this machine, each its own socket and Peer
port, one shared secret): four ranks, ranks 0-1 on node 0's daemon and 2-3 on node 1's
($EPD_SOCKET per rank, as a launcher sets it per node). The Buffer gathers each rank's daemon
Peer address and joins a group across the two nodes; normal dispatch and combine and
low-latency dispatch and combine then give exactly the one-node answers (torch references).
Host backend only: the daemons are started here."""

import os
import socket

import pytest
import torch

import epd_testing
from deep_ep_harness import run_ranks
from test_deep_ep_normal import E, H, K, _inputs, _ref_layout, _ref_recv

R = 4
MLL = 8

pytestmark = pytest.mark.skipif(
    epd_testing.CUDA or bool(os.environ.get("EPD_TEST_SOCKET")),
    reason="starts its own host-backend daemons (not run against $EPD_TEST_SOCKET or CUDA)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_nodes(tmp_path):
    """Two daemons with Peer listeners: [(socket, peer_address), ...]."""
    secret = tmp_path / "peer.secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"epd-python-multinode-secret-0123456789")
    os.close(fd)
    daemons = []
    try:
        for _ in range(2):
            address = "127.0.0.1:%d" % _free_port()
            daemons.append((epd_testing.Daemon(extra_args=(
                "--peer_listen=" + address, "--peer_secret_file=" + str(secret),
                "--peer_heartbeat_ms=100")), address))
        yield [(d.socket, address) for d, address in daemons]
    finally:
        for d, _ in daemons:
            d.stop()


def _body(rank, num_ranks, group, nodes):
    sock, _ = nodes[rank // 2]
    os.environ["EPD_SOCKET"] = sock
    # Rank 0's EPD_TRANSPORT names the group's transport (the others' is not read).
    os.environ["EPD_TRANSPORT"] = "tcp" if rank == 0 else "rdma"
    import deep_ep
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MLL, H, num_ranks, E)
    buf = deep_ep.Buffer(group, num_nvl_bytes=64 << 20, num_rdma_bytes=hint,
                         low_latency_mode=True, explicitly_destroy=True)
    assert buf._nodes == [(nodes[0][1], 2), (nodes[1][1], 2)], buf._nodes
    assert buf._transport == "tcp", buf._transport

    # Normal mode: layout, dispatch (rows in source rank, token order), combine.
    x, topk_idx, topk_weights = _inputs(rank)
    n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    ref_rank, ref_expert, ref_in_rank = _ref_layout(topk_idx, E, num_ranks)
    assert torch.equal(n_rank, ref_rank) and torch.equal(n_expert, ref_expert)
    assert torch.equal(in_rank, ref_in_rank)
    ref = _ref_recv(rank, num_ranks)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    assert torch.equal(recv_x, torch.stack([r[2] for r in ref]))
    assert recv_idx.tolist() == [r[3] for r in ref]
    assert buf._normal.ep.spec.transport == "tcp", buf._normal.ep.spec
    comb, _, _ = buf.combine(recv_x, handle)
    fanout = in_rank.sum(1, keepdim=True).float()
    assert torch.equal(comb, (x.float() * fanout).to(torch.bfloat16))

    # Low-latency: identity experts combine back to Σ_k w_k x (f32, ascending k).
    t = min(x.size(0), MLL)
    lx, lidx, lw = x[:t].contiguous(), topk_idx[:t].contiguous(), topk_weights[:t].contiguous()
    recv, count, lhandle, _, _ = buf.low_latency_dispatch(lx, lidx, MLL, E, use_fp8=False)
    combined, _, _ = buf.low_latency_combine(recv, lidx, lw, lhandle)
    want = torch.zeros((t, H), dtype=torch.float32)
    for k in range(K):
        ok = lidx[:, k] >= 0
        want[ok] += lw[ok, k:k + 1] * lx.float()[ok]
    assert torch.equal(combined, want.to(torch.bfloat16))
    buf.destroy()


def test_buffer_across_two_daemons(two_nodes):
    run_ranks(_body, R, two_nodes, timeout=120)
