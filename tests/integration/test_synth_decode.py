"""The decode synthesizer (bench.project.synth_decode) against real capture pods: a template
step taken from a 2-die pod with one request per die and micro-batch, synthesized for a 4-die
pod with more requests (the 4-die capture's own load: its requests' contexts, its gates'
routing, its MTP rows), equals that pod's capture event for event but the host times, with
one micro-batch, two, and MTP (with rejected drafts). And the scale path's pieces: the
papers' placements, a load's routing, a composed step."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bench.project.decode_scale import (
    TEMPLATE_LAYERS,
    Workload,
    capture_template,
    placement,
    project_scale,
    replicas,
    scale_load,
)
from bench.project.synth_decode import (
    SynthError,
    captured_load,
    synthesize_decode,
    template_of,
)
from memory.layout import LAYOUT_VERSION
from runtime import PodConfig
from runtime.decode.options import DecodeOptions
from runtime.decode.run import run_decode
from runtime.model.mtp import SpecConfig
from runtime.project import load_capture, load_profile

OV = {"seed": 0, "n_layers": TEMPLATE_LAYERS, "n_dense_layers": 1, "num_experts": 256, "topk": 8,
      "n_group": 8, "topk_group": 4}  # fmt: skip


def _capture(path, dies: int, batch: int, microbatches: int = 1, mtp: float | None = None):
    spec = SpecConfig(1, "synthetic", (mtp,)) if mtp is not None else None
    run_decode(DecodeOptions(dies=dies, batch=batch, prompt_len=16, steps=3, model="tiny",
                             overrides=OV, project="host", project_dir=str(path),
                             project_steps=3, microbatches=microbatches, spec=spec))  # fmt: skip
    return path / "raw"


def _step(cap, d: int) -> list[list]:
    """Die d's last step: (kind, stream, fields...) without host times, afters relative."""
    ev, main = cap.events[d], cap.streams[d].index("main")
    b = [i for i, e in enumerate(ev) if e[1] == main and e[0] == "begin" and e[4] == "step"][-1]
    e = next(i for i in range(b, len(ev)) if ev[i][1] == main and ev[i][0] == "end"
             and ev[i][4] == "step")  # fmt: skip
    seq0 = [0] * len(cap.streams[d])
    for x in ev[:b]:
        seq0[x[1]] += 1
    return [[x[0], x[1], *x[4:5], x[5] - seq0[x[4]]] if x[0] == "after" else [x[0], x[1], *x[4:]]
            for x in ev[b : e + 1]]  # fmt: skip


def _check_equal(tpl_raw, real_raw, tmp_path) -> int:
    tpl = template_of(tpl_raw)
    cfg = PodConfig.from_dict(json.loads((real_raw / "meta.json").read_text())["config"])
    out = synthesize_decode(tpl, captured_load(real_raw), tmp_path / "syn", cfg=cfg,
                            first_op=template_of(real_raw).first_op)  # fmt: skip
    real = load_capture(real_raw, LAYOUT_VERSION)
    syn = load_capture(out, LAYOUT_VERSION)
    assert syn.meta["synthesized"] is True and syn.num_dies == real.num_dies
    events = 0
    for d in range(real.num_dies):
        assert syn.streams[d] == real.streams[d]
        want, got = _step(real, d), _step(syn, d)
        assert got == want, f"die {d}"
        events += len(want)
    return events


@pytest.mark.timeout(300)
@pytest.mark.parametrize("microbatches, mtp", [(1, None), (2, None), (1, 0.5)])
def test_synthesized_step_equals_a_real_capture(tmp_path, microbatches, mtp):
    tpl = _capture(tmp_path / "tpl", 2, 2 * microbatches, microbatches, 1.0 if mtp else None)
    real = _capture(tmp_path / "real", 4, 12, microbatches, mtp)
    assert _check_equal(tpl, real, tmp_path) > 100
    # the template's own pod, from itself
    assert _check_equal(tpl, tpl, tmp_path / "self") > 50


