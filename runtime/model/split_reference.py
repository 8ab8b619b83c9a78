"""Single-process reference of the toy model on a split pod (`runtime.model.split`).

`SplitReference` holds a `DieModel` per attention die (no routed expert, its own KV) and per
expert die (its experts over `Placement.default(num_experts, exp_dies)`), and runs a step the way
the split pod groups its work:

    per layer, per attention die, per micro-batch: attention (+ dense FFN), the gate
    MoE layer, per domain d, per micro-batch i:
        a2e_ref over domain d's attention dies' micro-batch i -> experts on every expert die
        -> e2a_ref -> finish_moe on each of those attention dies
    logits of each micro-batch's last rows, in segment order

A split pod calling the same phases on the same micro-batches, with A2E / E2A delivering
`a2e_ref` / `e2a_ref`, reproduces these logits bit for bit. `generate` is `ReferencePod`'s, the
"dies" being the attention dies in `split.att_dies` order; so are `step(logit_rows, hidden)`,
`mtp` (an MTP sub-forward, micro-batched as `runtime.model.split.attention_mtp` runs it) and
`rewind`, on which `runtime.model.mtp.spec_step` runs a split pod's speculative schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from comm.alltoall import Split
from comm.quant import COMBINE_DTYPES
from comm.reference import QUANT_MODES, a2e_ref, dequantize_dispatch, e2a_ref
from comm.routing import Placement
from memory.errors import ConfigError
from runtime.model.config import ModelConfig
from runtime.model.die_model import DieModel, Segment, batch_rows, last_rows
from runtime.model.kv import DictKV
from runtime.model.reference import ReferencePod, expert_maps_of
from runtime.model.split import microbatches
from runtime.model.weights import build_weights
from sched.eplb import replica_for, row_positions

__all__ = ["SplitReference"]


class SplitReference(ReferencePod):
    """The split pod's model in one process.

    Arguments:
        cfg: model config (`cfg.validate(num_dies, expert_dies)` is checked first).
        split: the pod's `comm.alltoall.Split`.
        quant, combine_dtype: as `ReferencePod`.
        kv: one KV store per attention die (default a `DictKV` each), in `att_dies` order.
        expert_maps: an EPLB run's `(switch step, phy2log)` maps over the expert dies (as
            `ReferencePod`'s; steps are busy steps, passed to `step`): an attention die routes
            each micro-batch's rows with `replica_for` at its own die id.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        split: Split,
        quant: str | None = None,
        kv: Sequence | None = None,
        combine_dtype: str = "bfloat16",
        expert_maps: Sequence | None = None,
    ):
        n = len(split.att_dies) + len(split.exp_dies)
        split.check(n)
        cfg.validate(n, len(split.exp_dies))
        if quant not in QUANT_MODES:
            raise ConfigError(f"quant: expected one of {QUANT_MODES}, got {quant!r}")
        if combine_dtype not in COMBINE_DTYPES:
            raise ConfigError(
                f"combine_dtype: expected one of {COMBINE_DTYPES}, got {combine_dtype!r}"
            )
        if kv is not None and len(kv) != len(split.att_dies):
            raise ValueError(f"kv: expected {len(split.att_dies)} stores, got {len(kv)}")
        self.cfg, self.split, self.quant = cfg, split, quant
        self.num_dies = len(split.att_dies)  # generate's "dies": the attention dies
        self.combine_dtype = combine_dtype
        n_exp = len(split.exp_dies)
        self.maps = expert_maps_of(expert_maps, cfg, n_exp)
        phys = self.maps[0][1].num_physical if self.maps else cfg.num_experts
        self.placement = Placement.default(phys, split.exp_dies)
        att_weights = build_weights(cfg, [])
        self.dies = [
            DieModel(cfg, att_weights, kv[i] if kv is not None else DictKV(cfg.kv_cache_dim))
            for i in range(len(split.att_dies))
        ]
        if not self.maps:
            built = {x: sorted(self.placement.experts_on(x).tolist()) for x in split.exp_dies}
        else:  # every logical expert a die holds under any of the maps
            s = phys // n_exp
            built = {x: sorted({int(e) for _, m in self.maps
                                for e in m.phy2log[:, q * s : (q + 1) * s].ravel()})
                     for q, x in enumerate(split.exp_dies)}  # fmt: skip
        # an MTP module's MoE keeps the default placement (EPLB balances the main layers)
        self.mtp_placement = Placement.default(cfg.num_experts, split.exp_dies)
        self.experts = {x: DieModel(cfg, build_weights(cfg, built[x],
                                                       self.mtp_placement.experts_on(x).tolist()),
                                    DictKV(cfg.kv_cache_dim))
                        for x in split.exp_dies}  # fmt: skip
        self.step_no = 0

    def step(
        self, batches: Sequence[Sequence[Segment]], step: int | None = None,
        logit_rows: Sequence[np.ndarray] | None = None, hidden: bool = False,
    ):  # fmt: skip
        """One forward: `batches[i]` is attention die `split.att_dies[i]`'s segments; returns
        its float32 logits [n_segments, vocab] at each segment's last row. `logit_rows` /
        `hidden` as `ReferencePod.step` (the micro-batches' rows joined before the final norm,
        as `runtime.model.split.attention_step` does then)."""
        sp, cfg = self.split, self.cfg
        if len(batches) != len(sp.att_dies):
            raise ValueError(f"batches: expected {len(sp.att_dies)}, got {len(batches)}")
        self.step_no = self.step_no + 1 if step is None else int(step)
        m = sp.microbatches
        mbs = [microbatches(list(b), m) for b in batches]
        rows = [[batch_rows(s) for s in mb] for mb in mbs]
        hs = [[die.embed(r[0]) for r in rs] for die, rs in zip(self.dies, rows, strict=True)]
        hs = self._layers(range(cfg.n_layers), hs, mbs, rows)
        if logit_rows is None and not hidden:
            out = []
            for i, die in enumerate(self.dies):
                lg = [die.logits(hs[i][j][last_rows(mbs[i][j])]) for j in range(m) if mbs[i][j]]
                out.append(np.concatenate(lg) if lg else np.zeros((0, cfg.vocab_size),
                                                                  np.float32))  # fmt: skip
            return out
        hs = [np.concatenate(h) for h in hs]
        lrows = [last_rows(b) for b in batches] if logit_rows is None else list(logit_rows)
        if not hidden:
            return [die.logits(h[r]) for die, h, r in zip(self.dies, hs, lrows, strict=True)]
        normed = [die.final_norm(h) for die, h in zip(self.dies, hs, strict=True)]
        logits = [die.head(x[r]) for die, x, r in zip(self.dies, normed, lrows, strict=True)]
        return logits, normed

    def mtp(self, j: int, batches: Sequence[Sequence[Segment]],
            hidden: Sequence[np.ndarray]) -> tuple[list, list]:  # fmt: skip
        """MTP sub-forward j of every attention die (`runtime.model.split.attention_mtp`):
        segments of `(req, next tokens, start)`, `hidden` the normed rows at those positions;
        (logits, normed) at each segment's last row, per attention die."""
        cfg, m = self.cfg, self.split.microbatches
        layer = cfg.mtp_layer(j)
        k = layer - cfg.n_layers
        mbs = [microbatches(list(b), m) for b in batches]
        rows = [[batch_rows(s) for s in mb] for mb in mbs]
        hs = []
        for die, rs, x in zip(self.dies, rows, hidden, strict=True):
            at = np.concatenate([[0], np.cumsum([len(r[0]) for r in rs])]).tolist()
            hs.append([die.mtp_in(k, r[0], x[at[i] : at[i + 1]]) for i, r in enumerate(rs)])
        hs = self._layers((layer,), hs, mbs, rows)
        normed = [die.mtp_norm(k, np.concatenate(h)[last_rows(b)])
                  for die, h, b in zip(self.dies, hs, batches, strict=True)]  # fmt: skip
        return [die.head(x) for die, x in zip(self.dies, normed, strict=True)], normed

    def _layers(self, layers, hs: list, mbs: list, rows: list) -> list:
        """`layers` over every attention die's micro-batches `hs[i][j]` (the split pod's
        grouping: module docstring)."""
        sp, cfg, m = self.split, self.cfg, self.split.microbatches
        pos = {a: i for i, a in enumerate(sp.att_dies)}
        for layer in layers:
            for i, die in enumerate(self.dies):
                for j in range(m):
                    hs[i][j] = die.attention(layer, hs[i][j], mbs[i][j], rows[i][j])
                    if not cfg.is_moe(layer):
                        hs[i][j] = die.dense_ffn(layer, hs[i][j])
            if not cfg.is_moe(layer):
                continue
            gates = [[die.gate(layer, h) for h in hs[i]] for i, die in enumerate(self.dies)]
            main = layer < cfg.n_layers  # an MTP module: the default placement, no EPLB map
            m_now = [mp for start, mp in self.maps if start <= self.step_no][-1] if (
                self.maps and main) else None  # fmt: skip
            if m_now is not None:  # EPLB: each micro-batch's logical experts -> physical slots
                j0 = layer - cfg.n_dense_layers
                gates = [[(xn, self._route(m_now, j0, idx, a), w) for xn, idx, w in g]
                         for a, g in zip(sp.att_dies, gates, strict=True)]  # fmt: skip
            place = self.placement if main else self.mtp_placement
            for dom in sp.domains:
                for j in range(m):
                    at = [pos[a] for a in dom]
                    xns = [gates[i][j][0] for i in at]
                    idxs = [gates[i][j][1] for i in at]
                    ws = [gates[i][j][2] for i in at]
                    outs = a2e_ref(xns, idxs, place, list(dom), self.quant)
                    eouts = {
                        x: self.experts[x].experts(layer, dequantize_dispatch(o).x,
                                                   o.expert_counts,
                                                   self._ids(x, layer, m_now, place))
                        for x, o in outs.items()
                    }  # fmt: skip
                    routed = e2a_ref(eouts, outs, idxs, ws, list(dom), self.combine_dtype)
                    for k, i in enumerate(at):
                        hs[i][j] = self.dies[i].finish_moe(layer, hs[i][j], xns[k], routed[k])
        return hs

    def _route(self, m, j: int, idx: np.ndarray, die: int) -> np.ndarray:
        return replica_for(m, j, idx, row_positions(idx.shape[0], die, self.step_no))

    def _ids(self, x: int, layer: int, m, place: Placement) -> list[int]:
        """The logical expert of each local slot of expert die x (the map in force)."""
        if m is None:
            return place.experts_on(x).tolist()
        s = m.slots_per_die
        q = self.split.exp_dies.index(x)
        return m.phy2log[layer - self.cfg.n_dense_layers, q * s : (q + 1) * s].tolist()
