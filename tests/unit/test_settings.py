from pathlib import Path

import pytest

from silentswarm.errors import ConfigError
from silentswarm.settings import Settings


def test_defaults_match_the_documented_ones():
    s = Settings.from_env({})
    assert (s.leader_host, s.leader_port) == ("127.0.0.1", 8080)
    assert s.leader_url is None and s.default_leader_url == "http://127.0.0.1:8080"
    assert s.nats_url is None
    assert s.state_dir == Path(".swarm")
    assert (s.heartbeat_interval_s, s.offline_after_s) == (1.0, 3.0)
    assert s.run_dir == Path(".swarm/run") and s.logs_dir == Path(".swarm/runtime-logs")


def test_values_come_from_swarm_variables_only():
    s = Settings.from_env(
        {
            "SWARM_LEADER_PORT": "9000",
            "SWARM_NATS_URL": "nats://h:1",
            "SWARM_STATE_DIR": "/tmp/st",
            "SWARM_HEARTBEAT_INTERVAL_S": "0.5",
            "LEADER_PORT": "1",
        }
    )
    assert s.leader_port == 9000 and s.nats_url == "nats://h:1"
    assert s.state_dir == Path("/tmp/st") and s.heartbeat_interval_s == 0.5


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SWARM_LEADER_PORT": "http"}, "SWARM_LEADER_PORT"),
        ({"SWARM_NATS_PORT": "70000"}, "SWARM_NATS_PORT"),
        ({"SWARM_HEARTBEAT_INTERVAL_S": "0"}, "SWARM_HEARTBEAT_INTERVAL_S"),
        ({"SWARM_OFFLINE_AFTER_S": "0.5"}, "SWARM_OFFLINE_AFTER_S"),
        ({"SWARM_FELLOW_NAME": "a.b"}, "SWARM_FELLOW_NAME"),
        ({"SWARM_SUBJECT_PREFIX": "x>"}, "SWARM_SUBJECT_PREFIX"),
        ({"SWARM_LOG_LEVEL": "LOUD"}, "SWARM_LOG_LEVEL"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_variable(env, named):
    with pytest.raises(ConfigError) as err:
        Settings.from_env(env)
    assert named in err.value.message
    assert err.value.exit_code == 2


def test_replace_overrides_and_ignores_none():
    s = Settings.from_env({}).replace(leader_port=1234, nats_url=None, state_dir=Path("/x"))
    assert s.leader_port == 1234 and s.nats_url is None and s.state_dir == Path("/x")
    with pytest.raises(ConfigError):
        s.replace(leader_port=-1)


def test_as_env_round_trips():
    s = Settings.from_env({"SWARM_NATS_URL": "nats://a:1", "SWARM_LEADER_PORT": "9"})
    assert Settings.from_env(s.as_env()) == s


@pytest.mark.parametrize("value", ["auto", "tunnel", "p2p"])
def test_swarm_pipeline_transport_is_the_leaders_default_transport(value):
    assert Settings.from_env({}).pipeline_transport == "auto"
    assert Settings.from_env({"SWARM_PIPELINE_TRANSPORT": value}).pipeline_transport == value


def test_an_unknown_pipeline_transport_says_which_ones_there_are():
    with pytest.raises(ConfigError) as err:
        Settings.from_env({"SWARM_PIPELINE_TRANSPORT": "relay"})
    assert err.value.message == "SWARM_PIPELINE_TRANSPORT='relay': use auto, p2p, tunnel"
    assert err.value.exit_code == 2
