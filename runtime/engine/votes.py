"""The serving loop's lockstep vote, read at home (docs/protocols.md §11, rule R1).

Die p votes for step s by storing its rows (and the EXIT flag) in word `3p + 1 + s % 2` of the
vote block of EVERY voter's region, then s in word `3p` LAST: a publish over the fabric for a
voter on another host, two plain stores on this host (TSO orders them). Each die then reads
every vote in its own region, so no die polls another's memory. Its own `vote_step` /
`vote_rows` words stay too: the master and the recovery read a die's progress there.
"""

from __future__ import annotations

from collections.abc import Sequence

from memory import layout as L


class Votes:
    """The vote words of one die's serving loop over `voters` (global die ids)."""

    __slots__ = ("die", "voters", "base", "own", "home")

    def __init__(self, die, voters: Sequence[int]):
        lo = die.layout
        self.die = die
        self.voters = list(voters)
        if max(self.voters) >= L.MAX_VOTERS:
            raise ValueError(f"serving vote: die ids up to {L.MAX_VOTERS - 1}")
        self.base = lo.serve_word(L.SV_VOTES)
        self.own = (lo.serve_word(L.SV_VOTE_STEP), lo.serve_word(L.SV_VOTE_ROWS))
        self.home = die.words[die.die_id]

    def cast(self, s: int, value: int) -> None:
        """This die's vote for step s (rows | flags) into every voter's region, s LAST."""
        die, me = self.die, self.die.die_id
        step_w = self.base + L.VOTE_WORDS * me
        rows_w = step_w + 1 + (s & 1)
        fab = die.fab
        home = self.home
        home[self.own[1] + (s & 1)] = value
        home[self.own[0]] = s  # LAST (the master's view of this die)
        for p in self.voters:
            w = die.words[p]
            w[rows_w] = value
            if fab.remote[p]:
                fab.push_words(p, rows_w)
                fab.publish(p, step_w, s)
            else:
                w[step_w] = s  # LAST

    def step_word(self, p: int) -> int:
        """The word of this die's region holding the last step die p voted for."""
        return self.base + L.VOTE_WORDS * p

    def rows(self, p: int, s: int) -> int:
        """Die p's vote for step s (read once its step word reached s)."""
        return self.home[self.base + L.VOTE_WORDS * p + 1 + (s & 1)]

    def beyond(self, s: int) -> bool:
        """Whether any voter voted for a step after s."""
        home, base = self.home, self.base
        return any(home[base + L.VOTE_WORDS * p] > s for p in self.voters)
