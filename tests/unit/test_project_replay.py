"""The replay (runtime.project, docs/projection.md §2): hand-built captures whose projected times
are computed by hand from the profile's constants, each test one mechanism of the contract.

Most tests use PROFILE, a profile of round numbers (not a shipped one, so calibrating cm384
changes nothing here); the ping-pong uses cm384 itself, its expectation written with the
profile's own constants. Dies 0 and 1 share a node in PROFILE (dies_per_node 2), 2.. do not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runtime.project import ProjectError, load_capture, load_profile, replay, write_capture
from runtime.project.result import port_series

PROFILE = """
[profile]
name = "test"
description = "round numbers for hand computation"
[die]
dies_per_node = { value = 2, source = "test" }
hbm_gbps = { value = 1000, source = "test" }
bf16_tflops = { value = 100, source = "test" }
int8_tflops = { value = 200, source = "test" }
[link]
port_gbps = { value = 100, source = "test" }
write_latency_us = { value = 2, source = "test" }
write_latency_intra_us = { value = 1, source = "test" }
read_latency_us = { value = 3, source = "test" }
read_latency_intra_us = { value = 1.5, source = "test" }
[aiv]
b_core_gbps = { value = 10, source = "test" }
t_row_us = { value = 0.1, source = "test" }
t_tok_us = { value = 0.2, source = "test" }
t_put_us = { value = 0.3, source = "test" }
t_flag_us = { value = 0.4, source = "test" }
t_poll_us = { value = 0.05, source = "test" }
[collective]
cores = { value = 20, source = "test" }
t_fixed_us = { value = 5, source = "test" }
[p2p]
t_fixed_us = { value = 1, source = "test" }
[efficiency]
vector_memory = { value = 0.5, source = "test" }
gemm_bf16 = { value = 0.5, source = "test" }
mla_compute = { value = 0.25, source = "test" }
mla_memory = { value = 0.5, source = "test" }
[dma]
startup_us = { unknown = true, source = "test: no number" }
"""
PORT, B_CORE, L_INTRA, L_INTER = 100.0, 10.0, 1.0, 2.0
T_PUT, T_FLAG, T_POLL, T_ROW, T_TOK = 0.3, 0.4, 0.05, 0.1, 0.2


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "test.toml"
    path.write_text(PROFILE)
    return load_profile(str(path))


def project(tmp_path: Path, dies: list[dict], profile, calls=None, name="cap"):
    """Write `dies` (one {"die", "streams", "events"} each) as a capture, load it, replay."""
    meta = {"layout_version": 7, "workload": {"test": name}}
    if calls is not None:
        meta["calls"] = calls
    write_capture(tmp_path / name, meta, dies)
    return replay(load_capture(tmp_path / name, 7), profile)


def die(d: int, streams: list[str], *events: list) -> dict:
    return {"die": d, "streams": streams, "events": [list(e) for e in events]}


# event builders: [kind, stream, t0_ns, t1_ns, *fields]
def put(s, peer, nbytes, rows=0, tokens=0, row_bytes=0):
    return ["put", s, 0, 0, peer, nbytes, "app", rows, tokens, row_bytes]


def pub(s, peer, words, values):
    return ["pub", s, 0, 0, peer, list(words), list(values)]


def acq(s, words, targets, writers, field="f"):
    return ["acq", s, 0, 0, list(words), list(targets), list(writers), field]


def copy(s, nbytes):
    return ["copy", s, 0, 0, nbytes]


def begin(s, name, call):
    return ["begin", s, 0, 0, name, call]


def end(s, name, call, joins=()):
    return ["end", s, 0, 0, name, call, [list(j) for j in joins]]


def after(s, stream, seq):
    return ["after", s, 0, 0, stream, seq]


# -- the mechanisms --------------------------------------------------------------------------------


def test_ping_pong_on_cm384_is_two_transfers_two_latencies_and_the_engine_costs(tmp_path):
    # each way: the put (its issue, then its bytes moved by 1 core), the pub right after it
    # (its words delivered after the data: one queue), the write latency, the poll. Dies 0
    # and 1: one node (cm384: 16 dies per node).
    p = load_profile("cm384")
    nbytes = 1 << 20
    d0 = die(0, ["main"], begin(0, "pingpong", 0), put(0, 1, nbytes), pub(0, 1, [8], [1]),
             acq(0, [9], [1], [1]), end(0, "pingpong", 0))  # fmt: skip
    d1 = die(1, ["main"], acq(0, [8], [1], [0]), put(0, 0, nbytes), pub(0, 0, [9], [1]))
    res = project(tmp_path, [d0, d1], p)
    xfer = p.get("aiv.t_put_us") + nbytes / (p.get("aiv.b_core_gbps") * 1e3)
    assert nbytes / (p.get("link.port_gbps") * 1e3) < xfer  # the core, not the port, is slower
    lat = p.get("link.write_latency_intra_us")
    one_way = xfer + p.get("aiv.t_flag_us") + lat + p.get("aiv.t_poll_us")
    assert res.durations[(0, "pingpong", 0)] == pytest.approx(2 * one_way)
    assert res.times(1, 0, 0)[1] == pytest.approx(one_way)  # die 1 saw the ping


def test_two_senders_into_one_ingress_take_twice_as_long(tmp_path, profile):
    # a2a streams: 20 cores x 10 GB/s >= the 100 GB/s port, so each transfer is port-bound;
    # a flag follows each put, and the receiver's call waits for it
    nbytes = 1_000_000
    x = nbytes / (PORT * 1e3)
    tail = L_INTER + T_POLL  # dies 0, 1 -> 2, 3: other nodes

    def sender(d, dst):
        return die(d, ["a2a"], put(0, dst, nbytes), pub(0, dst, [d], [1]))

    def receiver(d, frm):
        return die(d, ["a2a"], begin(0, "pull", 0),
                   acq(0, frm, [1] * len(frm), frm), end(0, "pull", 0))  # fmt: skip

    one = project(tmp_path, [sender(0, 2), die(1, []), receiver(2, [0])], profile, name="one")
    two = project(tmp_path, [sender(0, 2), sender(1, 2), receiver(2, [0, 1])], profile,
                  name="two")  # fmt: skip
    apart = project(tmp_path, [sender(0, 2), sender(1, 3), receiver(2, [0]), receiver(3, [1])],
                    profile, name="apart")  # fmt: skip
    assert one.calls("pull").max_us == pytest.approx(x + tail)
    assert two.calls("pull").max_us == pytest.approx(2 * x + tail)  # FIFO: die 0 first (tie)
    assert apart.calls("pull").max_us == pytest.approx(x + tail)  # other ingress: no wait
    # the senders' streams do not wait for their bytes: the put's cores and the flag only
    assert two.times(1, 0, 1)[1] == pytest.approx(T_PUT + nbytes / (20 * B_CORE * 1e3)
                                                  + T_FLAG / 20)  # fmt: skip
    assert two.ports.ingress[2].sum() == pytest.approx(2 * nbytes)
    assert two.ports.egress[0].sum() == pytest.approx(nbytes)


def test_slow_transfers_share_a_port(tmp_path, profile):
    # 1-core streams move 10 GB/s: each holds the 100 GB/s ingress only for its share, so
    # the second waits for the port 10 us but its core is slower anyway: both take 100 us
    nbytes = 1_000_000
    d = [die(s, ["p2p.tx.2.0"], put(0, 2, nbytes)) for s in (0, 1)] + [die(2, [])]
    res = project(tmp_path, d, profile)
    xfer_us = nbytes / (B_CORE * 1e3)
    assert res.times(0, 0, 0)[1] == pytest.approx(T_PUT + xfer_us)
    assert res.times(1, 0, 0)[1] == pytest.approx(T_PUT + xfer_us)
    assert res.ports.ingress[2].sum() == pytest.approx(2 * nbytes)


def ring(chunks: int, slots: int, chunk_bytes: int, drop_head: int | None = None) -> list[dict]:
    """A p2p ring send of `chunks` chunks over `slots` slots, die 0 -> die 1, one lane each way:
    tail word 100 (on die 1, written by die 0), head word 200 (on die 0, written by die 1)."""
    tx = [begin(0, "send", 1)]
    for k in range(chunks):
        if k >= slots:  # credit: chunk k - slots consumed
            tx.append(acq(0, [200], [k - slots + 1], [1], "ack.head"))
        tx += [put(0, 1, chunk_bytes), pub(0, 1, [100], [k + 1])]
    tx += [acq(0, [200], [chunks], [1], "ack.head"), end(0, "send", 1)]
    rx = [begin(0, "recv", 1)]
    for k in range(chunks):
        rx += [acq(0, [100], [k + 1], [0], "desc.tail_ptr"), copy(0, chunk_bytes)]
        if k + 1 != drop_head:
            rx.append(pub(0, 0, [200], [k + 1]))
    rx.append(end(0, "recv", 1))
    return [die(0, ["p2p.tx.1.0"], *tx), die(1, ["p2p.rx.0.0"], *rx)]


def test_ring_credits_chain_to_the_receivers_head_publishes(tmp_path, profile):
    chunks, slots, c = 5, 2, 10_000
    res = project(tmp_path, ring(chunks, slots, c), profile)
    # the hand computation: each side's stream time, with the other side's arrivals
    cp, lat = c / (B_CORE * 1e3), L_INTRA
    tail_arr, head_arr = [], []
    t = r = 1.0  # p2p.t_fixed_us of the begins
    for k in range(chunks):  # the sender runs ahead until a credit stops it: interleave
        if k >= slots:
            while len(head_arr) < k - slots + 1:
                r = _rx_chunk(r, tail_arr[len(head_arr)], cp, head_arr, lat)
            t = max(t, head_arr[k - slots]) + T_POLL
        t = t + T_PUT + cp + T_FLAG  # the put (its core), then the pub (delivered after it)
        tail_arr.append(t + lat)
    while len(head_arr) < chunks:
        r = _rx_chunk(r, tail_arr[len(head_arr)], cp, head_arr, lat)
    t = max(t, head_arr[-1]) + T_POLL
    assert res.durations[(0, "send", 1)] == pytest.approx(t)
    assert res.durations[(1, "recv", 1)] == pytest.approx(r)


def _rx_chunk(r: float, tail_arrival: float, cp: float, head_arr: list, lat: float) -> float:
    r = max(r, tail_arrival) + T_POLL + cp + T_FLAG  # acq, copy out of the slot, pub the head
    head_arr.append(r + lat)
    return r


def test_a_missing_head_publish_is_trace_incomplete(tmp_path, profile):
    with pytest.raises(ProjectError) as e:
        project(tmp_path, ring(5, 2, 10_000, drop_head=5), profile)
    assert str(e.value).startswith(
        "trace incomplete: die 0 stream 0 seq 14 waits for word 200 >= 5 of die 1, never written"
    )


def test_fused_flags_wait_for_the_last_arrival(tmp_path, profile):
    # dies 1..4 each work a different time, then publish their flag word to die 0
    work = {1: 2_180_000, 2: 2_100_000, 3: 500_000, 4: 1_000_000}  # bytes of a local copy
    senders = [die(d, ["a2a"], copy(0, n), pub(0, 0, [10 + d], [7])) for d, n in work.items()]
    recv = die(0, ["a2a"], acq(0, [11, 12, 13, 14], [7] * 4, [1, 2, 3, 4], "fused.flag"))
    res = project(tmp_path, [recv, *senders], profile)
    rate = 20 * B_CORE  # collective cores x b_core

    def arrival(d):
        return work[d] / (rate * 1e3) + T_FLAG / 20 + (L_INTRA if d == 1 else L_INTER)

    assert max(work, key=arrival) == 2 and max(work, key=work.get) == 1  # die 1: die 0's node
    assert res.times(0, 0, 0)[1] == pytest.approx(arrival(2) + T_POLL)


def test_completion_counts_match_the_smallest_value_reaching_each_target(tmp_path, profile):
    # combine-style counters: writers 1..3 each raise two words of die 0 step by step; the acq
    # needs word (w, target) from each: matched to the first pub reaching the target
    writers = {}
    for d in (1, 2, 3):
        ev = []
        for v in (1, 2, 3):
            ev += [copy(0, 1_000_000 * d), pub(0, 0, [20 + d, 30 + d], [v, v])]
        writers[d] = die(d, ["main"], *ev)
    targets = {1: 3, 2: 1, 3: 2}  # writer -> the value its words must reach
    words = [w for d in (1, 2, 3) for w in (20 + d, 30 + d)]
    want = [targets[d] for d in (1, 2, 3) for _ in (0, 1)]
    who = [d for d in (1, 2, 3) for _ in (0, 1)]
    recv = die(0, ["main"], acq(0, words, want, who, "fused.cflag"))
    res = project(tmp_path, [recv, *writers.values()], profile)
    arrivals = []
    for d, t in targets.items():
        step = 1_000_000 * d / (B_CORE * 1e3) + 2 * T_FLAG  # a copy, then a pub of two words
        arrivals.append(t * step + (L_INTRA if d == 1 else L_INTER))
    assert res.times(0, 0, 0)[1] == pytest.approx(max(arrivals) + T_POLL)


def test_equal_values_match_the_lowest_seq_then_the_lowest_stream(tmp_path, profile):
    # die 1 publishes value 1 to word 5 on two streams: stream 0 at seq 2 (early in time),
    # stream 1 at seq 1 (late: a long copy first). The rule picks seq 1, the later one.
    d1 = die(1, ["main", "side"], copy(0, 10), copy(0, 10), pub(0, 0, [5], [1]),
             copy(1, 5_000_000), pub(1, 0, [5], [1]))  # fmt: skip
    res = project(tmp_path, [die(0, ["main"], acq(0, [5], [1], [1])), d1], profile)
    side_pub_done = 5_000_000 / (B_CORE * 1e3) + T_FLAG
    assert res.times(0, 0, 0)[1] == pytest.approx(side_pub_done + L_INTRA + T_POLL)


def test_a_pubs_words_land_after_its_streams_earlier_puts_to_that_peer(tmp_path, profile):
    # a2a (20 cores: 200 GB/s) puts 1 MB to die 1: the port (100 GB/s) takes 10 us, the cores
    # 5 us; its flag goes out at once but lands after the data. The side stream's 2 MB put to
    # die 1 (requested at the same time, served second) is another stream's: no floor.
    big = 1_000_000
    d0 = die(0, ["a2a", "side"], put(0, 1, big), pub(0, 1, [1], [1]), put(1, 1, 2 * big))
    d1 = die(1, ["main"], acq(0, [1], [1], [0]))
    res = project(tmp_path, [d0, d1], profile)
    eng = T_PUT + big / (20 * B_CORE * 1e3)
    assert res.times(0, 0, 1)[1] == pytest.approx(eng + T_FLAG / 20)  # the stream goes on
    assert res.times(1, 0, 0)[1] == pytest.approx(big / (PORT * 1e3) + L_INTRA + T_POLL)


def test_end_joins_the_lanes_of_its_call(tmp_path, profile):
    c1, c2 = 2_000_000, 3_000_000
    d0 = die(0, ["main", "p2p.tx.1.0", "p2p.tx.1.1"],
             begin(0, "send", 4), after(1, 0, 0), copy(1, c1), after(2, 0, 0), copy(2, c2),
             end(0, "send", 4, [(1, 1), (2, 1)]))  # fmt: skip
    res = project(tmp_path, [d0, die(1, [])], profile)
    assert res.durations[(0, "send", 4)] == pytest.approx(1.0 + c2 / (B_CORE * 1e3))


def test_ops_roofline_and_refusal(tmp_path, profile):
    ops = die(0, ["main"],
              ["op", 0, 0, 0, "quantize", 0, 1_000_000, 500_000, {}],  # aiv by default
              ["op", 0, 0, 0, "expert", 10**12, 1000, 1000, {"unit": "aic"}],
              ["op", 0, 0, 0, "mla", 10**9, 10**6, 0, {"unit": "aic", "dtype": "bf16"}],
              )  # fmt: skip
    res = project(tmp_path, [ops], profile)
    assert res.times(0, 0, 0)[1] == pytest.approx(1_500_000 / (1000 * 0.5 * 1e3))
    gemm = 10**12 / (100 * 0.5 * 1e6)  # compute-bound: flops / (peak x gemm_bf16)
    assert res.times(0, 0, 1)[1] - res.times(0, 0, 0)[1] == pytest.approx(gemm)
    mla = max(10**9 / (100 * 0.25 * 1e6), 10**6 / (1000 * 0.5 * 1e3))
    assert res.times(0, 0, 2)[1] - res.times(0, 0, 1)[1] == pytest.approx(mla)
    bad = die(0, ["main"], ["op", 0, 0, 0, "x", 1, 1, 1, {"unit": "tpu"}])
    with pytest.raises(ProjectError, match=r"die 0 stream 0 \(main\) seq 0 \(op\).*unit 'tpu'"):
        project(tmp_path, [bad], profile, name="bad")


def test_a_constant_the_capture_needs_and_the_profile_marks_unknown_is_refused(tmp_path, profile):
    d0 = die(0, ["dma.tx.1.0"], put(0, 1, 1000))
    with pytest.raises(ProjectError, match=r"dma\.startup_us is unknown \(source: test: no"):
        project(tmp_path, [d0, die(1, [])], profile)
    # and a capture without a DMA stream projects on the same profile
    project(tmp_path, [die(0, ["p2p.tx.1.0"], put(0, 1, 1000)), die(1, [])], profile, name="ok")


def test_a_cycle_is_refused(tmp_path, profile):
    d0 = die(0, ["a", "b"], after(0, 1, 0), after(1, 0, 0))
    with pytest.raises(ProjectError, match="trace cannot complete: die 0 stream 0 seq 0"):
        project(tmp_path, [d0], profile)


def test_a_call_that_never_ends_is_refused(tmp_path, profile):
    with pytest.raises(ProjectError, match="call send #3 begins and never ends"):
        project(tmp_path, [die(0, ["main"], begin(0, "send", 3))], profile)


def test_host_profile_charges_measured_times(tmp_path):
    # stream: begin at 1000 ns, a copy ending at 4000, an op ending at 9000, end at 9000
    d0 = die(0, ["main"], ["begin", 0, 1000, 1000, "step", 0], ["copy", 0, 2000, 4000, 10],
             ["op", 0, 5000, 9000, "x", 0, 0, 0, {}],
             ["end", 0, 9000, 9000, "step", 0, []])  # fmt: skip
    res = project(tmp_path, [d0], load_profile("host"))
    assert res.durations[(0, "step", 0)] == pytest.approx(8.0)  # 9000 - 1000 ns
    assert res.contention_model.startswith("host")


def test_host_profile_runs_a_dies_streams_one_after_another_in_file_order(tmp_path):
    # the host ran lane 1's copy, then lane 2's: 200 us, not the 100 us of two parallel lanes
    d0 = die(0, ["main", "p2p.tx.1.0", "p2p.tx.1.1"], ["begin", 0, 0, 0, "send", 0],
             ["copy", 1, 0, 100_000, 10], ["copy", 2, 100_000, 200_000, 10],
             ["end", 0, 200_000, 200_000, "send", 0, [[1, 0], [2, 0]]])  # fmt: skip
    res = project(tmp_path, [d0, die(1, [])], load_profile("host"))
    assert res.durations[(0, "send", 0)] == pytest.approx(200.0)


def test_host_profile_derives_waits_and_charges_only_the_detection(tmp_path):
    # die 1 writes word 7 at 50 us; die 0 checked from 1 us and saw it at 60 us: its wait is
    # the pub's (derived), its own cost the 10 us it took to see it: replayed, it ends at 60
    d1 = die(1, ["main"], ["copy", 0, 0, 50_000, 10], ["pub", 0, 50_000, 50_000, 0, [7], [1]])
    d0 = die(0, ["main"], ["begin", 0, 0, 0, "x", 0], ["acq", 0, 1_000, 60_000, [7], [1], [1], "f"],
             ["end", 0, 60_000, 60_000, "x", 0, []])  # fmt: skip
    res = project(tmp_path, [d0, d1], load_profile("host"))
    assert res.durations[(0, "x", 0)] == pytest.approx(60.0)
    # the writer slower in the replay than it was (a 5x longer copy): the wait grows with it
    d1["events"][0][3] = 250_000
    d1["events"][1][2:4] = [250_000, 250_000]
    slow = project(tmp_path, [d0, d1], load_profile("host"), name="slow")
    assert slow.durations[(0, "x", 0)] == pytest.approx(250.0)  # the pub, then 0 detection


# -- determinism and the figures -------------------------------------------------------------------


def alltoall(n: int, calls: int, interleave: bool = False) -> list[dict]:
    """n dies: per call a begin on main, puts + pubs to every peer on two a2a streams (even
    and odd peers), an acq of every flag, an end joining both; interleave: the two streams'
    events alternate in the file (another valid order of the same streams)."""
    dies = []
    for d in range(n):
        main, halves = [], ([], [])
        for c in range(calls):
            main.append(begin(0, "dispatch", c))
            for k in range(1, n):
                p = (d + k) % n
                h = halves[p % 2]
                h.append(put(1 + p % 2, p, 7296 * (1 + (d * p + c) % 5), 1 + (d + p) % 5, 1))
                h.append(pub(1 + p % 2, p, [1000 + d], [c + 1]))
            srcs = [(d - k) % n for k in range(1, n)]
            main.append(acq(0, [1000 + s for s in srcs], [c + 1] * len(srcs), srcs))
            main.append(end(0, "dispatch", c))
        ev = main + halves[0] + halves[1]
        if interleave:
            ev = main + [e for pair in zip(halves[1], halves[0], strict=False) for e in pair]
            ev += halves[0][len(halves[1]) :] + halves[1][len(halves[0]) :]
        dies.append(die(d, ["main", "a2a.0", "a2a.1"], *ev))
    return dies


def test_same_capture_and_profile_give_identical_bytes(tmp_path, profile):
    a = project(tmp_path, alltoall(6, 3), profile, calls=["dispatch"], name="a")
    b = project(tmp_path, alltoall(6, 3), profile, calls=["dispatch"], name="a")
    reordered = list(reversed(alltoall(6, 3, interleave=True)))  # dies listed 5..0
    c = project(tmp_path, reordered, profile, calls=["dispatch"], name="c")
    ja, jb, jc = (json.dumps(r.to_json(), sort_keys=True) for r in (a, b, c))
    assert ja == jb
    jc_as_a = jc.replace('"test": "c"', '"test": "a"')  # only the workload names differ
    assert ja == jc_as_a
    assert a.calls("dispatch").counted == 3 and a.calls("dispatch").p50_us > 0


def test_port_series_matches_a_brute_force_binning():
    transfers = [(0, 1, 0.0, 10.0, 1000), (0, 2, 5.0, 6.0, 300), (1, 0, 2.5, 97.5, 950),
                 (2, 1, 40.0, 40.0, 0)]  # fmt: skip
    ps = port_series(transfers, 3, 100.0, 10)
    want_eg = [[0.0] * 10 for _ in range(3)]
    want_in = [[0.0] * 10 for _ in range(3)]
    for src, dst, s, e, n in transfers:
        for k in range(10):
            lo, hi = max(s, 10.0 * k), min(e, 10.0 * (k + 1))
            if hi > lo:
                want_eg[src][k] += n * (hi - lo) / (e - s)
                want_in[dst][k] += n * (hi - lo) / (e - s)
    assert ps.bin_us == 10.0
    assert ps.egress == pytest.approx(np.array(want_eg))
    assert ps.ingress == pytest.approx(np.array(want_in))
