"""EPLB pieces that need no pod: the layout's eplb block, the PodConfig checks, keep_in_place,
row_positions and the EPLBConfig / initial map rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory import layout as L
from memory.errors import ConfigError
from runtime.model import ModelConfig
from runtime.model.expert_balancer import EPLBConfig, bank_bytes, initial_map
from runtime.pod.config import PodConfig
from sched.eplb import ExpertMap, keep_in_place, plan, replica_for, row_positions


def _pod(**kw) -> PodConfig:
    base = dict(num_dies=4, a2a_max_batch=16, a2a_hidden=64, a2a_topk=4, num_experts=20,
                app_bytes=1 << 20)  # fmt: skip
    return PodConfig(**{**base, **kw})


def test_eplb_block_sits_in_the_meta_area_after_everything_else():
    lo = _pod(eplb_layers=2, eplb_window=10).layout()
    assert lo.eplb_off >= lo.serve_off and lo.eplb_off > lo.fused_cevent_off
    assert lo.eplb_counts_off == lo.eplb_off + L.EPLB_WORDS * L.WORD
    row = lo.eplb_row_words * L.WORD
    assert lo.eplb_row_words == 1 + 2 * 5
    assert lo.eplb_plan_off == lo.eplb_counts_off + 10 * row
    assert lo.eplb_plan_off + 2 * 20 * L.WORD <= lo.meta_off + lo.meta_bytes
    assert lo.eplb_word(L.EP_READY) == lo.eplb_off // 8 + L.EP_READY
    plain = _pod().layout()
    assert plain.eplb_off == 0 and plain.layout_hash != lo.layout_hash


def test_eplb_needs_the_all_to_all_and_a_window():
    with pytest.raises(ConfigError, match="eplb_layers"):
        _pod(eplb_layers=2, eplb_window=0)
    with pytest.raises(ConfigError, match="eplb_layers"):
        PodConfig(num_dies=2, eplb_layers=1, eplb_window=4)
    with pytest.raises(ConfigError, match="eplb_window"):
        _pod(eplb_layers=1, eplb_window=-1)


def test_bank_and_physical_slots():
    cfg = ModelConfig.preset("small")
    e = EPLBConfig(redundant_per_die=2)
    assert e.physical(cfg, 8) == 32 + 16
    assert bank_bytes(cfg, 8, e) == 3 * 2 * 6 * 3 * 256 * 128 * 4 + 4096
    m = initial_map(cfg, 8, e)
    assert m.num_physical == 48 and m.logcnt.min() >= 1
    assert initial_map(cfg, 8, EPLBConfig(redundant_per_die=0)) == ExpertMap.identity(3, 32, 8)


def test_row_positions_rotate_by_die_and_step():
    assert row_positions(3, 2, 5).tolist() == [7, 8, 9]
    m = ExpertMap.from_phy2log([[0, 1, 0, 2]], 3, 2)  # expert 0 on both dies
    ids = np.array([[0], [0]])
    a = replica_for(m, 0, ids, row_positions(2, 0, 0))[:, 0].tolist()
    b = replica_for(m, 0, ids, row_positions(2, 0, 1))[:, 0].tolist()
    assert sorted(a) == [0, 2] and a == b[::-1]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(2, 8, 1), (4, 16, 1), (4, 16, 2), (8, 32, 1)]))
def test_keep_in_place_is_the_same_placement_with_fewer_moves(seed, shape):
    dies, experts, red = shape
    rng = np.random.default_rng(seed)
    old = plan(rng.random((2, experts)) * 10, dies, red)
    new = plan(rng.random((2, experts)) ** 3 * 10, dies, red)
    kept = ExpertMap.from_phy2log(keep_in_place(old, new.phy2log), experts, dies)
    s = old.slots_per_die
    for j in range(2):
        blocks = sorted(sorted(b) for b in new.phy2log[j].reshape(dies, s).tolist())
        assert sorted(sorted(b) for b in kept.phy2log[j].reshape(dies, s).tolist()) == blocks

        def held(m, j=j):
            return sum(
                len(
                    set(m.phy2log[j, d * s : (d + 1) * s])
                    & set(old.phy2log[j, d * s : (d + 1) * s])
                )
                for d in range(dies)
            )

        assert held(kept) >= held(new)
        # a kept expert stays in its old slot
        for d in range(dies):
            for i in range(s):
                e = kept.phy2log[j, d * s + i]
                if e in old.phy2log[j, d * s : (d + 1) * s]:
                    assert old.phy2log[j, d * s + i] == e
    assert np.allclose(
        kept.balancedness(np.ones((2, experts))), new.balancedness(np.ones((2, experts)))
    )


def test_keep_in_place_of_the_same_map_moves_nothing():
    m = plan(np.arange(32.0).reshape(1, 32) + 1, 8, 1)
    assert np.array_equal(keep_in_place(m, m.phy2log), m.phy2log)
    with pytest.raises(ValueError, match="shape"):
        keep_in_place(m, m.phy2log[:, :8])
