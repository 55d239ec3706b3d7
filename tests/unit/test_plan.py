import msgspec
import pytest

from silentswarm.errors import ConfigError
from silentswarm.plan import (
    GpuSlot,
    ModelConfig,
    Peer,
    StagePlan,
    TrainConfig,
    Transport,
    chain_plans,
    decode_plan,
    split_layers,
)


def test_split_layers_is_contiguous_and_covers_everything():
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ConfigError):
        split_layers(2, 3)


def test_chain_plans_round_trip_and_link_up():
    plans = chain_plans(
        job_id="j",
        model=ModelConfig(n_layers=6),
        train=TrainConfig(),
        addresses=[None, "tcp://h1:1", "tcp://h2:2"],
        fellow_ids=["a", "b", "c"],
    )
    for plan in plans:
        assert decode_plan(msgspec.json.encode(plan)) == plan
    assert [(p.layer_start, p.layer_end) for p in plans] == [(0, 2), (2, 4), (4, 6)]
    assert plans[0].next == Peer(fellow_id="b", data_address="tcp://h1:1")
    assert plans[2].prev.fellow_id == "b" and plans[2].is_last and plans[0].is_first
    assert all(p.intra_op_threads >= 1 for p in plans)


def base(**changes) -> StagePlan:
    fields = {
        "job_id": "j",
        "stage": 0,
        "n_stages": 1,
        "layer_start": 0,
        "layer_end": 4,
        "model": ModelConfig(n_layers=4, d_model=64, n_heads=4),
        "train": TrainConfig(),
    }
    return StagePlan(**(fields | changes))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"model": ModelConfig(n_layers=4, d_model=60, n_heads=8)}, "must divide"),
        ({"layer_end": 5}, "outside the model"),
        ({"train": TrainConfig(batch_size=6, micro_batches=4)}, "micro_batches"),
        ({"compression": "zip"}, "zip"),
        ({"grad_compression": "learned_dim8"}, "grad_compression"),
        ({"job_id": "a.b"}, "job_id"),
        ({"peer_timeout_s": 0}, "peer_timeout_s"),
        ({"stage": 1, "n_stages": 2, "prev": None}, "needs 'prev'"),
        ({"n_stages": 2, "next": Peer(fellow_id="b")}, "data_address"),
        (
            {
                "n_stages": 2,
                "transport": Transport.TUNNEL,
                "next": Peer(fellow_id="b", data_address="x"),
            },
            "NATS URL",
        ),
        (
            {"gpu_slots": [GpuSlot(gpu_index=0, gpu_uuid="u", layer_start=2, layer_end=6)]},
            "not inside",
        ),
        (
            {
                "gpu_slots": [
                    GpuSlot(gpu_index=0, gpu_uuid="u", layer_start=0, layer_end=3),
                    GpuSlot(gpu_index=1, gpu_uuid="v", layer_start=2, layer_end=4),
                ]
            },
            "overlaps",
        ),
    ],
)
def test_every_semantic_problem_is_named(changes, needle):
    problems = base(**changes).problems()
    assert any(needle in p for p in problems), problems
    with pytest.raises(ConfigError):
        base(**changes).checked()


def test_a_good_plan_has_no_problems():
    assert base().problems() == []


def test_decode_plan_names_the_source_and_the_field():
    with pytest.raises(ConfigError, match=r"p\.json: .*unknown field `nope`|p\.json.*nope"):
        decode_plan(
            b'{"job_id":"j","stage":0,"n_stages":1,"layer_start":0,"layer_end":1,"nope":1}',
            source="p.json",
        )
    with pytest.raises(ConfigError, match=r"p\.json: not valid JSON"):
        decode_plan(b"{", source="p.json")
