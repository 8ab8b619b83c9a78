"""The split decode synthesizer (bench.project.synth_decode_split) against real split capture
pods: a template step taken from a 2 + 2 pod (one request per attention die and micro-batch),
synthesized for larger pods with more requests (the target capture's own load: its requests'
contexts, its gates' routing, its MTP rows), equals that pod's capture event for event but the
host times, on every attention die (its step) and every expert die (its calls of the step),
with one micro-batch and with two and MTP (rejected drafts). Then the scale path's pieces on a
small pod, and the validation rows of a split workload."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bench.project.decode_points import DECODE_POINTS
from bench.project.decode_scale import capture_split_template
from bench.project.split_scale import SplitWorkload, project_split, split_scale_load
from bench.project.synth_decode_split import (
    SplitLoad,
    expert_window,
    split_template,
    step_window,
    synthesize_split,
)
from bench.project.validate_decode import SPLIT_REFUSAL, decode_rows
from comm.routing import Placement
from memory.layout import LAYOUT_VERSION
from runtime import PodConfig
from runtime.decode.options import DecodeOptions
from runtime.decode.run import run_decode
from runtime.model.mtp import SpecConfig
from runtime.project import load_capture, load_profile

OV = {"seed": 0, "n_layers": 4, "n_dense_layers": 1, "num_experts": 256, "topk": 8, "n_group": 8,
      "topk_group": 4}  # fmt: skip


def _capture(path, att: int, exp: int, batch: int, microbatches: int, mtp: float | None):
    spec = SpecConfig(1, "synthetic", (mtp,)) if mtp is not None else None
    run_decode(DecodeOptions(dies=att + exp, attention_dies=att, expert_dies=exp, batch=batch,
                             prompt_len=16, steps=3, model="tiny", overrides=OV, project="host",
                             project_dir=str(path), project_steps=3, microbatches=microbatches,
                             spec=spec))  # fmt: skip
    return path / "raw"


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    """(template, target) captures: one micro-batch without MTP (4 + 4 dies, 12 requests), two
    micro-batches with MTP at 0.5 (3 + 4 dies, 10 requests: uneven requests per die)."""
    root = tmp_path_factory.mktemp("split")
    return {
        1: (capture_split_template(root / "t1", microbatches=1),
            _capture(root / "r1", 4, 4, 12, 1, None)),
        2: (capture_split_template(root / "t2", microbatches=2, mtp=1),
            _capture(root / "r2", 3, 4, 10, 2, 0.5)),
    }  # fmt: skip


def captured_split_load(raw) -> SplitLoad:
    """The load of a real split capture's last step: each attention die's requests' starts
    (from its attention ops: context - span), each call's routing (its gates' `route`), the
    MTP sub-forward's rows, the default placement over the expert dies."""
    tpl = split_template(raw)
    topk, starts, routes, mtps = int(tpl.workload["topk"]), [], [], []
    for a in range(tpl.attention_dies):
        events = split_template(raw, tpl.step, attention=a).attention.events
        first, phase = {}, "main"
        routes.append([])
        for e in (e for e in events if e[0] == "op"):
            phase = {"embed": "main", "mtp_in": "mtp"}.get(e[4], phase)
            if e[4] == "mla":
                key = (phase, e[8].get("mb", 0))
                first.setdefault(key, list(zip(e[8]["req_ctx"], e[8]["req_span"], strict=True)))
            elif e[4] == "gate":
                routes[-1].append(np.asarray(e[8]["route"], np.int64))
        starts.append([c - s for k in sorted(first) if k[0] == "main" for c, s in first[k]])
        mtps.append([s for k in sorted(first) if k[0] == "mtp" for _, s in first[k]])
    n = json.loads((raw / "meta.json").read_text())["num_dies"]
    return SplitLoad(starts, lambda a, i, rows: routes[a][i].reshape(rows, topk),
                     Placement.default(int(tpl.workload["experts"]), range(tpl.attention_dies, n)),
                     topk, mtp_tokens=mtps if any(mtps) else None)  # fmt: skip


def _window(cap, d: int, tpl) -> list[list]:
    """Die d's events of the step (an attention die's step call, an expert die's calls), host
    times left out, each after's seq relative to the window's start."""
    ev, st = cap.events[d], cap.streams[d]
    if d < tpl.attention_dies:
        b, e = step_window(st, ev, tpl.step)
    else:
        b, e = expert_window(st, ev, tpl.step, tpl.slots)
    seq0 = [0] * len(st)
    for x in ev[:b]:
        seq0[x[1]] += 1
    return [[x[0], x[1], *x[4:5], x[5] - seq0[x[4]]] if x[0] == "after" else [x[0], x[1], *x[4:]]
            for x in ev[b : e + 1]]  # fmt: skip


def _synthesize(tpl_raw, real_raw, out, load: SplitLoad | None = None):
    real_tpl = split_template(real_raw)
    cfg = PodConfig.from_dict(json.loads((real_raw / "meta.json").read_text())["config"])
    syn = synthesize_split(split_template(tpl_raw), load or captured_split_load(real_raw), out,
                           cfg=cfg, first_op=real_tpl.first_op)  # fmt: skip
    return real_tpl, load_capture(real_raw, LAYOUT_VERSION), load_capture(syn, LAYOUT_VERSION)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("m", [1, 2])
