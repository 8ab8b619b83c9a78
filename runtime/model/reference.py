"""Single-process reference of the toy model, grouping work exactly like a pod of D dies.

`ReferencePod` holds one `DieModel` per die (die d builds the experts
`Placement.default(num_experts, range(D)).experts_on(d)` and has its own `DictKV`) and runs every
phase of every die in lockstep, with the plain-numpy collectives of `comm.reference` in between:

    per layer:  attention on every die
                dense layer: dense_ffn on every die
                MoE layer:   gate on every die -> dispatch_ref(xn, topk_idx, quant)
                             -> experts on every die (its DispatchOut rows, dequantized if INT8)
                             -> combine_ref(expert outputs, topk_weights) -> finish_moe per die
    logits of the last row of each segment, per die

A distributed pod calling the same `DieModel` phases on the same batches, with protocols that
deliver `dispatch_ref` / `combine_ref` results, must reproduce these logits bit for bit
(quant=None) and the same INT8 results (quant="int8", deterministic per-token quantization).

`mla_decompressed` is the textbook (non-absorbed) MLA the tests compare the absorbed form with.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from comm.quant import COMBINE_DTYPES
from comm.reference import QUANT_MODES, combine_ref, dequantize_dispatch, dispatch_ref
from comm.routing import Placement
from memory.errors import ConfigError
from runtime.model.config import ModelConfig
from runtime.model.die_model import DieModel, Segment, batch_rows, last_rows
from runtime.model.kv import DictKV
from runtime.model.ops import softmax
from runtime.model.pipeline import halves
from runtime.model.sampler import sample
from runtime.model.weights import LayerWeights, build_weights
from sched.eplb import ExpertMap, replica_for, row_positions

__all__ = ["GenerateResult", "ReferencePod", "expert_maps_of", "mla_decompressed"]


@dataclass(slots=True)
class GenerateResult:
    """What `ReferencePod.generate` produced.

    Fields:
        request_ids: `[die][i]`, the pod-wide id of die `d`'s i-th request.
        tokens: `[die][i]`, the generated ids of that request: `steps + 1` of them, the first
            sampled from the prefill logits, one more per decode step.
        logits: `[die][step]`, float32 `[n_requests_of_die, vocab]` of step 0 (prefill, last
            prompt row) .. `steps` (decode); the token of step s is sampled from `logits[d][s]`.
        prefill_s, decode_s: wall seconds of the prefill step and of all decode steps.
        num_decode_tokens: tokens produced by decode steps (`steps * total requests`).
    """

    request_ids: list[list[int]]
    tokens: list[list[list[int]]]
    logits: list[list[np.ndarray]]
    prefill_s: float
    decode_s: float
    num_decode_tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode throughput: `num_decode_tokens / decode_s` (0 when nothing was decoded)."""
        return self.num_decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


