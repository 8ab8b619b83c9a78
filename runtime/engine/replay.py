"""Schedule replay: run the steps the masters logged through the single-process reference and
compare tokens and logits with what was served, bit for bit.

The oracle needs no batch invariance: it replays the same global steps with the same per-die
batches (request, tokens, positions) and the same KV block tables as the pod ran, through
`ReferencePod` (the same `DieModel` phases, with `comm.reference` collectives in between) over
`PagedKV` stores, so every matmul sees the same rows as on the dies. A global step in which a
die ran no rows is an empty batch for it (a dummy step); steps in which no die had rows were
idle votes and ran nothing.

A run with the KV pool (`EngineConfig.kv_pool`) has requests whose prefix blocks were loaded
from the pool, not computed on their die: given the requests' prompts, the replay lands them
(`_PoolLanding`): a full prompt block's bytes are snapshotted, keyed by its chained hash, right
after the replayed step that completed it (in default mode they depend on that step's batch),
and written into a row's prefix blocks that no replayed computation on its die left there,
before the step of that row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from comm.alltoall import Split
from runtime.engine import wire
from runtime.engine.pd import PDTopology
from runtime.model import ModelConfig
from runtime.model.kv import PagedKV
from runtime.model.reference import ReferencePod
from runtime.model.sampler import sample_rows
from runtime.model.split_reference import SplitReference
from runtime.pod.proc import blas_threads, limit_blas_threads
from sched.kv import block_hash
from sched.pool import ns_root


@dataclass
class ReplayReport:
    """What the replay found.

    Attributes:
        steps: global steps replayed; rows: rows replayed; sampled: sampled tokens compared.
        token_mismatches: (step, group, request, served, replayed) of every differing token.
        logit_mismatches: (step, group, request, max |difference|) where logits differ.
        logits_compared: sampled rows whose logits were compared.
    """

    steps: int = 0
    rows: int = 0
    sampled: int = 0
    logits_compared: int = 0
    token_mismatches: list = field(default_factory=list)
    logit_mismatches: list = field(default_factory=list)
    drafts_compared: int = 0  # MTP: the drafts each die made for the next row
    draft_mismatches: list = field(default_factory=list)  # (step, group, request, served, replayed)
    pool_landed: int = 0  # KV pool: prefix blocks landed from a replayed store (`prompts`)
    pool_missing: int = 0  # prefix blocks neither computed on their die nor stored in the replay

    @property
    def bit_equal(self) -> bool:
        return (not self.token_mismatches and not self.logit_mismatches
                and not self.draft_mismatches and self.sampled > 0)  # fmt: skip


def replay(
    cfg: ModelConfig,
    num_dies: int,
    quant: str | None,
    num_blocks: int,
    block_size: int,
    logs: dict[int, list[dict]],
    combine_dtype: str = "bfloat16",
    expert_maps: list | None = None,
    split: Split | None = None,
    spec=None,
    prompts: dict[int, list[int]] | None = None,
    namespaces: dict[int, str] | None = None,
) -> ReplayReport:
    """Replay every logged step (logs: group -> the master's step records); combine_dtype:
    the served pod's (`EngineConfig.combine_dtype`); expert_maps: an EPLB pod's
    `(switch step, phy2log)` list (the dies' `eplb.maps`), whose steps count the steps with
    rows (busy steps), as the dies' balancer does; split: a split pod's topology
    (`EngineConfig.split`: the groups are its attention dies), replayed by `SplitReference`;
    spec: MTP (`runtime.model.mtp.SpecConfig`): each step's verify rows, MTP sub-forwards and
    drafts replayed with `spec_step` and compared (tokens, every verify row's logits, the
    drafts each die made); prompts: request id -> prompt token ids, to land the prefix blocks
    a KV pool run loaded (module docstring; None: nothing is landed); namespaces: request id
    -> its cache salt (the others: the default namespace), whose root its block hashes chain
    from, as on the dies."""
    kv = [PagedKV.zeros(cfg.kv_layers, num_blocks, block_size, cfg.kv_cache_dim)
          for _ in range(num_dies)]  # fmt: skip
    if split is not None:
        pod = SplitReference(cfg, split, quant, kv, combine_dtype, expert_maps)
    else:
        pod = ReferencePod(cfg, num_dies, quant, kv, combine_dtype, expert_maps=expert_maps)
    report = ReplayReport()
    pool = _PoolLanding(block_size, prompts, report, namespaces) if prompts is not None else None
    _replay_steps(pod, kv, logs, report, pool and pool.before, pool and pool.after, spec=spec)
    return report


def replay_pd(
    cfg: ModelConfig,
    topo: PDTopology,
    quant: str | None,
    num_blocks: int,
    decode_blocks: int,
    block_size: int,
    logs: dict[int, list[dict]],
    combine_dtype: str = "bfloat16",
    spec=None,
    prompts: dict[int, list[int]] | None = None,
    namespaces: dict[int, str] | None = None,
) -> ReplayReport:
    """A PD pod's replay: the prefill part (its dies' logged steps, a P-die reference), then
    the decode part (a D-die reference). The KV a request's prefill left in its blocks, right
    after the step that sampled its first token, is what its decode die must have received:
    the replay writes it into the decode die's blocks (the table of the request's first row
    there) before the step of that row, so a transfer that moved anything else shows as a
    logit or token mismatch. spec: MTP (as `replay`'s); the KV moved includes the MTP
    module's layer, and the drafts of each prefill die and decode die are compared. prompts:
    as `replay`'s (a PD request's pool hit loads into its prefill die), as are namespaces."""
    p_dies, d_dies = list(topo.prefill), list(topo.decode)
    report = ReplayReport()
    snaps: dict[int, np.ndarray] = {}

    def snapshot(kv: list[PagedKV], recs: dict[int, dict]) -> None:
        for d, rec in recs.items():
            for r in rec["rows"]:
                if r[4]:  # it sampled: the prompt's KV is complete
                    n = r[2] + len(r[1])
                    t = np.asarray(r[3][: -(-n // block_size)], np.int64)
                    pool = kv[d].pool
                    snaps[r[0]] = pool[:, t].reshape(pool.shape[0], -1, pool.shape[3])[:, :n].copy()

    def land(kv: list[PagedKV], recs: dict[int, dict]) -> None:
        for d, rec in recs.items():
            for r in rec["rows"]:
                s = snaps.pop(r[0], None)
                if s is None or r[2] != s.shape[1]:
                    continue
                n, pool = s.shape[1], kv[d].pool
                t = np.asarray(r[3][: -(-n // block_size)], np.int64)
                for i, b in enumerate(t):
                    rows = s[:, i * block_size : (i + 1) * block_size]
                    pool[:, b, : rows.shape[1]] = rows

    d_blocks = decode_blocks or num_blocks
    pre, post = None, snapshot
    if prompts is not None:
        pool = _PoolLanding(block_size, prompts, report, namespaces)

        def post(kv: list[PagedKV], recs: dict[int, dict]) -> None:
            snapshot(kv, recs)
            pool.after(kv, recs)

        pre = pool.before
    parts = ((p_dies, num_blocks, pre, post), (d_dies, d_blocks, land, None))
    for dies, blocks, before, after in parts:
        kv = [PagedKV.zeros(cfg.kv_layers, blocks, block_size, cfg.kv_cache_dim) for _ in dies]
        pod = ReferencePod(cfg, len(dies), quant, kv, combine_dtype)
        part = {dies.index(g): recs for g, recs in logs.items() if g in dies}
        _replay_steps(pod, kv, part, report, before, after, offset=dies[0], spec=spec)
    return report


class _PoolLanding:
    """The KV pool's loads in a replay (module docstring): `before` / `after` hooks of the steps.

    Per die, which block holds which block hash in the replay's stores (`held`: set when a
    replayed row completes a full block of its request's tokens, cleared when a row writes a
    block it does not complete); per hash, the bytes of the first replayed computation of a full
    prompt block (`snaps`: what the pool stored, the first put of a hash being the one kept).
    Before a step, each row's prefix blocks (those below its start) whose block does not hold
    their hash in the replay were not computed there: they came from the pool, and the snapshot
    is written into them. Not modelled: a hash computed twice in different batches (two dies at
    once, or stored again after the pool dropped it) lands its first replayed version.
    """

    def __init__(self, block_size: int, prompts: dict[int, list[int]], report: ReplayReport,
                 namespaces: dict[int, str] | None = None):  # fmt: skip
        self.bs, self.report = block_size, report
        self.prompts = {int(k): list(v) for k, v in prompts.items()}
        self.roots = {int(k): ns_root(v) for k, v in (namespaces or {}).items()}  # chain roots
        self.tokens: dict[int, list[int]] = {}  # request -> its tokens so far (prompt first)
        self.hashes: dict[int, list[int]] = {}  # request -> its full blocks' chained hashes
        self.held: dict[int, dict[int, int]] = {}  # die -> block -> hash it holds
        self.snaps: dict[int, np.ndarray] = {}
        self.seen: dict[tuple[int, int], tuple[int, ...]] = {}  # (die, request) -> checked

    def _chain(self, rid: int, n: int) -> list[int]:
        """The hashes of request rid's first n full blocks (fewer if its tokens are unknown)."""
        hs, toks, bs = self.hashes.setdefault(rid, []), self.tokens.get(rid), self.bs
        if toks is None:
            toks = self.tokens[rid] = list(self.prompts.get(rid, ()))
        while len(hs) < n and (len(hs) + 1) * bs <= len(toks):
            i = len(hs)
            parent = hs[-1] if hs else self.roots.get(rid)
            hs.append(block_hash(parent, tuple(toks[i * bs : (i + 1) * bs])))
        return hs[:n]

    def before(self, kv: list[PagedKV], recs: dict[int, dict]) -> None:
        bs = self.bs
        for d, rec in recs.items():
            held = self.held.setdefault(d, {})
            for r in rec["rows"]:
                rid, start, table = r[0], r[2], r[3]
                n = start // bs
                done = self.seen.get((d, rid), ())  # its blocks checked at an earlier row
                if len(done) > n or tuple(table[: len(done)]) != done:
                    done = ()  # a new table (preempted, recomputed)
                self.seen[(d, rid)] = tuple(table[:n])
                hs = self._chain(rid, n) if n > len(done) else []
                for i in range(len(done), n):
                    b = table[i]
                    if i < len(hs) and held.get(b) == hs[i]:
                        continue  # computed (or landed) on this die
                    s = self.snaps.get(hs[i]) if i < len(hs) else None
                    if s is None:
                        self.report.pool_missing += 1
                        held.pop(b, None)
                        continue
                    kv[d].pool[:, b] = s
                    held[b] = hs[i]
                    self.report.pool_landed += 1

    def after(self, kv: list[PagedKV], recs: dict[int, dict]) -> None:
        bs = self.bs
        for d, rec in recs.items():
            held = self.held.setdefault(d, {})
            for r in rec["rows"]:
                rid, fed, start, table = r[0], r[1], r[2], r[3]
                end = start + len(fed)
                toks = self.tokens.setdefault(rid, list(self.prompts.get(rid, ())))
                known = len(toks) >= start  # the tokens before this row's are known
                if known:
                    del toks[start:]
                    toks.extend(fed)  # (an MTP row's rejected drafts: cut by the next row)
                    self.hashes[rid] = self.hashes.get(rid, [])[: start // bs]
                n_prompt = len(self.prompts.get(rid, ())) // bs
                hs = self._chain(rid, end // bs) if known else []
                for i in range(start // bs, -(-end // bs)):
                    b = table[i]
                    if (i + 1) * bs > end or i >= len(hs):
                        held.pop(b, None)  # written, not a known full block
                        continue
                    held[b] = hs[i]
                    if i < n_prompt and hs[i] not in self.snaps:
                        self.snaps[hs[i]] = kv[d].pool[:, b].copy()


def _replay_steps(pod, kv: list[PagedKV], logs: dict[int, list[dict]], report: ReplayReport,
                  before=None, after=None, offset: int = 0, spec=None) -> None:  # fmt: skip
    """Replay every logged step of one lockstep group (logs keyed by rank 0..len(kv)-1), with
    one BLAS thread as on the dies: a multithreaded matmul sums in another order (measured:
    logits 1e-6 apart at 64-row steps)."""
    had = blas_threads()
    limit_blas_threads(1)
    try:
        if spec is not None:
            _run_spec_steps(pod, kv, logs, report, spec, before, after, offset)
        else:
            _run_steps(pod, kv, logs, report, before, after, offset)
    finally:
        if had:
            limit_blas_threads(had)


def _run_steps(pod, kv, logs, report, before, after, offset) -> None:
    by_step: dict[int, dict[int, dict]] = {}
    for group, records in logs.items():
        for rec in records:
            by_step.setdefault(rec["step"], {})[int(group)] = rec
    busy = 0
    for step in sorted(by_step):
        recs = by_step[step]
        if not any(rec["rows"] for rec in recs.values()):
            continue  # an idle vote: no die ran a forward
        if before is not None:
            before(kv, recs)
        batches = []
        for d in range(len(kv)):
            rows = recs[d]["rows"] if d in recs else []
            kv[d].begin_step([(r[0], r[2], len(r[1]), r[3]) for r in rows])
            batches.append([(r[0], r[1], r[2]) for r in rows])
            report.rows += sum(len(r[1]) for r in rows)
        logits = pod.step(batches, busy)
        busy += 1
        report.steps += 1
        for d, rec in recs.items():
            _compare(report, step, d + offset, rec, logits[d])
        if after is not None:
            after(kv, recs)


def _run_spec_steps(pod, kv, logs, report: ReplayReport, spec, before=None, after=None,
                    offset: int = 0) -> None:  # fmt: skip
    """MTP steps: every die's logged rows as `SpecRow`s (fed tokens with their drafts, drafts
    wanted, a chunk's next token, transcripts), `spec_step` over the reference with the paged
    stores placed by the logged tables, and each row's tokens, verify logits and drafts
    compared with the served ones."""
    from runtime.model.mtp import SpecRow, spec_step

    cfg = pod.cfg
    by_step: dict[int, dict[int, dict]] = {}
    for group, records in logs.items():
        for rec in records:
            by_step.setdefault(rec["step"], {})[int(group)] = rec
    transcripts: dict[int, list] = {}
    for step in sorted(by_step):
        recs = by_step[step]
        if not any(rec["rows"] for rec in recs.values()):
            continue
        if before is not None:
            before(kv, recs)
        rows, tables = [], []
        for d in range(len(kv)):
            die_rows, tab = [], {}
            for r in recs[d]["rows"] if d in recs else []:
                rid, toks, start, table, sample, index, temp, seed, drafts, want, nxt, tr = r
                if tr is not None:
                    transcripts[rid] = tr
                tab[rid] = table
                die_rows.append(SpecRow(rid, list(toks), start, drafts, sample, index, temp,
                                        seed, nxt if nxt >= 0 else None, want,
                                        transcripts.get(rid)))  # fmt: skip
                report.rows += len(toks)
            rows.append(die_rows)
            tables.append(tab)

        def place(segs, tables=tables):
            for d, seg in enumerate(segs):
                kv[d].begin_step([(rid, st, len(t), tables[d][rid]) for rid, t, st in seg])

        def run_main(segs, lrows, step=step, place=place):
            place(segs)
            return pod.step(segs, step, lrows, hidden=True)

        def run_mtp(j, segs, hidden, place=place):
            place(segs)
            return pod.mtp(j, segs, hidden)

        outs = spec_step(spec, rows, run_main, run_mtp, cfg.vocab_size)
        report.steps += 1
        for d, rec in recs.items():
            _compare_spec(report, step, d + offset, rec, rows[d], outs[d])
        if after is not None:
            after(kv, recs)


def _compare_spec(report: ReplayReport, step: int, group: int, rec: dict, rows, outs) -> None:
    served = {int(rid): [int(t) for t in toks] for rid, toks in rec["sampled"]}
    drafted = {int(rid): [int(t) for t in ds] for rid, ds in rec.get("drafted", [])}
    mine = []
    for r, o in zip(rows, outs, strict=True):
        if not r.sample:
            continue
        report.sampled += 1
        if served.get(r.rid) != o.emitted:
            report.token_mismatches.append((step, group, r.rid, served.get(r.rid), o.emitted))
        report.drafts_compared += 1
        if drafted.get(r.rid) != o.drafts:
            report.draft_mismatches.append((step, group, r.rid, drafted.get(r.rid), o.drafts))
        mine.append((r.rid, o.logits))
    if rec.get("logits") is not None and mine:
        got = wire.unpack_array(rec["logits"])
        at = 0
        for rid, lg in mine:
            report.logits_compared += lg.shape[0]
            part = got[at : at + lg.shape[0]]
            at += lg.shape[0]
            if part.shape != lg.shape or not np.array_equal(part, lg):
                diff = float(np.max(np.abs(part.astype(np.float64) - lg))) if (
                    part.shape == lg.shape) else float("inf")  # fmt: skip
                report.logit_mismatches.append((step, group, rid, diff))


def _compare(report: ReplayReport, step: int, group: int, rec: dict, logits: np.ndarray) -> None:
    rows = rec["rows"]
    samp = [i for i, r in enumerate(rows) if r[4]]
    if not samp:
        return
    mine = logits[samp]
    want = sample_rows(mine, [{"id": rows[i][0], "index": rows[i][5], "temperature": rows[i][6],
                               "seed": rows[i][7]} for i in samp])  # fmt: skip
    served = dict((int(a), int(b)) for a, b in rec["sampled"])
    for i, tok in zip(samp, want, strict=True):
        rid = rows[i][0]
        report.sampled += 1
        if served.get(rid) != tok:
            report.token_mismatches.append((step, group, rid, served.get(rid), tok))
    if rec.get("logits") is not None:
        got = wire.unpack_array(rec["logits"])
        report.logits_compared += len(samp)
        for j, i in enumerate(samp):
            if not np.array_equal(got[j], mine[j]):
                diff = float(np.max(np.abs(got[j].astype(np.float64) - mine[j])))
                report.logit_mismatches.append((step, group, rows[i][0], diff))


def replay_engine(cfg, logs: dict[int, list[dict]], prompts: dict[int, list[int]] | None = None,
                  namespaces: dict[int, str] | None = None) -> ReplayReport:  # fmt: skip
    """Replay what an engine of `EngineConfig` cfg served (`Engine.step_log`, after close).
    prompts: request id -> prompt token ids; with `cfg.kv_pool` the replay needs them to land
    the pool's loads (without them a loaded prefix replays as zeros: a mismatch); namespaces:
    request id -> cache salt, for the requests that had one (`RequestTracker.namespaces`)."""
    m = cfg.model_config()
    if cfg.pd is not None:
        return replay_pd(m, cfg.pd, cfg.quant, cfg.blocks, cfg.decode_blocks, cfg.block_size,
                         logs, cfg.combine_dtype, spec=cfg.speculative,
                         prompts=prompts, namespaces=namespaces)  # fmt: skip
    return replay(m, cfg.dies, cfg.quant, cfg.blocks, cfg.block_size, logs, cfg.combine_dtype,
                  split=cfg.split, spec=cfg.speculative, prompts=prompts,
                  namespaces=namespaces)  # fmt: skip
