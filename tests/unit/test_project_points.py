"""The published points and the frozen profiles (bench.project.points, bench.project.calibrate)."""

from __future__ import annotations

from importlib import resources

import pytest

from bench.project.calibrate import PLANS, Calibration, Fit, Window, with_values
from bench.project.points import FROZEN, POINTS, PROFILES, PubPoint, judge, points_of
from runtime.project import ProjectError, load_profile
from runtime.project.profile import parse_profile


def test_the_shipped_profiles_are_the_frozen_ones():
    # held-out points were evaluated with exactly these files: changing one must be on purpose
    for name in PROFILES:
        assert load_profile(name).sha256 == FROZEN[name], name


def test_point_ids_are_unique_and_roles_are_known():
    ids = [p.id for p in POINTS]
    assert len(ids) == len(set(ids))
    assert {p.role for p in POINTS} == {"calibration", "held_out"}
    assert {p.kind for p in POINTS} <= {"value", "below", "at_least"}


def test_every_calibrated_constant_names_calibration_points_of_its_profile():
    for name in PROFILES:
        prof = load_profile(name)
        roles = {p.id: p.role for p in points_of(name)}
        assert prof.calibrated, name
        for key, c in prof.calibrated.items():
            for pid in c["points"]:
                assert roles.get(pid) == "calibration", (name, key, pid)


def test_the_plans_fit_exactly_the_calibrated_constants():
    for name, plan in PLANS.items():
        fitted = set()
        for step in plan:
            fitted |= {step.key} if isinstance(step, Window) else {*step.keys, *step.tied}
        assert fitted == set(load_profile(name).calibrated), name


def test_table7_has_the_papers_split():
    t7 = [p for p in POINTS if p.figure == "000 Table 7"]
    held = [p for p in t7 if p.role == "held_out"]
    assert len([p for p in held if p.profile == "cm384"]) == 8  # EP32-256 x 2
    assert len([p for p in held if p.profile == "h800"]) == 10  # EP16-256 x 2
    assert all(p.tolerance == 0.15 for p in held)
    assert all(p.tolerance == 0.05 for p in t7 if p.role == "calibration")


def point(kind: str, published: float = 100.0, tol: float = 0.05) -> PubPoint:
    return PubPoint("x", "cm384", "f", "op", None, None, published, "us", kind, "held_out", tol,
                    "s")  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "projected", "ok"),
    [("value", 105.0, True), ("value", 94.9, False), ("value", 95.0, True),
     ("below", 99.9, True), ("below", 100.0, False), ("at_least", 100.0, True),
     ("at_least", 99.0, False)],
)  # fmt: skip
def test_judge(kind, projected, ok):
    error, got = judge(point(kind), projected)
    assert got is ok and error == pytest.approx(projected / 100.0 - 1.0)


def test_points_of_an_unknown_profile():
    with pytest.raises(ValueError, match="no published points"):
        points_of("nosuch")


def test_with_values_replaces_one_section_only():
    text = (
        '[profile]\nname = "t"\ndescription = "d"\n'
        '[collective]\nt_fixed_us = { value = 1, source = "a" }\n'
        '[p2p]\nt_fixed_us = { value = 2, source = "b" }\n'
    )
    out = with_values(text, {"p2p.t_fixed_us": 7.25, "collective.t_fixed_us": 3})
    prof = parse_profile(out.encode(), "t")
    assert prof.values == {"collective.t_fixed_us": 3.0, "p2p.t_fixed_us": 7.25}
    with pytest.raises(ProjectError, match=r"no \[aiv\] section"):
        with_values(text, {"aiv.t_tok_us": 1})
    with pytest.raises(ProjectError, match="no `t_row_us"):
        with_values(text, {"collective.t_row_us": 1})


def test_calibration_refuses_a_file_whose_points_differ_from_the_plan(tmp_path):
    body = (resources.files("runtime.project") / "profiles" / "h800.toml").read_text("utf-8")
    bad = body.replace('"table7.h800.dispatch.ep8", "table7.h800.combine.ep8"',
                       '"table7.h800.dispatch.ep8"', 1)  # fmt: skip
    cal = Calibration(bad, "bad.toml", caps=None)
    with pytest.raises(ProjectError, match="the plan fits it on"):
        cal.run()


def test_fit_and_window_shapes():
    for plan in PLANS.values():
        for step in plan:
            if isinstance(step, Fit):
                assert len(step.grid) == len(step.keys)
