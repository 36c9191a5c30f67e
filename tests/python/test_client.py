"""Client and Endpoint lifecycle through the Python API (one process; host backend, or the
CUDA one with EPD_TEST_DEVICE=cuda):
connect (explicit socket, $EPD_SOCKET, no daemon), session_id, stats, list_groups, join
(errors of each kind), EndpointInfo / spec / rank, leave, close and context managers,
Client.close leaving its endpoints, the exception hierarchy and its pickling."""

import pickle

import pytest

import epd

import epd_testing as T


spec = T.unique_spec


def test_version():
    assert epd.__version__ == epd.version() and epd.__version__.count(".") == 2
    assert epd._C.abi_version() == epd._C.ABI_VERSION


def test_connect_no_daemon(tmp_path):
    path = str(tmp_path / "nobody.sock")
    with pytest.raises(epd.UnavailableError) as e:
        epd.Client.connect(path, timeout=0.5)
    assert isinstance(e.value, ConnectionError)
    assert e.value.code == 14 and e.value.code_name == "UNAVAILABLE"
    assert "nobody.sock" in str(e.value)


def test_connect_from_environment(daemon, monkeypatch):
    monkeypatch.setenv("EPD_SOCKET", daemon.socket)
    with epd.Client.connect() as c:
        assert isinstance(c.session_id, str) and c.session_id
    assert c.closed
    with pytest.raises(epd.FailedPreconditionError, match="closed"):
        c.join(spec("env"), 0)


def test_stats_and_list_groups(client):
    summary = client.stats_summary()
    assert summary["backend"] == ("cuda" if T.CUDA else "host")
    assert summary["version"] == epd.__version__
    assert summary["num_sessions"] >= 1
    stats = client.stats()
    assert stats["version"] == epd.__version__
    s = spec("listed")
    with client.join(s, 0):
        names = [g["spec"]["name"] for g in client.list_groups()]
        assert s.name in names


def test_endpoint_info_spec_rank(client):
    s = spec("info", num_ranks=2)
    ep = client.join(s, 1)
    assert ep.rank == 1
    assert ep.spec == s
    assert ep.info.rank == 1 and ep.info.group == s.name
    assert ep.info.cuda is T.CUDA and (ep.info.gpu_uuid != "") is T.CUDA
    assert ep.info.launch_mode in ("daemon", "client")
    assert ep.info.op_timeout_ms > 0
    assert "rank=1" in repr(ep)
    ep.close()
    assert ep.closed and "closed" in repr(ep)


def test_join_errors(client, daemon):
    s = spec("errors", num_ranks=2)
    with pytest.raises(epd.InvalidArgumentError, match="rank") as e:
        client.join(s, 5)
    assert isinstance(e.value, ValueError)
    with pytest.raises(epd.InvalidArgumentError, match="num_experts"):
        client.join(s._replace(num_experts=3), 0)
    ep = client.join(s, 0)
    with pytest.raises(epd.AlreadyExistsError):
        client.join(s, 0)
    with pytest.raises(epd.FailedPreconditionError):
        client.join(s._replace(hidden=256), 1)
    with pytest.raises(epd.InvalidArgumentError, match="launch_mode"):
        client.join(s, 1, launch_mode="fast")
    with pytest.raises(epd.InvalidArgumentError, match="gpu"):
        client.join(s, 1, gpu=1.5)
    ep.close()
    # A secret set by the first joiner binds the others.
    guarded = spec("secret", num_ranks=2)
    first = client.join(guarded, 0, join_secret=b"s3cret")
    with epd.Client.connect(daemon.socket) as other:
        with pytest.raises(epd.PermissionDeniedError) as e:
            other.join(guarded, 1, join_secret=b"wrong")
        assert isinstance(e.value, PermissionError)
        other.join(guarded, 1, join_secret="s3cret").close()
    first.close()


def test_client_close_leaves_endpoints(daemon):
    c = epd.Client.connect(daemon.socket)
    s = spec("closing")
    ep = c.join(s, 0)
    view = ep.low_latency_combine_input()
    c.close()
    c.close()  # idempotent
    assert ep.closed
    with pytest.raises(epd.FailedPreconditionError, match="closed"):
        ep.get_dispatch_layout(view[0, :1, :2].long())
    # The rank is free again: another client joins it.
    with epd.Client.connect(daemon.socket) as again:
        again.join(s, 0).close()
    # The view still maps the endpoint's memory.
    view.fill_(1.0)
    assert float(view.float().sum()) == view.numel()


def test_exception_hierarchy():
    assert issubclass(epd.InvalidArgumentError, (epd.EpdError, ValueError))
    assert issubclass(epd.DeadlineExceededError, TimeoutError)
    assert issubclass(epd.UnavailableError, ConnectionError)
    assert issubclass(epd.NotFoundError, LookupError)
    assert issubclass(epd.EpdError, RuntimeError)
    e = epd.DeadlineExceededError(4, "DEADLINE_EXCEEDED", "rank 2 never arrived")
    assert str(e) == "DEADLINE_EXCEEDED: rank 2 never arrived"
    assert e.errno is None
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is epd.DeadlineExceededError and back.message == e.message and back.code == 4
    assert epd.DeadlineExceededError.__module__ == "epd"


@pytest.mark.host_only("on the CUDA backend Join itself waits for every rank (peer buffer mappings), "
                       "so a lone rank never reaches its op")
def test_pending_op_timeout(client):
    s = spec("timeout", num_ranks=2)
    with client.join(s, 0) as ep:
        import torch

        op = ep.get_dispatch_layout(torch.zeros((1, 2), dtype=torch.int64), wait=False)
        # Rank 1 never comes: the wait times out and the op stays pending.
        with pytest.raises(epd.DeadlineExceededError):
            op.wait(timeout=0.05)
        with pytest.raises(epd.InvalidArgumentError, match="timeout"):
            op.wait(timeout=-1)


def test_ranks_on_threads(client):
    """Two ranks of one group driven by two threads of one process: ops wait with the GIL
    released, so each rank's op completes while the other thread submits its own."""
    import threading

    import torch

    s = spec("threads", num_ranks=2)
    eps = [client.join(s, r) for r in range(2)]
    idx = torch.tensor([[0, 3], [1, 2]], dtype=torch.int64)
    x = torch.ones((2, 128), dtype=torch.bfloat16)
    results, errors = {}, []

    def rank_main(r):
        try:
            for _ in range(20):
                d = eps[r].low_latency_dispatch(x * (r + 1), idx)
                counts = d.recv_count.tolist()
                eps[r].low_latency_combine(d.recv_x, idx, torch.ones((2, 2)), d.handle)
            results[r] = counts
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    # Experts 0, 1 on rank 0 and 2, 3 on rank 1; each gets one token from each rank.
    assert results == {0: [2, 2], 1: [2, 2]}
    for ep in eps:
        ep.close()


def test_pending_op_of_closed_endpoint(client):
    import torch

    ep = client.join(spec("pendclosed"), 0)
    op = ep.get_dispatch_layout(torch.zeros((1, 2), dtype=torch.int64), wait=False)
    ep.close()
    with pytest.raises(epd.FailedPreconditionError, match="closed|destroyed"):
        op.wait(timeout=5)
