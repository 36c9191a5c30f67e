"""Arguments the binding checks before they reach the C ABI (one process; host backend, or
CUDA with EPD_TEST_DEVICE=cuda): a NUL in a str (socket, client_name, group name, gpu), ints
outside int32 or not ints (spec fields, rank, expert_alignment, num_sms,
max_dispatch_tokens_per_rank), wait / connect timeouts (NaN, negative, infinite, huge),
num_tokens given as an int; each an InvalidArgumentError naming the field and the value.
Also the closed states: join after Client.close names join, leave after close is a no-op."""

import functools
import math
import threading
import time

import numpy as np
import pytest

import epd

import epd_testing as T


# Mll 8: the low-latency ops take small_inputs()' 8 tokens.
spec = functools.partial(T.unique_spec, max_dispatch_tokens_per_rank=8)
inputs = T.small_inputs


def test_nul_in_strings(daemon, client):
    with pytest.raises(epd.InvalidArgumentError, match=r"connect: socket=.*NUL"):
        epd.Client.connect(daemon.socket + "\0junk")
    with pytest.raises(epd.InvalidArgumentError, match=r"connect: client_name='a\\x00b' .*NUL"):
        epd.Client.connect(daemon.socket, client_name="a\0b")
    with pytest.raises(epd.InvalidArgumentError, match="connect: client_name=b'.*' is a bytes"):
        epd.Client.connect(daemon.socket, client_name=b"\xff\xfe")
    s = spec("nul")
    with pytest.raises(epd.InvalidArgumentError, match=r"join: spec.name='ab\\x00cd' .*NUL"):
        client.join(s._replace(name="ab\0cd"), 0)
    with pytest.raises(epd.InvalidArgumentError, match=r"join: gpu='GPU-1\\x002' .*NUL"):
        client.join(s, 0, gpu="GPU-1\0" "2")
    with pytest.raises(epd.InvalidArgumentError, match="join: spec.name=7 is a int, expected a str"):
        client.join(s._replace(name=7), 0)
    # Nothing joined "ab" or any group under the names above.
    names = [g.get("spec", {}).get("name", g.get("name")) for g in client.list_groups()]
    assert "ab" not in names and not any(n and "\0" in n for n in names)
    # A path object is a socket too.
    import pathlib

    epd.Client.connect(pathlib.Path(daemon.socket)).close()


@pytest.mark.parametrize("field,value,match", [
    ("num_ranks", 1.5, r"spec.num_ranks=1.5 is a float, expected an int"),
    ("num_ranks", 2**40, r"spec.num_ranks=1099511627776 is outside the int32 range"),
    ("hidden", "128", r"spec.hidden='128' is a str, expected an int"),
    ("max_tokens_per_rank", 2**31, r"spec.max_tokens_per_rank=2147483648 is outside"),
    ("max_dispatch_tokens_per_rank", -2**31 - 1, r"spec.max_dispatch_tokens_per_rank=-2147483649"),
    ("num_experts", None, r"spec.num_experts=None is a NoneType"),
])
def test_spec_ints(client, field, value, match):
    with pytest.raises(epd.InvalidArgumentError, match="join: " + match):
        client.join(spec("ints")._replace(**{field: value}), 0)


def test_rank_and_op_ints(client):
    s = spec("opints")
    with pytest.raises(epd.InvalidArgumentError, match=r"join: rank=1099511627776 is outside"):
        client.join(s, 2**40)
    with pytest.raises(epd.InvalidArgumentError, match=r"join: rank=0.0 is a float"):
        client.join(s, 0.0)
    x, idx = inputs()
    with client.join(s, np.int64(0)) as ep:  # integers with __index__ are ints
        handle = ep.dispatch(x, topk_idx=idx).handle
        for call, match in [
            (lambda: ep.dispatch(x, topk_idx=idx, expert_alignment=2**40),
             r"dispatch: expert_alignment=1099511627776 is outside the int32 range"),
            (lambda: ep.dispatch(x, topk_idx=idx, num_sms=2**31),
             r"dispatch: num_sms=2147483648 is outside"),
            (lambda: ep.combine(x, handle, num_sms=1.0), r"combine: num_sms=1.0 is a float"),
            (lambda: ep.low_latency_dispatch(x, idx, max_dispatch_tokens_per_rank=2**31),
             r"low_latency_dispatch: max_dispatch_tokens_per_rank=2147483648 is outside"),
            (lambda: ep.low_latency_dispatch(x, idx, num_tokens=5),
             r"low_latency_dispatch: num_tokens=5 is an int; num_tokens is a \[1\] int32 "
             r"tensor on the endpoint's GPU"),
        ]:
            with pytest.raises(epd.InvalidArgumentError, match=match):
                call()
        # The endpoint is intact: numpy integers pass where ints go.
        r = ep.dispatch(x, topk_idx=idx, expert_alignment=np.int32(2), num_sms=np.int64(0))
        assert r.num_recv_tokens == x.shape[0]  # one rank: every token comes back


def test_wait_timeouts(client):
    x, idx = inputs()
    s = spec("timeouts", num_ranks=2)
    ep0, ep1 = client.join(s, 0), client.join(s, 1)
    op = ep0.dispatch(x, topk_idx=idx, wait=False)
    for bad, match in [(math.nan, "nan is not a number of seconds"),
                       (-1, "-1 is negative"), (-1e-3, "is negative"),
                       (-10**400, "is negative"), ("1", "'1' is a str")]:
        with pytest.raises(epd.InvalidArgumentError, match="wait: timeout=.*" + match):
            op.wait(timeout=bad)
    with pytest.raises(epd.DeadlineExceededError):
        op.wait(timeout=0.01)
    # Infinite and huge timeouts wait without a limit (not an overflowed, past deadline).
    for timeout in (math.inf, 1e12, 10**30):
        op = ep0.dispatch(x, topk_idx=idx, wait=False) if timeout != math.inf else op
        out = {}
        thread = threading.Thread(target=lambda: out.update(r=op.wait(timeout=timeout)))
        thread.start()
        time.sleep(0.05)
        ep1.dispatch(x, topk_idx=idx)
        thread.join(timeout=30)
        assert out["r"].num_recv_tokens == T.expected_recv(idx, 0, 2), timeout
    ep0.close()
    ep1.close()


def test_connect_timeouts(daemon):
    with pytest.raises(epd.InvalidArgumentError, match="connect: timeout=nan"):
        epd.Client.connect(daemon.socket, timeout=math.nan)
    with pytest.raises(epd.InvalidArgumentError, match="connect: timeout=-1 is negative"):
        epd.Client.connect(daemon.socket, timeout=-1)
    for timeout in (math.inf, 1e30, None, 0):
        epd.Client.connect(daemon.socket, timeout=timeout).close()


def test_closed_states(daemon):
    c = epd.Client.connect(daemon.socket)
    ep = c.join(spec("closed"), 0)
    ep.close()
    ep.leave()  # idempotent after close: close left already
    ep.close()
    c.close()
    for gpu in (None, "GPU-0"):
        with pytest.raises(epd.FailedPreconditionError, match="^FAILED_PRECONDITION: join: the client is closed"):
            c.join(spec("closed2"), 0, gpu=gpu)
    with pytest.raises(epd.FailedPreconditionError, match="stats: the client is closed"):
        c.stats_summary()
