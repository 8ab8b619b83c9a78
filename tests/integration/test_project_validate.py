"""`xpod project --validate` / `--calibrate` (bench.project.cli): the published points projected
from real capture pods, judged and written; a calibration on the frozen profile's own points
gives the frozen values back; bad flags refused before anything runs."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from bench.project.points import FROZEN, TABLE7
from runtime.cli.main import main
from runtime.project import load_profile

FIELDS = {"figure", "op", "ep", "batch", "published_us", "projected_us", "error", "role", "ok"}


def scratch_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("xpod-validate-*")}


@pytest.mark.timeout(300)
def test_validate_projects_and_judges_the_points_from_real_captures(tmp_path, capsys):
    out, caps = tmp_path / "v.json", tmp_path / "caps"
    argv = ["project", "--validate", "--profile", "cm384", "--points",
            "table7.cm384.*.ep8,table1.*", "--captures", str(caps), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["profile"] == "cm384" and doc["frozen"] is True
    assert doc["profile_sha256"] == FROZEN["cm384"] == load_profile("cm384").sha256
    assert set(doc["calibrated_keys"]) == set(load_profile("cm384").calibrated)
    for k in doc["calibrated_keys"].values():
        assert k["points"] and isinstance(k["value"], float)
    rows = {r["id"]: r for r in doc["points"]}
    assert set(rows) == {"table7.cm384.dispatch.ep8", "table7.cm384.combine.ep8",
                         "table1.write_512b"}  # fmt: skip
    for r in rows.values():
        assert set(r) >= FIELDS and r["role"] == "calibration"
        assert r["error"] == pytest.approx(r["projected"] / r["published"] - 1, abs=1e-3)
        assert r["ok"] is (abs(r["error"]) <= 0.05)
    disp = rows["table7.cm384.dispatch.ep8"]
    assert disp["published_us"] == TABLE7["cm384"][8][0] and disp["capture"] == "real"
    assert disp["ep"] == 8 and disp["batch"] == 128
    # the EP8 capture is a real 8-die capture pod, kept and reusable
    meta = json.loads((caps / "fused-int8-ep8-b128-real" / "meta.json").read_text())
    assert meta["num_dies"] == 8 and meta["synthesized"] is False
    assert doc["captures"]["fused-int8-ep8-b128-real"]["reused"] is False
    lines = [x for x in printed.splitlines() if x.startswith("000 Table")]
    assert len(lines) == 3 and all(x.endswith("projected (cm384)") for x in lines)
    # a second run reuses the captures and gives the same figures
    assert main(argv) == 0
    again = json.loads(out.read_text())
    assert again["points"] == doc["points"]
    assert again["captures"]["fused-int8-ep8-b128-real"]["reused"] is True


@pytest.mark.timeout(300)
def test_calibrating_the_frozen_h800_gives_its_values_back(tmp_path, capsys):
    # the fit depends only on the plan, the points and the profile's other constants: run
    # again, it finds the frozen values (a fit that drifted would change the frozen file)
    out = tmp_path / "h800.toml"
    before = scratch_dirs()
    assert main(["project", "--calibrate", "--profile", "h800", "--write", str(out),
                 "--json", str(tmp_path / "c.json")]) == 0  # fmt: skip
    assert scratch_dirs() == before  # the temporary captures are removed
    fitted = load_profile(str(out))
    frozen = load_profile("h800")
    assert fitted.values == frozen.values
    doc = json.loads((tmp_path / "c.json").read_text())
    (step,) = doc["steps"]
    assert all(abs(e) <= 0.05 for e in step["errors"].values())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--validate", "--profile", "cm384", "somedir"], "takes no CAPTURE_DIR"),
        (["--validate", "--profile", "cm384", "--write", "x.toml"], "--write goes with"),
        (["somedir", "--profile", "cm384", "--captures", "d"], "--captures goes with"),
        (["--calibrate", "--profile", "cm384", "--points", "x"], "--points goes with"),
        (["--validate", "--profile", "cm384", "--trace", "t.json"], "--trace goes with"),
    ],
)  # fmt: skip
def test_bad_flag_combinations_are_refused(argv, message, capsys):
    assert main(["project", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--validate", "--profile", "host"], "no published points"),
        (["--validate", "--profile", "nosuch"], "no such profile"),
        (["--validate", "--profile", "cm384", "--points", "table99.*"], "matches none of"),
    ],
)  # fmt: skip
def test_profiles_and_points_that_cannot_be_validated(argv, message, capsys):
    before = scratch_dirs()
    assert main(["project", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1
    assert scratch_dirs() == before
