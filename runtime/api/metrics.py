"""`/metrics`: the serving engine in Prometheus text (prometheus-client), label `group`.

Two sources:
- the requests, as the shell sees them (`Metrics` is the engine's observer, called on the
  engine's receiver thread): finished requests by reason, prompt and generation tokens, and
  histograms of time to first token, inter-token latency, end-to-end latency and queue time
  (arrival in the shell to the first step that planned it);
- the masters' stats (every 0.1 s; read at scrape time by `Metrics.collect`): running and
  waiting requests, KV usage and blocks, prefix-cache queries and hits (tokens), preemptions,
  steps and dummy steps, scheduling bubble, per-die attention / MoE-wait / forward time, and
  the step-time histogram. Pod-wide: MoE wait share (dispatch + combine time over forward time,
  all dies, since start) and attention imbalance (per global step, the max over dies of the
  step's attention time over its mean: what DP balance buys, 001 Fig. 10; a die that had no
  rows in a step counts 0).
- process CPU seconds of every xpod process by role (shell, master, output, die), for the CPU
  breakdown of `xpod bench serve`.
- reliability (`Engine.reliability`, runtime.engine.supervisor): faults injected / verified /
  detected by kind, recovered by tier, given up; recovery seconds by part (detect, teardown,
  launch, recompute); the ledger: requests accepted / ended / recomputed, tokens a stream had
  already (trimmed), token gaps (a bug: 0), stale messages of a dead incarnation; the
  incarnation and whether a restart is under way.
- prompt tokens by source (die-local prefix cache, KV pool, computed) and the KV pool's
  figures (runtime.api.pool_metrics).

Names follow vLLM's with an `xpod_` prefix (`xpod_time_to_first_token_seconds`, ...).
"""

from __future__ import annotations

import os
import threading

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from runtime.api.pd_metrics import PDMetrics
from runtime.api.pool_metrics import CacheMetrics

# Buckets sized for this machine's steps (~2-20 ms) and few enough to keep a scrape cheap:
# prometheus-client renders ~12 us per sample, and every bucket is a sample per group.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
STEP_BUCKETS = (0.002, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.1, 0.5)
IMBALANCE_BUCKETS = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0)
MAX_OPEN_STEPS = 100_000  # attention samples waiting for every group's report


disable_created_metrics()  # no `_created` series: the exposition stays readable