def test_a_synthesized_split_step_equals_a_real_capture(pods, tmp_path, m):
    tpl_raw, real_raw = pods[m]
    tpl, real, syn = _synthesize(tpl_raw, real_raw, tmp_path / "syn")
    assert syn.meta["synthesized"] is True and syn.num_dies == real.num_dies
    counts = {"attention": 0, "expert": 0}
    for d in range(real.num_dies):
        assert syn.streams[d] == real.streams[d]
        want, got = _window(real, d, tpl), _window(syn, d, tpl)
        assert got == want, f"die {d}"
        counts["attention" if d < tpl.attention_dies else "expert"] += len(want)
    assert counts["attention"] > 100 * m and counts["expert"] > 100 * m
    kinds = {e[0] for d in range(real.num_dies) for e in _window(syn, d, tpl)}
    assert {"put", "pub", "acq", "after", "op"} <= kinds
    # the template's own pod, from itself
    tpl, real, syn = _synthesize(tpl_raw, tpl_raw, tmp_path / "self")
    for d in range(real.num_dies):
        assert _window(syn, d, tpl) == _window(real, d, tpl), f"template die {d}"


@pytest.mark.timeout(60)
def test_a_wrong_load_is_not_equal(pods, tmp_path):
    tpl_raw, real_raw = pods[2]
    load = captured_split_load(real_raw)
    bad = dataclasses.replace(load, route=lambda a, i, rows: (load.route(a, i, rows) + 1) % 256)
    tpl, real, syn = _synthesize(tpl_raw, real_raw, tmp_path / "syn", bad)
    assert any(_window(real, d, tpl) != _window(syn, d, tpl) for d in range(real.num_dies))
    longer = dataclasses.replace(load, starts=[[s + 5 for s in st] for st in load.starts])
    tpl, real, syn = _synthesize(tpl_raw, real_raw, tmp_path / "ctx", longer)
    assert all(_window(real, d, tpl) != _window(syn, d, tpl) for d in range(tpl.attention_dies))


def test_the_papers_split_load():
    w = SplitWorkload(attention_dies=480, expert_dies=288, requests=96, context=3072, domains=3,
                      mtp=1, acceptance=0.9)  # fmt: skip
    assert w.domain_dies == 160 and w.microbatches == 2
    load = split_scale_load(w)
    p = load.placement
    assert p.dies == tuple(range(160, 448)) and p.num_experts == 288 and load.topk == 9
    assert np.bincount(p.die_of - 160).tolist() == [1] * 288
    idx = load.route(37, 5, 48)
    assert idx.shape == (48, 9) and (idx[:, 8] == 256 + 37 % 32).all()
    assert all(len(set(r)) == 9 for r in idx.tolist()) and idx[:, :8].max() < 256
    assert (load.route(37, 5, 48) == idx).all() and not (load.route(38, 5, 48) == idx).all()
    assert load.mtp_tokens[0].count(2) == 86 and load.tokens == 2 and load.shared_dies == 32
    with pytest.raises(ValueError, match="equal domains"):
        _ = dataclasses.replace(w, domains=7).domain_dies
    with pytest.raises(ValueError, match="256 routed"):
        split_scale_load(dataclasses.replace(w, expert_dies=256))


@pytest.mark.timeout(60)
def test_a_composed_split_step_on_a_small_pod(pods, tmp_path):
    tpl = split_template(pods[2][0])
    w = SplitWorkload(attention_dies=8, expert_dies=4, requests=6, context=2048, domains=2,
                      mtp=1, acceptance=0.5, shared_copies=0)  # fmt: skip
    prof = load_profile("cm384")
    f = project_split(w, prof, tpl, tmp_path / "a")
    assert f.step_us == project_split(w, prof, tpl, tmp_path / "b").step_us  # deterministic
    d, c = f.domain, f.calls
    assert f.moe_layer_us == pytest.approx(max(d.moe_layer_us, 2 * 2 * c["x"]))
    assert f.step_us == pytest.approx(d.rest_us + 3 * d.dense_layer_us + 58 * f.moe_layer_us)
    assert f.step_us >= d.step_us and c["calls"] == 4  # 2 steady MoE layers x 2 micro-batches
    assert min(c["a2e"], c["stage1"], c["moe"], c["e2a"]) > 0
    assert c["moe"] + c["e2a"] < c["round_trip"] and c["moe"] < c["x"]
    assert "ONE domain synthesized (4 + 4)" in f.label and "2 domains composed" in f.label
    with pytest.raises(ValueError, match="micro-batches or MTP"):
        project_split(dataclasses.replace(w, microbatches=1), prof, tpl, tmp_path / "c")


def test_split_rows_refuse_what_is_not_built(tmp_path):
    point = next(p for p in DECODE_POINTS if p.id == "001.s7.split.a2e")
    tpot = dataclasses.replace(point, workload={**point.workload, "measure": "tpot"})
    odd = dataclasses.replace(point, workload={**point.workload, "domains": 7})
    rows = decode_rows(load_profile("cm384"), tmp_path, [tpot, odd])
    assert [r["ok"] for r in rows] == [False, False]
    assert SPLIT_REFUSAL in rows[0]["refused"] and "'tpot'" in rows[0]["refused"]
    assert "equal domains" in rows[1]["refused"]
