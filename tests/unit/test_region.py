"""memory.region: create / attach / unlink of one segment, header checks, field views.

These touch /dev/shm, so they use the `leak_check` fixture like the integration tests.
"""

from __future__ import annotations

import os
import secrets
import stat

import numpy as np
import pytest

from memory import ProtocolError, Region, RegionHandle, ShmError, compute, region_name
from memory import layout as L
from memory.region import unlink_segment

pytestmark = pytest.mark.usefixtures("leak_check")

LAYOUT = compute(num_dies=2, lanes=2, ring_slots=4, slot_bytes=4096, app_bytes=1 << 16)


@pytest.fixture
def created():
    name = region_name(secrets.token_hex(4), 1)
    region = Region.create(name, 1, LAYOUT)
    try:
        yield region
    finally:
        region.close()
        unlink_segment(name)


def test_region_name():
    assert region_name("ab12", 3) == "/xpod.ab12.d3"


def test_create_writes_header_and_is_owner_only(created):
    h = created.header()
    assert int(h["magic"]) == L.MAGIC
    assert int(h["die_id"]) == 1 and int(h["num_dies"]) == 2
    assert int(h["region_bytes"]) == LAYOUT.region_bytes
    assert int(h["creator_pid"]) == os.getpid()
    st = os.stat("/dev/shm" + created.name)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == LAYOUT.region_bytes


def test_views_have_the_layout_sizes(created):
    assert created.app.nbytes == LAYOUT.app_bytes
    assert created.meta.nbytes == LAYOUT.meta_bytes
    assert created.managed.nbytes == LAYOUT.managed_bytes
    assert created.offset_of(created.app) == LAYOUT.app_off
    with pytest.raises(ValueError):
        created.offset_of(np.zeros(4))


def test_attach_sees_the_creators_writes(created):
    other = Region.attach(RegionHandle(created.name, 1), LAYOUT)
    try:
        f = created.field("desc", 1, 1)
        f["tail_ptr"] = 42
        assert int(other.field("desc", 1, 1)["tail_ptr"]) == 42
        w = LAYOUT.field_word("ack", 0, 1) + L.ACK_DONE
        other.words[w] = 9
        assert int(created.fields("ack")[0, 1]["done"]) == 9
        assert created.fields("rdv").shape == (2, 2)
    finally:
        other.close()


def test_attach_refuses_another_layout(created):
    other_layout = compute(num_dies=3, lanes=2, ring_slots=4, slot_bytes=4096, app_bytes=1 << 16)
    with pytest.raises((ProtocolError, ShmError)):
        Region.attach(RegionHandle(created.name, 1), other_layout)
    with pytest.raises(ProtocolError, match="die"):
        Region.attach(RegionHandle(created.name, 0), LAYOUT)  # header says die 1


def test_attach_refuses_bad_magic(created):
    created.words[0] = 0
    with pytest.raises(ProtocolError, match="magic"):
        Region.attach(RegionHandle(created.name, 1), LAYOUT)


def test_attach_missing_segment_names_it():
    name = "/xpod.00000000.d9"
    with pytest.raises(ShmError, match="xpod.00000000.d9"):
        Region.attach(RegionHandle(name, 9), LAYOUT)


def test_create_twice_fails_and_unlink_is_idempotent(created):
    with pytest.raises(ShmError, match=created.name):
        Region.create(created.name, 1, LAYOUT)
    assert unlink_segment(created.name) is True
    assert unlink_segment(created.name) is False


def test_close_with_live_views_does_not_crash():
    name = f"/xpod.{secrets.token_hex(4)}.d0"
    region = Region.create(name, 0, LAYOUT)
    try:
        view = region.app[:16]
        view[:] = 3
        region.close()
        assert view.sum() == 48  # the mapping lives as long as the view
    finally:
        unlink_segment(name)
