"""Client.reconnect across a daemon restart and the rank-mask calls, through the Python API
(one process holding both ranks of a group, host backend): exact low-latency rounds before
and after epd is killed and started again on its socket; ops raise UnavailableError (code
14) at once while it is down; reconnect re-binds the Endpoint objects (new session and
endpoint ids, fresh views); a PendingOp from before raises UnavailableError; a left
endpoint is not rejoined. Rank masks: update / query / clean on a "mask" group, the errors
of a "fail" group and of bad arguments, and the (named-only) mask field of op results.
Its own daemon: the session daemon is not killed."""

import pytest
import torch

import epd

import epd_testing as T

pytestmark = pytest.mark.host_only(reason="kills and restarts its own host-backend daemon")


@pytest.fixture
def own_daemon():
    d = T.Daemon()
    yield d
    d.stop()


def _inputs(rank, round_):
    """x [6, 128] bf16 (multiples of 1/4), topk_idx [6, 2] (distinct experts, some -1),
    weights 1/2 and 1/4: identity experts combine back to (sum of valid weights) * x."""
    t = torch.arange(6).view(-1, 1)
    h = torch.arange(128).view(1, -1)
    x = (((rank * 5 + t * 3 + h + round_) % 13 - 6).float() / 4).to(torch.bfloat16)
    e0 = (rank + t.view(-1) + round_) % 4
    e1 = torch.where(t.view(-1) % 3 == 2, torch.full_like(e0, -1), (e0 + 1) % 4)
    idx = torch.stack([e0, e1], dim=1).to(torch.int64)
    w = torch.tensor([[0.5, 0.25]] * 6, dtype=torch.float32)
    return x, idx, w


def _round(eps, round_, epoch=0):
    """A low-latency dispatch and identity combine on every endpoint (rank = index); checks
    each result exactly (and its mask: mask epoch `epoch`, no rank masked) and returns the
    dispatch results."""
    ins = [_inputs(r, round_) for r in range(len(eps))]
    pend = [ep.low_latency_dispatch(x, idx, wait=False) for ep, (x, idx, _) in zip(eps, ins)]
    recv = [p.wait(20) for p in pend]
    for r in recv:
        assert isinstance(r.mask, epd.OpMask) and tuple(r.mask) == (epoch, 0, 0)
        assert len(r) == 5  # the mask is read by name; the tuple unpacks as before
    pend = [ep.low_latency_combine(r.recv_x.clone(), idx, w, r.handle, wait=False)
            for ep, r, (_, idx, w) in zip(eps, recv, ins)]
    for p, (x, idx, w) in zip(pend, ins):
        out = p.wait(20)
        assert tuple(out.mask) == (epoch, 0, 0)
        weight = (w * (idx >= 0)).sum(dim=1, keepdim=True)
        assert torch.equal(out.combined_x.float(), weight * x.float())
    return recv


def _join_both(client, spec):
    return [client.join(spec, r) for r in range(spec.num_ranks)]


def test_reconnect_rebinds_endpoints(own_daemon):
    client = epd.Client.connect(own_daemon.socket, client_name="reconnect")
    spec = T.unique_spec("reconnect", num_ranks=2, max_dispatch_tokens_per_rank=8)
    eps = _join_both(client, spec)
    _round(eps, 1)
    session = client.session_id
    region = eps[0].low_latency_combine_input()
    x, idx, _ = _inputs(0, 9)
    stale = eps[0].low_latency_dispatch(x, idx, wait=False)  # rank 1 never joins this op

    own_daemon.kill()
    with pytest.raises(epd.UnavailableError) as e:
        eps[1].low_latency_dispatch(x, idx)
    assert e.value.code == 14 and e.value.code_name == "UNAVAILABLE"
    with pytest.raises(epd.UnavailableError, match="no epd daemon"):
        client.reconnect(timeout=0.2)
    own_daemon.restart()
    client.reconnect(timeout=20)

    assert client.session_id != session
    with pytest.raises(epd.UnavailableError, match="Reconnect") as e:
        stale.wait(5)
    assert e.value.code == 14
    assert eps[0].low_latency_combine_input().data_ptr() != region.data_ptr()
    _round(eps, 2)
    _round(eps, 3)
    client.reconnect()  # the Session is open: nothing to do
    _round(eps, 4)
    with pytest.raises(epd.InvalidArgumentError):
        client.reconnect(timeout=-1)
    client.close()
    with pytest.raises(epd.FailedPreconditionError, match="closed"):
        client.reconnect()


def test_left_endpoint_is_not_rejoined(own_daemon):
    client = epd.Client.connect(own_daemon.socket, client_name="reconnect-left")
    spec = T.unique_spec("reconnect_left", num_ranks=2, max_dispatch_tokens_per_rank=8)
    eps = _join_both(client, spec)
    eps[1].close()
    own_daemon.kill()
    own_daemon.restart()
    client.reconnect(timeout=20)
    eps[1] = client.join(spec, 1)  # rank 1 is free: the closed endpoint did not rejoin
    _round(eps, 1)
    client.close()


def test_rank_mask_arguments(client):
    with pytest.raises(epd.InvalidArgumentError, match="on_rank_failure"):
        client.join(T.unique_spec("mask_bad_policy", on_rank_failure="sometimes"), 0)
    ep = client.join(T.unique_spec("mask_args", num_ranks=2, on_rank_failure="mask"), 0)
    assert ep.spec.on_rank_failure == "mask"
    with pytest.raises(epd.InvalidArgumentError, match="not a sequence"):
        ep.update_rank_mask(mask=1)
    with pytest.raises(epd.InvalidArgumentError, match=r"mask\[0\]"):
        ep.update_rank_mask(mask=["one"])
    with pytest.raises(epd.InvalidArgumentError, match=r"update_rank_mask: mask\[0\]=True is a bool"):
        ep.update_rank_mask(mask=[True])
    with pytest.raises(epd.InvalidArgumentError, match=r"update_rank_mask: unmask has 1048577 ranks"):
        ep.update_rank_mask(unmask=range(1 << 20 | 1))
    ep.close()
    with pytest.raises(epd.FailedPreconditionError, match="closed"):
        ep.query_rank_mask()


def test_rank_mask_update_query_clean(client):
    eps = _join_both(client, T.unique_spec("mask", num_ranks=2, on_rank_failure="mask",
                                           max_dispatch_tokens_per_rank=8))
    start = eps[0].query_rank_mask()
    assert isinstance(start, epd.RankMask) and start.masked_ranks == ()
    m = eps[0].update_rank_mask(mask=[1])
    assert m.masked_ranks == (1,) and m.epoch > start.epoch
    assert eps[1].query_rank_mask() == m
    with pytest.raises(epd.InvalidArgumentError, match="5"):
        eps[0].update_rank_mask(mask=[5])
    assert eps[1].clean_rank_mask().masked_ranks == ()
    eps[0].update_rank_mask(mask=[1])
    last = eps[0].update_rank_mask(unmask=[1])
    assert last.masked_ranks == ()
    _round(eps, 1, epoch=last.epoch)
    for ep in eps:
        ep.close()


def test_rank_mask_needs_a_mask_group(client):
    ep = client.join(T.unique_spec("mask_fail", num_ranks=2, on_rank_failure="fail"), 0)
    with pytest.raises(epd.FailedPreconditionError, match="on_rank_failure"):
        ep.update_rank_mask(mask=[1])
    ep.close()
