"""`xpod bench alltoall` (bench/alltoall.py) and its peers (bench/peers.py, bench/mpi_peer.py).

Smoke tests only, with tiny shapes: rows come back well formed, the A2E rows report one metadata
write per attention die, and nothing is left behind. Speed is never asserted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numpy as np
import pytest

from bench import alltoall as A
from bench.alltoall.inputs import hottest_over_mean
from bench.peers import mpi_available, run_a2a_peer
from comm.routing import Placement
from runtime import cli

ROW_KEYS = ("bench", "transport", "protocol", "quant", "dies", "batch", "hidden", "topk")
ROW_KEYS += ("dispatch_p50_us", "dispatch_p99_us", "combine_p50_us", "combine_p99_us")
ROW_KEYS += ("total_p50_us", "algbw_gbps", "busbw_gbps", "aggregate_gbps", "memcpy_gbps")
ROW_KEYS += ("copy_limit_gbps", "copy_ratio", "cpu_s_per_die", "iters", "git_sha")
TINY = ["--hidden", "64", "--topk", "2", "--quick", "--iters", "4"]


@pytest.fixture(autouse=True)
def no_peer_leftovers():
    """Fail the test if it leaves a zmq socket directory or an mpirun spec directory behind."""
    tmp = tempfile.gettempdir()
    before = {n for n in os.listdir(tmp) if n.startswith("xpod-peer")}
    yield
    assert {n for n in os.listdir(tmp) if n.startswith("xpod-peer")} - before == set()


def bench(tmp_path, *argv: str) -> list[dict]:
    path = tmp_path / "rows.jsonl"
    assert cli.main(["bench", "alltoall", *argv, *TINY, "--json", str(path)]) == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_row(r: dict) -> None:
    missing = [k for k in ROW_KEYS if k not in r]
    assert not missing, f"row lacks {missing}: {r}"
    assert r["bench"] == "alltoall"
    assert r["quant"] in ("int8", "none")
    assert r["iters"] == 4
    assert 0 < r["dispatch_p50_us"] <= r["dispatch_p99_us"], r
    assert 0 < r["combine_p50_us"] <= r["combine_p99_us"], r
    assert r["total_p50_us"] > 0 and r["busbw_gbps"] > 0 and r["memcpy_gbps"] > 0, r
    assert r["copy_limit_gbps"] == pytest.approx(r["memcpy_gbps"] * r["cores"])
    assert r["cpu_s_per_die"] >= 0


def test_routing_picks_distinct_experts_and_counts_every_message():
    pt = A.Point(dies=4, batch=8, hidden=16, topk=3, num_experts=12, seed=5)
    idx, w = A.routing(pt, 2)
    assert idx.shape == (8, 3) and w.dtype == np.float32
    assert all(len(set(row)) == 3 for row in idx.tolist())
    assert np.array_equal(idx, A.routing(pt, 2)[0]), "routing must be reproducible"
    counts = A.counts_matrix(pt)
    assert counts.sum(axis=1).tolist() == [8 * 3] * 4
    a2e = A.Point(dies=3, batch=8, hidden=16, topk=3, num_experts=12, seed=5, attention_dies=1)
    counts = A.counts_matrix(a2e)
    assert counts[0].sum() == 24 and counts[:, 0].sum() == 0 and counts[1:].sum() == 0


@pytest.mark.timeout(120)
def test_xpod_rows_over_batch_dies_protocol_and_quant(tmp_path, capsys):
    rows = bench(tmp_path, "--dies", "2,4", "--batch", "1,4", "--protocol", "pull,fused")
    assert len(rows) == 2 * 2 * 2 * 2
    for r in rows:
        check_row(r)
        assert r["transport"] == "xpod" and r["protocol"] in ("pull", "fused")
        assert r["fused_dispatch_buffer_bytes"] > 0
    got = {(r["dies"], r["batch"], r["protocol"], r["quant"]) for r in rows}
    assert len(got) == 16
    by = {(r["dies"], r["batch"], r["quant"]): r for r in rows}
    # 4 dies, batch 4, top-2, int8: 8 messages of 64 + 4 bytes each per die
    assert by[(4, 4, "int8")]["dispatch_bytes_per_die"] == 8 * 68
    # combine: 8 rows of 64 bfloat16 (the default), or float32 with --combine-dtype float32
    assert by[(4, 4, "none")]["combine_bytes_per_die"] == 8 * 64 * 2
    assert by[(4, 4, "none")]["combine_dtype"] == "bfloat16"
    out = capsys.readouterr().out
    assert "disp_p50" in out and "Table 7 shape" in out and "fused receive buffers" in out
    from importlib.util import find_spec

    if find_spec("matplotlib") is not None:
        from bench.plot import plot_rows

        plot_rows(rows, str(tmp_path / "a2a.png"))
        assert (tmp_path / "a2a.png").read_bytes()[:4] == b"\x89PNG"


def test_skew_routing_makes_hot_experts_and_dedup_counts_token_die_pairs():
    pt = A.Point(dies=4, batch=64, hidden=16, topk=4, num_experts=32, seed=3)
    skew = A.Point(**{**dataclasses.asdict(pt), "routing": "skew"})
    assert hottest_over_mean(skew) > 3 * hottest_over_mean(pt)
    idx = A.routing(skew, 1)[0]
    assert all(len(set(row)) == 4 for row in idx.tolist())
    placement = Placement.default(32, (0, 1, 2, 3))
    for p in (pt, skew):
        dedup = A.counts_matrix(p, dedup=True)
        for src in range(4):  # one message per (token, die): distinct dies of each token's row
            dies_of = placement.die_of[A.routing(p, src)[0]]
            want = np.bincount([d for row in dies_of for d in set(row.tolist())], minlength=4)
            assert dedup[src].tolist() == want.tolist()
        assert (dedup <= A.counts_matrix(p)).all() and dedup.sum() < A.counts_matrix(p).sum()


@pytest.mark.timeout(120)
def test_dedup_rows_move_fewer_bytes_and_check_their_output(tmp_path, capsys):
    rows = bench(tmp_path, "--dies", "4", "--batch", "8", "--protocol", "pull,pull-dedup,fused,"
                 "fused-dedup", "--quant", "int8", "--routing", "uniform,skew",
                 "--experts", "8")  # fmt: skip
    assert len(rows) == 8
    by = {(r["protocol"], r["routing"]): r for r in rows}
    for routing in ("uniform", "skew"):
        for base in ("pull", "fused"):
            plain, dedup = by[(base, routing)], by[(f"{base}-dedup", routing)]
            check_row(dedup)
            assert dedup["dispatch_bytes_per_die"] < plain["dispatch_bytes_per_die"]
            assert dedup["combine_bytes_per_die"] < plain["combine_bytes_per_die"]
            assert dedup["hottest_over_mean"] == plain["hottest_over_mean"]
    out = capsys.readouterr().out
    assert "dedup (one message per token and die)" in out and "fewer" in out


@pytest.mark.timeout(120)
def test_float32_combine_moves_twice_the_bytes(tmp_path):
    args = ("--dies", "4", "--batch", "4", "--protocol", "fused", "--quant", "none")
    bf = bench(tmp_path, *args)[0]
    f32 = bench(tmp_path, *args, "--combine-dtype", "float32")[0]
    assert (bf["combine_dtype"], f32["combine_dtype"]) == ("bfloat16", "float32")
    assert f32["combine_bytes_per_die"] == 2 * bf["combine_bytes_per_die"] == 8 * 64 * 4
    assert f32["fused_combine_buffer_bytes"] == 2 * bf["fused_combine_buffer_bytes"]
    assert f32["dispatch_bytes_per_die"] == bf["dispatch_bytes_per_die"]


@pytest.mark.timeout(120)
def test_a2e_rows_report_one_metadata_write_per_attention_die(tmp_path, capsys):
    rows = bench(tmp_path, "--protocol", "a2e", "--attention-dies", "1,2",
                 "--expert-dies", "2,2", "--batch", "2", "--quant", "int8")  # fmt: skip
    assert [(r["attention_dies"], r["expert_dies"]) for r in rows] == [(1, 2), (2, 2)]
    for r in rows:
        check_row(r)
        assert r["protocol"] == "a2e"
        assert r["metadata_writes_per_attention_die"] == 1
        assert r["metadata_writes_per_trampoline"] == r["expert_dies"]
    assert "per attention die 1" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_peer_rows_move_the_same_bytes(tmp_path):
    rows = bench(tmp_path, "--dies", "3", "--batch", "2", "--protocol", "fused", "--peers")
    transports = {r["transport"] for r in rows}
    assert {"xpod", "zmq"} <= transports
    assert ("mpi4py" in transports) == mpi_available()[0]
    for r in rows:
        check_row(r)
    for quant in ("int8", "none"):
        same = [r for r in rows if r["quant"] == quant]
        assert len({r["dispatch_bytes_per_die"] for r in same}) == 1, same
        assert len({r["combine_bytes_per_die"] for r in same}) == 1, same
        for r in same:
            assert r["floor_us"] > 0 and r["time_over_floor"] > 0 and r["cpu_ms_per_step"] >= 0
    if mpi_available()[0]:  # the same job on MPI (it checks itself against comm.reference)
        ep = [(r["protocol"], r["quant"]) for r in rows if r["transport"] == "mpi4py"]
        assert sorted(ep) == [("alltoallv", "int8"), ("alltoallv", "none"),
                              ("ep", "int8"), ("ep", "none")], ep  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["zmq", "mpi4py"])
def test_a2a_peer_with_unbalanced_counts(transport):
    if transport == "mpi4py" and not mpi_available()[0]:
        pytest.skip(mpi_available()[1])
    counts = [[0, 3, 0], [1, 0, 2], [5, 0, 1]]  # empty blocks and self blocks included
    case = {"counts": counts, "dispatch_msg_bytes": 100, "combine_msg_bytes": 400, "warmup": 2,
            "iters": 0, "budget_s": 0.05, "min_iters": 3, "max_iters": 20}  # fmt: skip
    (res,) = run_a2a_peer(transport, [case], timeout_s=100)
    assert 3 <= res["iters"] <= 20
    assert len(res["dispatch_ns"]) == len(res["combine_ns"]) == res["iters"]
    assert min(res["dispatch_ns"]) > 0 and res["cpu_s_per_die"] >= 0


def test_a2a_peer_refuses_bad_cases():
    with pytest.raises(ValueError):
        run_a2a_peer("tcp", [{"counts": [[1]]}])
    with pytest.raises(ValueError):
        run_a2a_peer("zmq", [{"counts": [[1, 2]]}])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", [("8", "16", "7168", "8"), ("4", "3", "33", "2")])
def test_bench_passes_times_every_pass_the_protocols_run(tmp_path, capsys, shape):
    """`xpod bench passes`: one JSON row per pass (the kernels the protocols run, through
    the same region addressing), each timed and set against a copy of its bytes."""
    dies, batch, hidden, topk = shape
    out = tmp_path / "passes.jsonl"
    argv = ["bench", "passes", "--dies", dies, "--batch", batch, "--hidden", hidden, "--topk",
            topk, "--reps", "3", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    names = [r["pass"] for r in rows]
    assert len(names) == 6 and any("fused: pack" in n for n in names), names
    for r in rows:
        assert r["us"] > 0 and r["gbps"] > 0 and r["x_copy"] > 0, r
        assert r["bytes_read"] > 0 and r["bytes_written"] > 0
    assert "all passes" in capsys.readouterr().out
