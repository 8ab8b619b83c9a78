"""`DieModel`: what ONE die of the toy model computes (docs/architecture.md §5).

Shapes follow DeepSeek-V3 (003 §II-B, Table II), shrunk: a byte-level tokenizer, an embedding,
`n_layers` decoder blocks of MLA attention (a latent KV cache of `kv_lora_rank + qk_rope_dim`
floats per token and layer, weight absorption) followed by a dense SwiGLU FFN (the first
`n_dense_layers` blocks) or an MoE (routed experts spread over dies, one shared expert, top-k
gating), then a final RMSNorm and the LM head.

`DieModel` is what ONE die computes, split into phases (embed, attention, gate, experts,
finish_moe / dense_ffn, logits) so that a driver can put the collectives in between. The
single-process `runtime.model.reference.ReferencePod` and the distributed pod call the same
phases on the same arrays, so they compute bit-identical results; the contract they share:

- a die's batch is a list of segments `(req_id, tokens, start_pos)`; its rows are the tokens of
  the segments concatenated in list order (`batch_rows`);
- `attention` appends each segment's latent rows to the KV store, then attends request by request
  in segment order;
- the routed-expert input of a die is the dispatch output in `comm.reference` canonical order
  (local expert, src die, batch slot, k), dequantized with `comm.quant.dequantize_int8` when
  INT8; `experts` runs one matmul chain per local expert over its contiguous group;
- the combine is `comm.reference.combine_ref`'s ascending-k float32 accumulation, and
  `finish_moe` adds `(h + shared) + routed` in that order;
- `logits` is called on the gathered last row of each segment (`last_rows`), not on all rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from runtime.model.config import ModelConfig
from runtime.model.kv import KVStore
from runtime.model.ops import (
    absorbed_attention,
    attend,
    kernels,
    mla_project,
    mm,
    rms_norm,
    rope_tables,
    route_topk,
    set_batch_invariant,
    swiglu,
)
from runtime.model.weights import Weights, expert_bias

F32 = np.float32

# -- batches ----------------------------------------------------------------------

Segment = tuple[int, Sequence[int] | np.ndarray, int]  # (req_id, tokens, start_pos)


def batch_rows(segments: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray, list[tuple]]:
    """Flatten a die's batch.

    Arguments:
        segments: `(req_id, tokens, start_pos)` each, at least one token per segment.

    Returns:
        tokens: int64 `[n]`, every segment's tokens concatenated in list order.
        positions: int64 `[n]`, `start_pos + i` for the i-th token of its segment.
        bounds: per segment `(req_id, lo, hi, start_pos)`: its rows are `lo:hi`.
    """
    toks, pos, bounds, lo = [], [], [], 0
    for i, (req, tokens, start) in enumerate(segments):
        t = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if t.size == 0 or int(start) < 0:
            raise ValueError(
                f"segments[{i}]: request {req} needs >= 1 token and start_pos >= 0, got "
                f"{t.size} tokens at {start}"
            )
        toks.append(t)
        pos.append(np.arange(int(start), int(start) + t.size, dtype=np.int64))
        bounds.append((int(req), lo, lo + t.size, int(start)))
        lo += t.size
    if not toks:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), []
    return np.concatenate(toks), np.concatenate(pos), bounds


def last_rows(segments: Sequence[Segment]) -> np.ndarray:
    """int64 `[n_segments]`: the row index (in `batch_rows` order) of each segment's last token."""
    _, _, bounds = batch_rows(segments)
    return np.array([hi - 1 for _, _, hi, _ in bounds], dtype=np.int64)


# -- one die ---------------------------------------------------------------------------------------

MoEFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class DieModel:
    """What one die computes, in phases a driver interleaves with the collectives.

    Every phase takes and returns float32 arrays; `n` is the die's row count (0 allowed: every
    phase then returns `[0, ...]` arrays). One forward step of a die:

        tokens, positions, bounds = batch_rows(segments)
        h = embed(tokens)
        for layer in range(n_layers):
            h = attention(layer, h, segments)
            if not is_moe(layer): h = dense_ffn(layer, h)
            else:
                xn, idx, w = gate(layer, h)          # then dispatch xn by idx to the expert dies
                y = experts(layer, rows, counts, ids)  # on each expert die, its received rows
                routed = ...                         # combine y with w back to the source
                h = finish_moe(layer, h, xn, routed)
        logits(h[last_rows(segments)])
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, kv: KVStore):
        self.cfg = cfg
        self.weights = weights
        self.kv = kv
        self.cos, self.sin = rope_tables(cfg)
        self._bias = {layer: expert_bias(cfg, layer) for layer in range(cfg.kv_layers)}
        self._attn_ok: dict[int, bool] = {}
        set_batch_invariant(cfg.batch_invariant)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """int `[n]` token ids in `[0, vocab)` -> float32 `[n, hidden]` (a copy of the rows)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise ValueError(f"tokens: ids must be in [0, {self.cfg.vocab_size}), got {tokens}")
        return self.weights.embed[tokens]

    def attention(
        self, layer: int, h: np.ndarray, segments: Sequence[Segment], rows: tuple | None = None
    ) -> np.ndarray:
        """Pre-norm MLA block with residual: h float32 `[n, hidden]` -> `[n, hidden]`.

        Appends each segment's latent rows (`kv_rows[lo:hi]`) to `kv` under its request, in
        segment order, then attends each segment against all its request's rows (absorbed form).
        Projections are batched over all `n` rows; scores/softmax loop over segments. `rows`:
        `batch_rows(segments)` if the caller has it (a step computes it once for every layer).

        A die's 2-3 decode rows take the projections in two compiled calls
        (`runtime.model.kernels.mla_in` / `attn_out`: the same kernels in the same order as the
        numpy path, so the same bits; ~35 us less per layer than its ~20 numpy calls).
        """
        cfg, lw = self.cfg, self.weights.layers[layer]
        _, positions, bounds = batch_rows(segments) if rows is None else rows
        n = h.shape[0]
        if positions.shape[0] != n:
            raise ValueError(f"h: {n} rows, but the segments hold {positions.shape[0]}")
        if positions.size and positions.max() >= cfg.max_seq_len:
            raise ValueError(f"segments: position {positions.max()} >= max_seq_len")
        cos, sin = self.cos[positions], self.sin[positions]
        K = kernels()
        rows_ok = n >= 1 if self.cfg.batch_invariant else 2 <= n <= K.SMALL_ROWS
        small = rows_ok and h.dtype == F32 and self._compiled_attention(layer)
        if small:
            h = np.ascontiguousarray(h)
            w_q = lw.wq_b if lw.wq is None else lw.wq
            q_cat, kv_rows = K.mla_in(h, lw.attn_norm, cfg.norm_eps, lw.wq_a, lw.q_norm, w_q,
                                      lw.wkv_a, lw.kv_norm, lw.w_uk, cos, sin)  # fmt: skip
        else:
            x = rms_norm(h, lw.attn_norm, cfg.norm_eps)
            q_nope, q_pe, kv_rows = mla_project(cfg, lw, x, cos, sin)
        caches = []
        for req, lo, hi, start in bounds:
            self.kv.append(req, layer, kv_rows[lo:hi])
            cache = self.kv.get(req, layer)
            if cache.shape[0] != start + hi - lo:
                raise ValueError(
                    f"kv: request {req} layer {layer} holds {cache.shape[0]} rows after this "
                    f"step, expected start_pos + tokens = {start + hi - lo}"
                )
            caches.append(cache)
        seg_bounds = [(lo, hi, start) for _, lo, hi, start in bounds]
        if small:
            return K.attn_out(attend(cfg, q_cat, caches, seg_bounds), lw.w_uv, lw.wo, h)
        return h + absorbed_attention(cfg, lw, q_nope, q_pe, caches, seg_bounds)

    def _compiled_attention(self, layer: int) -> bool:
        """Whether layer's attention weights suit the compiled small-row path (C-contiguous
        float32, as `build_weights` makes them); checked once per layer."""
        ok = self._attn_ok.get(layer)
        if ok is None:
            lw = self.weights.layers[layer]
            ws = [
                lw.attn_norm,
                lw.wq_b if lw.wq is None else lw.wq,
                lw.wkv_a,
                lw.kv_norm,
                lw.w_uk,
                lw.w_uv,
                lw.wo,
            ] + ([] if lw.wq_a is None else [lw.wq_a, lw.q_norm])
            ok = self._attn_ok[layer] = all(
                w.dtype == F32 and w.flags.c_contiguous for w in ws
            )  # fmt: skip
        return ok

    def is_moe(self, layer: int) -> bool:
        return self.cfg.is_moe(layer)

    def dense_ffn(self, layer: int, h: np.ndarray) -> np.ndarray:
        """Dense layer: `h + swiglu(rms_norm(h))`, float32 `[n, hidden]`."""
        lw = self.weights.layers[layer]
        return h + swiglu(rms_norm(h, lw.ffn_norm, self.cfg.norm_eps), lw.dense)

    def gate(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """MoE routing of the die's rows.

        Returns:
            xn: float32 `[n, hidden]`, `rms_norm(h)`: what is dispatched and fed to the shared
                expert.
            topk_idx: int64 `[n, topk]`, logical expert ids (see `route_topk` for the order).
            topk_weights: float32 `[n, topk]`, each row sums to `routed_scaling`.
        """
        lw, cfg = self.weights.layers[layer], self.cfg
        xn = rms_norm(h, lw.ffn_norm, cfg.norm_eps)
        idx, w = route_topk(mm(xn, lw.gate), cfg.topk, cfg.gating, cfg.routed_scaling,
                            self.bias(layer), cfg.n_group, cfg.topk_group)  # fmt: skip
        return xn, idx, w

    def bias(self, layer: int) -> np.ndarray | None:
        """The router's correction bias of `layer` (`expert_bias`), built once."""
        return self._bias[layer]

    def experts(
        self,
        layer: int,
        x_rows: np.ndarray,
        expert_counts: np.ndarray,
        local_expert_ids: Sequence[int],
    ) -> np.ndarray:
        """Routed experts on rows grouped by local expert (unweighted).

        Arguments:
            layer: an MoE layer.
            x_rows: float32 `[m, hidden]`, the dispatched rows; local expert `j`'s group is rows
                `sum(counts[:j]) : sum(counts[:j+1])` (`DispatchOut` order).
            expert_counts: int `[n_local]`, rows per local expert (0 allowed).
            local_expert_ids: logical id of each local expert, in local order.

        Returns:
            y: float32 `[m, hidden]`, row i = SwiGLU of its expert on `x_rows[i]`, computed by one
                matmul chain per expert over its whole group.
        """
        counts = np.asarray(expert_counts, dtype=np.int64).reshape(-1)
        ids = [int(e) for e in local_expert_ids]
        if counts.size != len(ids) or counts.sum() != x_rows.shape[0] or (counts < 0).any():
            raise ValueError(
                f"expert_counts: expected {len(ids)} counts >= 0 summing to {x_rows.shape[0]} "
                f"rows, got {counts.tolist()}"
            )
        table = self.weights.experts[layer]
        missing = [e for e in ids if e not in table]
        if missing:
            raise ValueError(f"local_expert_ids: experts {missing} are not built on this die")
        y = np.empty((x_rows.shape[0], self.cfg.hidden), dtype=F32)
        offsets = np.concatenate(([0], np.cumsum(counts)))
        for j, e in enumerate(ids):
            lo, hi = int(offsets[j]), int(offsets[j + 1])
            if hi > lo:
                y[lo:hi] = swiglu(x_rows[lo:hi], table[e])
        return y

    def finish_moe(
        self, layer: int, h: np.ndarray, xn: np.ndarray, routed_out: np.ndarray
    ) -> np.ndarray:
        """End of an MoE layer: `(h + swiglu_shared(xn)) + routed_out`, two float32 adds in that
        order (the order is part of the bit-exactness contract).

        Arguments: h, xn (from `gate`), routed_out (the combine's output): float32 `[n, hidden]`.
        """
        lw = self.weights.layers[layer]
        return (h + swiglu(xn, lw.shared)) + routed_out

    def logits(self, h_last_rows: np.ndarray) -> np.ndarray:
        """float32 `[m, hidden]` -> float32 `[m, vocab]`: final RMSNorm then LM head."""
        return self.head(self.final_norm(h_last_rows))

    def final_norm(self, h: np.ndarray) -> np.ndarray:
        """The main model's final RMSNorm: the rows the LM head sees (and an MTP module's
        hidden input)."""
        return rms_norm(h, self.weights.final_norm, self.cfg.norm_eps)

    def head(self, x: np.ndarray) -> np.ndarray:
        """The shared LM head: normed float32 `[m, hidden]` -> float32 `[m, vocab]`."""
        return mm(x, self.weights.lm_head)

    # -- multi-token prediction (runtime.model.mtp) ----------------------------------------------

    def mtp_in(self, j: int, tokens: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """MTP module j's input rows: `concat(enorm(embed(next tokens)), hnorm(hidden)) @
        eh_proj` (DeepSeek-V3 report §2.2, the released code's order), float32 `[n, hidden]`.

        Arguments: tokens int `[n]`, the token after each row's position; hidden float32
        `[n, hidden]`, the normed row the previous head saw (`final_norm`, or the previous MTP
        sub-forward's `mtp_norm`)."""
        mw, eps = self.weights.mtp[j], self.cfg.norm_eps
        e = rms_norm(self.embed(tokens), mw.enorm, eps)
        x = np.concatenate([e, rms_norm(hidden, mw.hnorm, eps)], axis=1)
        return mm(x, mw.eh_proj)

    def mtp_norm(self, j: int, h: np.ndarray) -> np.ndarray:
        """MTP module j's own norm before the shared head (the rows it sees, and the next
        sub-forward's hidden input)."""
        return rms_norm(h, self.weights.mtp[j].norm, self.cfg.norm_eps)

    def forward(self, segments: Sequence[Segment], moe_fn: MoEFn) -> np.ndarray:
        """The whole layer loop on this die alone.

        Arguments:
            segments: the die's batch.
            moe_fn: `moe_fn(layer, xn, topk_idx, topk_weights) -> routed_out` float32
                `[n, hidden]`, the routed part of the MoE (dispatch, experts, combine).

        Returns:
            h: float32 `[n, hidden]`, the final hidden rows (before the final norm).
        """
        rows = batch_rows(segments)
        h = self.embed(rows[0])
        for layer in range(self.cfg.n_layers):
            h = self.attention(layer, h, segments, rows)
            if not self.is_moe(layer):
                h = self.dense_ffn(layer, h)
                continue
            xn, idx, w = self.gate(layer, h)
            h = self.finish_moe(layer, h, xn, moe_fn(layer, xn, idx, w))
        return h
