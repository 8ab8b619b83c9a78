"""Hardware profiles (runtime.project.profile, docs/projection.md §3): the shipped ones load and
cite a source for every constant; anything outside the schema is refused naming file and key;
a constant a projection needs and the profile lacks or marks unknown is refused naming it."""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path

import pytest

import runtime.project as project
from runtime.project import SCHEMA, ProjectError, load_profile

PROFILES = Path(project.__file__).parent / "profiles"
HEAD = '[profile]\nname = "mine"\ndescription = "a test profile"\n'


@pytest.mark.parametrize("name", ["cm384", "h800"])
def test_shipped_profiles_load_and_cite_every_constant(name):
    path = PROFILES / f"{name}.toml"
    prof = load_profile(name)
    assert prof.name == name
    assert prof.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    doc = tomllib.loads(path.read_text())
    for section, table in doc.items():
        if section == "profile":
            continue
        for key, const in table.items():
            assert len(const["source"]) >= 10, f"{name}: {section}.{key}: a source to find it by"
    for key, cal in prof.calibrated.items():
        assert cal["points"], key
    assert load_profile(str(path)).sha256 == prof.sha256  # by path too


def test_cm384_carries_the_seed_numbers():
    p = load_profile("cm384")
    assert p.get("link.port_gbps") == 196 and p.get("link.write_latency_us") == 2.1
    assert p.get("die.dies_per_node") == 16 and p.get("collective.cores") == 48
    assert 26 <= p.get("aiv.b_core_gbps") <= 37.5  # 001 §3.1's bound (PROJECTION.md §3.1)
    fitted = {"aiv.t_row_us", "aiv.t_tok_us", "collective.t_fixed_us", "aiv.b_core_gbps"}
    assert set(p.calibrated) == fitted  # the plan of bench.project.calibrate, nothing else
    for key in ("aiv.t_put_us", "aiv.t_flag_us", "aiv.t_poll_us", "p2p.t_fixed_us"):
        src = p.sources[key]  # set, with why: no point separates it
        assert p.get(key) == 0 and ("not separable" in src or "001 §3.1" in src), key
    assert "table7.cm384.dispatch.ep8" in p.calibrated["aiv.t_row_us"]["points"]
    assert "dma.startup_us" in p.unknown


def test_the_host_profile_is_built_in():
    p = load_profile("host")
    assert p.is_host and p.name == "host" and len(p.sha256) == 64


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(ProjectError, match=r"no such profile \(shipped: cm384, h800, host"):
        load_profile("tpu9")


def write(tmp_path, body: str, head: str = HEAD) -> str:
    path = tmp_path / "mine.toml"
    path.write_text(head + body)
    return str(path)


@pytest.mark.parametrize(
    "body, message",
    [
        ("[nic]\nx = { value = 1, source = 's' }\n", "[nic]: unknown section"),
        ("[link]\nport_gbs = { value = 1, source = 's' }\n", "link.port_gbs: unknown key"),
        ("[link]\nport_gbps = { value = 1 }\n", "link.port_gbps lacks its source"),
        ("[link]\nport_gbps = { value = 1, source = '' }\n", "link.port_gbps lacks its source"),
        ("[link]\nport_gbps = { value = 'fast', source = 's' }\n", "value 'fast' is not a finite"),
        ("[link]\nport_gbps = { value = true, source = 's' }\n", "value True is not a finite"),
        ("[link]\nport_gbps = 196\n", "link.port_gbps must be a table"),
        ("[link]\nport_gbps = { value = 0, source = 's' }\n", "value 0 must be > 0"),
        ("[aiv]\nt_row_us = { value = -1, source = 's' }\n", "value -1 must be >= 0"),
        ("[efficiency]\ngemm_int8 = { value = 1.2, source = 's' }\n", "at most 1"),
        ("[die]\naiv_cores = { value = 4.5, source = 's' }\n", "must be a whole number"),
        ("[aiv]\nt_row_us = { value = 1, source = 's', calibrated = true }\n",
         "aiv.t_row_us is calibrated but names no points"),
        ("[aiv]\nt_row_us = { value = 1, source = 's', calibrated = true, points = [] }\n",
         "aiv.t_row_us is calibrated but names no points"),
        ("[aiv]\nt_row_us = { value = 1, source = 's', bound = [1, 2] }\n", "has keys"),
        ("[dma]\ngbps = { unknown = false, source = 's' }\n", "dma.gbps: unknown must be true"),
        ("[dma]\ngbps = { unknown = true, value = 3, source = 's' }\n", "has keys"),
    ],
)  # fmt: skip
def test_refusals_name_the_file_and_the_key(tmp_path, body, message):
    path = write(tmp_path, body)
    with pytest.raises(ProjectError, match=re.escape(f"{path}: ") + ".*" + re.escape(message)):
        load_profile(path)


@pytest.mark.parametrize(
    "head, message",
    [
        ("", "lacks the [profile] section"),
        ('[profile]\nname = "x"\n', "profile.description must be a non-empty string"),
        ('[profile]\nname = "x"\ndescription = "y"\nowner = "z"\n', "profile.owner: unknown key"),
        ("[profile\n", "not a TOML file"),
    ],
)
def test_the_profile_section(tmp_path, head, message):
    path = write(tmp_path, "", head=head)
    with pytest.raises(ProjectError, match=re.escape(message)):
        load_profile(path)


def test_get_refuses_an_unknown_or_absent_constant_naming_it(tmp_path):
    path = write(tmp_path, "[dma]\nstartup_us = { unknown = true, source = '000 l.387' }\n")
    prof = load_profile(path)
    with pytest.raises(ProjectError, match=re.escape(
            f"profile mine ({path}): dma.startup_us is unknown (source: 000 l.387);"
            " this projection needs it")):  # fmt: skip
        prof.get("dma.startup_us")
    with pytest.raises(ProjectError, match=re.escape(f"profile mine ({path}): lacks aiv.t_row_us")):
        prof.get("aiv.t_row_us")


def test_the_schema_gives_every_key_a_meaning():
    assert set(SCHEMA) == {"die", "link", "aiv", "collective", "p2p", "dma", "efficiency",
                           "runtime"}  # fmt: skip
    assert all(meaning.strip() for keys in SCHEMA.values() for meaning in keys.values())
