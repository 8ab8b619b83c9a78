"""Expert load balancing in real pods (issue 12, parts 3-5): load recording in the metadata area,
expert moves over p2p while the old map serves, the switch at one agreed step, the reference
replaying the maps, a die killed mid-move, and serving with EPLB (schedule replay, /metrics)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from memory import layout as L
from memory.errors import ConfigError
from runtime import DieCrashed, Pod
from runtime.decode import (
    DecodeOptions,
    DecodeSpec,
    decode_main,
    make_prompts,
    pod_config,
    run_decode,
    spread,
)
from runtime.model import DictKV, DieModel, FFNWeights, ModelConfig, build_weights, expert_ffn
from runtime.model.expert_balancer import EPLBConfig, ExpertBalancer, initial_map, move_list
from sched.eplb import ExpertMap, plan

TINY = ModelConfig.preset("tiny", score_bias="skew")  # 16 experts top-4, 2 MoE layers


def _random_maps(cfg: ModelConfig, dies: int, redundant: int, n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    n_moe = cfg.n_layers - cfg.n_dense_layers
    return [
        plan(rng.random((n_moe, cfg.num_experts)) ** 4 * 100, dies, redundant).phy2log.tolist()
        for _ in range(n)
    ]


# -- value-coded expert moves ---------------------------------------------------------------------


def coded(layer: int, expert: int) -> FFNWeights:
    """Every element says which (layer, expert, matrix) it belongs to and where it sits."""
    h, inter = TINY.hidden, TINY.moe_inter
    mats = []
    for m, shape in enumerate(((h, inter), (h, inter), (inter, h))):
        base = ((layer * 64 + expert) * 3 + m) * 4096
        mats.append((base + np.arange(h * inter) % 4096).astype(np.float32).reshape(shape))
    return FFNWeights(*mats)


def move_steps(die, eplb: EPLBConfig, steps: int, seeded: bool) -> list:
    """Drive a die's balancer through `steps` steps without a forward (forced maps); after every
    step, what each local slot holds: (step, layer, slot, logical, matches, table matches)."""
    model = DieModel(TINY, build_weights(TINY, []), DictKV(TINY.kv_cache_dim))
    fill = None if seeded else coded
    want = expert_ffn if seeded else (lambda c, layer, e: coded(layer, e))
    bal = ExpertBalancer(die, model, eplb, fill=fill)
    out = []
    try:
        for b in range(steps):
            bal.begin_step(b)
            bal.end_step(b)
            for j in range(bal.n_moe):
                layer = TINY.n_dense_layers + j
                for i, e in enumerate(bal.local_ids(layer)):
                    ref = want(TINY, layer, e) if seeded else want(None, layer, e)
                    w = bal._ffn(j, int(bal.slot_buf[j, i]))
                    t = model.weights.experts[layer][e]
                    ok = all(np.array_equal(getattr(w, f), getattr(ref, f))
                             for f in ("w_gate", "w_up", "w_down"))  # fmt: skip
                    same = all(np.shares_memory(getattr(w, f), getattr(t, f))
                               for f in ("w_gate", "w_up", "w_down"))  # fmt: skip
                    out.append((b, layer, i, e, ok, same))
        words = die.words[die.die_id]
        lo = die.layout
        return [out, int(words[lo.eplb_word(L.EP_SWITCHED)]), bal.maps, bal.moves]
    finally:
        bal.close()


def _eplb_pod(cfg: ModelConfig, dies: int, eplb: EPLBConfig, timeout_s: float = 20.0):
    opts = DecodeOptions(dies=dies, batch=dies, steps=4, timeout_s=timeout_s)
    prompts, _ = spread(make_prompts(dies, 8, 0), dies)
    return pod_config(cfg, prompts, opts, eplb)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seeded", [False, True])
def test_moves_put_every_new_expert_in_every_slot(seeded):
    """Two forced plans on 4 dies: after each switch every slot holds its new expert (value-coded
    or seed-built bytes), the model's expert table is that slot's buffer, and before the switch
    the old map's experts are still in place."""
    dies = 4
    maps = _random_maps(TINY, dies, 1, 2, seed=3)
    eplb = EPLBConfig(redundant_per_die=1, every=2, maps=tuple(maps))
    n_moe = TINY.n_layers - TINY.n_dense_layers
    with Pod.launch(_eplb_pod(TINY, dies, eplb)) as pod:
        res = pod.run(move_steps, eplb, 16, seeded)
    first = 2 + 1 + n_moe  # plan after step 1 (every=2), moves from step 3, switch at 3 + n_moe
    switches = [0, first, first + 2 + 1 + n_moe]
    start = initial_map(TINY, dies, eplb).phy2log
    for d, (slots, switched, dmaps, moves) in enumerate(res):
        assert switched == 2
        assert [m["switch_step"] for m in dmaps] == switches
        assert [m["phy2log"] for m in dmaps[1:]] == maps
        for b, layer, i, e, ok, same in slots:
            k = sum(b >= s for s in switches) - 1
            phy2log = start.tolist() if k == 0 else maps[k - 1]
            s = len(phy2log[0]) // dies
            assert e == phy2log[layer - TINY.n_dense_layers][d * s + i], (d, b, layer, i)
            assert ok and same, (d, b, layer, i, e)
        assert all(m["bytes"] % (3 * TINY.hidden * TINY.moe_inter * 4) == 0 for m in moves)
    # the bytes moved are exactly the experts the move list says (a die keeps what it holds)
    maps_all = [ExpertMap.from_phy2log(p, TINY.num_experts, dies) for p in (start, *maps)]
    per_expert = 3 * TINY.hidden * TINY.moe_inter * 4
    for k in (1, 2):
        want = [0] * dies
        for j in range(n_moe):
            for dst, _, _, _ in move_list(maps_all[k - 1], maps_all[k], j):
                want[dst] += per_expert
        assert [r[3][k - 1]["bytes"] for r in res] == want


