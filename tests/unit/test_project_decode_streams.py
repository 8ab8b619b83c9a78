"""The decode figures of a hand-built two-stream capture (runtime.project.decode, a step of
`xpod decode --microbatches 2`): each compute stream's tiles, its idle time apart, the shares of
stream time summing to 1, the per-layer critical path through s1 (by the ops' micro-batch tags,
or by order without them), the per-stream busy time per micro-batch per layer, main's own ops;
a die without a `step` call left out of the shares and means."""

from __future__ import annotations

import pytest

from runtime.project import load_capture, replay, write_capture
from runtime.project.decode import CATEGORIES, decode_figures, tile_steps
from runtime.project.profile import parse_profile

MB = 1_000_000  # bytes a vector op moves per µs on any stream of the profile below
PROFILE = b"""
[profile]
name = "unit-streams"
description = "round numbers: a vector op moves 1 MB per us on main, s0 and s1"
[die]
hbm_gbps = { value = 1000, source = "test" }
dies_per_node = { value = 16, source = "test" }
aic_cores = { value = 24, source = "test" }
aiv_cores = { value = 48, source = "test" }
[efficiency]
vector_memory = { value = 1, source = "test" }
[link]
write_latency_intra_us = { value = 2, source = "test" }
write_latency_us = { value = 2, source = "test" }
[aiv]
t_flag_us = { value = 0, source = "test" }
t_poll_us = { value = 0, source = "test" }
b_core_gbps = { value = 100, source = "test" }
[collective]
cores = { value = 48, source = "test" }
t_fixed_us = { value = 10, source = "test" }
[runtime]
stream0_aic = { value = 16, source = "test" }
stream0_aiv = { value = 32, source = "test" }
stream1_aic = { value = 8, source = "test" }
stream1_aiv = { value = 16, source = "test" }
"""
MAIN, S0, S1, A2A = range(4)


class Die:
    """One die's events in file order, with per-stream seqs (as comm.capture writes them), and
    each micro-batch's latest event (as runtime.model.pipeline.Streams records them)."""

    def __init__(self, die: int, peer: int, tags: bool = False):
        self.die, self.peer, self.tags = die, peer, tags
        self.streams = ["main", "s0", "s1", "a2a"]
        self.seq, self.events = [0, 0, 0, 0], []
        self.last = [(MAIN, 0), (MAIN, 0)]
        self.waited: set[tuple[int, int, int]] = set()

    def add(self, sid: int, kind: str, *fields) -> int:
        q = self.seq[sid]
        self.seq[sid] += 1
        self.events.append([kind, sid, 0, 0, *fields])
        return q

    def on(self, mb: int, sid: int) -> None:
        """Micro-batch `mb`'s next ops on `sid`: after its latest event (if on another stream)."""
        other, q = self.last[mb]
        if other != sid and (sid, other, q) not in self.waited:
            self.waited.add((sid, other, q))
            self.add(sid, "after", other, q)

    def op(self, mb: int, sid: int, name: str, mb_bytes: float, **dims) -> None:
        self.on(mb, sid)
        tag = {"mb": mb} if self.tags else {}
        q = self.add(sid, "op", name, 0, int(mb_bytes * MB), 0, {"unit": "aiv", **tag, **dims})
        self.last[mb] = (sid, q)

    def collective(self, mb: int, name: str, call: int) -> None:
        """A call on a2a launched from s1: a guard word to the peer, a wait for the peer's."""
        self.add(A2A, "after", S1, self.seq[S1] - 1)
        self.add(A2A, "begin", name, call)
        self.add(A2A, "pub", self.peer, [call], [call])
        self.add(A2A, "acq", [call], [call], [self.peer], "flag")
        end = self.add(A2A, "end", name, call, [])
        q = self.add(S1, "after", A2A, end)
        self.last[mb] = (S1, q)

    def attention(self, m: int) -> None:
        for name, mb in (("mla_prolog", 1), ("mla", 2), ("o_proj", 1)):
            self.op(m, S0, name, mb)
        self.op(m, S0, "norms", 1, count=4)

    def ffn(self, m: int, layer: int, experts_mb: float) -> None:
        if layer == 0:
            self.op(m, S1, "dense_ffn", 3)
            return
        self.op(m, S1, "gate", 1)
        self.collective(m, "dispatch", 10 + m)
        self.op(m, S1, "experts", experts_mb)
        self.collective(m, "combine", 20 + m)
        self.op(m, S1, "shared_expert", 1)

    def step(self, experts_mb: float, interleaved: bool = False) -> None:
        """embed of both micro-batches, a dense layer, an MoE layer, the heads (module
        docstring of runtime.model.pipeline), main joining both streams. `interleaved`: each
        layer recorded as attention 0, FFN 0, attention 1, FFN 1 (same dependencies)."""
        self.add(MAIN, "begin", "step", 1)
        for m in (0, 1):
            self.op(m, S0, "embed", 1)
        for layer in (0, 1):
            if interleaved:
                for m in (0, 1):
                    self.attention(m)
                    self.ffn(m, layer, experts_mb)
                continue
            for m in (0, 1):
                self.attention(m)
            for m in (0, 1):
                self.ffn(m, layer, experts_mb)
        for m in (0, 1):
            self.op(m, S0, "norms", 1, count=1)
            self.op(m, S0, "lm_head", 1)
            self.op(m, S0, "sample", 1)
        for other, q in self.last:
            self.add(MAIN, "after", other, q)
        self.add(MAIN, "end", "step", 1, [])


