"""runtime.api.metrics.Metrics over a fake engine: the attention-imbalance join of the masters'
stats, the request observer, and the Prometheus exposition (parsed with prometheus_client's parser).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runtime.api.metrics import IMBALANCE_BUCKETS, MAX_OPEN_STEPS, Metrics

MS = 1_000_000  # ns


def fake_engine(groups: int = 2, stats: dict | None = None, procs: bool = False):
    me = SimpleNamespace(pid=os.getpid())
    gone = SimpleNamespace(pid=2**31 - 1)  # no such process: skipped
    return SimpleNamespace(
        config=SimpleNamespace(dies=groups),
        stats=stats if stats is not None else {},
        masters=[me] * groups if procs else [],
        outputs=[me] * groups if procs else [],
        pod=SimpleNamespace(procs=[me, gone]) if procs else None,
        observer=None,
    )


def tracked(**kw):
    t = dict(group=0, reason="length", tokens=[1, 2, 3], out=[4, 5], n_out=2, render=None,
             t0=100.0, t_first=100.25, t_sched=100.125, t_done=101.5, t_last=0.0)  # fmt: skip
    t.update(kw)
    return SimpleNamespace(**t)


def stats(group: int, die_step: int, attn=(), step_ms=()) -> dict:
    return {"group": group, "die_step": die_step, "attn_new": [list(a) for a in attn],
            "step_ms_new": list(step_ms)}  # fmt: skip


def value(m: Metrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, labels)


def imbalance(m: Metrics) -> tuple[float, float, float]:
    """(count, sum, mean gauge) of the attention imbalance."""
    return (value(m, "xpod_attention_imbalance_count"), value(m, "xpod_attention_imbalance_sum"),
            value(m, "xpod_attention_imbalance_mean"))  # fmt: skip


def families(m: Metrics) -> dict:
    text = generate_latest(m.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


# -- construction ----------------------------------------------------------------------------------


def test_sets_itself_as_observer():
    eng = fake_engine()
    m = Metrics(eng)
    assert eng.observer is m and m.groups == 2
    assert imbalance(m) == (0.0, 0.0, 0.0)


def test_two_metrics_have_separate_registries():
    a, b = Metrics(fake_engine()), Metrics(fake_engine())
    a.on_finish(tracked())
    assert value(a, "xpod_request_success_total", group="0", finished_reason="length") == 1
    assert value(b, "xpod_request_success_total", group="0", finished_reason="length") is None


# -- attention imbalance ---------------------------------------------------------------------------


def test_imbalance_of_one_step():
    m = Metrics(fake_engine(2))
    m.on_stats(stats(0, 6, [(5, 3 * MS)]))
    assert imbalance(m)[0] == 0  # group 1 has not reported
    m.on_stats(stats(1, 6, [(5, 1 * MS)]))
    assert imbalance(m) == (1.0, 1.5, 1.5)  # 3 / mean(3, 1)
    assert value(m, "xpod_attention_imbalance_bucket", le="1.25") == 0
    assert value(m, "xpod_attention_imbalance_bucket", le="1.5") == 1
    assert m.open_steps == {}


def test_step_reported_by_one_group_counts_the_other_as_zero():
    m = Metrics(fake_engine(2))
    m.on_stats(stats(1, 0))
    m.on_stats(stats(0, 8, [(7, 3 * MS)]))
    assert imbalance(m)[0] == 0  # group 1's floor (0) is not above step 7 yet
    m.on_stats(stats(1, 8))
    assert imbalance(m) == (1.0, 2.0, 2.0)


def test_steps_not_below_every_floor_wait():
    m = Metrics(fake_engine(2))
    m.on_stats(stats(0, 10, [(7, 2 * MS), (9, 1 * MS)]))
    m.on_stats(stats(1, 5, [(7, 2 * MS)]))
    assert imbalance(m)[0] == 0 and set(m.open_steps) == {7, 9}
    m.on_stats(stats(1, 8, [(9, 1 * MS)]))  # floor min(10, 8) = 8: step 7 closes (balanced)
    assert imbalance(m) == (1.0, 1.0, 1.0) and set(m.open_steps) == {9}
    m.on_stats(stats(1, 10))  # step 9: 1 ms on both
    assert imbalance(m) == (2.0, 2.0, 1.0) and m.open_steps == {}
    m.on_stats(stats(0, 10, [(10, 4 * MS)]))  # step 10 == floor: still open
    assert imbalance(m)[0] == 2 and set(m.open_steps) == {10}


def test_imbalance_three_groups_and_mean():
    m = Metrics(fake_engine(3))
    m.on_stats(stats(0, 3, [(1, 3 * MS), (2, 2 * MS)]))
    m.on_stats(stats(1, 3, [(1, 3 * MS), (2, 2 * MS)]))
    m.on_stats(stats(2, 3, [(1, 3 * MS)]))
    # step 1: 3/3 = 1.0; step 2: 2 / (4/3) = 1.5
    count, total, mean = imbalance(m)
    assert count == 2
    assert math.isclose(total, 2.5) and math.isclose(mean, 1.25)


def test_step_without_attention_time_is_not_counted():
    m = Metrics(fake_engine(2))
    m.on_stats(stats(0, 4, [(3, 0)]))
    m.on_stats(stats(1, 4, [(3, 0)]))
    assert imbalance(m) == (0.0, 0.0, 0.0) and m.open_steps == {}


def test_imbalance_is_never_below_one_nor_above_groups():
    m = Metrics(fake_engine(4))
    for s in range(1, 50):
        for g in range(4):
            ns = ((s * 7 + g * 13) % 5) * MS
            m.on_stats(stats(g, s, [(s - 1, ns)]))
    m.on_stats(stats(0, 100))
    for g in range(1, 4):
        m.on_stats(stats(g, 100))
    assert m.open_steps == {}
    count, total, _ = imbalance(m)
    assert count > 0
    below_one = value(m, "xpod_attention_imbalance_bucket", le=str(IMBALANCE_BUCKETS[0]))
    assert 0 <= below_one <= count
    assert value(m, "xpod_attention_imbalance_bucket", le="4.0") == count  # at most 4 groups
    assert count <= total <= 4 * count


def test_open_steps_are_bounded_when_a_group_stops_reporting():
    m = Metrics(fake_engine(2))
    m.on_stats(stats(1, 0))  # group 1 reports once, then never again
    m.on_stats(stats(0, MAX_OPEN_STEPS + 2, [(s, MS) for s in range(MAX_OPEN_STEPS + 1)]))
    assert len(m.open_steps) <= MAX_OPEN_STEPS
    assert 0 not in m.open_steps  # the oldest went first
    count, total, _ = imbalance(m)
    assert count > 0 and math.isclose(total, 2.0 * count)


def test_step_time_histogram():
    m = Metrics(fake_engine(2))
    m.on_stats(stats(1, 0, step_ms=[2.0, 4.0, 30.0]))
    assert value(m, "xpod_step_seconds_count", group="1") == 3
    assert math.isclose(value(m, "xpod_step_seconds_sum", group="1"), 0.036)
    assert value(m, "xpod_step_seconds_bucket", group="1", le="0.005") == 2
    assert value(m, "xpod_step_seconds_count", group="0") == 0


# -- the request observer --------------------------------------------------------------------------


def test_on_finish_unrendered():
    m = Metrics(fake_engine(2))
    m.on_finish(tracked(group=1, tokens=[1] * 5, out=[2] * 7, n_out=3))
    assert value(m, "xpod_request_success_total", group="1", finished_reason="length") == 1
    assert value(m, "xpod_prompt_tokens_total", group="1") == 5
    assert value(m, "xpod_generation_tokens_total", group="1") == 7  # len(out)
    assert value(m, "xpod_time_to_first_token_seconds_sum", group="1") == 0.25
    assert value(m, "xpod_request_queue_time_seconds_sum", group="1") == 0.125
    assert value(m, "xpod_e2e_request_latency_seconds_sum", group="1") == 1.5
    for h in ("time_to_first_token", "request_queue_time", "e2e_request_latency"):
        assert value(m, f"xpod_{h}_seconds_count", group="1") == 1
        assert value(m, f"xpod_{h}_seconds_count", group="0") == 0


def test_on_finish_rendered_counts_n_out():
    m = Metrics(fake_engine(2))
    m.on_finish(tracked(render={"kind": "completion"}, out=[], n_out=4, reason="stop"))
    assert value(m, "xpod_generation_tokens_total", group="0") == 4
    assert value(m, "xpod_request_success_total", group="0", finished_reason="stop") == 1


def test_on_finish_error_before_any_token():
    m = Metrics(fake_engine(2))
    m.on_finish(tracked(group=-1, reason=None, out=[], n_out=0, t_first=0.0, t_sched=0.0,
                        t_done=100.75))  # fmt: skip
    assert value(m, "xpod_request_success_total", group="0", finished_reason="error") == 1
    assert value(m, "xpod_time_to_first_token_seconds_count", group="0") == 0
    assert value(m, "xpod_request_queue_time_seconds_count", group="0") == 0
    assert value(m, "xpod_e2e_request_latency_seconds_sum", group="0") == 0.75
    assert value(m, "xpod_generation_tokens_total", group="0") == 0


def test_on_finish_accumulates_by_reason():
    m = Metrics(fake_engine(2))
    for reason in ("length", "stop", "stop", "abort"):
        m.on_finish(tracked(reason=reason))
    got = {r: value(m, "xpod_request_success_total", group="0", finished_reason=r)
           for r in ("length", "stop", "abort")}  # fmt: skip
    assert got == {"length": 1, "stop": 2, "abort": 1}
    assert value(m, "xpod_prompt_tokens_total", group="0") == 12
    assert value(m, "xpod_e2e_request_latency_seconds_count", group="0") == 4


def test_on_tokens_inter_token_latency():
    m = Metrics(fake_engine(2))
    m.on_tokens(tracked(group=1, t_last=0.0), 3, 10.0)  # the first tokens: no gap yet
    assert value(m, "xpod_inter_token_latency_seconds_count", group="1") == 0
    m.on_tokens(tracked(group=1, t_last=10.0), 4, 10.4)
    assert value(m, "xpod_inter_token_latency_seconds_count", group="1") == 4
    assert math.isclose(value(m, "xpod_inter_token_latency_seconds_sum", group="1"), 0.4)
    m.on_tokens(tracked(group=1, t_last=10.4), 0, 11.0)
    assert value(m, "xpod_inter_token_latency_seconds_count", group="1") == 4


# -- the exposition --------------------------------------------------------------------------------

# (family, type) of every metric the module docstring lists with a `group` label
GROUP_FAMILIES = {
    "xpod_request_success": "counter",
    "xpod_prompt_tokens": "counter",
    "xpod_generation_tokens": "counter",
    "xpod_time_to_first_token_seconds": "histogram",
    "xpod_inter_token_latency_seconds": "histogram",
    "xpod_e2e_request_latency_seconds": "histogram",
    "xpod_request_queue_time_seconds": "histogram",
    "xpod_num_requests_running": "gauge",
    "xpod_num_requests_waiting": "gauge",
    "xpod_kv_cache_usage_perc": "gauge",
    "xpod_kv_blocks_total": "gauge",
    "xpod_kv_blocks_free": "gauge",
    "xpod_kv_blocks_cached": "gauge",
    "xpod_prefix_cache_queries": "counter",
    "xpod_prefix_cache_hits": "counter",
    "xpod_num_preemptions": "counter",
    "xpod_steps": "counter",
    "xpod_dummy_steps": "counter",
    "xpod_scheduling_bubble_seconds": "counter",
    "xpod_attention_seconds": "counter",
    "xpod_moe_wait_seconds": "counter",
    "xpod_forward_seconds": "counter",
    "xpod_step_seconds": "histogram",
    "xpod_process_cpu_seconds": "counter",
}
POD_FAMILIES = {
    "xpod_moe_wait_share": "gauge",
    "xpod_attention_imbalance": "histogram",
    "xpod_attention_imbalance_mean": "gauge",
}


def master_stats(group: int, scale: int) -> dict:
    return {"group": group, "running": 2 * scale, "waiting": scale,
            "kv": {"total": 100, "used": 25 * scale, "cached": 5 * scale, "free": 10},
            "prefix_query_tokens": 1000 * scale, "prefix_hit_tokens": 400 * scale,
            "num_preemptions": scale, "busy_steps": 50 * scale, "dummy_steps": 3 * scale,
            "bubble_ns": 2_000_000_000 * scale, "attn_ns": 1_000_000_000 * scale,
            "moe_ns": 500_000_000 * scale, "step_ns": 4_000_000_000 * scale,
            "die_step": 0, "attn_new": [], "step_ms_new": []}  # fmt: skip


def scraped() -> tuple[Metrics, dict]:
    eng = fake_engine(2, {0: master_stats(0, 1), 1: master_stats(1, 2)}, procs=True)

    def pending():
        """Requests waiting in the shell."""
        return 7

    m = Metrics(eng, extra={"xpod_shell_pending": pending})
    for g in (0, 1):
        m.on_finish(tracked(group=g))
        m.on_stats(stats(g, 2, [(1, (g + 1) * MS)], step_ms=[5.0]))
    return m, families(m)


def test_exposition_has_every_family_with_group_label():
    _, fams = scraped()
    for name, kind in {**GROUP_FAMILIES, **POD_FAMILIES}.items():
        assert name in fams, name
        assert fams[name].type == kind, name
    for name in GROUP_FAMILIES:
        groups = {s.labels.get("group") for s in fams[name].samples}
        assert {"0", "1"} <= groups, (name, groups)
    for name in POD_FAMILIES:
        assert all("group" not in s.labels for s in fams[name].samples), name


def _by_group(fam) -> dict[str, float]:
    return {s.labels["group"]: s.value for s in fam.samples}


def test_exposition_values():
    _, fams = scraped()
    assert _by_group(fams["xpod_num_requests_running"]) == {"0": 2, "1": 4}
    assert _by_group(fams["xpod_num_requests_waiting"]) == {"0": 1, "1": 2}
    assert _by_group(fams["xpod_kv_cache_usage_perc"]) == {"0": 0.25, "1": 0.5}
    assert _by_group(fams["xpod_kv_blocks_total"]) == {"0": 100, "1": 100}
    assert _by_group(fams["xpod_kv_blocks_free"]) == {"0": 75, "1": 50}
    assert _by_group(fams["xpod_kv_blocks_cached"]) == {"0": 5, "1": 10}
    assert _by_group(fams["xpod_prefix_cache_queries"]) == {"0": 1000, "1": 2000}
    assert _by_group(fams["xpod_prefix_cache_hits"]) == {"0": 400, "1": 800}
    assert _by_group(fams["xpod_num_preemptions"]) == {"0": 1, "1": 2}
    assert _by_group(fams["xpod_steps"]) == {"0": 50, "1": 100}
    assert _by_group(fams["xpod_dummy_steps"]) == {"0": 3, "1": 6}
    for name, per_scale in [("xpod_scheduling_bubble_seconds", 2.0),
                            ("xpod_attention_seconds", 1.0), ("xpod_moe_wait_seconds", 0.5),
                            ("xpod_forward_seconds", 4.0)]:  # fmt: skip
        got = _by_group(fams[name])
        assert got == pytest.approx({"0": per_scale, "1": 2 * per_scale}), name
    (share,) = fams["xpod_moe_wait_share"].samples
    assert share.value == pytest.approx(1.5 / 12.0)
    # step 1: 1 ms and 2 ms -> 2 / 1.5
    (mean,) = fams["xpod_attention_imbalance_mean"].samples
    assert mean.value == pytest.approx(4 / 3)
    counts = {s.name: s.value for s in fams["xpod_attention_imbalance"].samples}
    assert counts["xpod_attention_imbalance_count"] == 1
    assert fams["xpod_shell_pending"].samples[0].value == 7
    assert fams["xpod_shell_pending"].documentation == "Requests waiting in the shell."
    step = {(s.name, s.labels.get("le")): s.value for s in fams["xpod_step_seconds"].samples
            if s.labels["group"] == "0"}  # fmt: skip
    assert step[("xpod_step_seconds_count", None)] == 1
    assert step[("xpod_step_seconds_bucket", "0.005")] == 1


def test_exposition_cpu_by_role():
    _, fams = scraped()
    roles = {
        (s.labels["role"], s.labels["group"]) for s in fams["xpod_process_cpu_seconds"].samples
    }
    # die 1 is no such process: left out
    assert roles == {("shell", ""), ("master", "0"), ("master", "1"), ("output", "0"),
                     ("output", "1"), ("die", "0")}  # fmt: skip
    assert all(s.value >= 0 for s in fams["xpod_process_cpu_seconds"].samples)


def test_exposition_without_stats():
    m = Metrics(fake_engine(3))
    fams = families(m)
    for name in ("xpod_num_requests_running", "xpod_kv_cache_usage_perc", "xpod_kv_blocks_free",
                 "xpod_steps", "xpod_forward_seconds"):  # fmt: skip
        assert _by_group(fams[name]) == {"0": 0, "1": 0, "2": 0}, name
    assert fams["xpod_moe_wait_share"].samples[0].value == 0
    assert fams["xpod_attention_imbalance_mean"].samples[0].value == 0
    # histograms and token counters of every group show from the start
    for name in ("xpod_time_to_first_token_seconds", "xpod_step_seconds", "xpod_prompt_tokens",
                 "xpod_generation_tokens"):  # fmt: skip
        groups = {s.labels["group"] for s in fams[name].samples}
        assert groups == {"0", "1", "2"}, name
    roles = {s.labels["role"] for s in fams["xpod_process_cpu_seconds"].samples}
    assert roles == {"shell"}