class ReferencePod:
    """D `DieModel`s in one process, stepped in lockstep with reference collectives.

    Arguments:
        cfg: model config; `cfg.validate(num_dies)` is checked first.
        num_dies: dies of the pod; every die attends and hosts `num_experts / num_dies` experts.
        quant: None (float32 dispatch) or "int8" (per-token INT8 dispatch payloads).
        kv: one KV store per die (default: a `DictKV` each); the schedule replay passes
            `runtime.model.kv.PagedKV` stores driven by the served block tables.
        combine_dtype: "bfloat16" (expert rows rounded as a pod's default combine sends them)
            or "float32": the pod's `a2a_combine_dtype`.
        expert_maps: replay of an EPLB run (`runtime.model.expert_balancer`): `(switch_step,
            phy2log)` pairs, the first at step 0, each phy2log `[moe layers][P]`; from its switch
            step on, each MoE layer routes a die's row i to replica `(i + die + step) % replicas` of
            its expert (`sched.eplb.replica_for` over `row_positions`) over a block placement of the
            P physical slots, as the pod does. Steps are numbered by `generate` (0 = prefill) or
            passed to `step`.
        microbatches: 1, or 2: each step's batch of a die in two halves by request
            (`runtime.model.pipeline.halves`), each half a step of its own over every die, as a
            micro-batched colocated pod computes them (no EPLB map, no logit_rows / hidden).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_dies: int,
        quant: str | None = None,
        kv: Sequence | None = None,
        combine_dtype: str = "bfloat16",
        expert_maps: Sequence[tuple[int, Sequence]] | None = None,
        microbatches: int = 1,
    ):
        cfg.validate(num_dies)
        if microbatches not in (1, 2) or (microbatches == 2 and expert_maps):
            raise ConfigError(f"microbatches: 1, or 2 without expert maps; got {microbatches}")
        self.microbatches = microbatches
        if quant not in QUANT_MODES:
            raise ConfigError(f"quant: expected one of {QUANT_MODES}, got {quant!r}")
        if combine_dtype not in COMBINE_DTYPES:
            raise ConfigError(
                f"combine_dtype: expected one of {COMBINE_DTYPES}, got {combine_dtype!r}"
            )
        self.cfg, self.num_dies, self.quant = cfg, num_dies, quant
        self.combine_dtype = combine_dtype
        self.maps = expert_maps_of(expert_maps, cfg, num_dies)
        phys = self.maps[0][1].num_physical if self.maps else cfg.num_experts
        self.placement = Placement.default(phys, tuple(range(num_dies)))
        if kv is not None and len(kv) != num_dies:
            raise ValueError(f"kv: expected {num_dies} stores (one per die), got {len(kv)}")
        built = [set(self.placement.experts_on(d).tolist()) for d in range(num_dies)]
        if self.maps:
            s = phys // num_dies
            built = [
                {int(e) for _, m in self.maps for e in m.phy2log[:, d * s : (d + 1) * s].ravel()}
                for d in range(num_dies)
            ]
        # an MTP module's MoE keeps the default placement (EPLB balances the main layers)
        self.mtp_placement = Placement.default(cfg.num_experts, tuple(range(num_dies)))
        self.dies = [
            DieModel(
                cfg,
                build_weights(
                    cfg, sorted(built[d]), self.mtp_placement.experts_on(d).tolist()
                ),  # fmt: skip
                kv[d] if kv is not None else DictKV(cfg.kv_cache_dim),
            )
            for d in range(num_dies)
        ]
        self.step_no = 0

    def step(
        self, batches: Sequence[Sequence[Segment]], step: int | None = None,
        logit_rows: Sequence[np.ndarray] | None = None, hidden: bool = False,
    ):  # fmt: skip
        """One forward over every die.

        Arguments:
            batches: `[die]`, each a list of segments `(req_id, tokens, start_pos)` (may be
                empty); a request's KV rows live on the die whose batch holds it.
            step: the step number that picks the expert map (`expert_maps`); default: the
                previous step's + 1 (0 first).
            logit_rows: `[die]` row indices (in `batch_rows` order) to take the logits at;
                default each segment's last row.
            hidden: also return every row's final-normed hidden rows `[die]` (an MTP
                module's input).

        Returns:
            logits: `[die]`, float32 `[n_segments_of_die, vocab]`, at each segment's last row
                (or at `logit_rows`); with `hidden`, `(logits, normed)`.
        """
        if len(batches) != self.num_dies:
            raise ValueError(f"batches: expected {self.num_dies} (one per die), got {len(batches)}")
        self.step_no = self.step_no + 1 if step is None else int(step)
        if self.microbatches == 1:
            return self._forward(batches, logit_rows, hidden)
        if logit_rows is not None or hidden:
            raise ValueError("logit_rows / hidden: one micro-batch only")
        parts = [halves(b) for b in batches]
        outs = [self._forward([p[m] for p in parts], None, False) for m in range(2)]
        return [np.concatenate([o[d] for o in outs]) for d in range(self.num_dies)]

    def _forward(self, batches, logit_rows, hidden: bool):
        """`step`'s forward over every die, as one batch each."""
        rows = [batch_rows(b) for b in batches]  # once for every layer
        hs = [die.embed(r[0]) for die, r in zip(self.dies, rows, strict=True)]
        hs = self.run_layers(range(self.cfg.n_layers), hs, batches, rows)
        lrows = [last_rows(b) for b in batches] if logit_rows is None else list(logit_rows)
        if not hidden:
            return [die.logits(h[r]) for die, h, r in zip(self.dies, hs, lrows, strict=True)]
        normed = [die.final_norm(h) for die, h in zip(self.dies, hs, strict=True)]
        logits = [die.head(x[r]) for die, x, r in zip(self.dies, normed, lrows, strict=True)]
        return logits, normed

    def mtp(self, j: int, batches: Sequence[Sequence[Segment]],
            hidden: Sequence[np.ndarray]) -> tuple[list, list]:  # fmt: skip
        """MTP sub-forward j of every die (`runtime.model.forward.forward_mtp`): segments of
        `(req, next tokens, start)`, `hidden` the normed rows at those positions; (logits,
        normed) at each segment's last row, per die. The step number is the last `step`'s."""
        layer = self.cfg.mtp_layer(j)
        m = layer - self.cfg.n_layers
        rows = [batch_rows(b) for b in batches]
        hs = [die.mtp_in(m, r[0], x) for die, r, x in zip(self.dies, rows, hidden, strict=True)]
        hs = self.run_layers((layer,), hs, batches, rows)
        normed = [die.mtp_norm(m, h[last_rows(b)])
                  for die, h, b in zip(self.dies, hs, batches, strict=True)]  # fmt: skip
        return [die.head(x) for die, x in zip(self.dies, normed, strict=True)], normed

    def run_layers(self, layers, hs, batches, rows) -> list[np.ndarray]:
        """`layers` (attention, then the dense FFN or the MoE) over every die's rows."""
        for layer in layers:
            hs = [
                die.attention(layer, h, b, r)
                for die, h, b, r in zip(self.dies, hs, batches, rows, strict=True)
            ]
            if self.cfg.is_moe(layer):
                hs = self._moe(layer, hs)
            else:
                hs = [die.dense_ffn(layer, h) for die, h in zip(self.dies, hs, strict=True)]
        return hs

    def rewind(self, batches: Sequence[Sequence[Segment]], layers: Sequence[int]) -> None:
        """Drop every row at or after each segment's start in `layers` of its die's store
        (a `DictKV`: rejected speculative rows; a paged store overwrites them in place)."""
        for die, batch in zip(self.dies, batches, strict=True):
            cut = getattr(die.kv, "truncate", None)
            if cut is None:
                continue
            for req, _, start in batch:
                for layer in layers:
                    cut(req, layer, start)

    def _moe(self, layer: int, hs: list[np.ndarray]) -> list[np.ndarray]:
        gates = [die.gate(layer, h) for die, h in zip(self.dies, hs, strict=True)]
        xns, idxs, ws = (list(g) for g in zip(*gates, strict=True))
        if layer >= self.cfg.n_layers:  # an MTP module: the default placement, no EPLB map
            out = dispatch_ref(xns, idxs, self.mtp_placement, quant=self.quant)
            ex = {d: self.dies[d].experts(layer, dequantize_dispatch(o).x, o.expert_counts,
                                          self.mtp_placement.experts_on(d))
                  for d, o in out.items()}  # fmt: skip
            routed = combine_ref(ex, out, idxs, ws, combine_dtype=self.combine_dtype)
            return [die.finish_moe(layer, h, xn, r)
                    for die, h, xn, r in zip(self.dies, hs, xns, routed, strict=True)]  # fmt: skip
        m = None
        if self.maps:
            m = [mp for start, mp in self.maps if start <= self.step_no][-1]
            j = layer - self.cfg.n_dense_layers
            idxs = [replica_for(m, j, idx, row_positions(idx.shape[0], d, self.step_no))
                    for d, idx in enumerate(idxs)]  # fmt: skip
        dispatched = dispatch_ref(xns, idxs, self.placement, quant=self.quant)
        expert_outs = {}
        for d, out in dispatched.items():
            rows = dequantize_dispatch(out).x
            if m is None:
                ids = self.placement.experts_on(d)
            else:
                s = m.slots_per_die
                ids = m.phy2log[layer - self.cfg.n_dense_layers, d * s : (d + 1) * s]
            expert_outs[d] = self.dies[d].experts(layer, rows, out.expert_counts, ids)
        routed = combine_ref(expert_outs, dispatched, idxs, ws, combine_dtype=self.combine_dtype)
        return [
            die.finish_moe(layer, h, xn, r)
            for die, h, xn, r in zip(self.dies, hs, xns, routed, strict=True)
        ]

    def generate(
        self,
        prompts: Sequence[Sequence[Sequence[int]]],
        steps: int,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> GenerateResult:
        """Prefill every request in one step, then `steps` decode steps of one token each.

        Request ids are assigned die by die in order: die 0's requests get 0..n0-1, die 1's
        n0..n0+n1-1, and so on. The token of request `r` at step `s` (0 = from the prefill) is
        `sample(logits, temperature, [np.random.default_rng([seed, r, s])])`.

        Arguments:
            prompts: `[die][i]`, the prompt token ids of die d's i-th request (>= 1 token each;
                lengths may differ; a die may have no requests). The KV store must not already
                hold these request ids (use a fresh `ReferencePod`).
            steps: decode steps (>= 0); `len(prompt) + steps` must be <= `max_seq_len`.
            temperature: 0 = greedy, > 0 = seeded sampling.
            seed: sampling seed.

        Returns:
            result: a `GenerateResult`.
        """
        if len(prompts) != self.num_dies:
            raise ValueError(f"prompts: expected {self.num_dies} lists (one per die)")
        ids, nxt = [], 0
        for d, reqs in enumerate(prompts):
            ids.append(list(range(nxt, nxt + len(reqs))))
            nxt += len(reqs)
            for i, p in enumerate(reqs):
                if len(p) == 0 or len(p) + steps > self.cfg.max_seq_len:
                    raise ValueError(
                        f"prompts[{d}][{i}]: {len(p)} tokens + {steps} steps must be in "
                        f"[1, max_seq_len={self.cfg.max_seq_len}]"
                    )
        batches = [
            [(r, list(p), 0) for r, p in zip(ids[d], prompts[d], strict=True)]
            for d in range(len(ids))
        ]
        t0 = time.perf_counter()
        logits = self.step(batches, 0)
        prefill_s = time.perf_counter() - t0
        history = [[lg] for lg in logits]
        tokens = [
            [[int(t)] for t in self._sample(lg, ids[d], 0, temperature, seed)]
            for d, lg in enumerate(logits)
        ]
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            batches = [
                [(r, [tokens[d][i][-1]], len(prompts[d][i]) + s - 1) for i, r in enumerate(ids[d])]
                for d in range(len(ids))
            ]
            logits = self.step(batches, s)
            for d, lg in enumerate(logits):
                history[d].append(lg)
                for i, t in enumerate(self._sample(lg, ids[d], s, temperature, seed)):
                    tokens[d][i].append(int(t))
        decode_s = time.perf_counter() - t0
        return GenerateResult(ids, tokens, history, prefill_s, decode_s, steps * nxt)

    @staticmethod
    def _sample(logits, req_ids, step: int, temperature: float, seed: int) -> np.ndarray:
        rngs = [np.random.default_rng([seed, r, step]) for r in req_ids] if temperature else None
        return sample(logits, temperature, rngs)


def expert_maps_of(expert_maps, cfg: ModelConfig, num_dies: int) -> list:
    """[(switch_step, ExpertMap)] in step order, checked (ValueError naming the entry)."""
    if not expert_maps:
        return []
    out = []
    n_moe = cfg.n_layers - cfg.n_dense_layers
    for i, (start, phy2log) in enumerate(expert_maps):
        m = ExpertMap.from_phy2log(phy2log, cfg.num_experts, num_dies)
        if m.num_layers != n_moe:
            raise ValueError(f"expert_maps[{i}]: {m.num_layers} layers, the model has {n_moe}")
        out.append((int(start), m))
    out.sort(key=lambda t: t[0])
    if out[0][0] != 0 or len({m.num_physical for _, m in out}) != 1:
        raise ValueError("expert_maps: the first map starts at step 0 and all have one slot count")
    return out


def mla_decompressed(
    cfg: ModelConfig,
    lw: LayerWeights,
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    cache: np.ndarray,
    start: int,
) -> np.ndarray:
    """Textbook MLA for one request: decompress K/V from the latent rows, standard attention.

    Arguments:
        cfg, lw: config and the layer's weights.
        q_nope: float32 `[s, H, qk_nope_dim]`; q_pe: float32 `[s, H, qk_rope_dim]` (roped), the
            request's queries at positions `start .. start + s - 1`.
        cache: float32 `[T, kv_lora_rank + qk_rope_dim]`, `T = start + s`: `concat(c_kv, k_pe)`.
        start: position of the first query.

    Returns:
        o: float32 `[s, hidden]`: per head `k = concat(c_kv @ W_UK[h]^T, k_pe)`,
            `v = c_kv @ W_UV[h]`, causal softmax(q k^T / sqrt(d_qk)) v, then `W_O`.
    """
    r, nh = cfg.kv_lora_rank, cfg.n_heads
    c_kv, k_pe = cache[:, :r], cache[:, r:]
    s, t = q_nope.shape[0], cache.shape[0]
    heads = []
    for h in range(nh):
        k = np.concatenate([c_kv @ lw.w_uk[h].T, k_pe], axis=1)  # [T, nope + rope]
        v = c_kv @ lw.w_uv[h]  # [T, v]
        q = np.concatenate([q_nope[:, h], q_pe[:, h]], axis=1)  # [s, nope + rope]
        scores = (q @ k.T) / np.float32(np.sqrt(cfg.qk_head_dim))
        scores[np.arange(t)[None, :] > np.arange(s)[:, None] + start] = -np.inf
        heads.append(softmax(scores) @ v)
    return np.concatenate(heads, axis=1) @ lw.wo
