"""`xpod project --calibrate`: fit a profile's calibrated constants on its calibration points.

The plan of each shipped profile (`PLANS`) names the few constants it fits and the points it
fits them on (docs/projection.md §4.2); nothing else of the profile moves, and no held-out
point is ever read. Two kinds of step, in order:

- `Window`: a constant that 001 §3.1's two inequalities bracket (a per-core MTE rate: 1 MB on
  2 lanes below 20 us needs it high enough, 9 MB on 48 lanes at least 2.5x faster than on 2
  needs it low enough). Each side is found by bisection (the projected send time and the
  ratio both fall as the rate grows), and the constant is set to the window's middle.
- `Fit`: constants fitted by least squares of the points' relative errors
  (`scipy.optimize.least_squares`, trust-region reflective, each constant >= 0) from every
  start of a stated grid, the best fit kept. The projection is piecewise linear in the
  constants and flat where another path is critical (a per-token cost hidden behind the port
  has no gradient), so one start can stall on a flat piece; Nelder-Mead on the largest
  |error| stalled likewise at a kink (17 % where a 5 % fit exists). The values are rounded to
  3 decimals and the points evaluated again with the rounded values.

The fitted values are written into the profile's TOML text, each on its own line (the file
stays readable and diffable); the profile's `points` lists must name exactly the plan's points,
or calibration refuses (the file would lie about where a value comes from).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bench.project.points import POINTS, PubPoint, judge
from bench.project.validate import Captures, Projector, project_point
from runtime.project import Profile, ProjectError
from runtime.project.profile import parse_profile

ROUND = 3  # decimals of a fitted value
BISECT_LO, BISECT_HI, BISECT_TOL = 1.0, 1000.0, 0.01


@dataclass(frozen=True, slots=True)
class Window:
    """`key` inside the window a `below` point (key >= lo) and an `at_least` point (key <= hi)
    leave, both falling as key grows: set to the window's middle."""

    key: str
    below: str
    at_least: str


@dataclass(frozen=True, slots=True)
class Fit:
    """`keys` minimising the squared relative errors of `points`, from every start of `grid`
    (one tuple of values per key); `tied`: keys set to the value of another key (one physical
    constant the profile states twice)."""

    keys: tuple[str, ...]
    grid: tuple[tuple[float, ...], ...]
    points: tuple[str, ...]
    tied: dict[str, str] = field(default_factory=dict)


_T7 = "table7.{}.{}.ep{}"
PLANS: dict[str, tuple[Window | Fit, ...]] = {
    "cm384": (
        Window("aiv.b_core_gbps", "001.s3.1.p2p_1mb_2lanes", "001.s3.1.p2p_9mb_48v2"),
        Fit(("collective.t_fixed_us", "aiv.t_tok_us", "aiv.t_row_us"),
            ((10.0, 30.0, 50.0), (0.5, 2.0, 5.0), (0.0, 0.5)),
            tuple(_T7.format("cm384", op, ep) for ep in (8, 16)
                  for op in ("dispatch", "combine"))),
    ),
    "h800": (
        Fit(("collective.t_fixed_us", "link.write_latency_us"), ((5.0, 20.0, 50.0), (1.0, 5.0)),
            tuple(_T7.format("h800", op, 8) for op in ("dispatch", "combine")),
            tied={"link.write_latency_intra_us": "link.write_latency_us"}),
    ),
}  # fmt: skip


def with_values(text: str, values: dict[str, float]) -> str:
    """`text` (a profile's TOML) with the `value` of each "section.key" replaced, in place."""
    for name, v in values.items():
        section, key = name.split(".")
        head = re.search(rf"^\[{re.escape(section)}\]\s*$", text, flags=re.M)
        if head is None:
            raise ProjectError(f"calibrate: the profile has no [{section}] section for {name}")
        end = re.search(r"^\[", text[head.end() :], flags=re.M)
        stop = head.end() + (end.start() if end else len(text) - head.end())
        body = text[head.end() : stop]
        pat = rf"^({re.escape(key)} = \{{ value = )[^,}}]+"
        num = _num(v)
        new, n = re.subn(pat, lambda m, num=num: m.group(1) + num, body, count=1, flags=re.M)
        if n != 1:
            raise ProjectError(f"calibrate: no `{key} = {{ value = ... }}` line in [{section}]")
        text = text[: head.end()] + new + text[stop:]
    return text


def _num(v: float) -> str:
    v = float(v)  # every digit: the fit's trial values must reach the replay unrounded
    return str(int(v)) if v == int(v) else repr(v)


