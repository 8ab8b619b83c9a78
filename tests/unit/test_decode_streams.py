"""The decode streams of a micro-batched step (000 §4.2.3; runtime.model.pipeline,
runtime.project.costs): their cost classes, a hand-built two-micro-batch trace whose projected
step is the hand-computed overlapped critical path, and a collective launched from stream s1.

PROFILE is round numbers (not a shipped profile): a die of 24 cube cores at 24 TFLOPS (1 TFLOPS a
core), stream 0 with 16 of them, stream 1 with 8; HBM 1,000 GB/s; 20 GB/s per vector core.
"""

from __future__ import annotations

import pytest

from comm.capture import Capture, captured
from runtime.model.pipeline import MOE_STREAM, Streams, halves, microbatch_event
from runtime.project import ProjectError, load_capture, replay, write_capture
from runtime.project.costs import ProfileCosts, StreamClass
from runtime.project.profile import parse_profile

PROFILE = """
[profile]
name = "streams"
description = "round numbers for hand computation"
[die]
aic_cores = { value = 24, source = "test" }
aiv_cores = { value = 48, source = "test" }
bf16_tflops = { value = 24, source = "test" }
hbm_gbps = { value = 1000, source = "test" }
[aiv]
b_core_gbps = { value = 20, source = "test" }
[efficiency]
vector_memory = { value = 0.5, source = "test" }
gemm_bf16 = { value = 1, source = "test" }
mla_compute = { value = 1, source = "test" }
mla_memory = { value = 1, source = "test" }
[runtime]
stream0_aic = { value = 16, source = "test" }
stream0_aiv = { value = 32, source = "test" }
stream1_aic = { value = 8, source = "test" }
stream1_aiv = { value = 16, source = "test" }
"""


def costs(text: str = PROFILE) -> ProfileCosts:
    return ProfileCosts(parse_profile(text.encode(), "test.toml"))


def op(name: str, flops: float, nbytes: float, unit: str = "aic") -> list:
    return ["op", 0, 0, 0, name, flops, nbytes, 0, {"unit": unit, "dtype": "bf16"}]


def test_stream_classes_take_their_share_of_the_cube_cores_and_their_vector_cores():
    pc = costs()
    s0, s1, main = pc.stream_class("s0"), pc.stream_class("s1"), pc.stream_class("main")
    assert s0 == StreamClass(32.0, False, 16 / 24, True)
    assert s1 == StreamClass(16.0, False, 8 / 24, True)
    assert main == StreamClass(1.0, False)  # the whole die, as before
    gemm = op("o_proj", 24e6, 0)  # 1 µs on the whole die's 24 TFLOPS
    assert pc.op(0, main, gemm)[0] == pytest.approx(1.0)
    assert pc.op(0, s0, gemm)[0] == pytest.approx(1.5)  # 16 of 24 cube cores
    assert pc.op(0, s1, gemm)[0] == pytest.approx(3.0)  # 8 of 24
    weights = op("experts", 1e6, 1e6)  # memory-bound: HBM is the die's whole, on any stream
    assert pc.op(0, main, weights)[0] == pc.op(0, s1, weights)[0] == pytest.approx(1.0)
    # a vector op: min(hbm x vector_memory = 500, cores x 20 GB/s): s0 500, s1 320 GB/s
    norms = op("norms", 0, 1e6, "aiv")
    assert pc.op(0, main, norms)[0] == pc.op(0, s0, norms)[0] == pytest.approx(2.0)
    assert pc.op(0, s1, norms)[0] == pytest.approx(1e6 / 320e3)
    with pytest.raises(ProjectError, match="more cores than the die has"):
        costs(PROFILE.replace('stream1_aic = { value = 8', 'stream1_aic = { value = 25')
              ).stream_class("s1")  # fmt: skip
    with pytest.raises(ProjectError, match="lacks runtime.stream0_aic"):
        costs(PROFILE.replace("stream0_aic", "graph_launch_ms")).stream_class("s0")


A_FLOPS = 16e6 * 10  # 10 µs on stream 0's 16 TFLOPS (6.667 on the whole die)
M_BYTES = 15e6  # 15 µs at 1,000 GB/s on any stream (its 1e7 FLOPs: 1.25 µs on stream 1)
LAYERS = 3