@pytest.mark.timeout(300)
def test_a_wrong_load_is_not_equal_and_bad_templates_are_refused(tmp_path):
    tpl_raw = _capture(tmp_path / "tpl", 2, 2)
    real = _capture(tmp_path / "real", 4, 8)
    load = captured_load(real)
    bad = type(load)(load.starts, lambda d, i, rows: (load.route(d, i, rows) + 1) % 256,
                     load.placement, load.topk)  # fmt: skip
    cfg = PodConfig.from_dict(json.loads((real / "meta.json").read_text())["config"])
    out = synthesize_decode(template_of(tpl_raw), bad, tmp_path / "syn", cfg=cfg,
                            first_op=template_of(real).first_op)  # fmt: skip
    r, s = load_capture(real, LAYOUT_VERSION), load_capture(out, LAYOUT_VERSION)
    assert any(_step(r, d) != _step(s, d) for d in range(4))  # another routing: another step
    with pytest.raises(SynthError, match="no step call"):
        template_of(tpl_raw, step=99)
    with pytest.raises(SynthError, match="die 5"):
        template_of(tpl_raw, die=5)


def test_the_papers_placements():
    p, k = placement(Workload(dies=320, requests=4, context=64))
    assert k == 9 and p.num_experts == 320 and np.bincount(p.die_of).max() == 1
    p, k = placement(Workload(dies=288, requests=4, context=64))
    counts = np.bincount(p.die_of, minlength=288)
    assert p.num_experts == 320 and counts[:256].max() == 1 and (counts[256:] == 2).all()
    p, k = placement(Workload(dies=8, requests=4, context=64, shared="local"))
    assert k == 8 and np.bincount(p.die_of).tolist() == [32] * 8
    with pytest.raises(ValueError, match="more than 256 dies"):
        placement(Workload(dies=128, requests=4, context=64))


def test_a_scale_load_routes_every_row_to_its_shared_copy():
    w = Workload(dies=320, requests=6, context=100, mtp=1, acceptance=0.5)
    load = scale_load(w)
    idx = load.route(7, 3, 12)
    assert idx.shape == (12, 9) and (idx[:, 8] == 256 + 32 + 7).all()
    assert all(len(set(r)) == 9 for r in idx.tolist())  # distinct experts per row
    assert load.mtp_tokens[0] == [2, 2, 2, 1, 1, 1] and load.tokens == 2
    assert (load.route(7, 3, 12) == idx).all()  # seeded
    assert not (load.route(8, 3, 12)[:, :8] == idx[:, :8]).all()


@pytest.mark.timeout(300)
def test_a_composed_step_on_a_small_pod(tmp_path):
    raw = capture_template(tmp_path / "tpl")
    tpl = template_of(raw)
    w = Workload(dies=8, requests=16, context=2048, shared="local")
    f = project_scale(w, load_profile("cm384"), tpl, tmp_path / "w")
    again = project_scale(w, load_profile("cm384"), tpl, tmp_path / "w2")
    assert f.step_us == again.step_us  # deterministic
    assert f.step_us == pytest.approx(f.rest_us + 3 * f.dense_layer_us + 58 * f.moe_layer_us)
    assert 0 < f.dense_layer_us < f.moe_layer_us and "projected (cm384" in f.label
    longer = project_scale(dataclasses.replace(w, context=8192), load_profile("cm384"),
                           tpl, tmp_path / "w3")  # fmt: skip
    assert longer.breakdown_us["attention"] > f.breakdown_us["attention"]


def test_redundant_copies_go_to_the_hottest_experts_and_share_their_rows():
    w = Workload(dies=288, requests=60, context=64, routing="skew")
    reps = replicas(w)
    assert sum(len(r) for r in reps) == 256 + w.redundant
    hot = max(range(256), key=lambda e: len(reps[e]))
    assert len(reps[hot]) > 2  # the skew's hottest expert gets several copies
    load = scale_load(w)
    rows = np.concatenate([load.route(d, 0, 64) for d in range(288)])
    used = {int(x) for x in rows[np.isin(rows, reps[hot])]}
    assert used == set(reps[hot])  # every copy takes rows
    uniform = replicas(Workload(dies=288, requests=60, context=64))
    assert max(len(r) for r in uniform) <= 2  # balanced: at most one copy each
