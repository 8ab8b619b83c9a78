"""Capture pods (comm.capture, runtime.pod.capture, bench.project) and what the replay makes of
them (runtime.project): every protocol's capture is complete (each guarded step matches the
write that satisfied it, nothing dropped), the projection of a capture is deterministic and
independent of how fast the host ran it, and the trace synthesizer writes what a real capture
writes, event for event (docs/projection.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
import pytest

from bench.alltoall.inputs import Point
from bench.project.capture import capture_alltoall, capture_p2p
from bench.project.synth import synthesize_alltoall
from runtime import PodConfig
from runtime.project import ProjectError, load_capture, load_profile, replay

SMALL = dict(num_dies=4, app_bytes=1 << 20, ring_slots=4, slot_bytes=16 << 10, lanes=4)


def a2a_config(pt: Point, quant: str) -> PodConfig:
    return PodConfig(num_dies=pt.dies, app_bytes=1 << 20, a2a_max_batch=pt.batch,
                     a2a_hidden=pt.hidden, a2a_topk=pt.topk, num_experts=pt.num_experts,
                     a2a_max_local_experts=(pt.num_experts // (pt.dies - pt.attention_dies)
                                            if pt.attention_dies else 0),
                     a2a_dispatch_dtype="int8" if quant == "int8" else "float32")  # fmt: skip


def events(path, die: int) -> tuple[list, list]:
    with open(path / f"die-{die:04d}.msgpack", "rb") as fh:
        m = msgpack.unpackb(fh.read(), raw=False)
    return m["streams"], [[e[0], e[1], *e[4:]] for e in m["events"]]  # no host times


def project(path, profile: str = "cm384") -> bytes:
    return json.dumps(replay(load_capture(path), load_profile(profile)).to_json(),
                      sort_keys=True).encode()  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["mte", "zero-copy", "dma"])
@pytest.mark.parametrize("cores", [1, 2, 4])
@pytest.mark.parametrize("nbytes", [8, 70_000])
def test_every_p2p_variant_and_lane_count_captures_completely(tmp_path, variant, cores, nbytes):
    path, _ = capture_p2p(PodConfig(**SMALL), nbytes, cores, variant, tmp_path / "cap")
    cap = load_capture(path)
    res = replay(cap, load_profile("host"))  # every acquire matched, or ProjectError
    assert res.calls("send").counted == 2
    streams, evs = events(path, 0)
    lanes = [s for s in streams if ".tx.1." in s]
    assert len(lanes) == cores, streams
    done = [e for e in evs if e[0] == "acq" and e[-1] == "ack.done"]
    assert len(done) == 3 * cores  # each lane of each call waits for its ack
    if variant == "dma":  # the SDMA path has no start-up figure: refused, naming the key
        with pytest.raises(ProjectError, match="dma"):
            replay(cap, load_profile("cm384"))
    else:
        assert project(path) == project(path)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", ["pull", "fused", "pull-dedup", "fused-dedup"])
@pytest.mark.parametrize("quant", ["int8", "none"])
def test_every_alltoall_protocol_captures_completely(tmp_path, protocol, quant):
    pt = Point(4, 8, 256, 4, 16, 3)
    path, _ = capture_alltoall(a2a_config(pt, quant), pt, protocol, quant, tmp_path / "cap")
    res = replay(load_capture(path), load_profile("cm384"))
    for name in ("dispatch", "combine"):
        stats = res.calls(name)
        assert stats.counted == 2 and stats.p50_us > 0
    kinds = {e[0] for d in range(pt.dies) for e in events(path, d)[1]}
    assert {"put" if protocol.startswith("fused") else "get", "pub", "acq", "op"} <= kinds


@pytest.mark.timeout(180)
def test_a2e_e2a_capture_completely(tmp_path):
    pt = Point(6, 8, 256, 4, 16, 3, attention_dies=2)
    path, _ = capture_alltoall(a2a_config(pt, "int8"), pt, "a2e", "int8", tmp_path / "cap")
    res = replay(load_capture(path), load_profile("cm384"))
    assert res.calls("a2e").counted == 2 and res.calls("e2a").counted == 2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dies", [8, 16])
@pytest.mark.parametrize("protocol", ["fused", "fused-dedup"])
def test_the_synthesizer_writes_what_a_capture_writes(tmp_path, dies, protocol):
    pt = Point(dies, 16, 512, 8, 256, 5)
    cfg = a2a_config(pt, "int8")
    real, _ = capture_alltoall(cfg, pt, protocol, "int8", tmp_path / "real")
    syn = synthesize_alltoall(cfg, pt, protocol, "int8", tmp_path / "syn")
    for d in range(dies):
        assert events(syn, d) == events(real, d), f"die {d}"
    meta = json.loads((syn / "meta.json").read_text())
    assert meta["synthesized"] is True
    assert project(real) != project(syn)  # the capture says which it is
    a, b = (json.loads(project(p))["projected"] for p in (real, syn))
    assert a == b  # the same projected figures


@pytest.mark.scale
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("dies", [32, 64])
def test_the_synthesizer_writes_what_a_capture_writes_at_scale(tmp_path, dies):
    pt = Point(dies, 128, 7168, 8, 256, 0)
    cfg = a2a_config(pt, "int8")
    real, _ = capture_alltoall(cfg, pt, "fused", "int8", tmp_path / "real")
    syn = synthesize_alltoall(cfg, pt, "fused", "int8", tmp_path / "syn")
    for d in range(dies):
        assert events(syn, d) == events(real, d), f"die {d}"


CAPTURE = """
import sys
from bench.alltoall.inputs import Point
from bench.project.capture import capture_alltoall
from tests.integration.test_capture_pods import a2a_config
pt = Point(4, 16, 512, 8, 256, 1)
capture_alltoall(a2a_config(pt, "int8"), pt, "fused", "int8", sys.argv[1])
"""


@pytest.mark.timeout(240)
def test_a_projection_does_not_depend_on_the_host(tmp_path):
    """The same capture on all cores and on one core beside a busy loop: byte-identical
    projected JSON (host time decides nothing but the order within a die)."""
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    subprocess.run([sys.executable, "-c", CAPTURE, str(fast)], check=True, timeout=200)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        subprocess.run(["taskset", "-c", "0", sys.executable, "-c", CAPTURE, str(slow)],
                       check=True, timeout=200)  # fmt: skip
    finally:
        hog.kill()
        hog.wait()
    for profile in ("cm384", "h800"):
        a, b = (json.loads(project(p, profile)) for p in (fast, slow))
        assert a["projected"] == b["projected"] and a["profile_sha256"] == b["profile_sha256"]


def _recv_while_the_sender_fails(die, nbytes: int) -> int:
    """Die 0 waits to receive a message from die 1; die 1 fails instead of sending it."""
    import numpy as np

    from comm import recv as comm_recv

    buf = die.alloc(nbytes, np.uint8)
    die.barrier()
    if die.die_id == 1:
        raise ValueError("die 1 fails before it sends")
    if die.die_id == 0:
        comm_recv(die, buf, 1, event_id=0)
    return 0


def lambda_ok(die) -> int:
    return 1


@pytest.mark.timeout(120)
def test_a_capture_of_a_failed_run_is_refused(tmp_path):
    # die 1 raises instead of sending: die 0's recv waits for words never written until the
    # pod aborts it, so its log holds a recv that began and never ended (an aborted call
    # records no end): writing the capture refuses, and no meta.json makes it loadable
    from runtime import Pod
    from runtime.pod.capture import write_capture

    with Pod.launch(PodConfig(num_dies=2, capture=True, app_bytes=1 << 20)) as pod:
        with pytest.raises(Exception, match="die 1 fails"):
            pod.run(_recv_while_the_sender_fails, 4096, timeout_s=60)
        with pytest.raises(Exception, match="unfinished calls"):
            write_capture(pod, tmp_path / "cap", {"bench": "failed"}, ["recv"])
        assert pod.run(lambda_ok) == [1, 1]  # the pod stays usable
    with pytest.raises(ProjectError, match="meta.json"):
        load_capture(tmp_path / "cap")
