"""runtime.pod.config.PodConfig: defaults, validation naming the field, TOML / dict construction."""

from __future__ import annotations

import dataclasses
import os

import pytest

from comm.wait import WaitPolicy
from runtime import ConfigError, PodConfig


def test_defaults_are_valid_and_fit_8_dies_in_under_1_gib():
    cfg = PodConfig()
    assert cfg.lanes == 4 and cfg.ring_slots == 8 and cfg.slot_bytes % 64 == 0
    assert cfg.cores == len(os.sched_getaffinity(0))  # 0 means "the machine's"
    lo = PodConfig(num_dies=8).layout()
    assert 8 * lo.region_bytes < 1 << 30


def test_frozen():
    cfg = PodConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_dies = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_dies", 0),
        ("num_dies", -1),
        ("num_dies", 257),
        ("num_dies", True),
        ("num_dies", 2.0),
        ("num_dies", "4"),
        ("cores", -1),
        ("lanes", 0),
        ("lanes", 65),
        ("ub_bytes", 100),
        ("ub_bytes", 200),
        ("ring_slots", 1),
        ("slot_bytes", 100),
        ("slot_bytes", 0),
        ("app_bytes", -1),
        ("max_region_bytes", 100),
        ("trace_capacity", 1),
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("timeout_s", "10"),
        ("ready_timeout_s", 0),
        ("wait", "busy"),
        ("pin", "yes"),
        ("start_method", "forkserver"),
        ("trace", 1),
    ],
)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ConfigError) as ei:
        PodConfig(**{field: value})
    assert field in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_region_larger_than_max_region_bytes():
    with pytest.raises(ConfigError, match="max_region_bytes"):
        PodConfig(app_bytes=64 << 20, max_region_bytes=32 << 20)
    lo = PodConfig(app_bytes=1 << 20).layout()
    PodConfig(app_bytes=1 << 20, max_region_bytes=lo.region_bytes)  # exactly fits


@pytest.mark.parametrize("build", ["from_dict", "load", "replace"])
def test_unknown_key_is_an_error(build):
    with pytest.raises(ConfigError, match="foo"):
        if build == "from_dict":
            PodConfig.from_dict({"num_dies": 2, "foo": 1})
        elif build == "load":
            PodConfig.load(foo=1)
        else:
            PodConfig().replace(foo=1)


def test_unknown_key_via_constructor_is_a_type_error():
    with pytest.raises(TypeError):
        PodConfig(foo=1)  # type: ignore[call-arg]


def test_dict_round_trip():
    cfg = PodConfig(num_dies=3, lanes=2, timeout_s=1.5, trace=True)
    assert PodConfig.from_dict(cfg.to_dict()) == cfg


def test_replace_validates():
    cfg = PodConfig()
    assert cfg.replace(num_dies=7).num_dies == 7
    with pytest.raises(ConfigError, match="num_dies"):
        cfg.replace(num_dies=0)


def test_load_toml_top_level_and_pod_table_then_overrides(tmp_path):
    flat = tmp_path / "flat.toml"
    flat.write_text("num_dies = 6\nlanes = 2\n")
    table = tmp_path / "table.toml"
    table.write_text("[pod]\nnum_dies = 5\ntimeout_s = 2.5\n")
    assert PodConfig.load(str(flat)).num_dies == 6
    cfg = PodConfig.load(str(table), num_dies=3, lanes=None)
    assert cfg.num_dies == 3  # the flag wins
    assert cfg.timeout_s == 2.5  # the file's value
    assert cfg.lanes == PodConfig().lanes  # None = flag not given


def test_load_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("num_dies = = 3\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        PodConfig.load(str(bad))
    with pytest.raises(ConfigError, match="nope.toml"):
        PodConfig.load(str(tmp_path / "nope.toml"))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[pod]\nnum_die = 3\n")
    with pytest.raises(ConfigError, match="num_die"):
        PodConfig.load(str(unknown))


def test_layout_is_derived_not_stored():
    cfg = PodConfig(num_dies=2, lanes=2, ring_slots=4, slot_bytes=4096, app_bytes=1 << 20)
    lo = cfg.layout()
    assert (lo.num_dies, lo.lanes, lo.ring_slots, lo.slot_bytes) == (2, 2, 4, 4096)
    assert "region_bytes" not in cfg.to_dict()


@pytest.mark.parametrize(
    "wait, num_dies, cores, spins",
    [
        ("spin", 8, 2, True),
        ("yield", 2, 2, False),
        ("auto", 2, 2, True),  # a core per die: spin
        ("auto", 8, 2, False),  # more dies than cores: yield every poll
    ],
)
def test_wait_policy(wait, num_dies, cores, spins):
    pol = PodConfig(wait=wait, num_dies=num_dies, cores=cores, timeout_s=3.0).wait_policy()
    assert isinstance(pol, WaitPolicy)
    assert pol.timeout_s == 3.0
    assert (pol.spin_polls > 0) == spins
    if not spins:
        assert pol.yield_every == 1


@pytest.mark.parametrize(
    "pin, num_dies, cores, pinned",
    [
        ("on", 8, 2, True),
        ("off", 2, 2, False),
        ("auto", 2, 2, True),
        ("auto", 3, 2, False),
        ("auto", 4, 2, True),
        ("auto", 16, 2, True),
        ("auto", 6, 4, False),
        ("off", 4, 2, False),
    ],
)
def test_pinned(pin, num_dies, cores, pinned):
    assert PodConfig(pin=pin, num_dies=num_dies, cores=cores).pinned() is pinned