def _project(tmp_path, expert_die: bool = False, main_op: bool = False, tags: bool = False,
             interleaved: bool = False):  # fmt: skip
    dies = [Die(0, 1, tags), Die(1, 0, tags)]
    for d in dies:
        d.step(experts_mb=4, interleaved=interleaved)
    maps = [{"die": d.die, "streams": d.streams, "events": d.events} for d in dies]
    if main_op:  # an op of main's own after the join (as an MTP sub-forward would be)
        ev = maps[0]["events"]
        ev.insert(len(ev) - 1, ["op", MAIN, 0, 0, "norms", 0, MB, 0, {"unit": "aiv"}])
    if expert_die:  # a die with ops but no `step` call (a split pod's expert die)
        ops = [["op", 0, 0, 0, "experts", 0, 5 * MB, 0, {"unit": "aiv"}]] * 3
        maps.append({"die": 2, "streams": ["main"], "events": ops})
    write_capture(tmp_path, {"calls": ["step"], "warmup": 0, "synthesized": True}, maps)
    return replay(load_capture(tmp_path), parse_profile(PROFILE, "unit.toml"))


def test_each_compute_stream_is_tiled_with_its_idle_time_apart(tmp_path):
    res = _project(tmp_path)
    t = tile_steps(res, 0)[0]
    # by hand (µs): s0 embeds both micro-batches (t = 2), layer 0's attention of both (5 each:
    # t = 12); s1 idles to 7 for micro-batch 0's attention, dense FFN 3 (t = 10), idles to 12,
    # dense FFN (t = 15). Layer 1: s0's attention of both (t = 22); s1 idles to 17, gate 1,
    # dispatch 10 + the peer's guard 2, experts 4, combine 12, shared 1 (t = 47), then the
    # same for micro-batch 1 (t = 77). s0 idles for each micro-batch's last FFN (to 47 and 77)
    # before its head (3 each): the step ends at 80.
    assert t.span_us == pytest.approx(80)
    assert t.by_category == pytest.approx({
        "attention": 4 * 4, "gate": 2, "dispatch": 2 * 12, "experts": 2 * 4,
        "combine": 2 * 12, "shared": 2, "dense_ffn": 2 * 3, "mtp": 0,
        "other": 2 * 1 + 4 * 1 + 2 * 3,  # embeds, the layers' norms, the heads
    })  # fmt: skip
    assert t.stream_us == pytest.approx({"s0": 2 + 4 * 5 + 2 * 3, "s1": 2 * 3 + 2 * 30})
    assert t.idle_us == pytest.approx({"s0": (47 - 22) + (77 - 50), "s1": 7 + 2 + 2})
    for s, last in (("s0", 80), ("s1", 77)):  # busy + idle: from the step's begin to the last
        assert t.stream_us[s] + t.idle_us[s] == pytest.approx(last)
    assert sum(t.by_category.values()) == pytest.approx(sum(t.stream_us.values())) == 94
    assert t.tiled_us == pytest.approx(94) and t.tiled_us > t.span_us  # the streams overlap
    assert t.microbatches == 2
    # the critical path per layer: layer 0 ends with micro-batch 1's dense FFN on s1 (t = 15),
    # layer 1 with its shared expert (t = 77)
    assert t.layers == [("dense", pytest.approx(15)), ("moe", pytest.approx(77 - 15))]
    assert tile_steps(res, 1)[0].by_category == pytest.approx(t.by_category)  # the same die


