"""The shell's ledger (`RequestTracker`): token deltas carry their start index, a replayed token
is trimmed, a gap is counted, messages of a dead incarnation are dropped, a restart re-admits
every live request as prompt + delivered tokens, and every accepted request ends exactly once.
A hypothesis state machine drives random adds, deltas (with overlaps), restarts, stale
messages, aborts and finishes against a model of the true streams."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.engine.tracker import RequestTracker
from runtime.model import ModelConfig
from sched import LoadBalancer, SamplingParams

MAX_TOKENS = 12


def stream(rid: int) -> list[int]:
    """The one true token stream of request `rid` (what any incarnation would produce)."""
    return [10 + (rid * 31 + i * 7) % 200 for i in range(MAX_TOKENS)]


class Ends:
    def __init__(self) -> None:
        self.ended: dict[int, int] = {}

    def on_tokens(self, t, n, now) -> None:
        pass

    def on_finish(self, t) -> None:
        self.ended[t.id] = self.ended.get(t.id, 0) + 1

    def on_stats(self, body) -> None:
        pass


class Ledger(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, str, dict]] = []
        lb = LoadBalancer(2, 64, 64, 16, "least_kv")
        self.tr = RequestTracker(ModelConfig.preset("tiny"), 2, lb,
                                 lambda g, k, b: self.sent.append((g, k, b)))  # fmt: skip
        self.ends = Ends()
        self.tr.observer = self.ends
        self.ids: list[int] = []
        self.overlaps = 0

    def _live(self) -> list:
        return [t for t in self.tr.reqs.values() if t.group >= 0]

    @rule(seed=st.one_of(st.none(), st.integers(0, 1000)))
    def add(self, seed) -> None:
        t = self.tr.track([1, 2, 3], SamplingParams(max_tokens=MAX_TOKENS, seed=seed))
        assert t.params.seed is not None  # drawn once, recorded
        self.tr.enqueue([t])
        self.ids.append(t.id)

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def delta(self, data) -> None:
        t = data.draw(st.sampled_from(sorted(self._live(), key=lambda r: r.id)))
        have = len(t.out)
        back = data.draw(st.integers(0, have))  # a replay of tokens it has (after a restart)
        n = data.draw(st.integers(0, MAX_TOKENS - have + back))
        start = have - back
        toks = stream(t.id)[start : start + n]
        self.overlaps += min(back, n)
        self.tr.on_out({"gen": self.tr.gen, "deltas": [[t.id, start, toks]], "done": []})

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def stale(self, data) -> None:
        t = data.draw(st.sampled_from(sorted(self._live(), key=lambda r: r.id)))
        before = list(t.out)
        self.tr.on_out({"gen": self.tr.gen - 1, "deltas": [[t.id, len(t.out), [999]]],
                        "done": [[t.id, "stop", 3, 0, "", 0.0]]})  # fmt: skip
        assert t.out == before and not t.done.is_set()

    @rule()
    def restart(self) -> None:
        self.tr.hold = True
        back = self.tr.readmit(self.tr.gen + 1)
        for t in back:
            assert t.group == -1 and len(t.out) < MAX_TOKENS
        self.sent.clear()
        self.tr.hold = False
        self.tr.dispatch_pending()
        for _g, kind, body in self.sent:  # resumed: prompt + delivered, output index base
            t = self.tr.reqs[body["id"]]
            assert kind == "add" and body["base"] == len(t.out)
            assert body["prompt"] == [1, 2, 3] + t.out
            assert body["params"]["max_tokens"] == MAX_TOKENS - len(t.out)
            assert body["params"]["seed"] == t.params.seed

    @precondition(lambda self: self.tr.reqs)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tr.reqs)))
        self.tr.abort(rid)

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def finish(self, data) -> None:
        t = data.draw(st.sampled_from(sorted(self._live(), key=lambda r: r.id)))
        self.tr.on_out({"gen": self.tr.gen, "deltas": [], "done": [[t.id, "stop", 3, 0, "",
                                                                    0.0]]})  # fmt: skip

    @invariant()
    def streams_are_prefixes_and_end_once(self) -> None:
        for t in self.tr.reqs.values():
            assert t.out == stream(t.id)[: len(t.out)]
        assert all(v == 1 for v in self.ends.ended.values()), self.ends.ended
        led = self.tr.ledger
        assert led["token_gaps"] == 0 and led["tokens_replayed"] == self.overlaps
        assert led["accepted"] == len(self.ids) == led["ended"] + len(self.tr.reqs)

    def teardown(self) -> None:
        self.tr.fail(RuntimeError("closed"))
        assert sorted(self.ends.ended) == sorted(self.ids)
        assert all(v == 1 for v in self.ends.ended.values())
        assert self.tr.ledger["accepted"] == self.tr.ledger["ended"]


Ledger.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_ledger = Ledger.TestCase


def test_a_gap_is_counted_and_a_readmit_ends_what_delivered_already_ends():
    sent = []
    tr = RequestTracker(ModelConfig.preset("tiny"), 1, LoadBalancer(1, 8, 64, 16, "least_kv"),
                        lambda g, k, b: sent.append(b))  # fmt: skip
    a = tr.track([1], SamplingParams(max_tokens=3, seed=1))
    b = tr.track([1], SamplingParams(max_tokens=5, stop_token_ids=(77,), seed=2))
    c = tr.track([1], SamplingParams(max_tokens=5, seed=3))
    tr.enqueue([a, b, c])
    tr.on_out({"gen": 0, "deltas": [[a.id, 0, [5, 6, 7]], [b.id, 0, [8, 77]], [c.id, 2, [9]]],
               "done": []})  # fmt: skip
    assert tr.ledger["token_gaps"] == 1  # c's tokens started at 2 with 0 delivered
    back = tr.readmit(1)
    assert back == [c]  # a has max_tokens, b ended on its stop token: both end, once
    assert a.reason == "length" and b.reason == "stop" and a.done.is_set() and b.done.is_set()
