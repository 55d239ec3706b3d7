"""What a fellow may advertise as its data and sync addresses (swarm/endpoints.py): checked
where the operator sets them (settings), where the leader hears them (a registration), and a
peer that is given a bad one anyway fails with a LinkError naming it (a real ZeroMQ socket)."""

from __future__ import annotations

import msgspec
import pytest

from silentswarm.agent.errors import LinkError
from silentswarm.endpoints import endpoint_problem
from silentswarm.errors import ConfigError
from silentswarm.protocol import FellowIdentity
from silentswarm.settings import Settings


@pytest.mark.parametrize(
    ("address", "ports", "good"),
    [
        ("tcp://127.0.0.1:5701", False, True),
        ("tcp://fellow-3.lab.example:5701", False, True),
        ("tcp://[::1]:5701", False, True),
        ("tcp://[fe80::1%eth0]:5701", False, True),
        ("tcp://fellow_a:5701", False, True),  # a Compose service's name
        ("tcp://fellow-3.lab.example.:5701", False, True),
        ("tcp://10.0.0.5:5701\n", False, False),
        ("tcp://10.0.0.5:7000-7003", True, True),
        ("tcp://10.0.0.5:7000-7003", False, False),  # a range is a sync address's only
        ("foo", False, False),
        ("10.0.0.5:5701", False, False),
        ("ipc:///run/leader.sock", False, False),
        ("inproc://x", True, False),
        ("udp://10.0.0.5:5701", False, False),
        ("tcp://*:5701", False, False),
        ("tcp://10.0.0.5", False, False),
        ("tcp://10.0.0.5:5701;x", True, False),
        ("tcp://-bad-:5701", False, False),
    ],
)
def test_only_a_tcp_endpoint_is_advertisable(address, ports, good):
    problem = endpoint_problem(address, ports=ports)
    assert (problem is None) == good, problem
    assert good or repr(address) in problem


@pytest.mark.parametrize(
    ("field", "address"),
    [("data_address", "foo"), ("sync_address", "ipc:///tmp/x"), ("data_address", "tcp://h:1-2")],
)
def test_a_registration_with_another_address_is_refused_naming_the_field(field, address):
    identity = {"fellow_id": "f", "instance_id": "i", "hostname": "h", "version": "1", "pid": 1}
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert({**identity, field: address}, FellowIdentity)
    good = msgspec.convert({**identity, field: "tcp://10.0.0.5:7000"}, FellowIdentity)
    assert getattr(good, field) == "tcp://10.0.0.5:7000"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SWARM_DATA_ADDRESS": "10.0.0.5:5701"}, "SWARM_DATA_ADDRESS"),
        ({"SWARM_SYNC_ADDRESS": "udp://10.0.0.5:7000"}, "SWARM_SYNC_ADDRESS"),
    ],
)
def test_a_fellow_with_another_address_does_not_start(env, named):
    with pytest.raises(ConfigError, match=f"{named}: .* is not tcp://host:port"):
        Settings.from_env(env)
    assert Settings.from_env({"SWARM_DATA_ADDRESS": ""}).data_address in (None, "")


def test_a_link_to_an_address_zeromq_refuses_is_a_link_error():
    from silentswarm.agent.pipe.zmq import ZmqLink

    with pytest.raises(LinkError, match="ring 0 -> 1: cannot connect to 'foo'"):
        ZmqLink(name="ring 0 -> 1", connect="foo")
