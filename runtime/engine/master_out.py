"""What a DP-group master sends the engine (`Master` inherits it): the `out` message of a
wake-up (token deltas with the output index of their first token, paced by `stream_interval`;
finishes; PD and KV pool events; prefix hits), through the group's output process when there is
one; the `stats` message every `STATS_EVERY_S` while busy and once more as the group goes idle;
the heartbeat's `pong` once the die has echoed a ping.

Split from `master.py`, whose loop calls `flush` and `heartbeat` on every wake-up; the state
read here (`deltas`, `done`, `sent_n`, `counters`, ...) is made in `Master.__init__`.
"""

from __future__ import annotations

import time

from runtime.engine import wire

STATS_EVERY_S = 0.1


class MasterOut:
    """The sending methods of `runtime.engine.master.Master` (see the module doc)."""

    # -- output --------------------------------------------------------------------------------

    def send(self, kind: str, body: dict) -> None:
        self.outbox.send(wire.pack(kind, {**body, "gen": self.spec.gen}))

    def flush(self) -> None:
        send = self._due()
        events = self.pd.take_events() if self.pd is not None else []
        pool = self.pool.take_events() if self.pool is not None else []
        if send or self.done or events or pool:
            deltas = []  # [id, output index of the first token, tokens]: the shell's ledger
            for rid, toks in send.items():  # checks each start against what it has delivered
                start = self.sent_n.get(rid, 0)
                self.sent_n[rid] = start + len(toks)
                deltas.append([rid, start, toks])
            for rec in self.done:
                self.sent_n.pop(rec[0], None)
            self.tokens_out.send(wire.pack("out", {
                "group": self.spec.group, "gen": self.spec.gen, "deltas": deltas,
                "done": self.done, "pd": events, "pool": pool, "cached": self.cached}))  # fmt: skip
            self.done, self.cached = [], []
        now = time.monotonic()
        # Every 0.1 s while busy, and once more as the group goes idle (gauges read 0 then).
        idle = not (self.sched.has_work() or self.in_flight)
        if now - self.stats_at >= STATS_EVERY_S or (idle and self.stats_dirty):
            self.stats_at = now
            self.stats_dirty = False
            self.send("stats", self.stats())

    def _due(self) -> dict[int, list[int]]:
        """The deltas to send now: all of them, or with `stream_interval` N > 1 (vLLM's
        --stream-interval) a streamed request's first token at once, then every N tokens, and
        whatever is left when it finishes; the rest wait in `deltas`."""
        n = self.spec.stream_interval
        if n <= 1 or not self.deltas:
            send, self.deltas = self.deltas, {}
            return send
        ending = {rec[0] for rec in self.done}
        send = {rid: toks for rid, toks in self.deltas.items()
                if len(toks) >= n or rid in ending or rid not in self.started}  # fmt: skip
        for rid in send:
            del self.deltas[rid]
            if rid not in ending:
                self.started.add(rid)
        return send

    def heartbeat(self) -> None:
        """Answer the pings the die has echoed (its loop ran since they were asked)."""
        echoed = self.words[self.pong_word]
        while self.pings and self.pings[0] <= echoed:
            seq = self.pings.pop(0)
            self.send("pong", {"group": self.spec.group, "seq": seq,
                               "die_step": int(self.words[self.vote_word])})  # fmt: skip

    def stats(self) -> dict:
        """The scheduler's and the group's counters; the step times and the attention time of
        each step since the last stats; `die_step`: every result of a step below it is in."""
        s = self.sched.stats()
        self.counters["dummy_steps"] = self.words[self.dummy_word]
        attn, moe, step = (int(self.words[i]) for i in self.phase_words)
        body = {"group": self.spec.group, "t": time.time(), **s, **self.counters,
                "kv": self.kv.usage(), "attn_ns": attn, "moe_ns": moe, "step_ns": step,
                "die_step": self.die_step, "step_ms_new": self.step_new,
                "kv_masked_blocks": self.masked,
                "attn_new": self.attn_new}  # fmt: skip
        if self.pd is not None:
            body.update(self.pd.stats())
        if self.pool is not None:
            body.update(self.pool.stats())
        self.step_new, self.attn_new = [], []
        return body
