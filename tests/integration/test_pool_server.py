"""runtime.engine.pool_server: a real server process copying between fake die regions (plain
owner-only shm segments with a value-coded KV pool) and its DRAM and SSD tiers."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import time

import msgpack
import numpy as np
import posix_ipc
import pytest
import zmq

from comm.kvlink import KVGeometry
from memory import pool_layout as P
from memory.errors import ConfigError
from runtime.engine import pool_server as S
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(30)

L, NB, BS, ROW = 3, 12, 4, 8
KV_OFF = 8192
REGION = KV_OFF + L * NB * BS * ROW * 4 + 4096
SLOT = L * BS * ROW * 4
N_SLOTS = 10
FP = P.make_fingerprint("pool-server-test")
RECV_S = 10.0


def code(die: int) -> np.ndarray:
    """float32 [L, NB, BS, ROW]: every value names (die, layer, block, token, col)."""
    return (np.arange(L * NB * BS * ROW, dtype=np.float32) + 1 + die * L * NB * BS * ROW).reshape(
        L, NB, BS, ROW
    )


class FakeDie:
    """A die region: an owner-only segment /xpod.<pod>.d<die> with a KV pool at KV_OFF."""

    def __init__(self, pod: str, die: int, fill: int):
        self.name, self.die = f"/xpod.{pod}.d{die}", die
        self.create(fill)

    def create(self, fill: int) -> None:
        shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, mode=0o600, size=REGION)
        self.mm = mmap.mmap(shm.fd, REGION)
        shm.close_fd()
        self.arr = np.frombuffer(self.mm, np.uint8)
        self.kv()[:] = code(fill)

    def kv(self) -> np.ndarray:
        n = L * NB * BS * ROW * 4
        return self.arr[KV_OFF : KV_OFF + n].view(np.float32).reshape(L, NB, BS, ROW)

    @property
    def geo(self) -> KVGeometry:
        return KVGeometry(KV_OFF, L, NB, BS, ROW)

    def spec(self) -> S.DieRegion:
        return S.DieRegion(self.die, self.name, REGION, KV_OFF, NB)

    def close(self) -> None:
        self.arr = None
        with contextlib.suppress(BufferError):
            self.mm.close()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)

    def recreate(self, fill: int) -> None:
        self.close()
        self.create(fill)


class Rig:
    """Two fake dies, a results socket, an inbox (a master's), servers started and stopped."""

    def __init__(self, tmp: str):
        self.tmp, self.pod = tmp, f"pt{os.getpid()}{int(time.monotonic_ns()) % 100000}"
        self.dies = [FakeDie(self.pod, 0, 0), FakeDie(self.pod, 1, 1)]
        self.ctx = zmq.Context()
        self.results = self._pull("results")
        self.inbox_addr = f"ipc://{tmp}/inbox.sock"
        self.inbox = self._pull("inbox")
        self.handles: list[S.PoolServerHandle] = []
        self.order_socks: dict[int, zmq.Socket] = {}

    def _pull(self, name: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.PULL)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(f"ipc://{self.tmp}/{name}.sock")
        return s

    def config(self, server: int = 0, **kw) -> S.PoolServerConfig:
        kw.setdefault("dies", tuple(d.spec() for d in self.dies))
        return S.PoolServerConfig(
            pod=self.pod, server=server, fingerprint=FP, n_layers=L, block_size=BS,
            row_floats=ROW, n_slots=N_SLOTS, orders=S.order_socket(self.tmp, server),
            results=f"ipc://{self.tmp}/results.sock", **kw,
        )  # fmt: skip

    def start(self, server: int = 0, **kw) -> tuple[S.PoolServerHandle, dict]:
        h = S.start_pool_server(self.config(server, **kw))
        self.handles.append(h)
        inv = self.recv("inventory")
        assert inv["server"] == server and inv["pid"] == h.pid
        if server not in self.order_socks:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(h.cfg.orders)
            self.order_socks[server] = s
        return h, inv

    def send(self, kind: str, body: dict, server: int = 0) -> None:
        self.order_socks[server].send(S.pack(kind, body))

    def send_raw(self, frame: bytes, server: int = 0) -> None:
        self.order_socks[server].send(frame)

    def recv(self, kind: str, sock: zmq.Socket | None = None) -> dict:
        sock = self.results if sock is None else sock
        if not sock.poll(int(RECV_S * 1000)):
            raise AssertionError(f"no {kind} reply within {RECV_S} s")
        got, body = S.unpack(sock.recv(), S.REPLY_KINDS)
        assert got == kind, (got, body)
        return body

    def ask(self, kind: str, body: dict, reply: str, server: int = 0) -> dict:
        self.send(kind, body, server)
        return self.recv(reply, self.inbox if kind == "load" else None)

    def close(self) -> None:
        for h in self.handles:
            S.stop_pool_server(h)
        for s in (self.results, self.inbox, *self.order_socks.values()):
            s.close(linger=0)
        self.ctx.term()
        for d in self.dies:
            d.close()


@pytest.fixture
def rig(tmp_path):
    r = Rig(str(tmp_path))
    try:
        yield r
    finally:
        r.close()


def block_crcs(die: FakeDie, blocks: list[int]) -> list[int]:
    return [P.block_crc(die.arr, die.geo, b) for b in blocks]


def load(rig: Rig, rid: int, slots: list[int], die: int, blocks: list[int], n: int,
         gen: int = 0) -> dict:  # fmt: skip
    body = {"id": rid, "die": die, "gen": gen, "slots": slots, "n_tokens": n,
            "dst_offs": rig.dies[die].geo.offsets(blocks), "reply_to": rig.inbox_addr}  # fmt: skip
    return rig.ask("load", body, "loaded")


def test_store_then_load_into_another_die(rig):
    a, b = rig.dies
    _, inv = rig.start()
    assert inv["entries"] == [] and inv["skipped"] == 0 and inv["n_slots"] == N_SLOTS
    st = rig.ask("store", {"id": 1, "die": 0, "gen": 0, "die_blocks": [1, 2, 3],
                           "slots": [5, 0, 6], "n_tokens": 3 * BS}, "stored")  # fmt: skip
    assert (st["id"], st["status"], st["error"], st["bytes"]) == (1, S.OK, "", 3 * SLOT)
    assert st["crcs"] == block_crcs(a, [1, 2, 3])
    seg = P.attach_pool(rig.pod, 0, FP)
    try:
        np.testing.assert_array_equal(seg.slots()[:, [5, 0, 6]], a.kv()[:, [1, 2, 3]])
    finally:
        seg.close()
    before = b.kv().copy()
    ld = load(rig, 2, [5, 0, 6], 1, [9, 4, 10], 3 * BS)  # on the inbox, not the results
    assert (ld["id"], ld["status"], ld["bytes"]) == (2, S.OK, 3 * SLOT)
    assert ld["crcs"] == st["crcs"] == block_crcs(b, [9, 4, 10])
    assert b.kv()[:, [9, 4, 10]].tobytes() == a.kv()[:, [1, 2, 3]].tobytes()
    rest = [k for k in range(NB) if k not in (9, 4, 10)]
    np.testing.assert_array_equal(b.kv()[:, rest], before[:, rest])  # nothing else written
    assert not rig.results.poll(50)

    # a partial last block: only its first rows land
    ld = load(rig, 3, [5, 0], 1, [7, 8], BS + 1)
    assert ld["status"] == S.OK and ld["bytes"] == L * (BS + 1) * ROW * 4
    np.testing.assert_array_equal(b.kv()[:, 7], a.kv()[:, 1])
    np.testing.assert_array_equal(b.kv()[:, 8, :1], a.kv()[:, 2, :1])
    np.testing.assert_array_equal(b.kv()[:, 8, 1:], before[:, 8, 1:])


def test_die_region_recreated_is_reattached(rig):
    a, b = rig.dies
    rig.start()
    assert rig.ask("store", {"id": 1, "die": 0, "die_blocks": [0], "slots": [1]},
                   "stored")["status"] == S.OK  # fmt: skip
    assert load(rig, 2, [1], 1, [3], BS)["status"] == S.OK
    b.recreate(fill=5)  # the die restarted: a new segment under the same name, same gen
    assert load(rig, 3, [1], 1, [2], BS)["status"] == S.OK
    np.testing.assert_array_equal(b.kv()[:, 2], a.kv()[:, 0])
    np.testing.assert_array_equal(b.kv()[:, 3], code(5)[:, 3])  # the old block was not copied
    b.recreate(fill=6)
    assert load(rig, 4, [1], 1, [5], BS, gen=1)["status"] == S.OK  # a new incarnation
    np.testing.assert_array_equal(b.kv()[:, 5], a.kv()[:, 0])
    b.close()  # the die is gone: an error, not a crash
    ld = load(rig, 5, [1], 1, [5], BS, gen=2)
    assert ld["status"] == S.ERROR and "shm_open" in ld["error"]
    b.create(fill=1)
    assert rig.ask("probe", {"id": 9}, "echo")["id"] == 9


def test_demote_drop_promote_load(rig, tmp_path):
    a, b = rig.dies
    ssd = tmp_path / "ssd"
    rig.start(ssd_dir=str(ssd), ssd_blocks=2)
    st = rig.ask("store", {"id": 1, "die": 0, "die_blocks": [2, 5], "slots": [3, 4]}, "stored")
    h, toks = 0xFEED_0000_0000_0001, list(range(BS))
    dm = rig.ask("demote", {"h": h, "slot": 3, "ns": "t1", "parent": 0x1, "tokens": toks,
                            "crc": st["crcs"][0]}, "demoted")  # fmt: skip
    assert dm["ok"] and dm["crc"] == st["crcs"][0] and dm["error"] == ""
    assert dm["path"] == str(ssd / FP.hex() / "t1" / f"{h:016x}.blk") and os.path.exists(dm["path"])
    seg = P.attach_pool(rig.pod, 0, FP)
    try:
        seg.slots()[:, 3] = 0  # the DRAM copy is gone (the slot reused)
        assert rig.ask("drop", {"slot": 3}, "dropped") == {"server": 0, "slot": 3, "ok": True}
        pr = rig.ask("promote", {"h": h, "ns": "t1", "slot": 7}, "promoted")
        assert (pr["ok"], pr["slot"], pr["crc"]) == (True, 7, st["crcs"][0])
        np.testing.assert_array_equal(seg.slots()[:, 7], a.kv()[:, 2])
    finally:
        seg.close()
    ld = load(rig, 2, [7], 1, [11], BS)
    assert ld["crcs"] == [st["crcs"][0]]
    assert b.kv()[:, 11].tobytes() == a.kv()[:, 2].tobytes()
    pr = rig.ask("promote", {"h": h, "path": dm["path"], "slot": 1}, "promoted")
    assert pr["ok"] and pr["crc"] == st["crcs"][0]

    # a slot whose bytes are not what the index says is not written out
    bad = rig.ask("demote", {"h": 2, "slot": 4, "ns": None, "parent": None, "tokens": toks,
                             "crc": st["crcs"][0]}, "demoted")  # fmt: skip
    assert not bad["ok"] and "crc" in bad["error"]
    assert rig.ask("demote", {"h": 2, "slot": 4, "tokens": toks}, "demoted")["ok"]
    full = rig.ask("demote", {"h": 3, "slot": 4, "tokens": toks}, "demoted")
    assert not full["ok"] and "full" in full["error"]  # ssd_blocks = 2
    assert rig.ask("demote", {"h": h, "slot": 1, "ns": "t1", "tokens": toks}, "demoted")["ok"]

    dl = rig.ask("delete", {"h": h, "ns": "t1"}, "deleted")
    assert dl["ok"] and not os.path.exists(dm["path"])
    assert not rig.ask("delete", {"h": h, "ns": "t1"}, "deleted")["ok"]
    gone = rig.ask("promote", {"h": h, "ns": "t1", "slot": 7}, "promoted")
    assert not gone["ok"] and "No such file" in gone["error"]
    assert rig.ask("demote", {"h": 3, "slot": 4, "tokens": toks}, "demoted")["ok"]  # room again


def test_killed_server_leaves_its_segment_and_restarts_with_its_ssd_tier(rig, tmp_path):
    a, b = rig.dies
    ssd = str(tmp_path / "ssd")
    h, _ = rig.start(ssd_dir=ssd)
    st = rig.ask("store", {"id": 1, "die": 0, "die_blocks": [4, 6], "slots": [0, 1]}, "stored")
    want = []
    for i, (slot, parent, ns) in enumerate([(0, None, None), (1, 0x111, "tenant")]):
        key, toks = 0x1000 + i, [i * 10 + t for t in range(BS)]
        body = {"h": key, "slot": slot, "ns": ns, "parent": parent, "tokens": toks,
                "crc": st["crcs"][i]}  # fmt: skip
        assert rig.ask("demote", body, "demoted")["ok"]
        want.append([key, ns, parent, toks, st["crcs"][i]])
    name = "/dev/shm" + P.pool_segment_name(rig.pod, 0)
    os.kill(h.pid, signal.SIGKILL)
    h.process.join(5)
    assert h.exitcode == -signal.SIGKILL
    assert os.path.exists(name)  # SIGKILL: nobody unlinked it
    assert S.cleanup_pool_segment(rig.pod, 0) and not os.path.exists(name)
    assert not S.cleanup_pool_segment(rig.pod, 0)
    # a stale segment of the same name (another dead incarnation) is replaced at start
    P.create_pool(rig.pod, 0, P.make_fingerprint("stale"), 1, 1, 1, 1).close()
    h2, inv = rig.start(ssd_dir=ssd)
    assert sorted(e[:5] for e in inv["entries"]) == sorted(want)
    assert inv["skipped"] == 0 and inv["removed_tmp"] == 0
    seg = P.attach_pool(rig.pod, 0, FP)
    assert seg.creator_pid == h2.pid and seg.n_slots == N_SLOTS
    seg.close()
    e = next(e for e in inv["entries"] if e[0] == 0x1001)
    assert rig.ask("promote", {"h": e[0], "path": e[5], "slot": 9}, "promoted")["ok"]
    assert load(rig, 2, [9], 1, [0], BS)["crcs"] == [st["crcs"][1]]
    np.testing.assert_array_equal(b.kv()[:, 0], a.kv()[:, 6])
    assert S.stop_pool_server(h2) == 0  # SIGTERM: a clean exit that unlinks its segment
    assert not os.path.exists(name)


def test_bad_orders_get_error_replies_and_the_server_keeps_serving(rig):
    rig.start()
    frame = msgpack.packb(["xpod", "bogus", 1, {"id": 5}])
    rig.send_raw(frame)
    e = rig.recv("error")
    assert e["id"] == 5 and "bogus" in e["error"]
    rig.send_raw(msgpack.packb(["xpod", "store", 99, {"id": 6}]))
    e = rig.recv("error")
    assert e["id"] == 6 and "version 99" in e["error"]
    rig.send_raw(b"\xc1 not msgpack")
    assert rig.recv("error")["id"] is None
    rig.send_raw(msgpack.packb(["xpod", "store", 1, [1, 2]]))
    assert "not a dict" in rig.recv("error")["error"]

    def store_err(body: dict, what: str) -> None:
        r = rig.ask("store", {"id": 7, "die": 0, **body}, "stored")
        assert r["status"] == S.ERROR and r["id"] == 7 and what in r["error"], r

    store_err({"die_blocks": [0], "slots": [N_SLOTS]}, "outside the pool")
    store_err({"die_blocks": [NB], "slots": [0]}, "outside the pool")
    store_err({"die": 9, "die_blocks": [0], "slots": [0]}, "not a die of pool server")
    store_err({"die_blocks": [0], "slots": [0], "n_tokens": BS + 1}, "tokens")
    store_err({"die_blocks": [0, 1], "slots": [2, 2]}, "each slot once")
    store_err({"die_blocks": "x", "slots": [0]}, "list of ints")
    ld = load(rig, 8, [N_SLOTS + 3], 1, [0], BS)
    assert ld["status"] == S.ERROR and ld["id"] == 8
    body = {"id": 10, "die": 1, "slots": [0], "n_tokens": BS, "reply_to": rig.inbox_addr,
            "dst_offs": [0, KV_OFF, REGION - 10]}  # fmt: skip
    ld = rig.ask("load", body, "loaded")
    assert ld["status"] == S.ERROR and "outside its KV pool" in ld["error"]
    before = rig.dies[1].kv().copy()
    body["dst_offs"] = [KV_OFF]  # one segment for three layers
    assert rig.ask("load", body, "loaded")["status"] == S.ERROR
    np.testing.assert_array_equal(rig.dies[1].kv(), before)
    assert not rig.ask("demote", {"h": 1, "slot": 0, "tokens": [1]}, "demoted")["ok"]  # no SSD
    pr = rig.ask("promote", {"h": 1, "slot": 0, "path": "/etc/passwd"}, "promoted")
    assert not pr["ok"]
    assert rig.ask("probe", {"id": 11}, "echo") == {"server": 0, "id": 11}
    ok = rig.ask("store", {"id": 12, "die": 0, "die_blocks": [0], "slots": [0]}, "stored")
    assert ok["status"] == S.OK and ok["crcs"] == block_crcs(rig.dies[0], [0])
    rig.send("stop", {})
    rig.handles[0].process.join(5)
    assert rig.handles[0].exitcode == 0
    assert not os.path.exists("/dev/shm" + P.pool_segment_name(rig.pod, 0))


def test_refuses_an_unusable_ssd_dir_in_the_caller(rig, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "photos.jpg").write_bytes(b"x")
    with pytest.raises(ConfigError, match=f"{d} holds files that are not xpod pool files"):
        S.start_pool_server(rig.config(ssd_dir=str(d)))
    with pytest.raises(ConfigError, match="region"):
        S.start_pool_server(rig.config(dies=(S.DieRegion(0, "/x", 100, 0, NB),)))


def test_server_follows_its_parent(rig):
    """The engine dies (here: an intermediate process that started the server): the server
    gets its parent-death signal, exits and unlinks its segment."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "engine"
        code_ = 1
        try:
            os.close(r)
            h = S.start_pool_server(rig.config())
            bound = S.order_socket(rig.tmp, 0)[len("ipc://") :]  # serving: segment made
            deadline = time.monotonic() + RECV_S
            while not os.path.exists(bound) and time.monotonic() < deadline:
                time.sleep(0.01)
            seg = "/dev/shm" + P.pool_segment_name(rig.pod, 0)
            os.write(w, f"{h.pid} {int(os.path.exists(seg))}".encode())
            code_ = 0
        finally:
            os._exit(code_)
    os.close(w)
    server, served = (int(v) for v in (os.read(r, 64) or b"0 0").split())
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0 and server > 0 and served  # it was serving
    seg = "/dev/shm" + P.pool_segment_name(rig.pod, 0)
    wait_for(lambda: not os.path.exists(seg), RECV_S, "the orphaned server's segment unlinked")

    def gone() -> bool:
        try:
            with open(f"/proc/{server}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    wait_for(gone, RECV_S, "the orphaned server to exit")
    with contextlib.suppress(OSError):
        os.unlink(S.order_socket(rig.tmp, 0)[len("ipc://") :])


def test_orders_for_a_predecessor_or_an_old_segment_are_refused(rig):
    from runtime.engine.pool_shell import segment_inode

    a, b = rig.dies
    rig.start(epoch=3)
    seg = segment_inode(b.name)
    assert rig.ask("store", {"id": 1, "die": 0, "die_blocks": [0], "slots": [1], "epoch": 3,
                             "seg": segment_inode(a.name)}, "stored")["status"] == S.OK  # fmt: skip
    before = b.kv().copy()
    body = {"id": 2, "die": 1, "slots": [1], "n_tokens": BS, "reply_to": rig.inbox_addr,
            "dst_offs": b.geo.offsets([3]), "epoch": 2, "seg": seg}  # fmt: skip
    ld = rig.ask("load", body, "loaded")  # meant for the server before this one
    assert ld["status"] == S.ERROR and "epoch" in ld["error"]
    b.recreate(fill=7)  # the die restarted since the master chose its blocks
    fresh = b.kv().copy()
    ld = rig.ask("load", {**body, "epoch": 3}, "loaded")
    assert ld["status"] == S.ERROR and "segment changed" in ld["error"]
    np.testing.assert_array_equal(b.kv(), fresh)  # nothing written into the new incarnation
    assert not np.array_equal(fresh, before)
    ok = rig.ask("load", {**body, "epoch": 3, "seg": segment_inode(b.name)}, "loaded")
    assert ok["status"] == S.OK
    np.testing.assert_array_equal(b.kv()[:, 3], a.kv()[:, 0])
