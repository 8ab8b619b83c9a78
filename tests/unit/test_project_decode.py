"""The decode figures of a hand-built capture (runtime.project.decode): every tile of a step in
its category, a collective's wait for the slowest peer in that collective, per-layer spans, the
MTP sub-forward apart, the tiles summing to the step's span."""

from __future__ import annotations

import pytest

from runtime.project import load_capture, replay, write_capture
from runtime.project.decode import CATEGORIES, decode_figures, tile_steps
from runtime.project.profile import parse_profile

MB = 1_000_000  # bytes a vector op moves per µs on the profile below
PROFILE = b"""
[profile]
name = "unit"
description = "round numbers"
[die]
hbm_gbps = { value = 1000, source = "test" }
dies_per_node = { value = 16, source = "test" }
[efficiency]
vector_memory = { value = 1, source = "test" }
[link]
write_latency_intra_us = { value = 2, source = "test" }
write_latency_us = { value = 2, source = "test" }
[aiv]
t_flag_us = { value = 0, source = "test" }
t_poll_us = { value = 0, source = "test" }
[collective]
cores = { value = 48, source = "test" }
t_fixed_us = { value = 10, source = "test" }
"""


class Die:
    """One die's events in file order, with per-stream seqs (as comm.capture writes them)."""

    def __init__(self, die: int):
        self.die, self.streams, self.seq, self.events = die, ["main", "a2a"], [0, 0], []

    def add(self, sid: int, kind: str, *fields) -> int:
        q = self.seq[sid]
        self.seq[sid] += 1
        self.events.append([kind, sid, 0, 0, *fields])
        return q

    def op(self, name: str, mb: float, **dims) -> int:
        return self.add(0, "op", name, 0, int(mb * MB), 0, {"unit": "aiv", **dims})

    def collective(self, name: str, call: int, peer: int, word: int) -> None:
        """A call on `a2a`: a guard word to the peer, a wait for the peer's; main waits."""
        self.add(1, "after", 0, self.seq[0] - 1)
        self.add(1, "begin", name, call)
        self.add(1, "pub", peer, [word], [call])
        self.add(1, "acq", [word], [call], [peer], "flag")
        end = self.add(1, "end", name, call, [])
        self.add(0, "after", 1, end)

    def forward(self, peer: int, experts_mb: float, call: int) -> None:
        """embed, a dense layer, an MoE layer, the head."""
        self.op("embed", 1)
        for name, mb in (("mla_prolog", 2), ("mla", 1), ("o_proj", 1)):
            self.op(name, mb)
        self.op("norms", 1, count=4)
        self.op("dense_ffn", 2)
        for name, mb in (("mla_prolog", 2), ("mla", 1), ("o_proj", 1)):
            self.op(name, mb)
        self.op("norms", 1, count=4)
        self.op("gate", 1)
        self.collective("dispatch", call, peer, 100 + call)
        self.op("experts", experts_mb)
        self.collective("combine", call, peer, 200 + call)
        self.op("shared_expert", 1)
        self.op("norms", 1, count=1)
        self.op("lm_head", 1)
        self.op("sample", 1)

    def mtp(self) -> None:
        self.op("mtp_in", 1)
        self.op("mla_prolog", 1)
        self.op("norms", 1, count=1)
        self.op("lm_head", 1)


def _capture(tmp_path, mtp: bool = False):
    dies = [Die(0), Die(1)]
    for d in dies:
        d.add(0, "begin", "step", 1)
        d.forward(1 - d.die, 3 if d.die == 0 else 10, call=1)
        if mtp:
            d.mtp()
        d.add(0, "end", "step", 1, [])
    maps = [{"die": d.die, "streams": d.streams, "events": d.events} for d in dies]
    write_capture(tmp_path, {"calls": ["step"], "warmup": 0, "synthesized": True}, maps)
    cap = load_capture(tmp_path)
    return replay(cap, parse_profile(PROFILE, "unit.toml"))


