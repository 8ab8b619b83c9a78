"""The A2E / E2A trace synthesizer (bench.project.synth_a2e) writes what a capture pod of
`bench.alltoall.dies.a2e_run` writes: every die's streams and events (all but the host times),
the meta but for what says it is synthesized, and so the same projected figures."""

from __future__ import annotations

import json

import pytest

from bench.alltoall.inputs import Point
from bench.project.capture import capture_alltoall
from bench.project.synth import synthesize_alltoall
from bench.project.synth_a2e import config_for, synthesize_a2e
from memory.errors import ConfigError
from runtime import PodConfig
from runtime.project import load_capture, load_profile, replay
from tests.integration.test_capture_pods import events, project

HOST_KEYS = {"synthesized", "commit"}  # what a synthesized meta says differently


def assert_same_capture(syn, real, dies: int) -> None:
    """Every die's [kind, stream, ...fields] (no t0/t1) and every meta key, equal."""
    for d in range(dies):
        s, r = events(syn, d), events(real, d)
        assert s[0] == r[0], f"die {d}: streams"
        assert len(s[1]) == len(r[1]), f"die {d}: {len(s[1])} events, a capture {len(r[1])}"
        for i, (a, b) in enumerate(zip(s[1], r[1], strict=True)):
            assert a == b, f"die {d} event {i}"
    ms, mr = (json.loads((p / "meta.json").read_text()) for p in (syn, real))
    assert ms.keys() == mr.keys()
    for k in ms.keys() - HOST_KEYS - {"dies"}:
        assert ms[k] == mr[k], k
    assert [(e["die"], e["file"], e["events"]) for e in ms["dies"]] == [
        (e["die"], e["file"], e["events"]) for e in mr["dies"]
    ]
    assert ms["synthesized"] is True and mr["synthesized"] is False


def same_as_capture(tmp_path, pt: Point, quant: str) -> None:
    cfg = config_for(pt, quant)
    real, _ = capture_alltoall(cfg, pt, "a2e", quant, tmp_path / "real")
    syn = synthesize_a2e(cfg, pt, quant, tmp_path / "syn")
    assert_same_capture(syn, real, pt.dies)
    a, b = (json.loads(project(p))["projected"] for p in (real, syn))
    assert a == b  # the same projected figures


@pytest.mark.timeout(60)
@pytest.mark.parametrize("quant", ["int8", "none"])
@pytest.mark.parametrize("att, exp", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_the_a2e_synthesizer_writes_what_a_capture_writes(tmp_path, att, exp, quant):
    same_as_capture(tmp_path, Point(att + exp, 8, 256, 4, 16, 3, attention_dies=att), quant)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "pt",
    [
        Point(10, 2, 256, 2, 16, 1, attention_dies=2),  # expert dies with no rows, or only some
        Point(9, 8, 256, 4, 18, 2, attention_dies=3),  # 3 + 6: one trampoline per expert die pair
        Point(2, 4, 256, 2, 4, 0, attention_dies=1),  # one attention die, one expert die
        Point(24, 32, 1024, 8, 64, 5, attention_dies=8),  # 8 + 16 at top-8
    ],
    ids=["2+8-sparse", "3+6", "1+1", "8+16"],
)
def test_the_a2e_synthesizer_at_edge_splits(tmp_path, pt):
    same_as_capture(tmp_path, pt, "int8")


@pytest.mark.timeout(60)
def test_a_wrong_routing_is_not_a_capture(tmp_path):
    """The comparison can fail: another routing seed changes the rows each die carries."""
    pt = Point(6, 8, 256, 4, 16, 3, attention_dies=2)
    cfg = config_for(pt, "int8")
    real, _ = capture_alltoall(cfg, pt, "a2e", "int8", tmp_path / "real")
    other = Point(6, 8, 256, 4, 16, 4, attention_dies=2)
    syn = synthesize_a2e(cfg, other, "int8", tmp_path / "syn")
    assert any(events(syn, d) != events(real, d) for d in range(pt.dies))
    with pytest.raises(AssertionError):
        assert_same_capture(syn, real, pt.dies)
    unquantized = synthesize_a2e(cfg, pt, "none", tmp_path / "none")  # no quantize op
    assert any(events(unquantized, d) != events(real, d) for d in range(pt.attention_dies))


@pytest.mark.timeout(60)
def test_synthesize_alltoall_routes_a2e(tmp_path):
    pt = Point(4, 4, 256, 2, 8, 0, attention_dies=2)
    cfg = config_for(pt, "none")
    a = synthesize_alltoall(cfg, pt, "a2e", "none", tmp_path / "a")
    b = synthesize_a2e(cfg, pt, "none", tmp_path / "b")
    for d in range(pt.dies):
        assert events(a, d) == events(b, d)
    with pytest.raises(ValueError, match="attention dies"):
        synthesize_a2e(cfg, Point(4, 4, 256, 2, 8, 0), "none", tmp_path / "c")


def test_a_config_beyond_the_pod_cap_is_for_a_layout_only():
    """001 §7.1's one DP domain: 160 + 288 dies, past PodConfig's 256 (which stays)."""
    pt = Point(448, 96, 7168, 8, 288, 0, attention_dies=160)
    cfg = config_for(pt, "int8")
    assert cfg.num_dies == 448 and cfg.layout().num_dies == 448
    assert cfg.layout().a2a_experts_per_die == 1
    with pytest.raises(ConfigError, match="num_dies"):
        PodConfig(num_dies=448)


@pytest.mark.scale
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("att, exp", [(16, 32), (32, 64)])
def test_the_a2e_synthesizer_writes_what_a_capture_writes_at_scale(tmp_path, att, exp):
    same_as_capture(tmp_path, Point(att + exp, 96, 7168, 8, 256, 0, attention_dies=att), "int8")


@pytest.mark.scale
@pytest.mark.timeout(600)
def test_the_a2e_synthesizer_at_001_one_domain(tmp_path):
    """160 attention + 288 expert dies, batch 96, hidden 7168, top-8, INT8: synthesized and
    replayed on cm384 (no pod: past the launcher's cap)."""
    pt = Point(448, 96, 7168, 8, 288, 0, attention_dies=160)
    syn = synthesize_a2e(config_for(pt, "int8"), pt, "int8", tmp_path / "syn")
    res = replay(load_capture(syn), load_profile("cm384"))
    for name in ("a2e", "e2a"):
        stats = res.calls(name)
        assert stats.counted == 2 and stats.p50_us > 0