class Metrics:
    """The engine's observer and a Prometheus collector; `registry` is what `/metrics` shows."""

    def __init__(self, engine, extra: dict | None = None):
        self.engine = engine
        self.groups = engine.config.dies
        self.extra = extra or {}  # callables -> gauges of the shell (pending, health, ...)
        self.registry = CollectorRegistry(auto_describe=True)
        r, g = self.registry, ["group"]
        self.ttft = Histogram("xpod_time_to_first_token_seconds", "Time to first token.", g,
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("xpod_inter_token_latency_seconds", "Inter-token latency.", g,
                             buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("xpod_e2e_request_latency_seconds", "End-to-end request latency.",
                             g, buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        self.queue = Histogram("xpod_request_queue_time_seconds",
                               "Arrival to the first step that planned the request.", g,
                               buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.step = Histogram("xpod_step_seconds", "Forward time of a step with rows.", g,
                              buckets=STEP_BUCKETS, registry=r)  # fmt: skip
        self.imbalance = Histogram("xpod_attention_imbalance",
                                   "Per global step: max over dies of the attention time over"
                                   " its mean.", buckets=IMBALANCE_BUCKETS, registry=r)  # fmt: skip
        self.success = Counter("xpod_request_success", "Finished requests by reason.",
                               ["group", "finished_reason"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("xpod_prompt_tokens", "Prompt tokens of finished requests.",
                                     g, registry=r)  # fmt: skip
        self.gen_tokens = Counter("xpod_generation_tokens", "Generated tokens.", g, registry=r)
        self.rejected = Counter("xpod_http_requests_rejected", "Requests refused before the"
                                " engine.", ["reason"], registry=r)  # fmt: skip
        for grp in range(self.groups):  # every group shows from the start
            for h in (self.ttft, self.itl, self.e2e, self.queue, self.step):
                h.labels(str(grp))
            self.prompt_tokens.labels(str(grp))
            self.gen_tokens.labels(str(grp))
        self.lock = threading.Lock()
        self.open_steps: dict[int, dict[int, int]] = {}  # step -> group -> attention ns
        self.floor: dict[int, int] = {}  # group -> every result below this step is in
        self.imb_sum = 0.0
        self.imb_n = 0
        self.procs: dict[int, psutil.Process] = {}
        self.pd = PDMetrics(engine, r) if getattr(engine.config, "pd", None) else None
        self.cache = CacheMetrics(engine)
        r.register(_Callback(self.collect))
        engine.observer = self

    # -- the engine's observer (its receiver thread) --------------------------------------------

    def on_tokens(self, t, n: int, now: float) -> None:
        if t.t_last and n:
            gap = (now - t.t_last) / n
            h = self.itl.labels(str(t.group))
            for _ in range(n):
                h.observe(gap)

    def on_finish(self, t) -> None:
        g = str(max(t.group, 0))
        self.success.labels(g, t.reason or "error").inc()
        self.prompt_tokens.labels(g).inc(len(t.tokens))
        self.gen_tokens.labels(g).inc(t.n_out if t.render is not None else len(t.out))
        if t.t_first:
            self.ttft.labels(g).observe(max(0.0, t.t_first - t.t0))
        if t.t_sched:
            self.queue.labels(g).observe(max(0.0, t.t_sched - t.t0))
        self.e2e.labels(g).observe(max(0.0, t.t_done - t.t0))
        if self.pd is not None:
            self.pd.on_finish(t)

    def on_stats(self, body: dict) -> None:
        g = body.get("group", -1)
        h = self.step.labels(str(g))
        for ms in body.get("step_ms_new", ()):
            h.observe(ms / 1e3)
        with self.lock:
            for step, ns in body.get("attn_new", ()):
                self.open_steps.setdefault(step, {})[g] = ns
            self.floor[g] = body.get("die_step", 0)
            self._close_steps()

    def _close_steps(self) -> None:
        """Every step below each group's floor has all its reports: observe its imbalance."""
        if len(self.floor) < self.groups:
            return
        floor = min(self.floor.values())
        done = [s for s in self.open_steps if s < floor]
        if len(self.open_steps) > MAX_OPEN_STEPS:  # a group stopped reporting: drop the oldest
            done = sorted(self.open_steps)[: len(self.open_steps) - MAX_OPEN_STEPS // 2]
        for s in done:
            times = self.open_steps.pop(s)
            total = sum(times.values())
            if total <= 0:
                continue
            ratio = max(times.values()) / (total / self.groups)
            self.imbalance.observe(ratio)
            self.imb_sum += ratio
            self.imb_n += 1

    # -- scrape time ----------------------------------------------------------------------------

    def _eplb(self, by: dict):
        """Expert load balancing (only when the engine runs it), from the eplb words of the
        dies that host experts (a split pod's expert dies: the label is then the die's id)."""
        if getattr(self.engine.config, "expert_dies", 0) and hasattr(self.engine, "eplb_counters"):
            by = self.engine.eplb_counters()
        if not any("eplb_rows" in (s or {}) for s in by.values()):
            return
        lead = by.get(min(by)) or {}
        yield GaugeMetricFamily("xpod:eplb_balancedness", "Mean over MoE layers of mean / max"
                                " rows per die in the last EPLB window (1 = balanced).",
                                value=lead.get("eplb_balance_ppm", 0) / 1e6)  # fmt: skip
        yield CounterMetricFamily("xpod_eplb_rebalances", "Expert maps switched to.",
                                  value=lead.get("eplb_switched", 0))  # fmt: skip
        rows = [(s or {}).get("eplb_rows", 0) for s in by.values()]
        mean = sum(rows) / len(rows) if rows else 0
        yield GaugeMetricFamily("xpod_eplb_rows_max_over_mean", "Routed rows of the busiest die"
                                " over the mean, since start.",
                                value=max(rows) / mean if mean else 1.0)  # fmt: skip
        for name, doc, key, scale in (
            ("xpod_eplb_expert_rows", "Routed-expert rows a die received.", "eplb_rows", 1),
            ("xpod_eplb_moved_bytes", "Expert weight bytes a die received in rebalances.",
             "eplb_moved_bytes", 1),
            ("xpod_eplb_move_seconds", "Time a die spent moving experts.", "eplb_move_ns", 1e-9),
        ):  # fmt: skip
            m = CounterMetricFamily(name, doc, labels=["group"])
            for g, s in by.items():
                m.add_metric([str(g)], (s or {}).get(key, 0) * scale)
            yield m

    def _split(self):
        """A split pod (MoE-attention disaggregation): per-role time shares, the expert dies'
        idle share, A2E / E2A seconds per step (`runtime.engine.split_stats`)."""
        sp = self.engine.split_stats() if hasattr(self.engine, "split_stats") else None
        if not sp:
            return
        m = GaugeMetricFamily("xpod_role_time_share", "Share of a role's time per phase"
                              " (attention dies: of their forward time; expert dies: of their"
                              " loop time).", labels=["role", "phase"])  # fmt: skip
        for role, key in (("attention", "attention_share"), ("expert", "expert_share")):
            for phase, v in sp[key].items():
                m.add_metric([role, phase], v)
        yield m
        for name, doc, v in (
            ("xpod_expert_idle_share", "Expert dies' time waiting for A2E input, of their"
             " loop time.", sp["expert_idle_share"]),
            ("xpod_a2e_seconds_per_step", "An attention die's A2E time per step (all MoE"
             " layers).", sp["a2e_ms_per_step"] / 1e3),
            ("xpod_e2a_seconds_per_step", "An attention die's E2A time per step (all MoE"
             " layers).", sp["e2a_ms_per_step"] / 1e3),
        ):  # fmt: skip
            yield GaugeMetricFamily(name, doc, value=v)
        c = CounterMetricFamily("xpod_expert_a2e_calls", "A2E calls an expert die served.",
                                labels=["die"])  # fmt: skip
        for x, n in sp["expert_a2e_calls"].items():
            c.add_metric([str(x)], n)
        yield c

    def collect(self):
        stats = dict(self.engine.stats)
        fresh = self.engine.die_counters() if hasattr(self.engine, "die_counters") else {}
        by = {g: {**(stats.get(g) or {}), **fresh.get(g, {})} or None for g in range(self.groups)}
        gauges = {
            "xpod_num_requests_running": ("Requests running in a group.", "running"),
            "xpod_num_requests_waiting": ("Requests waiting in a group's master.", "waiting"),
        }
        for name, (doc, key) in gauges.items():
            m = GaugeMetricFamily(name, doc, labels=["group"])
            for g, s in by.items():
                m.add_metric([str(g)], (s or {}).get(key, 0))
            yield m
        kv = {
            "xpod_kv_cache_usage_perc": ("KV blocks in use over all blocks (0..1).", None),
            "xpod_kv_blocks_total": ("KV blocks of a group.", "total"),
            "xpod_kv_blocks_free": ("KV blocks not in use (cached ones included).", "unused"),
            "xpod_kv_blocks_cached": ("Free KV blocks that still hold a cached prefix.", "cached"),
            "xpod_kv_blocks_masked": ("KV blocks masked for good (memory faults).", "masked"),
        }
        for name, (doc, key) in kv.items():
            m = GaugeMetricFamily(name, doc, labels=["group"])
            for g, s in by.items():
                u = (s or {}).get("kv") or {}
                if key is None:
                    v = u.get("used", 0) / max(u.get("total", 0), 1)
                elif key == "unused":
                    v = u.get("total", 0) - u.get("used", 0)
                else:
                    v = u.get(key, 0)
                m.add_metric([str(g)], v)
            yield m
        counters = {
            "xpod_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                          "prefix_query_tokens", 1),
            "xpod_prefix_cache_hits": ("Prompt tokens found in the prefix cache.",
                                       "prefix_hit_tokens", 1),
            "xpod_num_preemptions": ("Preemptions (recompute).", "num_preemptions", 1),
            "xpod_kv_fault_recomputed": ("Requests recomputed because a KV block they held was"
                                         " masked.", "kv_recomputed", 1),
            "xpod_steps": ("Steps the group's die ran with rows.", "busy_steps", 1),
            "xpod_dummy_steps": ("Steps the group's die ran with no rows (pod-wide lockstep).",
                                 "dummy_steps", 1),
            "xpod_scheduling_bubble_seconds": ("Die time from a result to its next command.",
                                               "bubble_ns", 1e-9),
            "xpod_attention_seconds": ("Die attention time.", "attn_ns", 1e-9),
            "xpod_moe_wait_seconds": ("Die dispatch + combine time.", "moe_ns", 1e-9),
            "xpod_forward_seconds": ("Die forward time (every step).", "step_ns", 1e-9),
            "xpod_spec_decode_num_drafts": ("MTP: verify rows that carried drafts.",
                                            "spec_drafts", 1),
            "xpod_spec_decode_num_draft_tokens": ("MTP: draft tokens verified.",
                                                  "spec_draft_tokens", 1),
            "xpod_spec_decode_num_accepted_tokens": ("MTP: draft tokens accepted.",
                                                     "spec_accepted_tokens", 1),
            "xpod_spec_decode_verify_rows": ("MTP: decode rows verified (with or without"
                                             " drafts).", "spec_verify_rows", 1),
            "xpod_mtp_seconds": ("MTP: die time in the MTP module's sub-forwards.", "mtp_ns",
                                 1e-9),
        }  # fmt: skip
        for name, (doc, key, scale) in counters.items():
            m = CounterMetricFamily(name, doc, labels=["group"])
            for g, s in by.items():
                m.add_metric([str(g)], (s or {}).get(key, 0) * scale)
            yield m
        per_pos = CounterMetricFamily(
            "xpod_spec_decode_num_accepted_tokens_per_pos", "MTP: drafts accepted at each"
            " position (0-based) of a verify row.", labels=["group", "position"])  # fmt: skip
        for g, s in by.items():
            for j, n in enumerate((s or {}).get("spec_accepted_per_pos") or ()):
                per_pos.add_metric([str(g), str(j)], n)
        yield per_pos
        yield from self.cache.collect(by)
        moe = sum((s or {}).get("moe_ns", 0) for s in by.values())
        fwd = sum((s or {}).get("step_ns", 0) for s in by.values())
        yield GaugeMetricFamily("xpod_moe_wait_share", "Pod-wide MoE wait share of forward time"
                                " since start.", value=moe / fwd if fwd else 0.0)  # fmt: skip
        with self.lock:
            mean = self.imb_sum / self.imb_n if self.imb_n else 0.0
        yield GaugeMetricFamily("xpod_attention_imbalance_mean", "Mean per-step attention"
                                " imbalance since start.", value=mean)  # fmt: skip
        yield from self._eplb(by)
        yield from self._split()
        if self.pd is not None:
            yield from self.pd.collect(by)
        for name, fn in self.extra.items():
            yield GaugeMetricFamily(name, fn.__doc__ or name, value=fn())
        yield from self._processes()
        yield from self._reliability()

    def _reliability(self):
        rel = self.engine.reliability() if hasattr(self.engine, "reliability") else {}
        counts = rel.get("counts", {})
        for what, label, doc in (
            ("injected", "kind", "Faults injected (fault plan), by kind-target."),
            ("verified", "kind", "Injected faults verified to have fired."),
            ("detected", "kind", "Faults detected, by how (exit, stall, heartbeat)."),
            ("recovered", "tier", "Faults recovered from, by tier."),
            ("failed", "kind", "Faults the engine gave up on (or recovery was off)."),
        ):
            m = CounterMetricFamily(f"xpod_faults_{what}", doc, labels=[label])
            for k, v in sorted(counts.get(what, {}).items()):
                m.add_metric([k], v)
            yield m
        plan = rel.get("plan") or {}
        for key, doc in (("planned", "Faults in the fault plan (--inject)."),
                         ("fired", "Planned faults that fired so far."),
                         ("not_fired", "Planned faults that have not fired (yet, while it runs;"
                                       " reported with why when the engine closes).")):  # fmt: skip
            value = plan.get("pending", 0) if key == "not_fired" else plan.get(key, 0)
            yield GaugeMetricFamily(f"xpod_faults_{key}", doc, value=value)
        m = SummaryMetricFamily("xpod_recovery_seconds", "Recovery time by part (detect:"
                                " injection to detection; teardown; launch; recompute: launch to"
                                " the first resumed token).", labels=["part"])  # fmt: skip
        for part, vals in sorted(rel.get("recovery_s", {}).items()):
            m.add_metric([part], len(vals), float(sum(vals)))
        yield m
        ledger = rel.get("ledger", {})
        for key, doc in (
            ("accepted", "Requests the engine accepted."),
            ("ended", "Accepted requests that ended (each exactly once)."),
            ("failed", "Accepted requests that ended with an error."),
            ("requests_recomputed", "Requests re-admitted after a restart (token recomputation)."),
            ("tokens_replayed", "Tokens a stream already had, trimmed (never sent twice)."),
            ("token_gaps", "Token deltas that did not start where the stream was (a bug: 0)."),
            ("stale_messages", "Messages of a dead incarnation dropped after a restart."),
        ):
            name = key if key.startswith(("requests", "tokens", "token")) else f"requests_{key}"
            yield CounterMetricFamily(f"xpod_{name}", doc, value=ledger.get(key, 0))
        yield GaugeMetricFamily("xpod_engine_incarnation", "Restarts so far (0 at launch).",
                                value=rel.get("gen", 0))  # fmt: skip
        yield GaugeMetricFamily("xpod_recovering", "1 while a restart is under way.",
                                value=1.0 if rel.get("recovering") else 0.0)  # fmt: skip

    def _processes(self):
        m = CounterMetricFamily("xpod_process_cpu_seconds", "CPU time (user + system) of every"
                                " xpod process, by role.", labels=["role", "group"])  # fmt: skip
        eng = self.engine
        procs = [("shell", "", os.getpid())]
        if hasattr(eng, "processes"):  # the engine's list survives a restart under way
            procs += [(what, str(g), pid) for what, g, pid in eng.processes()]
        else:
            procs += [("master", str(g), p.pid) for g, p in enumerate(eng.masters)]
            procs += [("output", str(g), p.pid) for g, p in enumerate(eng.outputs)]
            if eng.pod is not None:
                procs += [("die", str(g), p.pid) for g, p in enumerate(eng.pod.procs)]
        pids = GaugeMetricFamily("xpod_process_pid", "Process id of every xpod process, by"
                                 " role.", labels=["role", "group"])  # fmt: skip
        for role, g, pid in procs:
            if pid is None:
                continue
            pids.add_metric([role, g], pid)
            try:
                p = self.procs.get(pid) or self.procs.setdefault(pid, psutil.Process(pid))
                t = p.cpu_times()
                m.add_metric([role, g], t.user + t.system)
            except (psutil.Error, ValueError):
                continue
        return [m, pids]


class _Callback:
    """A collector that yields `fn()`'s metric families at every scrape. No `describe`: the
    registry (auto_describe) learns its names from one collect at registration, so that
    `restricted_registry` (`/metrics?name[]=...`) finds them."""

    def __init__(self, fn):
        self.fn = fn

    def collect(self):
        yield from self.fn()