def pipeline_trace(two_streams: bool) -> dict:
    """Two micro-batches of LAYERS layers, recorded as `forward_microbatched` does: per layer
    the attention of micro-batch 0 then 1 (s0), then the MoE of 0 then 1 (s1); or every op on
    main (one stream)."""
    cap = Capture(0, None)
    st = Streams(cap if two_streams else None, 2)
    for _ in range(LAYERS):
        for m in range(2):
            with st.on(m, "s0"):
                cap.op("mla", A_FLOPS, 0, 0, unit="aic", dtype="bf16")
        for m in range(2):
            with st.on(m, MOE_STREAM):
                cap.op("experts", 1e7, M_BYTES, 0, unit="aic", dtype="bf16")
    st.join()
    return {"die": 0, "streams": cap.streams, "events": cap.events}


def test_two_micro_batches_overlap_attention_and_moe_on_the_critical_path(tmp_path):
    prof = parse_profile(PROFILE.encode(), "test.toml")
    spans = {}
    for two in (True, False):
        path = write_capture(tmp_path / str(two), {"workload": {}}, [pipeline_trace(two)])
        res = replay(load_capture(path), prof)
        spans[two] = res.makespan_us
        if two:
            g, cap = res.graph, res.capture
            s0, s1 = cap.streams[0].index("s0"), cap.streams[0].index("s1")
            att = [x for x in range(g.n) if g.locate(x)[1] == s0 and g.kind[x] == 4]
            moe = [x for x in range(g.n) if g.locate(x)[1] == s1 and g.kind[x] == 4]
            assert [g.cost[x] for x in att] == pytest.approx([10.0] * 2 * LAYERS)
            assert [g.cost[x] for x in moe] == pytest.approx([15.0] * 2 * LAYERS)
            # micro-batch 1's first attention runs while micro-batch 0's MoE does
            assert res.finish[att[1]] == pytest.approx(20.0)
            assert res.finish[moe[0]] == pytest.approx(25.0)
            # micro-batch 0's second attention waits for its MoE, not for micro-batch 1's
            assert res.finish[att[2]] == pytest.approx(35.0)
    # by hand (A = 10 on s0, M = 15 on s1, M >= A): stream 1 is the critical path after the
    # first attention, A + 2 L M; one stream: 2 L (A x 16 / 24 + M)
    assert spans[True] == pytest.approx(10 + 2 * LAYERS * 15)
    assert spans[False] == pytest.approx(2 * LAYERS * (10 * 16 / 24 + 15))
    assert spans[True] < spans[False]


class FakeEp:
    def __init__(self, cap):
        self.cap = cap


@captured("dispatch")
def fake_dispatch(ep, event_id: int) -> None:
    ep.cap.op("quantize", 0, 8, 8)


def test_a_collective_launched_from_stream_1_starts_after_it_and_joins_back_to_it():
    cap = Capture(0, None)
    s1 = cap.stream("s1")
    with cap.on(s1):
        cap.op("gate", 1, 1, 1)
        fake_dispatch(FakeEp(cap), event_id=7)
        cap.op("experts", 1, 1, 1)
    a2a = cap.stream("a2a")
    on = {sid: [e for e in cap.events if e[1] == sid] for sid in (cap.main, s1, a2a)}
    assert on[cap.main] == []  # main neither waits for it nor is waited for
    kinds = [e[0] for e in on[a2a]]
    assert kinds == ["after", "begin", "op", "end"]
    assert on[a2a][0][4:] == [s1, 0]  # after s1's gate
    assert [e[0] for e in on[s1]] == ["op", "after", "op"]
    assert on[s1][1][4:] == [a2a, 3]  # s1 goes on after the call's end


def test_halves_and_event_ids():
    segs = [(r, [r], 0) for r in range(5)]
    assert halves(segs) == [segs[:3], segs[3:]]
    assert halves(segs[:1]) == [segs[:1], []] and halves([]) == [[], []]
    ids = {microbatch_event(s, 4, layer, m) for s in range(3) for layer in range(4)
           for m in range(2)}  # fmt: skip
    assert len(ids) == 3 * 4 * 2 and min(ids) == 0