def test_a_steps_tiles_land_in_their_categories(tmp_path):
    res = _capture(tmp_path)
    t0, t1 = tile_steps(res, 0)[0], tile_steps(res, 1)[0]
    # die 0: embed 1; dense layer 7 (attention 4, norms 1, dense_ffn 2); MoE layer: attention
    # 4, norms 1, gate 1 (t = 14), dispatch: launch 10 + the peer's guard 2 (t = 26), experts 3,
    # combine: launch 10, then die 1's guard, which comes 10 + 10 + 2 after t = 26 (die 1's
    # experts take 10): t = 48, 19 us of combine; shared 1, head 3
    assert t0.by_category == pytest.approx({
        "attention": 8, "gate": 1, "dispatch": 12, "experts": 3, "combine": 19, "shared": 1,
        "dense_ffn": 2, "mtp": 0, "other": 1 + 1 + 1 + 3,
    })  # fmt: skip
    assert t0.span_us == pytest.approx(sum(t0.by_category.values())) == pytest.approx(52)
    assert res.durations[(0, "step", 1)] == pytest.approx(t0.span_us)
    assert [k for k, _ in t0.layers] == ["dense", "moe"]
    assert t0.layers[0][1] == pytest.approx(7)
    assert t0.layers[1][1] == pytest.approx(4 + 1 + 1 + 12 + 3 + 19 + 1)
    # die 1 never waits in the combine: die 0's guard landed at 26 + 3 + 10 + 2 = 41 < 46
    assert t1.by_category["experts"] == pytest.approx(10)
    assert t1.by_category["combine"] == pytest.approx(10)
    assert t1.span_us == pytest.approx(50)


def test_figures_take_the_slowest_die_and_share_by_die(tmp_path):
    fig = decode_figures(_capture(tmp_path))
    assert fig.steps == [1] and fig.step_p50_us == pytest.approx(52)
    assert fig.critical == [0]  # die 0 waited for die 1's experts: 52 against 50
    assert fig.layer_us["dense"] == pytest.approx(7)
    assert fig.layer_us["moe"] == pytest.approx(41)
    assert fig.layer_us["all"] == pytest.approx(24)
    for share in fig.share:
        assert sum(share.values()) == pytest.approx(1)
    assert fig.share[0]["combine"] == pytest.approx(19 / 52)
    assert fig.share[1]["experts"] == pytest.approx(10 / 50)
    assert fig.mean_share["experts"] == pytest.approx((3 / 52 + 10 / 50) / 2)
    assert fig.mean_us["combine"] == pytest.approx((19 + 10) / 2)
    assert set(fig.mean_us) == set(CATEGORIES)


def test_the_mtp_sub_forward_is_its_own_category(tmp_path):
    res = _capture(tmp_path, mtp=True)
    t = tile_steps(res, 0)[0]
    assert t.by_category["mtp"] == pytest.approx(4)  # mtp_in, its layer's op, its head
    assert t.by_category["attention"] == pytest.approx(8)  # the MTP layer's prolog is mtp's
    assert len(t.layers) == 2 and t.span_us == pytest.approx(56)
    assert decode_figures(res).mtp_us == pytest.approx(4)


def test_the_all_to_alls_own_ops_take_the_cards_row_widths():
    from runtime.decode.project import with_comm_widths
    from runtime.model.card import CARDS, apply_card

    v3 = CARDS["deepseek-v3"]
    events = [  # fused's ops without a hidden: 10 dispatch rows of a 384-byte stride; a sum
        ["op", 1, 0, 0, "assemble", 0, 10 * 384, 10 * 384, {"unit": "aiv", "rows": 10}],
        ["op", 1, 0, 0, "weighted_sum", 2 * 10 * 256, 10 * 512, 2 * 4 * 256,
         {"unit": "aiv", "rows": 10}],
    ]  # fmt: skip
    out = apply_card(with_comm_widths(events, 256, v3), v3)
    assert out[0][6] == out[0][7] == 10 * (7168 + 512)  # INT8 rows with their scale slot
    assert out[1][6] == 10 * 2 * 7168 and out[1][7] == 2 * 4 * 7168  # BF16 rows
    assert apply_card(events, v3) == events  # without a width they would keep the toy's
