"""`--project PROFILE` on `xpod bench p2p`, `bench ring` and `bench alltoall`
(bench/project/attach.py): every xpod row gets its projected fields, labelled with the profile,
equal to what `xpod project` says of the same capture (the same capture and profile give
byte-identical output, so equality is exact); a bad profile is refused before any pod starts,
and a projection that needs a constant the profile lacks is refused naming the key.

The profile is a file of the test's own with every constant of the schema, so no test depends
on the shipped profiles' values (some are placeholders being calibrated)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import pytest

from bench import p2p as P2P
from bench.project.attach import total_p50_us
from bench.project.capture import capture_p2p
from runtime import Pod, cli
from runtime.project import SCHEMA

COUNTS = {"die.aiv_cores": 48, "die.aic_cores": 24, "die.dies_per_node": 16,
          "collective.cores": 8, "runtime.stream0_aic": 16, "runtime.stream0_aiv": 32,
          "runtime.stream1_aic": 8, "runtime.stream1_aiv": 16}  # fmt: skip
COMMON = ("profile", "profile_sha256", "projection_model", "projection_capture_s",
          "projection_replay_s", "projected_per_die_us")  # fmt: skip


def profile_file(tmp_path, drop: str | None = None, name: str = "testhw") -> str:
    """A profile with every constant of the schema (`drop`: all but that one)."""
    lines = ["[profile]", f'name = "{name}"', 'description = "the tests\' own"']
    for section, keys in SCHEMA.items():
        lines.append(f"[{section}]")
        for key in keys:
            full = f"{section}.{key}"
            if full == drop:
                continue
            if full in COUNTS:
                value = COUNTS[full]
            elif "_intra_" in key:  # one node is nearer than two
                value = 0.5
            elif section == "efficiency":
                value = 0.8
            elif key.endswith(("_us", "_ms")):
                value = 1.5
            else:  # rates, capacities
                value = 100.0
            lines.append(f'{key} = {{ value = {value}, source = "test" }}')
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def xpod_project(capture: str, profile: str, out) -> dict:
    """What `xpod project CAPTURE --profile P --json F` says."""
    assert cli.main(["project", capture, "--profile", profile, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def check_common(r: dict, profile: str) -> None:
    missing = [k for k in COMMON if k not in r]
    assert not missing, f"row lacks {missing}: {r}"
    assert r["profile"] == "testhw" and len(r["profile_sha256"]) == 64
    with open(profile, "rb") as fh:
        assert r["profile_sha256"] == hashlib.sha256(fh.read()).hexdigest()
    assert r["projection_capture_s"] > 0 and r["projection_replay_s"] >= 0
    assert all(x is not None and x > 0 for x in r["projected_per_die_us"]), r


@pytest.fixture
def no_capture_leftovers():
    """The captures of a run without --project-dir go to temporary directories, removed."""
    tmp = tempfile.gettempdir()
    before = {n for n in os.listdir(tmp) if n.startswith("xpod-capture-")}
    yield
    assert {n for n in os.listdir(tmp) if n.startswith("xpod-capture-")} - before == set()


@pytest.mark.timeout(180)
def test_p2p_rows_carry_the_projection_of_a_one_way_send(tmp_path, capsys):
    prof = profile_file(tmp_path)
    caps, out = tmp_path / "caps", tmp_path / "p2p.jsonl"
    argv = ["bench", "p2p", "--quick", "--sizes", "8,4K", "--cores", "1,2", "--variants",
            "mte,zero-copy,async", "--iters-scale", "0.1", "--project", prof,
            "--project-dir", str(caps), "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    rows = rows_of(out)
    assert len(rows) == 12
    for r in rows:
        check_common(r, prof)
        assert r["projection_nodes"] == 2 and r["projected_p50_us"] > 0
        assert len(r["projected_per_die_us"]) == 2
        # die 0 only sends: its per-call time is the send's latency
        assert r["projected_per_die_us"][0] == r["projected_p50_us"]
        doc = xpod_project(r["projection_capture"], prof, tmp_path / "p.json")
        assert r["projected_p50_us"] == doc["projected"]["calls"]["send"]["p50_us"]
        assert doc["profile_sha256"] == r["profile_sha256"]
    # async is projected as the mte send (isend(...).wait() is what send runs)
    by = {(r["variant"], r["cores"], r["size_bytes"]): r for r in rows}
    assert by[("async", 2, 4096)]["projected_p50_us"] == by[("mte", 2, 4096)]["projected_p50_us"]
    # a capture of the same configuration made apart from the bench: the same projection
    args = cli.build_parser(argv).parse_args(argv)
    cfg = P2P.parse_options(args).config
    path, _ = capture_p2p(cfg, 4096, 2, "zero-copy", tmp_path / "own", inter_node=True)
    doc = xpod_project(str(path), prof, tmp_path / "own.json")
    assert by[("zero-copy", 2, 4096)]["projected_p50_us"] == doc["projected"]["calls"]["send"][
        "p50_us"
    ]  # fmt: skip
    table = [ln for ln in printed.splitlines() if ln.endswith("  projected (testhw, 2 nodes)")]
    assert len(table) == 12  # every printed projected row labelled
    assert printed.count("projected (testhw, 2 nodes)") == 13  # and the table's heading


@pytest.mark.timeout(120)
def test_p2p_same_node_places_the_pair_on_one_node(tmp_path, capsys, no_capture_leftovers):
    prof = profile_file(tmp_path)
    rows = {}
    for extra in ([], ["--project-same-node"]):
        out = tmp_path / "p2p.jsonl"
        assert cli.main(["bench", "p2p", "--sizes", "8", "--cores", "1", "--variants", "mte",
                         "--iters-scale", "0.05", "--project", prof, "--json", str(out),
                         *extra]) == 0  # fmt: skip
        (r,) = rows_of(out)
        check_common(r, prof)
        assert "projection_capture" not in r  # a temporary directory, removed
        rows[bool(extra)] = r
    assert rows[False]["projection_nodes"] == 2 and rows[True]["projection_nodes"] == 1
    assert "projected (testhw, 1 node)" in capsys.readouterr().out
    # the test profile's latencies are shorter within a node
    assert rows[True]["projected_p50_us"] < rows[False]["projected_p50_us"]


@pytest.mark.timeout(180)
def test_ring_rows_carry_the_projection_of_a_round(tmp_path, capsys):
    prof = profile_file(tmp_path)
    caps, out = tmp_path / "caps", tmp_path / "ring.jsonl"
    assert cli.main(["bench", "ring", "--dies", "2,3", "--rounds", "20", "--project", prof,
                     "--project-dir", str(caps), "--json", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    rows = rows_of(out)
    assert [r["dies"] for r in rows] == [2, 3]
    for r in rows:
        check_common(r, prof)
        assert len(r["projected_per_die_us"]) == r["dies"]
        doc = xpod_project(r["projection_capture"], prof, tmp_path / "p.json")
        rnd = doc["projected"]["calls"]["round"]["p50_us"]
        assert r["projected_round_p50_us"] == rnd > 0
        assert r["projected_p50_us"] == round(rnd / r["dies"], 4)
        assert f"{r['projected_p50_us']:.2f}" in printed
    assert printed.count("projected (testhw)") >= 3  # the heading and a label per row


@pytest.mark.timeout(240)
def test_alltoall_and_a2e_rows_carry_dispatch_combine_and_total(tmp_path, capsys):
    prof = profile_file(tmp_path)
    caps, out = tmp_path / "caps", tmp_path / "a2a.jsonl"
    argv = ["bench", "alltoall", "--dies", "4", "--batch", "8", "--hidden", "64", "--topk", "2",
            "--quick", "--iters", "3", "--protocol", "fused,a2e", "--quant", "int8",
            "--attention-dies", "2", "--expert-dies", "2", "--project", prof,
            "--project-dir", str(caps), "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    rows = rows_of(out)
    assert sorted(r["protocol"] for r in rows) == ["a2e", "fused"]
    for r in rows:
        check_common(r, prof)
        assert len(r["projected_per_die_us"]) == r["dies"]
        first, second = ("a2e", "e2a") if r["protocol"] == "a2e" else ("dispatch", "combine")
        doc = xpod_project(r["projection_capture"], prof, tmp_path / "p.json")
        calls = doc["projected"]["calls"]
        assert r["projected_dispatch_us"] == calls[first]["p50_us"] > 0
        assert r["projected_combine_us"] == calls[second]["p50_us"] > 0
        assert r["projected_total_us"] == total_p50_us(doc, first, second)
        assert r["projected_total_us"] == pytest.approx(
            r["projected_dispatch_us"] + r["projected_combine_us"], abs=2e-4
        )  # two counted calls: the p50 is their mean, and a mean of sums is a sum of means
        line = next(ln for ln in printed.splitlines()
                    if f"{r['projected_total_us']:.2f}" in ln)  # fmt: skip
        assert line.endswith("projected (testhw)"), line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bench", ["p2p", "ring", "alltoall"])
def test_a_bad_profile_is_refused_before_any_pod_starts(tmp_path, capsys, monkeypatch, bench):
    def launch(*a, **k):
        raise AssertionError("a pod started")

    monkeypatch.setattr(Pod, "launch", launch)
    assert cli.main(["bench", bench, "--project", "nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"xpod bench {bench}: error: argument --project:"), err
    assert "nosuch" in err and "no such profile" in err and len(err.splitlines()) == 1
    bad = tmp_path / "bad.toml"
    bad.write_text('[profile]\nname = "bad"\ndescription = "x"\n[link]\nport_gbps = 5\n')
    assert cli.main(["bench", bench, "--project", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "argument --project:" in err and "link.port_gbps" in err


@pytest.mark.timeout(120)
def test_a_projection_that_needs_a_missing_constant_is_refused_for_that_row_only(
    tmp_path, capsys, no_capture_leftovers
):
    # the DMA variant needs dma.startup_us, which the profile lacks: its rows are refused
    # (projected figures null, the key named); the MTE rows, which do not need it, project
    prof = profile_file(tmp_path, drop="dma.startup_us")
    out = tmp_path / "p2p.jsonl"
    argv = ["bench", "p2p", "--sizes", "8", "--cores", "1", "--variants", "mte,dma",
            "--iters-scale", "0.01", "--project", prof, "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    rows = {r["variant"]: r for r in rows_of(out) if r.get("transport", "").startswith("xpod")}
    assert rows["mte"]["projected_p50_us"] > 0 and "projection_refused" not in rows["mte"]
    assert rows["dma"]["projected_p50_us"] is None and rows["dma"]["projected_per_die_us"] is None
    assert "dma.startup_us" in rows["dma"]["projection_refused"]
    assert "refused (-):" in printed and "dma.startup_us" in printed