def test_two_stream_figures_share_stream_time_and_time_each_stream(tmp_path):
    fig = decode_figures(_project(tmp_path))
    assert fig.step_us == [pytest.approx(80)] and fig.critical == [0]
    assert fig.layer_us == pytest.approx({"dense": 15, "moe": 62, "all": (15 + 62) / 2})
    for share in fig.share:
        assert sum(share.values()) == pytest.approx(1)
    assert fig.share[0]["experts"] == pytest.approx(8 / 94)
    assert fig.share[0]["dispatch"] == pytest.approx(24 / 94)
    assert fig.mean_us["combine"] == pytest.approx(24)
    # busy per micro-batch per layer: (2 layers x 2 micro-batches)
    assert fig.stream_us == pytest.approx({"s0": 28 / 4, "s1": 66 / 4})
    assert fig.mtp_us == 0


def test_a_die_without_step_calls_is_left_out_of_the_shares_and_means(tmp_path):
    fig = decode_figures(_project(tmp_path, expert_die=True))
    ref = decode_figures(_project(tmp_path / "ref"))
    assert len(fig.share) == 3 and fig.share[2] is None
    assert fig.share[:2] == ref.share
    assert fig.mean_share == pytest.approx(ref.mean_share)
    assert fig.mean_us == pytest.approx(ref.mean_us)
    assert sum(fig.mean_share.values()) == pytest.approx(1)
    assert set(fig.mean_us) == set(CATEGORIES)


def test_layers_follow_the_micro_batch_tags_in_any_recording_order(tmp_path):
    plain = tile_steps(_project(tmp_path / "plain"), 0)[0]
    for interleaved in (False, True):
        t = tile_steps(_project(tmp_path / str(interleaved), tags=True,
                                interleaved=interleaved), 0)[0]  # fmt: skip
        assert t.layers == plain.layers and t.by_category == pytest.approx(plain.by_category)
    # without tags an interleaved recording (micro-batch 0's FFN before micro-batch 1's
    # attention, as a split pod launches its A2E) reads each micro-batch's attention as a layer:
    # it ends at each FFN's last s1 op (10, 15, 47, 77)
    t = tile_steps(_project(tmp_path / "untagged", interleaved=True), 0)[0]
    assert [v for _, v in t.layers] == pytest.approx([10, 5, 32, 30])


def test_mains_own_ops_in_a_two_stream_step_are_tiled_too(tmp_path):
    t = tile_steps(_project(tmp_path, main_op=True), 0)[0]
    ref = tile_steps(_project(tmp_path / "ref"), 0)[0]
    assert t.span_us == pytest.approx(ref.span_us + 1)  # after the join at 80: 1 µs of norms
    assert t.by_category["other"] == pytest.approx(ref.by_category["other"] + 1)
    assert t.tiled_us == pytest.approx(ref.tiled_us + 1) == 95
    assert t.stream_us == ref.stream_us and t.layers == ref.layers
