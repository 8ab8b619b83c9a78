"""Two micro-batches in one colocated step (000 §4.2.3, Fig. 14b): `forward_microbatched`.

A die's segments are cut in two halves by request (`halves`: the first ceil(n / 2) requests
are micro-batch 0, the rest micro-batch 1; either may be empty). Each half is its own forward
pass, its layers interleaved with the other's on the die's one host thread:

```
per layer l:   attention(mb0, l)  attention(mb1, l)   stream s0: MLA prolog, attention core,
               ffn(mb0, l)        ffn(mb1, l)          o_proj, norms (and per micro-batch its
before:        embed(mb0) embed(mb1)                   embedding, final norm, LM head, sampling)
after:         head(mb0)  head(mb1)                    stream s1: gate, dispatch, routed experts,
                                                       combine, shared expert (or dense FFN)
```

Every die runs both micro-batches' collectives at every MoE layer, empty or not, at event ids
`(step * slots + slot) * 2 + mb` (`microbatch_event`): unique, and the same on every die.

A capture pod records the ops on the two hardware streams of 000 §4.2.3, `s0` (the attention
path) and `s1` (the MoE path; its dispatch and combine on the `a2a` stream, launched from
`s1`), with `after` edges for the data each micro-batch's next op needs (`Streams`): its FFN
waits for its attention, its next layer's attention for its FFN (the combine and the shared
expert), its head for its last FFN. So the replay overlaps one micro-batch's attention with
the other's MoE, as the paper's pipeline does; the host itself runs them one after another.

Bit-exactness: each half is a forward of its own requests, so the pod equals
`ReferencePod(microbatches=2)` (each half a reference step) bit for bit; in batch-invariant
mode (`ModelConfig.batch_invariant`) every row is computed independently of its batch mates,
so its tokens and logits also equal one micro-batch's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np

from memory.errors import ConfigError
from runtime.model.card import record
from runtime.model.die_model import DieModel, batch_rows, last_rows
from runtime.model.expert_balancer import ExpertBalancer
from runtime.model.forward import Clock, attend, attention_dims, feed_forward, record_head

MICROBATCHES = 2
ATTENTION_STREAM, MOE_STREAM = "s0", "s1"  # 000 §4.2.3's stream 0 and stream 1


def halves(segments) -> list[list]:
    """A die's segments in two micro-batches by request: the first ceil(n / 2), the rest."""
    k = (len(segments) + 1) // 2
    return [list(segments[:k]), list(segments[k:])]


def microbatch_event(step: int, slots: int, slot: int, mb: int) -> int:
    """The MoE event id of micro-batch `mb` at event slot `slot` of step `step`."""
    return (step * slots + slot) * MICROBATCHES + mb


class Streams:
    """A capture pod die's decode streams: each micro-batch's latest event (stream, seq), and
    the `after` edge a stream needs when a micro-batch's next op runs on another stream than
    its last one (skipped when the stream already waited for that event or a later one).
    Without a capture (`cap` None) it records nothing."""

    def __init__(self, cap, microbatches: int):
        self.cap = cap
        if cap is None:
            return
        self.sid = {n: cap.stream(n) for n in (ATTENTION_STREAM, MOE_STREAM)}
        self.last = [(cap.main, cap.last(cap.main))] * microbatches
        self.waited: dict[tuple[int, int], int] = {}  # (stream, other) -> latest seq waited for

    def _wait(self, sid: int, other: int, seq: int) -> None:
        if other == sid or seq < 0 or self.waited.get((sid, other), -1) >= seq:
            return
        self.waited[(sid, other)] = seq
        self.cap.after(sid, other, seq)

    @contextlib.contextmanager
    def on(self, mb: int, name: str) -> Iterator[None]:
        """Record micro-batch `mb`'s next ops on stream `name`, after its previous one (its
        model ops tagged `mb`)."""
        if self.cap is None:
            yield
            return
        sid = self.sid[name]
        self._wait(sid, *self.last[mb])
        tags, self.cap.tags = self.cap.tags, {**self.cap.tags, "mb": mb}
        try:
            with self.cap.on(sid):
                yield
        finally:
            self.cap.tags = tags
        self.last[mb] = (sid, self.cap.last(sid))

    def join(self) -> None:
        """The caller's stream (main) goes on after every micro-batch's last event."""
        if self.cap is not None:
            for other, seq in self.last:
                self._wait(self.cap.main, other, seq)


def forward_microbatched(
    die, model: DieModel, segments, protocol: str, quant, clock: Clock, bal: ExpertBalancer,
):  # fmt: skip
    """`runtime.model.forward.forward` in two micro-batches (module docstring): float32 logits
    `[n_segments, vocab]` at each segment's last row, in `segments` order. Every die calls it
    at every step (an empty `segments` is a dummy step). Without EPLB only (its replica choice
    depends on a row's position in the die's batch)."""
    if bal.eplb is not None:
        raise ConfigError("micro-batches: a colocated step runs them without EPLB")
    cfg = model.cfg
    cap = getattr(die, "cap", None)
    st = Streams(cap, MICROBATCHES)
    mbs = halves(segments)
    slots = clock.slots or cfg.n_layers
    t = time.perf_counter_ns()
    hs, batches, atts = [], [], []
    for m, seg in enumerate(mbs):
        with st.on(m, ATTENTION_STREAM):
            t0 = t
            batch = batch_rows(seg)  # once for every layer
            hs.append(model.embed(batch[0]))
            t = clock.span(5, -1, t)
            if cap is not None:
                record(cap, cfg, "embed", t0, rows=hs[m].shape[0])
        batches.append(batch)
        atts.append(attention_dims(seg) if cap is not None else None)
    for layer in range(cfg.n_layers):
        for m, seg in enumerate(mbs):
            with st.on(m, ATTENTION_STREAM):
                hs[m], t = attend(die, model, hs[m], seg, batches[m], layer, clock, t, atts[m])
        for m in range(MICROBATCHES):
            ev = microbatch_event(clock.step, slots, layer, m)
            with st.on(m, MOE_STREAM):
                hs[m], t = feed_forward(die, model, hs[m], layer, ev, protocol, quant, clock,
                                        bal, t)  # fmt: skip
    logits = []
    for m, seg in enumerate(mbs):
        with st.on(m, ATTENTION_STREAM):
            t0 = t
            logits.append(model.logits(hs[m][last_rows(seg)]))
            t = clock.span(5, -1, t)
            record_head(cap, cfg, t0, len(seg))
    st.join()
    return np.concatenate(logits)


__all__ = ["ATTENTION_STREAM", "MICROBATCHES", "MOE_STREAM", "Streams", "forward_microbatched",
           "halves", "microbatch_event"]  # fmt: skip
