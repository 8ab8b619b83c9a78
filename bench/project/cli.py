"""`xpod project`: re-project a saved capture, or check a profile against every published point.

    xpod project CAPTURE_DIR --profile P [--json F] [--trace F]     (runtime.cli.project)
    xpod project --validate --profile cm384|h800 [--json F] [--captures DIR] [--real-upto N]
    xpod project --calibrate --profile cm384|h800 [--write F] [--captures DIR]

`--validate` projects each published point of the profile (bench.project.points) from the
captures it needs, made or reused (`--captures DIR` keeps them for the next run), and prints one
row per point: figure, op, ep, batch, published, projected, signed relative error, role
(calibration / held_out), the kind of capture, ok. `--calibrate` fits the profile's calibrated
constants on its calibration points only (bench.project.calibrate) and prints them; `--write F`
writes the fitted profile (F may be the shipped file). It lives in bench/ because it launches
capture pods; re-projecting a capture needs nothing of the pod (runtime.cli.project).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.cli import project as plain
from runtime.cli.argtypes import error_line, int_range, output_file


@dataclass(frozen=True, slots=True)
class Options:
    plain: plain.ProjectOptions | None  # re-project CAPTURE_DIR
    mode: str  # "project" | "validate" | "calibrate"
    profile: str
    json: str | None
    captures: str | None
    real_upto: int
    recapture: bool
    write: str | None
    prog: str
    points: list[str] | None = None
    decode: bool = False


def add_args(p: argparse.ArgumentParser) -> None:
    """`xpod project`'s flags: runtime.cli.project's, and the validation's."""
    plain.add_args(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--validate", action="store_true",
                      help="project every published point of the profile and judge it")  # fmt: skip
    mode.add_argument("--calibrate", action="store_true",
                      help="fit the calibrated constants on the calibration points")  # fmt: skip
    p.add_argument("--captures", default=None, metavar="DIR",
                   help="--validate/--calibrate: keep (and reuse) the captures here"
                        " (default: a temporary directory, removed)")  # fmt: skip
    p.add_argument("--real-upto", type=int_range(2, 256), default=16, metavar="N",
                   help="--validate/--calibrate: capture EP pods of up to N dies for real,"
                        " synthesize larger ones (default 16; 128 fits this machine)")  # fmt: skip
    p.add_argument("--recapture", action="store_true",
                   help="--validate/--calibrate: make every capture again, reuse none")  # fmt: skip
    p.add_argument("--points", default=None, metavar="GLOBS",
                   help="--validate: only the points whose id matches one of these globs"
                        " (e.g. 'table7.*.ep8,table1.*'; ids: docs/projection.md §4)")  # fmt: skip
    p.add_argument("--write", type=output_file, default=None, metavar="F",
                   help="--calibrate: write the fitted profile to F")  # fmt: skip
    p.add_argument("--decode", action="store_true",
                   help="--validate: add the published decode points (per-layer latency, TPOT,"
                        " micro-batch gains, iteration shares), projected at the papers' scale"
                        " by synthesis (docs/projection.md §6.3)")  # fmt: skip


def parse_options(args: argparse.Namespace) -> Options:
    """The checked flags; nothing runs here."""
    mode = "validate" if args.validate else "calibrate" if args.calibrate else "project"
    if mode == "project":
        given = {"--captures": args.captures, "--recapture": args.recapture,
                 "--write": args.write, "--real-upto": args.real_upto != 16,
                 "--points": args.points, "--decode": args.decode}  # fmt: skip
        for flag, v in given.items():
            if v:
                raise ValueError(f"{flag} goes with --validate or --calibrate")
        return Options(plain.parse_options(args), mode, args.profile, args.json, None, 16, False,
                       None, args.cmd_prog)  # fmt: skip
    if args.capture is not None:
        raise ValueError(f"--{mode} takes no CAPTURE_DIR (it makes its own captures)")
    if args.trace:
        raise ValueError(f"--trace goes with a CAPTURE_DIR, not --{mode}")
    if args.write and mode != "calibrate":
        raise ValueError("--write goes with --calibrate")
    if args.decode and mode != "validate":
        raise ValueError("--decode goes with --validate")
    globs = None
    if args.points is not None:
        if mode != "validate":
            raise ValueError("--points goes with --validate (calibration reads its plan's points)")
        globs = [g.strip() for g in args.points.split(",") if g.strip()]
        if not globs:
            raise ValueError("--points: give a comma list of point id globs")
    return Options(None, mode, args.profile, args.json, args.captures, args.real_upto,
                   args.recapture, args.write, args.cmd_prog, globs, args.decode)  # fmt: skip


