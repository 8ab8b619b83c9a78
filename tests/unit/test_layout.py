"""memory.layout: constants pinned to the docstring diagram, and the region geometry."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory import FIELD_BYTES, P2P_ACK, P2P_DESC, P2P_RDV, ConfigError, compute
from memory import layout as L

SMALL = dict(num_dies=4, lanes=4, ring_slots=8, slot_bytes=4096, app_bytes=1 << 20)


def _diagram_rows() -> dict[str, list[str]]:
    """`kind -> [word names]` parsed from the field table of the module docstring."""
    doc = L.__doc__
    rows = {}
    kind = None
    for line in doc.splitlines():
        m = re.match(r"\s*(desc|ack|rdv|sync)\b.*?\s([A-Z0-9_]+)\s", line)
        if m:
            kind = m.group(1)
            continue
        if kind and line.strip().startswith("|"):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            rows[kind] = cells
            kind = None
    return rows


# -- constants pinned to the diagram ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, dtype",
    [("desc", P2P_DESC), ("ack", P2P_ACK), ("rdv", P2P_RDV), ("sync", L.SYNC)],
)
def test_field_dtype_matches_docstring_diagram(kind, dtype):
    rows = _diagram_rows()
    assert kind in rows, f"no diagram row for {kind} in memory/layout.py docstring"
    drawn = rows[kind]
    assert dtype.itemsize == FIELD_BYTES == 32
    assert len(dtype.names) == 4
    # "spare" words may be numbered in the dtype (spare0, spare1...): compare the stems.
    stems = [re.sub(r"\d+$", "", n) for n in dtype.names]
    assert stems == drawn
    for i, name in enumerate(dtype.names):
        fdt, off = dtype.fields[name][:2]
        assert off == 8 * i, f"{kind}.{name} at byte {off}, diagram says {8 * i}"
        assert fdt == np.dtype("<i8")


@pytest.mark.parametrize(
    "dtype, words",
    [
        (P2P_DESC, {"event_id": L.DESC_EVENT, "chunk_id": L.DESC_CHUNK, "tail_ptr": L.DESC_TAIL,
                    "msg_info": L.DESC_INFO}),
        (P2P_ACK, {"event_id": L.ACK_EVENT, "head_ptr": L.ACK_HEAD, "done": L.ACK_DONE,
                   "status": L.ACK_STATUS}),
        (P2P_RDV, {"event_id": L.RDV_EVENT, "dst_off": L.RDV_OFF, "nbytes": L.RDV_NBYTES,
                   "seq": L.RDV_SEQ}),
        (L.SYNC, {"count0": L.SYNC_COUNT}),
    ],
)  # fmt: skip
def test_word_indices_match_dtype_offsets(dtype, words):
    for name, idx in words.items():
        assert dtype.fields[name][1] == idx * L.WORD


def test_scalar_constants():
    assert L.WORD == 8
    assert L.PAGE == 4096
    assert L.HEADER_BYTES == L.PAGE
    assert L.MAGIC.to_bytes(8, "little") == b"XPODHBM1"
    assert L.LAYOUT_VERSION >= 1
    assert L.FIELD_KINDS == {"desc": P2P_DESC, "ack": P2P_ACK, "rdv": P2P_RDV}


def test_header_fits_its_page_and_is_words():
    assert L.HEADER.itemsize <= L.HEADER_BYTES
    assert L.HEADER.names[0] == "magic"
    for name in L.HEADER.names:
        assert L.HEADER.fields[name][0].itemsize == 8


def test_polled_word_is_documented_last():
    # The docstring promises the polled word of each field is published last.
    doc = L.__doc__
    assert "(tail_ptr, done, seq, count)" in doc
    assert P2P_DESC.names[2] == "tail_ptr" and P2P_ACK.names[2] == "done"
    assert P2P_RDV.names[3] == "seq" and L.SYNC.names[0] == "count0"


# -- geometry --------------------------------------------------------------------------------------


def test_areas_in_diagram_order_and_page_aligned():
    lo = compute(**SMALL)
    areas = lo.areas()
    assert list(areas) == ["header", "app", "meta", "managed"]
    end = 0
    for name, (off, size) in areas.items():
        assert off == end, f"{name} does not follow the previous area"
        assert off % L.PAGE == 0 and size % L.PAGE == 0, name
        end = off + size
    assert end == lo.region_bytes
    assert lo.app_off == L.HEADER_BYTES


def test_meta_blocks_in_order():
    lo = compute(**SMALL)
    block = SMALL["num_dies"] * SMALL["lanes"] * FIELD_BYTES
    assert lo.desc_off == lo.meta_off
    assert lo.ack_off == lo.desc_off + block
    assert lo.rdv_off == lo.ack_off + block
    assert lo.sync_off == lo.rdv_off + block
    assert lo.sync_off + L.sync_bytes(SMALL["num_dies"]) <= lo.meta_off + lo.meta_bytes


def test_app_bytes_rounded_up_to_a_page():
    lo = compute(**{**SMALL, "app_bytes": 5000})
    assert lo.app_bytes == 8192
    assert compute(**{**SMALL, "app_bytes": 0}).app_bytes == 0


def test_field_offsets_distinct_and_aligned():
    lo = compute(**SMALL)
    offs = [
        lo.field_off(kind, p, ln)
        for kind in ("desc", "ack", "rdv")
        for p in range(lo.num_dies)
        for ln in range(lo.lanes)
    ]
    assert len(set(offs)) == len(offs)
    assert all(o % FIELD_BYTES == 0 for o in offs)
    assert all(lo.meta_off <= o < lo.sync_off for o in offs)
    assert lo.field_off("ack", 2, 3) == lo.ack_off + (2 * lo.lanes + 3) * FIELD_BYTES
    assert lo.field_word("rdv", 1, 2) * L.WORD == lo.field_off("rdv", 1, 2)


def test_ring_offsets_tile_the_managed_area():
    lo = compute(**SMALL)
    assert lo.ring_bytes == SMALL["ring_slots"] * SMALL["slot_bytes"]
    rings = sorted(lo.ring_off(s, ln) for s in range(lo.num_dies) for ln in range(lo.lanes))
    assert rings[0] == lo.managed_off
    assert all(b - a == lo.ring_bytes for a, b in zip(rings, rings[1:], strict=False))
    assert rings[-1] + lo.ring_bytes <= lo.managed_off + lo.managed_bytes
    assert lo.ring_off(1, 2) == lo.managed_off + (1 * lo.lanes + 2) * lo.ring_bytes


def test_layout_hash_depends_on_every_parameter():
    base = compute(**SMALL)
    assert base.layout_hash == compute(**SMALL).layout_hash
    for key, value in [("num_dies", 5), ("lanes", 2), ("ring_slots", 4), ("slot_bytes", 8192),
                       ("app_bytes", 2 << 20)]:  # fmt: skip
        assert compute(**{**SMALL, key: value}).layout_hash != base.layout_hash, key


def test_describe_names_every_area():
    text = compute(**SMALL).describe()
    for word in ("app", "meta", "managed", "desc", "ack", "rdv", "sync", "rings"):
        assert word in text


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_dies", 0),
        ("num_dies", True),
        ("lanes", 0),
        ("lanes", 65),
        ("ring_slots", 1),
        ("slot_bytes", 32),
        ("slot_bytes", 100),
        ("app_bytes", -1),
        ("num_dies", 2.0),
    ],
)
def test_compute_rejects_bad_values_naming_the_argument(key, value):
    with pytest.raises(ConfigError, match=key):
        compute(**{**SMALL, key: value})


@settings(max_examples=200, deadline=None)
@given(
    num_dies=st.integers(1, 64),
    lanes=st.integers(1, 8),
    ring_slots=st.integers(2, 16),
    slot_kib=st.integers(1, 64),
    app_bytes=st.integers(0, 1 << 24),
)
def test_layout_properties(num_dies, lanes, ring_slots, slot_kib, app_bytes):
    lo = compute(
        num_dies=num_dies,
        lanes=lanes,
        ring_slots=ring_slots,
        slot_bytes=slot_kib * 1024,
        app_bytes=app_bytes,
    )
    assert lo.app_bytes >= app_bytes and lo.app_bytes - app_bytes < L.PAGE
    assert lo.region_bytes % L.PAGE == 0
    assert lo.managed_bytes >= num_dies * lanes * lo.ring_bytes
    last = lo.field_off("rdv", num_dies - 1, lanes - 1)
    assert last + FIELD_BYTES <= lo.sync_off
    assert lo.ring_off(num_dies - 1, lanes - 1) + lo.ring_bytes <= lo.region_bytes
