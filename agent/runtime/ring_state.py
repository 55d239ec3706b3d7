"""What of a replicated stage each of its rings keeps in sync (:mod:`silentswarm.rings`).

A stage holds one segment of layers per ring it is in. Each of its pieces sits at a layer
(:attr:`~silentswarm.agent.runtime.stage_model.Piece.at`), so each variable belongs to one
ring: the segment holding its piece's layer. The trainable variables are in layer order, so a
ring's are a contiguous index range (:func:`variable_bounds`), and its gradients a contiguous
row range of the stage's packed matrix (:func:`silentswarm.agent.runtime.replicas.ring_rows`).

A ring's *state* (what a donor hands over at a ring change) is its trainable variables first
(what a member checks the donor's weights with), then every other variable a checkpoint holds
that belongs to it: the non-trainable variables of its pieces, the optimizer's slots of its
variables (AdamW's moments), DiLoCo's anchor and outer momentum of its variables, and the
optimizer's own variables (its step count, its learning rate), which every ring carries. The
overlap schedule's pending gradient is no part of it (replicas never run it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from silentswarm.agent.runtime.checkpoint import named_variables
from silentswarm.agent.runtime.stage_model import StageModel
from silentswarm.plan import SyncRing


@dataclass(frozen=True)
class RingState:
    """One ring's share of a stage's state: ``variables``, the first ``n_weights`` of them
    its trainable weights; ``moments``: ``(position of AdamW's first moment of a weight,
    position of its second)``; ``anchors``: ``(position of a DiLoCo anchor, position of its
    weight)``; ``counts``: the position of the optimizer's step count (other integer state,
    a dropout layer's seed, is no count): what a member checks a donor's state with, class
    by class."""

    variables: list[Any]
    n_weights: int
    moments: tuple[tuple[int, int], ...] = ()
    anchors: tuple[tuple[int, int], ...] = ()
    counts: tuple[int, ...] = ()


def _ring_of(at: int, rings: Sequence[SyncRing]) -> int:
    for i, ring in enumerate(rings):
        if ring.layer_start <= at < ring.layer_end:
            return i
    raise ValueError(f"no ring holds layer {at}")


def variable_rings(model: StageModel, rings: Sequence[SyncRing]) -> list[int]:
    """The ring of each of the model's trainable variables, in order."""
    return [
        _ring_of(piece.at, rings) for piece in model.pieces for _ in piece.layer.trainable_variables
    ]


def variable_bounds(model: StageModel, rings: Sequence[SyncRing]) -> list[tuple[int, int]]:
    """Each ring's trainable variables as an index range ``[first, end)`` of the model's
    (they are in layer order; a ring may hold none, e.g. a frozen segment under an adapter)."""
    owner = variable_rings(model, rings)
    out = []
    for i in range(len(rings)):
        held = [j for j, r in enumerate(owner) if r == i]
        first = held[0] if held else (len([r for r in owner if r < i]))
        out.append((first, first + len(held)))
    return out


def _slots(
    model: StageModel, names: Sequence[str] = ("_momentums", "_velocities")
) -> dict[int, int]:
    """The optimizer's per-variable slots (AdamW's moments; ``names`` says which), by id, to
    the index of the trainable variable each belongs to; none for an optimizer that keeps no
    such lists (then every ring carries all of its variables)."""
    optimizer = model.optimizer
    out: dict[int, int] = {}
    for j, variable in enumerate(model.variables):
        try:
            index = optimizer._get_variable_index(variable)
        except (AttributeError, KeyError):
            return {}
        for name in names:
            slots = getattr(optimizer, name, None)
            if slots is not None and index < len(slots):
                out[id(slots[index])] = j
    return out


def ring_states(model: StageModel, rings: Sequence[SyncRing]) -> list[RingState]:
    """Each ring's share of the stage's state (see the module's doc), in ring order."""
    owner = variable_rings(model, rings)
    of_piece = {
        id(v): _ring_of(piece.at, rings) for piece in model.pieces for v in piece.layer.variables
    }
    of_trainable = {id(v): owner[j] for j, v in enumerate(model.variables)}
    of_slot = {key: owner[j] for key, j in _slots(model).items()}
    of_outer = {
        id(state): owner[j]
        for states in (model.anchor, model.outer_momentum)
        for j, state in enumerate(states)
    }
    weights: list[list[Any]] = [[] for _ in rings]
    rest: list[list[Any]] = [[] for _ in rings]
    for j, variable in enumerate(model.variables):
        weights[owner[j]].append(variable)
    pending = {id(p) for p in model.pending}
    for _, variable in named_variables(model):
        key = id(variable)
        if key in of_trainable or key in pending:
            continue
        ring = of_slot.get(key, of_outer.get(key, of_piece.get(key)))
        for i in range(len(rings)) if ring is None else (ring,):
            rest[i].append(variable)
    first = {j: key for key, j in _slots(model, ("_momentums",)).items()}
    second = {j: key for key, j in _slots(model, ("_velocities",)).items()}
    moment_pairs = [(first[j], second[j]) for j in first if j in second]
    anchor_of = {id(a): id(v) for a, v in zip(model.anchor, model.variables, strict=False)}
    out = []
    for w, r in zip(weights, rest, strict=True):
        variables = [*w, *r]
        at = {id(v): i for i, v in enumerate(variables)}
        out.append(
            RingState(
                variables=variables,
                n_weights=len(w),
                moments=tuple((at[m], at[v]) for m, v in moment_pairs if m in at and v in at),
                anchors=tuple(
                    (i, at[anchor_of[id(v)]]) for i, v in enumerate(variables) if id(v) in anchor_of
                ),
                counts=tuple(at[k] for k in (id(model.optimizer.iterations),) if k in at),
            )
        )
    return out


__all__ = ["RingState", "ring_states", "variable_bounds", "variable_rings"]
