"""Bad input through the Python API on three rank processes (host backend): a wrong dtype,
shape or device, a non-contiguous tensor, an object that is not a tensor, a bad stream, a
handle from another endpoint, a stale handle, a closed or left endpoint. Each raises the
epd exception of its status code with the field named, and the next op (run by every rank)
still gives the reference result."""

import ctypes

import pytest
import torch

import epd_testing as T

# ---- a DLPack tensor on a CUDA device, built by hand (no GPU needed: epd refuses it) ------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_CAPSULE_NAME = b"dltensor"
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeCudaTensor:
    """Exports `like`'s memory and shape as a kDLCUDA tensor of device 0."""

    def __init__(self, like):
        self.like = like
        self.shape = (ctypes.c_int64 * like.dim())(*like.shape)
        self.managed = _DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = like.data_ptr()
        t.device = _DLDevice(2, 0)
        t.ndim = like.dim()
        t.dtype = _DLDataType(4, 16, 1)  # kDLBfloat
        t.shape = self.shape

    def __dlpack__(self, stream=None):
        return _PyCapsule_New(ctypes.addressof(self.managed), _CAPSULE_NAME, None)

    def __dlpack_device__(self):
        return (2, 0)


# ---- the next op after an error: a dispatch and combine checked against the reference ----


def _good_ops(w, seed=1):
    data = []
    for src in range(T.R):
        t = T.num_tokens(src, seed)
        data.append((T.make_x(src, seed, t), T.make_topk_idx(src, seed, t), T.make_weights(src, seed, t)))
    x, idx, wt = data[w.rank]
    r = w.ep.dispatch(x, topk_idx=idx, topk_weights=wt)
    ref = T.ref_dispatch(w.rank, seed, data)
    assert r.num_recv_tokens == ref["num_recv_tokens"]
    assert torch.equal(r.recv_x, ref["recv_x"])
    c = w.ep.combine(r.recv_x, r.handle)
    assert c.combined_x.shape == x.shape
    ll = w.ep.low_latency_dispatch(x[: min(len(x), T.MLL)], idx[: min(len(x), T.MLL)])
    w.ep.low_latency_combine(ll.recv_x, idx[: min(len(x), T.MLL)], wt[: min(len(x), T.MLL)], ll.handle)


def _side_endpoint(w, tag):
    """A one-rank group of this rank alone (its ops need no peer)."""
    spec = w.spec._replace(name="%s_%s%d" % (w.base_name, tag, w.rank), num_ranks=1)
    return w.client.join(spec, 0)


def _expect(w, exc, field, fn):
    with pytest.raises(exc) as e:
        fn()
    message = str(e.value)
    assert field in message, message
    assert e.value.code_name == {3: "INVALID_ARGUMENT", 9: "FAILED_PRECONDITION"}[e.value.code]
    return message


def _bad(w, case):
    t = T.num_tokens(w.rank, 1)
    x, idx, wt = T.make_x(w.rank, 1, t), T.make_topk_idx(w.rank, 1, t), T.make_weights(w.rank, 1, t)
    ep, epd = w.ep, w.epd
    bad_arg = epd.InvalidArgumentError
    if case == "dtype":
        m = _expect(w, bad_arg, "x has dtype float32", lambda: ep.dispatch(x.float(), topk_idx=idx))
        assert isinstance(pytest.raises(ValueError, ep.dispatch, x.float(), topk_idx=idx).value, epd.EpdError)
        _expect(w, bad_arg, "topk_idx has dtype int32", lambda: ep.get_dispatch_layout(idx.int()))
        _expect(w, bad_arg, "topk_weights has dtype",
                lambda: ep.dispatch(x, topk_idx=idx, topk_weights=wt.double()))
        return m
    if case == "shape":
        _expect(w, bad_arg, "topk_idx has shape", lambda: ep.dispatch(x, topk_idx=idx[:, :2].contiguous()))
        _expect(w, bad_arg, "x has shape", lambda: ep.dispatch(torch.zeros((t, T.H + 128), dtype=torch.bfloat16), topk_idx=idx))
        big = torch.zeros((T.MLL + 1, T.H), dtype=torch.bfloat16)
        _expect(w, bad_arg, "x", lambda: ep.low_latency_dispatch(big, torch.zeros((T.MLL + 1, T.K), dtype=torch.int64)))
        return None
    if case == "device":
        return _expect(w, bad_arg, "x is on device type 2",
                       lambda: ep.dispatch(FakeCudaTensor(x), topk_idx=idx))
    if case == "contiguous":
        # Four tokens on every rank (an empty tensor is contiguous whatever its strides).
        wide = torch.zeros((4, 2 * T.H), dtype=torch.bfloat16)
        idx4 = T.make_topk_idx(w.rank, 1, 4)
        _expect(w, bad_arg, "x is not contiguous", lambda: ep.dispatch(wide[:, ::2], topk_idx=idx4))
        _expect(w, bad_arg, "topk_idx is not contiguous",
                lambda: ep.get_dispatch_layout(idx4.t().contiguous().t()))
        return None
    if case == "not_a_tensor":
        m = _expect(w, bad_arg, "x is a list", lambda: ep.dispatch([[1.0] * T.H] * t, topk_idx=idx))
        _expect(w, bad_arg, "handle is a str", lambda: ep.combine(x, "handle"))
        _expect(w, bad_arg, "stream is a str", lambda: ep.get_dispatch_layout(idx, stream="default"))
        _expect(w, bad_arg, "spec", lambda: w.client.join({"name": "x"}, 0))
        return m
    if case == "foreign_handle":
        side = _side_endpoint(w, "foreign")
        r = side.dispatch(x, topk_idx=torch.zeros_like(idx))
        m = _expect(w, w.epd.FailedPreconditionError, "handle", lambda: ep.combine(r.recv_x, r.handle))
        side.close()
        return m
    if case == "stale_handle":
        r1 = ep.dispatch(x, topk_idx=idx)
        h1 = r1.handle
        n1 = r1.num_recv_tokens
        r2 = ep.dispatch(x, topk_idx=idx)
        y = torch.zeros((n1, T.H), dtype=torch.bfloat16)
        m = _expect(w, w.epd.FailedPreconditionError, "handle", lambda: ep.combine(y, h1))
        ep.combine(r2.recv_x, r2.handle)
        return m
    if case == "closed":
        side = _side_endpoint(w, "closed")
        with side:
            side.get_dispatch_layout(idx)
        assert side.closed
        m = _expect(w, w.epd.FailedPreconditionError, "closed", lambda: side.get_dispatch_layout(idx))
        side.close()  # idempotent
        left = _side_endpoint(w, "left")
        left.leave()
        left.leave()  # idempotent
        _expect(w, w.epd.FailedPreconditionError, "", lambda: left.get_dispatch_layout(idx))
        left.close()
        return m
    raise AssertionError(case)


@pytest.mark.parametrize("case", [
    "dtype", "shape",
    pytest.param("device", marks=pytest.mark.host_only(
        "the kDLCUDA tensor is hand-built over host memory; the CUDA backend would read it")),
    "contiguous", "not_a_tensor", "foreign_handle", "stale_handle", "closed"])
def test_bad_input_then_next_op(world, case):
    world.run(_bad, case)
    world.run(_good_ops)
