"""The one wait policy of xpod: spin, then yield, then back off; always a deadline.

Every poll loop of every package waits through `wait_ge` (or `WaitPolicy.wait`). Why three phases,
with numbers measured on the 2-core machines xpod runs on (docs/architecture.md §4):

- spin: a Python poll of a memoryview word costs ~0.1 us, so a partner on another core is seen
  within a fraction of a microsecond. Only worth it when every die has a core to itself
  (`num_dies <= cores`); otherwise the spinner burns the slice its partner needs (a pure-spin token
  ring of 8 processes on 2 cores takes ~6.6 ms per hop).
- yield: `os.sched_yield()` (~0.5 us, releases the GIL too) hands the core to whoever is runnable.
  With more dies than cores we yield on every poll: 4.5 us per hop at 8 processes, 13 at 16.
- back off: after `backoff_after_s` of fruitless waiting, sleep `sleep_s` per poll, so idle dies
  of a large pod stop competing with the ones doing work. A sleep wake-up costs tens of us, which
  is noise once a wait has already lasted milliseconds.

The deadline and the pod's abort word are checked every `check_every` polls, never per poll.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from memory.errors import ConfigError, PeerTimeout, PodAborted

_yield = os.sched_yield
_now = time.monotonic_ns


@dataclass(frozen=True)
class WaitPolicy:
    """Knobs of the wait loop.

    Attributes:
        spin_polls: polls before the first yield (0 = yield from the start).
        yield_every: polls between yields once spinning is over (1 = every poll).
        backoff_after_s: seconds of waiting before sleeping between polls.
        sleep_s: sleep per poll in the back-off phase.
        timeout_s: deadline of one wait; PeerTimeout after it.
        check_every: polls between deadline / abort checks.
    """

    spin_polls: int = 0
    yield_every: int = 1
    backoff_after_s: float = 0.02
    sleep_s: float = 0.0002
    timeout_s: float = 60.0
    check_every: int = 64

    def __post_init__(self) -> None:
        for name in ("spin_polls", "yield_every", "check_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "spin_polls" else 1):
                raise ConfigError(f"wait policy {name}: {v!r} must be an int >= 1")
        for name in ("backoff_after_s", "sleep_s", "timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"wait policy {name}: must be >= 0")

    @classmethod
    def for_pod(cls, num_dies: int, cores: int, timeout_s: float = 60.0) -> WaitPolicy:
        """The adaptive default: spin with a rare yield when every die has a core, else yield on
        every poll (a wait policy must adapt to num_dies / cores)."""
        if num_dies <= cores:
            return cls(spin_polls=20000, yield_every=64, timeout_s=timeout_s)
        return cls(spin_polls=0, yield_every=1, timeout_s=timeout_s)

    def with_timeout(self, timeout_s: float) -> WaitPolicy:
        return replace(self, timeout_s=timeout_s)

    @property
    def name(self) -> str:
        return "spin" if self.spin_polls else "yield"


class WaitContext:
    """What a wait is for, turned into a message only when the deadline passes.

    die_id waits for `field` of `peer` to reach `expected`; `abort` is an optional
    (words, index, value) triple: the wait raises PodAborted once words[index] != value.
    """

    __slots__ = ("die_id", "abort", "waited_ns", "waits", "progress")

    def __init__(self, die_id: int, abort: tuple | None = None):
        self.die_id = die_id
        self.abort = abort
        # A multi-host die's fabric progress (`comm.fabric`): called on every poll of a slow
        # wait, since a peer's remote store lands in this die's region only while it runs.
        self.progress = None
        self.waited_ns = 0  # wall time spent in slow-path waits (the "waiting" share of a die)
        self.waits = 0  # slow-path waits


def wait_ge(
    words: memoryview,
    idx: int,
    target: int,
    policy: WaitPolicy,
    ctx: WaitContext,
    peer: int,
    field: str,
    probe=None,
    progress_every: int = 1,
) -> int:
    """Wait until `words[idx] >= target`; return the value seen.

    Arguments:
        words: int64 memoryview (a region's `words`).
        idx: word index to poll.
        target: value to reach (polled words only grow).
        policy: the wait policy.
        ctx: die id and abort word of the waiting die.
        peer, field: named in the timeout error ("die 1 waited for die 0 ack.done ...").
        probe: optional callable run with the deadline checks (every `check_every` polls of the
            slow phase); it may raise to end the wait (e.g. a protocol mismatch seen elsewhere).
        progress_every: with a fabric progress (`ctx.progress`), call it every this many polls:
            1 for a word a die of another host writes (it lands only through progress: no spin
            phase then), more for a same-host peer (others' stores still land meanwhile).
    Raises:
        PeerTimeout after policy.timeout_s; PodAborted if the launcher aborted the pod.
    """
    v = words[idx]
    if v >= target:
        return v
    if ctx.progress is not None and progress_every == 1:  # nothing arrives while spinning
        return _wait_slow(words, idx, target, policy, ctx, peer, field, probe, 1)
    for _ in range(policy.spin_polls):
        v = words[idx]
        if v >= target:
            return v
    return _wait_slow(words, idx, target, policy, ctx, peer, field, probe, progress_every)


def _wait_slow(words, idx, target, policy, ctx, peer, field, probe=None, every=1) -> int:
    start = _now()
    deadline = start + int(policy.timeout_s * 1e9)
    backoff_at = start + int(policy.backoff_after_s * 1e9)
    yield_every = policy.yield_every
    check_every = policy.check_every
    sleeping = False
    polls = 0
    progress = ctx.progress
    while True:
        if progress is not None and (polls + 1) % every == 0:  # a remote word: every poll
            progress()
        v = words[idx]
        if v >= target:
            ctx.waited_ns += _now() - start
            ctx.waits += 1
            return v
        polls += 1
        if sleeping:
            time.sleep(policy.sleep_s)
        elif polls % yield_every == 0:
            _yield()
        if polls % check_every == 0:
            now = _now()
            if now > deadline:
                raise PeerTimeout(
                    f"die {ctx.die_id}: timed out after {policy.timeout_s:g} s waiting for die"
                    f" {peer} {field} >= {target} (seen {v})"
                )
            if not sleeping and now > backoff_at:
                sleeping = True
            if probe is not None:
                probe()
            ab = ctx.abort
            if ab is not None and ab[0][ab[1]] != ab[2]:
                raise PodAborted(
                    f"die {ctx.die_id}: aborted by the launcher while waiting for die {peer}"
                    f" {field} >= {target} (seen {v})"
                )


class Doze:
    """The sleeps of a parked loop (one that sleeps on a doorbell between looks at its own
    words: the serving loop's park, a split pod's expert die waiting for attention dies).

    On one host a peer's store is in the parked die's region when the peer rings, so every
    sleep is `poll_s` (which only bounds how late the launcher's abort is seen). A die with
    peers on another host (`progress`: the fabric's, `WaitContext.progress`) sees their stores
    only once its own `progress()` has applied them (MULTIHOST §0 "target progress"): `look`
    then drives the fabric before every look at the words, and since a peer rings after its
    store left but not after it landed, the sleeps after the park starts or the bell rings
    begin at `first_s` and double up to `poll_s` (a store in flight is applied within about
    twice its delay, and an idle die soon sleeps `poll_s` again: idle CPU stays ~0).

    Use: `doze = Doze(ctx.progress, poll_s)`; loop: drain the bell, `doze.look()`, check the
    words, `doze.sleep(bell.wait)`.
    """

    __slots__ = ("progress", "poll_s", "first_s", "next_s")

    def __init__(self, progress, poll_s: float, first_s: float = 0.0002):
        self.progress = progress
        self.poll_s = poll_s
        self.first_s = min(first_s, poll_s)
        self.next_s = self.first_s if progress is not None else poll_s

    def look(self) -> None:
        """Before a look at the words: let the fabric land the remote peers' stores."""
        if self.progress is not None:
            self.progress()

    def sleep(self, wait) -> bool:
        """`wait(timeout_s)` (a doorbell's: True if it rang) for the next sleep; its result."""
        rang = wait(self.next_s)
        if self.progress is not None:
            self.next_s = self.first_s if rang else min(2 * self.next_s, self.poll_s)
        return rang