def test_move_list_keeps_held_experts_and_takes_sources_from_holders():
    old = initial_map(TINY, 4, EPLBConfig())
    new = ExpertMap.from_phy2log(_random_maps(TINY, 4, 1, 1, seed=5)[0], TINY.num_experts, 4)
    for j in range(old.num_layers):
        moves = move_list(old, new, j)
        s = new.slots_per_die
        for dst, slot, e, src in moves:
            assert new.phy2log[j, dst * s + slot] == e
            assert e not in old.phy2log[j, dst * s : (dst + 1) * s]
            assert e in old.phy2log[j, src * s : (src + 1) * s] and src != dst
        moved = {(dst, slot) for dst, slot, _, _ in moves}
        for dst in range(4):
            for slot in range(s):
                e = new.phy2log[j, dst * s + slot]
                if (dst, slot) not in moved:
                    assert e in old.phy2log[j, dst * s : (dst + 1) * s]


# -- decode with EPLB: the reference replaying the maps -------------------------------------------


@pytest.mark.timeout(240)
def test_decode_compare_bit_equal_to_the_replay_and_balances_a_skewed_load():
    """EPLB off and on in one run, float32 combine: with EPLB on every token and logit equals the
    reference replaying the maps bit for bit; against EPLB off the greedy tokens are equal and
    the logits within 1e-5; the skewed load is more balanced with EPLB on."""
    opts = DecodeOptions(dies=4, batch=16, prompt_len=16, steps=22, model="tiny",
                         combine_dtype="float32", overrides={"score_bias": "skew"},
                         eplb="compare", eplb_config=EPLBConfig(every=4),
                         timeout_s=60.0)  # fmt: skip
    s = run_decode(opts)
    assert s["bench"] == "decode-eplb"
    assert len(s["rebalances"]) >= 2
    assert s["mismatched_tokens"] == 0 and s["logits_bit_equal"]
    assert s["total_tokens"] == 16 * 23
    assert s["off_vs_on_mismatched_tokens"] == 0
    assert s["off_vs_on_logits_max_abs_diff"] < 1e-5
    assert s["hottest_over_mean"] > 2.0
    assert s["balancedness_on"] > s["balancedness_off"]
    assert s["max_rows_per_die_on"] < s["max_rows_per_die_off"]
    for r in s["rebalances"]:
        assert r["bytes_moved"] > 0 and r["switch_step"] > r["plan_step"] + 2