class Calibration:
    """Fits `PLANS[profile.name]` starting from the profile's text (module docstring)."""

    def __init__(self, text: str, where: str, caps: Captures,
                 log: Callable[[str], None] = print) -> None:  # fmt: skip
        self.text, self.where, self.caps, self.log = text, where, caps, log
        self.base = parse_profile(text.encode(), where)
        if self.base.name not in PLANS:
            raise ProjectError(f"calibrate: no plan for profile {self.base.name!r}: one of"
                               f" {', '.join(PLANS)}")  # fmt: skip
        self.points = {p.id: p for p in POINTS if p.profile == self.base.name}
        self.fitted: dict[str, float] = {}
        self.evals = 0

    def profile(self, values: dict[str, float]) -> Profile:
        """The base profile with `values` (and everything fitted so far) in place."""
        return parse_profile(with_values(self.text, {**self.fitted, **values}).encode(),
                             self.where)  # fmt: skip

    def figure(self, point: PubPoint, values: dict[str, float]) -> float:
        """`point`'s projected figure with `values` on top of the fitted ones."""
        return self.figures([point], values)[0]

    def figures(self, points: list[PubPoint], values: dict[str, float]) -> list[float]:
        """The points' projected figures with `values` (each capture replayed once)."""
        self.evals += 1
        proj = Projector(self.profile(values))
        return [project_point(p, self.caps, proj)[0] for p in points]

    def run(self) -> tuple[str, dict]:
        """(the fitted profile's text, a report of each step)."""
        self._check_points()
        steps = []
        for step in PLANS[self.base.name]:
            steps.append(self._window(step) if isinstance(step, Window) else self._fit(step))
        return with_values(self.text, self.fitted), {"steps": steps, "evaluations": self.evals}

    def _check_points(self) -> None:
        for step in PLANS[self.base.name]:
            if isinstance(step, Window):
                want = {step.key: [step.below, step.at_least]}
            else:
                want = {k: list(step.points) for k in (*step.keys, *step.tied)}
            for key, pts in want.items():
                have = self.base.calibrated.get(key, {}).get("points")
                if have != pts:
                    raise ProjectError(
                        f"{self.where}: {key}: calibrated on {have} in the file, the plan fits it"
                        f" on {pts}: make the file say `calibrated = true, points = {pts}`"
                    )

    def _window(self, w: Window) -> dict:
        below, at_least = self.points[w.below], self.points[w.at_least]
        self.log(f"calibrate {w.key}: the window of {w.below} and {w.at_least} ...")

        def edge(point: PubPoint) -> float:
            """below: the smallest value where the point holds (it holds above); at_least:
            the largest (it holds below)."""
            rising = point.kind == "below"  # holds from some value on

            def ok(x: float) -> bool:
                return judge(point, self.figure(point, {w.key: x}))[1]

            good, bad = (BISECT_HI, BISECT_LO) if rising else (BISECT_LO, BISECT_HI)
            if not ok(good):
                raise ProjectError(f"calibrate {w.key}: {point.id} holds nowhere in"
                                   f" [{BISECT_LO:g}, {BISECT_HI:g}]")  # fmt: skip
            if ok(bad):
                return bad
            while abs(good - bad) > BISECT_TOL:
                mid = (good + bad) / 2
                good, bad = (mid, bad) if ok(mid) else (good, mid)
            return good

        lo, hi = edge(below), edge(at_least)
        if lo > hi:
            raise ProjectError(f"calibrate {w.key}: {w.below} needs >= {lo:.2f} and"
                               f" {w.at_least} <= {hi:.2f}: no value satisfies both")  # fmt: skip
        self.fitted[w.key] = round((lo + hi) / 2, ROUND)
        return {"key": w.key, "window": [round(lo, 3), round(hi, 3)],
                "value": self.fitted[w.key], "points": [w.below, w.at_least]}  # fmt: skip

    def _fit(self, f: Fit) -> dict:
        from scipy.optimize import least_squares  # bounded least squares, a well-kept solver

        pts = [self.points[i] for i in f.points]
        self.log(f"calibrate {', '.join(f.keys)} on {', '.join(f.points)} (least squares) ...")

        def values(x) -> dict[str, float]:
            v = {k: max(0.0, float(x[i])) for i, k in enumerate(f.keys)}
            v.update({t: v[src] for t, src in f.tied.items()})
            return v

        def errors(x) -> np.ndarray:
            got = self.figures(pts, values(x))
            return np.array([judge(p, g)[0] for p, g in zip(pts, got, strict=True)])

        best = None
        for start in itertools.product(*f.grid):
            res = least_squares(errors, np.array(start), bounds=(0.0, np.inf), method="trf",
                                diff_step=1e-3, xtol=1e-6, ftol=1e-8, max_nfev=200)  # fmt: skip
            if best is None or res.cost < best[0].cost:
                best = (res, start)
        res, start = best
        fitted = {k: round(v, ROUND) for k, v in values(res.x).items()}
        self.fitted.update(fitted)
        got = self.figures(pts, {})
        errs = {p.id: round(judge(p, g)[0], 4) for p, g in zip(pts, got, strict=True)}
        return {"keys": fitted, "start": dict(zip(f.keys, start, strict=True)),
                "points": list(f.points), "errors": errs, "evaluations": int(res.nfev),
                "starts": len(list(itertools.product(*f.grid)))}  # fmt: skip


__all__ = ["PLANS", "Calibration", "Fit", "Window", "with_values"]
