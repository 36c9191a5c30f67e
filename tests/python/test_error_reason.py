"""The error catalog in Python (docs/ERRORS.md): every EpdError carries `reason`
("EPD-1001") and `reason_name` ("SPEC_INVALID"): errors the daemon sends over gRPC (a bad
spec, a wrong join secret, a rank already held), errors of the binding's and the package's
own checks (the unclassified reason of their code), str() naming a specific reason, and
pickling keeping it."""

import pickle

import pytest

import epd

import epd_testing as T


def test_daemon_errors_carry_their_reason(client, daemon):
    s = T.unique_spec("reasons", num_ranks=2)
    with pytest.raises(epd.InvalidArgumentError) as e:
        client.join(s._replace(num_experts=3), 0)
    assert e.value.reason == "EPD-1001" and e.value.reason_name == "SPEC_INVALID"
    assert str(e.value).endswith("[EPD-1001 SPEC_INVALID]")

    first = client.join(s, 0, join_secret=b"s3cret")
    with pytest.raises(epd.AlreadyExistsError) as e:
        client.join(s, 0, join_secret=b"s3cret")
    assert (e.value.reason, e.value.reason_name) == ("EPD-1005", "RANK_TAKEN")
    with epd.Client.connect(daemon.socket) as other:
        with pytest.raises(epd.PermissionDeniedError) as e:
            other.join(s, 1, join_secret=b"wrong")
        assert (e.value.reason, e.value.reason_name) == ("EPD-4001", "JOIN_SECRET_MISMATCH")
    first.close()


def test_binding_errors_get_the_generic_reason_of_their_code(client):
    with pytest.raises(epd.InvalidArgumentError) as e:
        client.join(T.unique_spec("generic"), 0, gpu=1.5)
    assert (e.value.reason, e.value.reason_name) == ("EPD-9003", "INVALID_ARGUMENT")
    assert str(e.value).startswith("INVALID_ARGUMENT: ") and "EPD-9003" not in str(e.value)
    with pytest.raises(epd.InvalidArgumentError) as e:  # The package's own check.
        client.join(T.unique_spec("generic")._replace(nodes="not a list"), 0)
    assert (e.value.reason, e.value.reason_name) == ("EPD-9003", "INVALID_ARGUMENT")


def test_reason_pickles_and_defaults_to_the_unclassified_one():
    e = epd.PermissionDeniedError(7, "PERMISSION_DENIED", "join_secret: wrong", "EPD-4001",
                                  "JOIN_SECRET_MISMATCH")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is epd.PermissionDeniedError
    assert (back.reason, back.reason_name) == ("EPD-4001", "JOIN_SECRET_MISMATCH")
    assert str(back) == "PERMISSION_DENIED: join_secret: wrong [EPD-4001 JOIN_SECRET_MISMATCH]"
    # Built without a reason (by hand, or by the package's own checks): the unclassified one.
    plain = epd.InternalError(13, "INTERNAL", "made by hand")
    assert (plain.reason, plain.reason_name) == ("EPD-9013", "INTERNAL_UNCLASSIFIED")
    assert str(plain) == "INTERNAL: made by hand"