@pytest.mark.timeout(180)
def test_decode_eplb_on_int8_pull_check_passes():
    """`--eplb on --check` with INT8 dispatch over the pull protocol: the pod equals the INT8
    reference replaying its maps bit for bit."""
    opts = DecodeOptions(dies=4, batch=8, prompt_len=8, steps=12, model="tiny", quant="int8",
                         protocol="pull", overrides={"score_bias": "skew"}, eplb="on",
                         eplb_config=EPLBConfig(every=3, policy="deepseek"), check=True,
                         timeout_s=60.0)  # fmt: skip
    s = run_decode(opts)
    assert s["int8_ref_mismatched_tokens"] == 0 and s["int8_ref_logits_bit_equal"]
    assert len(s["eplb"]["rebalances"]) >= 1


def test_bad_eplb_configs_are_refused_before_launch():
    dense = ModelConfig.preset("tiny", n_dense_layers=3)
    with pytest.raises(ConfigError, match="no MoE layer"):
        EPLBConfig().check(dense, 4)
    with pytest.raises(ConfigError, match="two replicas"):
        EPLBConfig(redundant_per_die=20).check(TINY, 4)
    with pytest.raises(ConfigError, match="every"):
        EPLBConfig(every=0)
    with pytest.raises(ConfigError, match="policy"):
        EPLBConfig(policy="random")
    with pytest.raises(ConfigError, match="maps"):
        EPLBConfig(maps=([[0] * 20] * 2,)).check(TINY, 4)
    with pytest.raises(ConfigError, match="eplb"):
        run_decode(DecodeOptions(dies=4, model="tiny", eplb="sometimes"))


# -- a die killed mid-move -------------------------------------------------------------------------


def decode_killed_mid_move(die, spec, victim: int, outdir: str):
    """decode_main, but the victim dies (SIGKILL) in the middle of its second layer's moves;
    every survivor writes the plan it serves with when its run fails."""
    if die.die_id == victim:
        orig = ExpertBalancer._move

        def move(self, j, p):
            if j == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(self, j, p)

        ExpertBalancer._move = move
    try:
        return decode_main(die, spec)
    except BaseException as e:
        lo = die.layout
        switched = int(die.words[die.die_id][lo.eplb_word(L.EP_SWITCHED)])
        with open(os.path.join(outdir, f"die{die.die_id}"), "w") as f:
            f.write(f"{switched} {type(e).__name__}")
        raise


@pytest.mark.timeout(120)
def test_a_die_killed_mid_move_fails_the_pod_and_no_die_switches(tmp_path, monkeypatch):
    # The survivors report from their error path after the crash's abort: give them time to
    # get there (the pod's close waits for their exit, SIGKILL only past this grace): on a
    # loaded machine 0.1 s is not enough to unwind and write the report
    from runtime.pod import launcher

    monkeypatch.setattr(launcher, "CRASH_GRACE_S", 30.0)
    dies = 4
    maps = _random_maps(TINY, dies, 1, 1, seed=9)
    eplb = EPLBConfig(every=2, maps=tuple(maps))
    prompts, ids = spread(make_prompts(8, 8, 0), dies)
    spec = DecodeSpec(TINY, prompts, ids, 12, eplb=eplb, keep_logits=False)
    opts = DecodeOptions(dies=dies, batch=8, steps=12, timeout_s=5.0)
    cfg = pod_config(TINY, prompts, opts, eplb)
    with Pod.launch(cfg) as pod, pytest.raises(DieCrashed, match="die 2"):
        pod.run(decode_killed_mid_move, spec, 2, str(tmp_path))
    for d in (0, 1, 3):  # the survivors stopped with an error, still on the initial map
        switched, err = (tmp_path / f"die{d}").read_text().split()
        assert switched == "0", (d, err)
    assert not (tmp_path / "die2").exists()