def run(opts: Options) -> int:
    """Re-project, validate or calibrate; a refusal is one line on stderr and status 2."""
    if opts.mode == "project":
        return plain.run(opts.plain)
    from bench.project.calibrate import Calibration
    from bench.project.points import PROFILES, points_of
    from bench.project.validate import Captures, print_report, scratch_root, summary, validate
    from runtime.project import ProjectError, load_profile

    try:
        profile = load_profile(opts.profile)
        if profile.name not in PROFILES or profile.is_host:
            raise ProjectError(
                f"profile {profile.name!r} ({profile.path}): no published points to {opts.mode}"
                f" on; points exist for {', '.join(PROFILES)}"
            )
    except ProjectError as e:
        sys.stderr.write(error_line(opts.prog, e))
        return 2
    root, scratch = scratch_root(opts.captures)
    caps = Captures(root, opts.real_upto, opts.recapture)
    try:
        if opts.mode == "validate":
            comm, dec = points_of(profile.name), []
            if opts.decode:
                from bench.project.validate_decode import decode_points, decode_rows

                comm, dec = _select_both(comm, decode_points(profile.name), opts.points)
            else:
                comm = select(comm, opts.points)
            doc = validate(profile, caps, comm)
            if opts.decode:
                doc["points"] += decode_rows(profile, root / "decode-templates", dec)
                doc["summary"] = summary(doc["points"])
            print_report(doc)
        else:
            text = Path(profile.path).read_text(encoding="utf-8") if Path(
                profile.path).is_file() else _shipped_text(profile.name)  # fmt: skip
            cal = Calibration(text, profile.path, caps, log=_err)
            fitted, doc = cal.run()
            doc.update(profile=profile.name, profile_sha256_before=profile.sha256)
            _print_fit(doc)
            if opts.write:
                _atomic(opts.write, fitted)
                from runtime.project import load_profile as reload

                doc["profile_sha256"] = reload(opts.write).sha256
                print(f"wrote {opts.write} (sha256 {doc['profile_sha256']})")
    except ProjectError as e:
        sys.stderr.write(error_line(opts.prog, e))
        return 2
    finally:
        if scratch:
            shutil.rmtree(root, ignore_errors=True)
    if opts.json:
        _atomic(opts.json, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


def _select_both(comm: list, dec: list, globs: list[str] | None) -> tuple[list, list]:
    """`select` over the communication and the decode points together: one must match."""
    if globs is None:
        return comm, dec
    from fnmatch import fnmatchcase

    def pick(pts: list) -> list:
        return [p for p in pts if any(fnmatchcase(p.id, g) for g in globs)]

    both = (pick(comm), pick(dec))
    if not any(both):
        select(comm + dec, globs)  # the refusal, naming the ids
    return both


def select(points: list, globs: list[str] | None) -> list:
    """The points whose id matches a glob (all without globs); ProjectError if none does."""
    from fnmatch import fnmatchcase

    from runtime.project import ProjectError

    if globs is None:
        return points
    out = [p for p in points if any(fnmatchcase(p.id, g) for g in globs)]
    if not out:
        ids = ", ".join(p.id for p in points)
        raise ProjectError(f"--points {','.join(globs)}: matches none of {ids}")
    return out


def _shipped_text(name: str) -> str:
    from importlib import resources

    return (resources.files("runtime.project") / "profiles" / f"{name}.toml").read_text("utf-8")


def _print_fit(doc: dict) -> None:
    for step in doc["steps"]:
        if "window" in step:
            lo, hi = step["window"]
            print(f"{step['key']} = {step['value']:g}  (the middle of [{lo:g}, {hi:g}], the"
                  f" window of {', '.join(step['points'])})")  # fmt: skip
        else:
            keys = ", ".join(f"{k} = {v:g}" for k, v in step["keys"].items())
            errs = ", ".join(f"{p} {e:+.1%}" for p, e in step["errors"].items())
            print(f"{keys}  (least squares from {step['starts']} starts; errors {errs})")
    print(f"{doc['evaluations']} projections")


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _atomic(path: str, text: str) -> None:
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)


__all__ = ["Options", "add_args", "parse_options", "run"]
