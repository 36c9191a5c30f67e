"""Groups across nodes, the client side: GroupSpec.nodes and NodeSpec, Client.peer_address,
the checks of a node list before anything is sent, and how epd.deep_ep derives the nodes
from every rank's daemon Peer address (the session daemon has no Peer listener, so the
groups joined here are one-node groups; tests/multinode/ runs real ones)."""

import pytest

import epd

import epd_testing as T


def test_group_spec_nodes_default_to_one_node_and_keep_positions():
    s = epd.GroupSpec("g", 2, 128, 2, 4, 8)
    assert s.nodes == () and s.max_dispatch_tokens_per_rank == 0 and s.use_fp8 is False
    s = epd.GroupSpec("g", 4, 128, 2, 4, 8, 4, True, [("a:1", 2), epd.NodeSpec("b:2", 2)])
    assert s.nodes[1] == ("b:2", 2)
    n = epd.NodeSpec(peer_address="10.0.0.1:7300", num_ranks=4)
    assert n.peer_address == "10.0.0.1:7300" and n.num_ranks == 4


def test_group_spec_transport_defaults_to_the_daemons_and_reaches_the_daemon(client):
    assert epd.GroupSpec("g", 2, 128, 2, 4, 8).transport == ""
    assert epd.GroupSpec("g", 2, 128, 2, 4, 8, transport="rdma").transport == "rdma"
    # The daemon sees the spec's transport: it refuses one on a group without nodes, and a
    # name that is no transport (the session daemon has no Peer listener).
    with pytest.raises(epd.InvalidArgumentError) as e:
        client.join(T.unique_spec("transport_one_node", transport="rdma"), 0)
    assert 'spec.transport: "rdma" is set for a group without nodes' in str(e.value)
    with pytest.raises(epd.InvalidArgumentError) as e:
        client.join(T.unique_spec("transport_bad", num_ranks=2, transport="udp",
                                  nodes=[("127.0.0.1:1", 1), ("127.0.0.1:2", 1)]), 0)
    assert 'spec.transport: "udp" is not a transport' in str(e.value)
    with pytest.raises(epd.InvalidArgumentError) as e:
        client.join(T.unique_spec("transport_nul", transport="tc\0p"), 0)
    assert "spec.transport" in str(e.value)
    with client.join(T.unique_spec("transport_default", transport=""), 0) as ep:
        assert ep.spec.transport == ""


def test_peer_address_is_empty_without_a_peer_listener(client):
    assert client.peer_address == ""


def test_one_node_endpoint_spec_has_no_nodes(client):
    with client.join(T.unique_spec("nodes_none"), 0) as ep:
        assert ep.spec.nodes == ()


@pytest.mark.parametrize(
    "nodes, fragment",
    [
        ("a:1", "spec.nodes is a str"),
        (5, "spec.nodes is a int"),
        ([("a:1",)], "spec.nodes[0]"),
        ([("a:1", 1), "b:2"], "spec.nodes[1]"),
        ([(7, 1)], "spec.nodes[0].peer_address"),
        ([("a\0:1", 1)], "spec.nodes[0].peer_address"),
        ([("a:1", "one")], "spec.nodes[0].num_ranks"),
        ([("a:1", 2**31)], "spec.nodes[0].num_ranks"),
        ([("h" * 300, 1)], "at most 255"),
        ([("\udc80:1", 1)], "spec.nodes[0].peer_address"),
    ],
)
def test_bad_node_lists_are_refused_naming_the_entry(client, nodes, fragment):
    with pytest.raises(epd.InvalidArgumentError) as e:
        client.join(T.unique_spec("nodes_bad", nodes=nodes), 0)
    assert fragment in str(e.value)


def test_deep_ep_nodes_from_rank_addresses():
    from epd.deep_ep.buffer import _nodes_of

    assert _nodes_of(["", ""], ["h", "h"]) == []
    assert _nodes_of(["a:1"] * 3, ["h1", "h2", "h3"]) == []
    assert _nodes_of(["a:1", "a:1", "b:2", "b:2", "b:2"], ["h"] * 5) == [("a:1", 2), ("b:2", 3)]
    with pytest.raises(epd.InvalidArgumentError) as e:
        _nodes_of(["a:1", "b:2", "a:1"], ["h"] * 3)
    assert "rank 2" in str(e.value) and "contiguous" in str(e.value)
    with pytest.raises(epd.InvalidArgumentError) as e:
        _nodes_of(["a:1", ""], ["h1", "h2"])
    assert "rank 1" in str(e.value) and "peer_listen" in str(e.value)
    with pytest.raises(epd.UnimplementedError) as e:
        _nodes_of(["", ""], ["h1", "h2"])
    assert "h1, h2" in str(e.value) and "--peer_listen" in str(e.value)