# -- serving with EPLB ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_serving_with_eplb_equals_a_replay_of_schedule_and_maps():
    """An engine rebalancing every 4 busy steps while it serves: every sampled token and its
    logits equal the reference replaying the masters' schedule with the dies' maps; the dies
    agree on the maps; /metrics shows the balancedness and the moves."""
    from prometheus_client import generate_latest

    from runtime.api.metrics import Metrics
    from runtime.engine import Engine
    from runtime.engine.replay import replay
    from sched import SamplingParams

    prompts = [f"request {i}: " + "abc" * (i % 5) for i in range(12)]
    params = [SamplingParams(max_tokens=20 + i % 4, temperature=0.7 * (i % 2), seed=i,
                             ignore_eos=True) for i in range(12)]  # fmt: skip
    eplb = EPLBConfig(every=4)
    with Engine.launch(dies=2, model="tiny", max_num_seqs=4, max_num_batched_tokens=32,
                       log_steps=True, keep_logits=True, timeout_s=20.0,
                       model_overrides={"score_bias": "skew"}, eplb=eplb) as eng:  # fmt: skip
        outs = eng.generate(prompts, params, timeout_s=120)
        text = generate_latest(Metrics(eng).registry).decode()
        m, c = eng.model, eng.config
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params, strict=True))
    reports = [r["eplb"] for r in eng.pod_result]
    maps = [(x["switch_step"], x["phy2log"]) for x in reports[0]["maps"]]
    assert len(maps) >= 3, "the engine must have switched maps while serving"
    assert all([(x["switch_step"], x["phy2log"]) for x in r["maps"]] == maps for r in reports)
    rep = replay(m, c.dies, c.quant, c.blocks, c.block_size, eng.step_log, c.combine_dtype,
                 expert_maps=maps)  # fmt: skip
    assert rep.token_mismatches == [] and rep.logit_mismatches == [], rep
    assert rep.bit_equal and rep.logits_compared == rep.sampled
    assert "xpod:eplb_balancedness " in text and "xpod_eplb_moved_bytes_total" in text
    bal = float(text.split("\nxpod:eplb_balancedness ")[1].split()[0])
    assert 0.0 < bal <= 1.0


@pytest.mark.timeout(180)
def test_nodes_keep_whole_expert_groups_so_a_token_touches_at_most_topk_group_nodes():
    """Group-limited routing (4 groups, 2 kept) on 4 dies in nodes of 2, deepseek policy: in
    every map every replica of a group sits on one node, so every routed token's physical slots
    lie on <= topk_group nodes; the run equals the reference replaying its maps."""
    over = {"score_bias": "skew", "n_group": 4, "topk_group": 2}
    eplb = EPLBConfig(every=3, policy="deepseek", dies_per_node=2)
    opts = DecodeOptions(dies=4, batch=8, prompt_len=8, steps=14, model="tiny", overrides=over,
                         eplb="on", eplb_config=eplb, check=True, timeout_s=60.0)  # fmt: skip
    s = run_decode(opts)
    assert s["mismatched_tokens"] == 0 and s["logits_bit_equal"]
    assert len(s["eplb"]["rebalances"]) >= 2
    cfg = ModelConfig.preset("tiny", **over)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((256, cfg.num_experts)).astype(np.float32)
    from runtime.model import expert_bias, route_topk
    from sched.eplb import replica_for, row_positions

    idx, _ = route_topk(logits, cfg.topk, cfg.gating, cfg.routed_scaling, expert_bias(cfg, 1),
                        cfg.n_group, cfg.topk_group)  # fmt: skip
    group = cfg.num_experts // cfg.n_group
    maps = [m["phy2log"] for m in s["eplb"]["maps"]]
    assert maps[0] == initial_map(cfg, 4, eplb).phy2log.tolist() and len(maps) >= 3
    for phy2log in maps:
        m = ExpertMap.from_phy2log(phy2log, cfg.num_experts, 4)
        node_of_slot = np.arange(m.num_physical) // m.slots_per_die // 2
        for j in range(m.num_layers):
            for g in range(cfg.n_group):
                slots = np.flatnonzero(m.phy2log[j] // group == g)
                assert np.unique(node_of_slot[slots]).size == 1, (j, g)
            phys = replica_for(m, j, idx, row_positions(idx.shape[0], 1, 3))
            assert max(np.unique(node_of_slot[p]).size for p in phys) <= cfg.topk_group
