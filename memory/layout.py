"""Layout of one die's HBM region: pure functions of a few sizes, identical on every die.

Glossary (spec -> code): app data area -> app area, metadata area -> meta area, managed data area
-> managed area, eventID -> event_id, chunkID -> chunk_id, tailPtr -> tail_ptr, headPtr -> head_ptr.

```
 offset 0      4 KiB                          meta_off                 managed_off     region_bytes
 | header     | app area                     | meta area              | managed area           |
 | magic, ver | user buffers, KV blocks,     | 32-byte fields, one    | p2p rings: one per     |
 | sizes,     | weights (AppAllocator);      | writer each (below)    | (sender, lane), each   |
 | offsets    | zero-copy recv targets       |                        | ring_slots x slot_bytes|
```

Meta area, in this order, every field 32 bytes = four little-endian int64 words:

```
 desc[peer][lane]  P2P_DESC  inbound descriptor of peer's sends to this die
                             | event_id | chunk_id | tail_ptr | msg_info |   writer: peer (sender)
 ack[peer][lane]   P2P_ACK   ack of peer's receives of this die's sends
                             | event_id | head_ptr | done     | status   |   writer: peer (receiver)
 rdv[peer][lane]   P2P_RDV   zero-copy rendezvous: where peer wants this die's send
                             | event_id | dst_off  | nbytes   | seq      |   writer: peer (receiver)
 sync[dies / 4]    SYNC      barrier counts: word s of the block is die s's (a word per die)
                             | count    | count    | count    | count    |   writer: that die
```

The polled word of each field is written last (tail_ptr, done, seq, count) and only grows during
the pod's life, so a stale value never looks like a fresh one (docs/protocols.md §3). `done` is
the per-(sender, receiver) message sequence number that the sender put in `chunk_id`
(`seq << 24 | chunk`), not the caller's event id: event ids are caller-chosen and may repeat, a
polled word may not.

All-to-all fields (only in a pod launched with `a2a_max_batch`), in the meta area after `sync`:

```
 pull[kind][half][src]  | event_id | off      | count    | seq      |   writer: src
                          kind 0 dispatch, 1 combine; seq = the operation number, LAST;
                          off = row offset | code << 48: a dispatch's quant (0 float32
                          rows, 1 int8), a combine's dispatch operation number mod 2**15
 fused_flag[half][src]  | event_id | count    | seq      | quant    |   writer: src (or the
                          trampoline forwarding src's packets in A2E'); seq LAST
 fused_counts[half][src][local expert]   int64 rows per expert          writer: src
 fused_cflag[slot][k]   int64 combine completion word = operation number, writer: the die that
                          computed (slot, k) (or the trampoline forwarding it in E2A')
 a2e_flag[half]         | event_id | count    | seq      | quant    |   writer: the partner
                          attention die of this trampoline; seq LAST. On an attention die:
                          its trampoline's E2A done flag (count = rows or REFUSED), after
                          the rows
 fused_refuse[src]      int64: the fused-combine / E2A operation number at which src refused
                          its part (bad input); written before src's completion words
 fused_cevent[src]      int64: the event id of src's latest fused-combine / E2A rows into this
                          die; written before src's completion words
 a2e_seen[src]          int64: in a trampoline, the last A2E operation expert die src finished
                          (its E2A rows written first): the trampoline's done flag waits for
                          every expert die, not only those its attention die routed rows to
```
Serving fields (only in a pod launched with `serve_slot_bytes`), after the all-to-all fields:

```
 serve   SERVE_WORDS int64 words:
   vote_step, vote_rows[2]           writer: this die   lockstep vote of global step s:
                                                        rows[s % 2] first, vote_step = s LAST
   cmd_pub, cmd_promised             writer: the master commands published / promised (counts)
   cmd_taken                         writer: this die   commands taken
   res_pub                           writer: this die   results published
   res_taken                         writer: the master results taken
   dummy_steps                       writer: this die   steps it ran with no rows
   cmd_len[slots], res_len[slots]    writer: the slot's writer, before its *_pub count
   ping                              writer: the master heartbeat sequence it asks the die to echo
   pong                              writer: this die   the last ping it saw, echoed from its loop
   attn_ns, moe_ns, step_ns          writer: this die   cumulative attention, MoE wait (dispatch
                                                        + combine) and forward time of its steps
   progress                          writer: this die   where it is (`progress_word`): the
                                                        supervisor's hang detector samples it
   kv_fault                          writer: the shell  a memory fault report (what the runtime's
                                                        UCE report is to 001 §6.3): seq << 32 |
                                                        (block + 1), 0 = a block of the die's next
                                                        rows; the die polls it at each step
   fault_hits                        writer: this die   die-side injected faults it fired
   done_step                         writer: this die   the last step it finished
   fault_at                          writer: this die   when its last die-side fault fired (ns)
   fault_arm                         writer: the shell  die-side faults armed by time (ordinal)
   a2e_ns, e2a_ns                    writer: this die   a split pod: cumulative A2E / E2A time
   idle_ns, expert_ns, a2e_calls     writer: this die   an expert die: waiting for A2E input,
                                                        computing experts, calls served
   parked[64]                        writer: attention  in an expert die, one per attention die
                                     die a (word a)     a: 2s + 1 parked after step s, 2s running
   kv_pool                           writer: this die   where its paged KV pool starts (bytes)
   pd[32][PD_PEER_WORDS]             a PD pod's KV links, per peer die p (comm/kvlink.py): in a
                                     decode die, written by prefill die p: started, done,
                                     echo, records[PD_SLOTS] (request, first token, bytes,
                                     crc, ns, status, crc ns, MTP drafts[2] or -1); in a
                                     prefill die, written by decode die p: ack, probe
   votes[256][3]                     writer: die p      (word 3p) p's lockstep vote, in every
                                     (words 3p..3p+2)   voter's region: rows[s % 2] first, then
                                                        s LAST (each die reads votes at home)
```
Expert load balancing fields (only in a pod launched with `eplb_layers`), after the serving
words (runtime.model.expert_balancer):

```
 eplb    EPLB_WORDS int64 words:
   plan_seq                          writer: the leader  rebalances planned (LAST of a plan)
   plan_step                         writer: the leader  the step whose end made plan plan_seq
   ready                             writer: this die    the plan whose expert moves it finished
   switched                          writer: this die    the plan it serves with
   count_step                        writer: this die    steps whose counts are complete (last+1)
   moved_bytes, move_ns              writer: this die    expert bytes it received, time moving
   balance_ppm                       writer: the leader  balancedness of its last window x 1e6
   rows                              writer: this die    rows its slots received, cumulative
   count_by[256]                     writer: die p       (word p) in the leader: p's count_step
   ready_by[256]                     writer: die p       (word p) in every member: p's ready
 counts[window][1 + layers * slots]  writer: this die    row s % window: step s, then the rows
                                                         each local slot got in each MoE layer
 plan[layers][physical]              writer: the leader  phy2log of plan plan_seq, in every
                                                         die (the leader pushes it, then
                                                         plan_step, then plan_seq LAST)
```
Every die polls these words in its own region (rule R1 of docs/protocols.md §11); the leader
pulls a remote die's count row once its count_by word says the step is complete.

The command ring (master -> die) and the result ring (die -> master) are `serve_slots` slots of
`serve_slot_bytes` each in the managed area; slot k % slots holds message k. Every count only
grows. A writer may fill slot k once `k - taken < slots`.

`count` = COUNT_REFUSED (-1) in a pull field, fused flag or a2e flag says that the writer refused
its input to that operation: it still takes part (publishes, waits for every peer) so that every
die's operation counter stays in step, and every reader raises after its wait.

Managed area: ring (sender s, lane l) of die d starts at
`managed_off + (s * lanes + l) * ring_slots * slot_bytes`; chunk k of the ring lives in slot
`k % ring_slots`. A slot is free for the sender while `tail_ptr - head_ptr < ring_slots`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from memory.a2a_rows import (  # noqa: F401 - DEDUP_ENTRY, PULL_ROW_META: re-exported
    DEDUP_ENTRY,
    PULL_ROW_META,
    a2a_sizes,
    dedup_entries_off,
)
from memory.a2a_rows import check_range as _check
from memory.a2a_rows import round_up as _round_up
from memory.errors import ConfigError
from memory.progress import PROGRESS_STATES, progress_word, unpack_progress  # noqa: F401

MAGIC = 0x314D4248444F5058  # b"XPODHBM1" little-endian
LAYOUT_VERSION = 9  # 2: fused_refuse, fused_cevent; 3: serve heartbeat, phase times; 4: eplb;
# 5: split pods (A2E done flag in the attention die's a2e_flag, serve words a2e_ns .. parked);
# 6: PD pods' KV link words (serve pd); 7: a barrier word per source die and the serving votes
# of every die in every voter's region (multi-host: a die polls only its own region); 8: the
# serve word mtp_ns (speculative decoding); 9: a KV record carries the MTP drafts (PD_REC_WORDS 9)
PAGE = 4096
HEADER_BYTES = PAGE
FIELD_BYTES = 32
WORD = 8

P2P_DESC = np.dtype(
    [("event_id", "<i8"), ("chunk_id", "<i8"), ("tail_ptr", "<i8"), ("msg_info", "<i8")]
)
P2P_ACK = np.dtype([("event_id", "<i8"), ("head_ptr", "<i8"), ("done", "<i8"), ("status", "<i8")])
P2P_RDV = np.dtype([("event_id", "<i8"), ("dst_off", "<i8"), ("nbytes", "<i8"), ("seq", "<i8")])
SYNC = np.dtype([(f"count{i}", "<i8") for i in range(4)])  # a field of the sync block

# Word index of each name inside its 32-byte field (hot paths index int64 words, not bytes).
DESC_EVENT, DESC_CHUNK, DESC_TAIL, DESC_INFO = 0, 1, 2, 3
ACK_EVENT, ACK_HEAD, ACK_DONE, ACK_STATUS = 0, 1, 2, 3
RDV_EVENT, RDV_OFF, RDV_NBYTES, RDV_SEQ = 0, 1, 2, 3
SYNC_COUNT = 0
PULL_EVENT, PULL_OFF, PULL_COUNT, PULL_SEQ = 0, 1, 2, 3
FLAG_EVENT, FLAG_COUNT, FLAG_SEQ, FLAG_QUANT = 0, 1, 2, 3  # fused_flag and a2e_flag
COUNT_REFUSED = -1  # a count word of a die that refused its input to the operation
# Serving words (word index inside the serve block), see the diagram.
SV_VOTE_STEP, SV_VOTE_ROWS, SV_CMD_PUB, SV_CMD_PROMISED, SV_CMD_TAKEN = 0, 1, 3, 4, 5
SV_RES_PUB, SV_RES_TAKEN, SV_DUMMY_STEPS, SV_CMD_LEN = 6, 7, 8, 9  # then the slot lengths
SERVE_SLOTS = 4
SV_PING = SV_CMD_LEN + 2 * SERVE_SLOTS  # then the heartbeat and the cumulative phase times
SV_PONG, SV_ATTN_NS, SV_MOE_NS, SV_STEP_NS = SV_PING + 1, SV_PING + 2, SV_PING + 3, SV_PING + 4
SV_PROGRESS = SV_STEP_NS + 1  # step << 24 | (layer + 1) << 12 | phase << 4 | state (progress_word)
SV_KV_FAULT = SV_PROGRESS + 1  # seq << 32 | (block + 1): a KV block reported faulty (0: pick)
SV_FAULT_HITS = SV_KV_FAULT + 1  # die-side faults (err / drop / delay) this die has fired
SV_DONE_STEP = SV_FAULT_HITS + 1  # the last step this die finished (rollback target: min + 1)
SV_FAULT_AT = SV_DONE_STEP + 1  # CLOCK_MONOTONIC ns of this die's last die-side fault
SV_FAULT_ARM = SV_FAULT_AT + 1  # the shell arms this die's at=T die-side faults (an ordinal)
# a split pod (MoE-attention disaggregation): cumulative A2E / E2A ns of a die's calls, an
# expert die's idle (waiting for A2E input) and expert-compute ns and A2E calls, and the parked
# word of every attention die in each expert die (2s + 1: parked after step s; 2s: running s)
SV_A2E_NS, SV_E2A_NS, SV_IDLE_NS, SV_EXPERT_NS, SV_A2E_CALLS = range(
    SV_FAULT_ARM + 1, SV_FAULT_ARM + 6
)
SV_PARKED = SV_A2E_CALLS + 1
MAX_PARKED = 64  # attention dies of a split serving pod
SV_KV_POOL = SV_PARKED + MAX_PARKED  # byte offset of this die's paged KV pool in its region
SV_MTP_NS = SV_KV_POOL + 1  # cumulative ns of this die's MTP sub-forwards (speculative decoding)
SV_PD, MAX_PD_DIES, PD_SLOTS, PD_REC_WORDS = SV_MTP_NS + 1, 32, 4, 9  # KV links
PD_STARTED, PD_DONE, PD_ECHO, PD_ACK, PD_PROBE, PD_REC = range(6)  # words of a peer block
PD_PEER_WORDS = PD_REC + PD_SLOTS * PD_REC_WORDS
# the serving vote of every die in every voter's region (rule R1: a die reads votes in its own
# memory): die p's vote for step s is rows at SV_VOTES + 3p + 1 + s % 2, then s at SV_VOTES + 3p
SV_VOTES, VOTE_WORDS, MAX_VOTERS = SV_PD + MAX_PD_DIES * PD_PEER_WORDS, 3, 256
SERVE_WORDS = SV_VOTES + MAX_VOTERS * VOTE_WORDS
# Expert load balancing words (word index inside the eplb block), see the diagram.
EP_PLAN_SEQ, EP_PLAN_STEP, EP_READY, EP_SWITCHED, EP_COUNT_STEP = range(5)
EP_MOVED_BYTES, EP_MOVE_NS, EP_BALANCE_PPM, EP_ROWS = range(5, 9)
EP_COUNT_BY, EP_READY_BY = 16, 16 + MAX_VOTERS  # per-source words (MAX_VOTERS dies)
EPLB_WORDS = 16 + 2 * MAX_VOTERS

HEADER = np.dtype(
    [
        ("magic", "<u8"),
        ("layout_version", "<i8"),
        ("layout_hash", "<i8"),
        ("die_id", "<i8"),
        ("num_dies", "<i8"),
        ("lanes", "<i8"),
        ("ring_slots", "<i8"),
        ("slot_bytes", "<i8"),
        ("app_off", "<i8"),
        ("app_bytes", "<i8"),
        ("meta_off", "<i8"),
        ("meta_bytes", "<i8"),
        ("managed_off", "<i8"),
        ("managed_bytes", "<i8"),
        ("region_bytes", "<i8"),
        ("creator_pid", "<i8"),
    ]
)

FIELD_KINDS = {"desc": P2P_DESC, "ack": P2P_ACK, "rdv": P2P_RDV}


def sync_bytes(num_dies: int) -> int:
    """The barrier block: one count word per die (die s writes word s), in 32-byte fields."""
    return _round_up(num_dies * WORD, FIELD_BYTES)


@dataclass(frozen=True)
class RegionLayout:
    """Offsets and sizes of every area and field of one region (the same for every die).

    All offsets are bytes from the start of the region; `*_word(...)` give int64 word indices.
    """

    num_dies: int
    lanes: int
    ring_slots: int
    slot_bytes: int
    app_bytes: int
    app_off: int
    meta_off: int
    meta_bytes: int
    managed_off: int
    managed_bytes: int
    region_bytes: int
    desc_off: int
    ack_off: int
    rdv_off: int
    sync_off: int
    # expert-parallel all-to-all (0 when the pod has none; see `compute`)
    a2a_max_batch: int = 0
    a2a_hidden: int = 0
    a2a_topk: int = 0
    a2a_experts_per_die: int = 0
    a2a_num_experts: int = 0
    a2a_dispatch_bytes: int = 4  # 4: float32 (or INT8) dispatch rows; 1: INT8-only rows
    a2a_combine_bytes: int = 2  # 2: bfloat16 combine rows; 4: float32
    pull_field_off: int = 0
    pull_disp_off: int = 0
    pull_disp_rows: int = 0
    pull_disp_stride: int = 0
    pull_comb_off: int = 0
    pull_comb_rows: int = 0
    pull_comb_stride: int = 0
    fused_flag_off: int = 0  # meta: [2 halves][num_dies] | event_id | count | seq | quant |
    fused_counts_off: int = 0  # meta: [2][num_dies][experts_per_die] int64 per-expert rows
    fused_cflag_off: int = 0  # meta: [max_batch][topk] int64 combine completion words
    fused_disp_off: int = 0  # managed: [2][num_dies][fused_disp_rows] rows of pull_disp_stride
    fused_disp_rows: int = 0  # per source: max_batch x min(topk, experts_per_die)
    fused_comb_off: int = 0  # managed: [max_batch][topk] rows of pull_comb_stride
    a2e_in_off: int = 0  # managed: [2 halves][max_batch * topk] rows, a trampoline's inbound
    a2e_flag_off: int = 0  # meta: [2 halves] one field | event_id | count | seq | quant |
    fused_refuse_off: int = 0  # meta: [num_dies] int64, fused-combine op a die refused
    fused_cevent_off: int = 0  # meta: [num_dies] int64, event id of a die's fused-combine rows
    a2e_seen_off: int = 0  # meta: [num_dies] int64, the last A2E operation an expert die finished
    serve_slot_bytes: int = 0  # bytes per command / result ring slot (0: no serving area)
    serve_off: int = 0  # meta: SERVE_WORDS words of the serving protocol
    serve_cmd_off: int = 0  # managed: [SERVE_SLOTS] command slots of serve_slot_bytes
    serve_res_off: int = 0  # managed: [SERVE_SLOTS] result slots of serve_slot_bytes
    eplb_layers: int = 0  # MoE layers whose expert load is recorded (0: no eplb area)
    eplb_window: int = 0  # rows of the per-step count ring
    eplb_off: int = 0  # meta: EPLB_WORDS words
    eplb_counts_off: int = 0  # meta: [eplb_window][1 + eplb_layers * experts_per_die] int64
    eplb_plan_off: int = 0  # meta: [eplb_layers][num_experts] int64 phy2log

    @property
    def ring_bytes(self) -> int:
        return self.ring_slots * self.slot_bytes

    @property
    def layout_hash(self) -> int:
        """CRC of the parameters: attach refuses a region built for another configuration."""
        key = f"{self.num_dies},{self.lanes},{self.ring_slots},{self.slot_bytes},{self.app_bytes}"
        if self.a2a_max_batch:
            key += f",a2a:{self.a2a_max_batch},{self.a2a_hidden},{self.a2a_topk}"
            key += f",{self.a2a_experts_per_die},{self.a2a_num_experts}"
            if self.a2a_dispatch_bytes != 4:
                key += f",disp{self.a2a_dispatch_bytes}"
            key += f",comb{self.a2a_combine_bytes}"
        if self.serve_slot_bytes:
            key += f",serve:{self.serve_slot_bytes}"
        if self.eplb_layers:
            key += f",eplb:{self.eplb_layers},{self.eplb_window}"
        return zlib.crc32(key.encode())

    def serve_word(self, index: int) -> int:
        """Word index (in the region) of serving word `index` (SV_* constants)."""
        return self.serve_off // WORD + index

    def eplb_word(self, index: int) -> int:
        """Word index (in the region) of eplb word `index` (EP_* constants)."""
        return self.eplb_off // WORD + index

    @property
    def eplb_row_words(self) -> int:
        """Words of one row of the count ring: the step, then layers x local slots."""
        return 1 + self.eplb_layers * self.a2a_experts_per_die

    def pull_field_word(self, kind: int, half: int, src: int) -> int:
        """Word index of pull field (kind 0 = dispatch, 1 = combine; half 0/1) written by src."""
        return (
            self.pull_field_off + ((kind * 2 + half) * self.num_dies + src) * FIELD_BYTES
        ) // WORD

    def fused_flag_word(self, half: int, src: int) -> int:
        return (self.fused_flag_off + (half * self.num_dies + src) * FIELD_BYTES) // WORD

    def fused_counts_off_of(self, half: int, src: int) -> int:
        return self.fused_counts_off + (half * self.num_dies + src) * self.a2a_experts_per_die * 8

    def fused_buffer_bytes(self) -> dict[str, int]:
        """The pre-allocated fused receive buffers of one die (the paper's formula, 000 §4.2.1:
        n_ranks x max_tokens x msg_bytes for dispatch; combine rows, bfloat16 (or float32), are
        indexed by (batch_slot, k_index), so max_batch x topk of them)."""
        return {
            "dispatch": self.num_dies * self.fused_disp_rows * self.pull_disp_stride,
            "dispatch_both_halves": 2
            * self.num_dies
            * self.fused_disp_rows
            * self.pull_disp_stride,
            "combine": self.a2a_max_batch * self.a2a_topk * self.pull_comb_stride,
        }

    def pull_block_off(self, kind: int, half: int) -> int:
        """Byte offset of the pull send area of `kind` and `half` (rows of the kind's stride)."""
        if kind == 0:
            return self.pull_disp_off + half * self.pull_disp_rows * self.pull_disp_stride
        return self.pull_comb_off + half * self.pull_comb_rows * self.pull_comb_stride

    def field_off(self, kind: str, peer: int, lane: int) -> int:
        """Byte offset of field `kind` ("desc", "ack", "rdv") for (peer, lane)."""
        base = {"desc": self.desc_off, "ack": self.ack_off, "rdv": self.rdv_off}[kind]
        return base + (peer * self.lanes + lane) * FIELD_BYTES

    def field_word(self, kind: str, peer: int, lane: int) -> int:
        return self.field_off(kind, peer, lane) // WORD

    def ring_off(self, sender: int, lane: int) -> int:
        """Byte offset of the ring that `sender`'s `lane` writes into, in the receiver's region."""
        return self.managed_off + (sender * self.lanes + lane) * self.ring_bytes

    def areas(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, bytes) of every area, in address order."""
        return {
            "header": (0, HEADER_BYTES),
            "app": (self.app_off, self.app_bytes),
            "meta": (self.meta_off, self.meta_bytes),
            "managed": (self.managed_off, self.managed_bytes),
        }

    def describe(self) -> str:
        """A human-readable table of areas and field blocks, for `xpod layout` and debuggers."""
        n = self.num_dies * self.lanes
        lines = [f"region {self.region_bytes} bytes ({self.region_bytes / 2**20:.1f} MiB)"]
        for name, (off, size) in self.areas().items():
            lines.append(f"  {name:<8} off {off:>12}  bytes {size:>12}")
        for name, off, dt in (
            ("desc", self.desc_off, P2P_DESC),
            ("ack", self.ack_off, P2P_ACK),
            ("rdv", self.rdv_off, P2P_RDV),
        ):
            cols = ", ".join(dt.names)
            lines.append(
                f"  meta.{name:<5}off {off:>12}  [{self.num_dies}][{self.lanes}] x 32 B ({cols})"
            )
        lines.append(f"  meta.sync off {self.sync_off:>12}  [{self.num_dies}] x 8 B (count by die)")
        lines.append(
            f"  rings    [{self.num_dies} senders][{self.lanes} lanes] x {self.ring_slots} slots"
            f" x {self.slot_bytes} B = {n * self.ring_bytes} B"
        )
        return "\n".join(lines)


def compute(
    *,
    num_dies: int,
    lanes: int,
    ring_slots: int,
    slot_bytes: int,
    app_bytes: int,
    a2a_max_batch: int = 0,
    a2a_hidden: int = 0,
    a2a_topk: int = 0,
    a2a_experts_per_die: int = 0,
    a2a_num_experts: int = 0,
    a2a_dispatch_bytes: int = 4,
    serve_slot_bytes: int = 0,
    a2a_combine_bytes: int = 2,
    eplb_layers: int = 0,
    eplb_window: int = 0,
) -> RegionLayout:
    """Compute the layout of one region from the pod's sizes.

    Arguments:
        num_dies: dies in the pod (every die has a desc/ack/rdv field and a ring per peer, self
            included so indices stay simple).
        lanes: AIV lanes per die (the largest `cores` an operation may use).
        ring_slots: slots per (sender, lane) ring; >= 2 so that sender and receiver can overlap.
        slot_bytes: bytes per ring slot, a multiple of 64.
        app_bytes: size of the app area, rounded up to a page.
        a2a_max_batch, a2a_hidden, a2a_topk, a2a_experts_per_die, a2a_num_experts: the
            expert-parallel all-to-all areas (pull fields and send areas; experts_per_die is the
            most experts one die may host); none when a2a_max_batch is 0.
        a2a_dispatch_bytes: bytes per element of a dispatch row: 4 (float32 or INT8 dispatch)
            or 1 (INT8 only: rows of hidden + PULL_ROW_META bytes, the paper's buffer formula).
        a2a_combine_bytes: bytes per element of a combine row: 2 (bfloat16) or 4 (float32).
        serve_slot_bytes: bytes per slot of the serving command and result rings (0: none).
        eplb_layers, eplb_window: the expert load balancing words, count ring and plan (needs
            the all-to-all; 0: none).
    Returns:
        RegionLayout with every offset; raises ConfigError naming the bad argument.
    """
    _check("num_dies", num_dies, 1, 4096)
    _check("lanes", lanes, 1, 64)
    _check("ring_slots", ring_slots, 2, 1 << 16)
    _check("slot_bytes", slot_bytes, 64, 1 << 30)
    if slot_bytes % 64:
        raise ConfigError(f"slot_bytes: {slot_bytes} is not a multiple of 64")
    _check("app_bytes", app_bytes, 0, 1 << 40)
    app_bytes = _round_up(app_bytes, PAGE)
    app_off = HEADER_BYTES
    meta_off = app_off + app_bytes
    block = num_dies * lanes * FIELD_BYTES
    desc_off = meta_off
    ack_off = desc_off + block
    rdv_off = ack_off + block
    sync_off = rdv_off + block
    _check("serve_slot_bytes", serve_slot_bytes, 0, 1 << 30)
    if serve_slot_bytes % 64:
        raise ConfigError(f"serve_slot_bytes: {serve_slot_bytes} is not a multiple of 64")
    if a2a_dispatch_bytes not in (1, 4):
        raise ConfigError(
            f"a2a_dispatch_bytes: {a2a_dispatch_bytes!r} must be 4 (float32) or 1 (int8)"
        )
    if a2a_combine_bytes not in (2, 4):
        raise ConfigError(
            f"a2a_combine_bytes: {a2a_combine_bytes!r} must be 2 (bfloat16) or 4 (float32)"
        )
    a2a = a2a_sizes(
        num_dies,
        a2a_max_batch,
        a2a_hidden,
        a2a_topk,
        a2a_experts_per_die,
        a2a_dispatch_bytes,
        a2a_combine_bytes,
    )
    on = bool(a2a_max_batch)
    pull_field_off = sync_off + sync_bytes(num_dies)
    fused_flag_off = pull_field_off + (4 * num_dies * FIELD_BYTES if on else 0)
    fused_counts_off = fused_flag_off + (2 * num_dies * FIELD_BYTES if on else 0)
    fused_cflag_off = fused_counts_off + (2 * num_dies * a2a_experts_per_die * WORD if on else 0)
    a2e_flag_off = fused_cflag_off + (a2a_max_batch * a2a_topk * WORD if on else 0)
    fused_refuse_off = a2e_flag_off + (2 * FIELD_BYTES if on else 0)
    fused_cevent_off = fused_refuse_off + (num_dies * WORD if on else 0)
    a2e_seen_off = fused_cevent_off + (num_dies * WORD if on else 0)
    serve_off = a2e_seen_off + (num_dies * WORD if on else 0)
    eplb_off = serve_off + (SERVE_WORDS * WORD if serve_slot_bytes else 0)
    _check("eplb_layers", eplb_layers, 0, 1 << 12)
    _check("eplb_window", eplb_window, 0, 1 << 16)
    if eplb_layers and not (on and eplb_window):
        raise ConfigError("eplb_layers: expert load balancing needs the all-to-all and a window")
    ep = bool(eplb_layers)
    eplb_counts_off = eplb_off + (EPLB_WORDS * WORD if ep else 0)
    row = (1 + eplb_layers * a2a_experts_per_die) * WORD
    eplb_plan_off = eplb_counts_off + (eplb_window * row if ep else 0)
    meta_end = eplb_plan_off + (eplb_layers * a2a_num_experts * WORD if ep else 0)
    meta_bytes = _round_up(meta_end - meta_off, PAGE)
    managed_off = meta_off + meta_bytes
    rings = num_dies * lanes * ring_slots * slot_bytes
    pull_disp_off = managed_off + _round_up(rings, PAGE)
    pull_comb_off = pull_disp_off + _round_up(2 * a2a["disp_rows"] * a2a["disp_stride"], PAGE)
    fused_disp_off = pull_comb_off + _round_up(2 * a2a["comb_rows"] * a2a["comb_stride"], PAGE)
    fused_disp_rows = a2a_max_batch * min(a2a_topk, a2a_experts_per_die) if on else 0
    fused_comb_off = fused_disp_off + _round_up(
        2 * num_dies * fused_disp_rows * a2a["disp_stride"], PAGE
    )
    a2e_in_off = fused_comb_off + _round_up(a2a_max_batch * a2a_topk * a2a["comb_stride"], PAGE)
    serve_cmd_off = a2e_in_off + _round_up(2 * a2a["disp_rows"] * a2a["disp_stride"], PAGE)
    serve_res_off = serve_cmd_off + SERVE_SLOTS * serve_slot_bytes
    end = serve_res_off + SERVE_SLOTS * serve_slot_bytes
    managed_bytes = _round_up(end - managed_off, PAGE)
    return RegionLayout(
        num_dies=num_dies,
        lanes=lanes,
        ring_slots=ring_slots,
        slot_bytes=slot_bytes,
        app_bytes=app_bytes,
        app_off=app_off,
        meta_off=meta_off,
        meta_bytes=meta_bytes,
        managed_off=managed_off,
        managed_bytes=managed_bytes,
        region_bytes=managed_off + managed_bytes,
        desc_off=desc_off,
        ack_off=ack_off,
        rdv_off=rdv_off,
        sync_off=sync_off,
        a2a_max_batch=a2a_max_batch,
        a2a_hidden=a2a_hidden,
        a2a_topk=a2a_topk,
        a2a_experts_per_die=a2a_experts_per_die,
        a2a_num_experts=a2a_num_experts,
        a2a_dispatch_bytes=a2a_dispatch_bytes,
        a2a_combine_bytes=a2a_combine_bytes,
        pull_field_off=pull_field_off if a2a_max_batch else 0,
        pull_disp_off=pull_disp_off if a2a_max_batch else 0,
        pull_disp_rows=a2a["disp_rows"],
        pull_disp_stride=a2a["disp_stride"],
        pull_comb_off=pull_comb_off if a2a_max_batch else 0,
        pull_comb_rows=a2a["comb_rows"],
        pull_comb_stride=a2a["comb_stride"],
        fused_flag_off=fused_flag_off if on else 0,
        fused_counts_off=fused_counts_off if on else 0,
        fused_cflag_off=fused_cflag_off if on else 0,
        fused_disp_off=fused_disp_off if on else 0,
        fused_disp_rows=fused_disp_rows,
        fused_comb_off=fused_comb_off if on else 0,
        a2e_in_off=a2e_in_off if on else 0,
        a2e_flag_off=a2e_flag_off if on else 0,
        fused_refuse_off=fused_refuse_off if on else 0,
        fused_cevent_off=fused_cevent_off if on else 0,
        a2e_seen_off=a2e_seen_off if on else 0,
        serve_slot_bytes=serve_slot_bytes,
        serve_off=serve_off if serve_slot_bytes else 0,
        serve_cmd_off=serve_cmd_off if serve_slot_bytes else 0,
        serve_res_off=serve_res_off if serve_slot_bytes else 0,
        eplb_layers=eplb_layers,
        eplb_window=eplb_window if ep else 0,
        eplb_off=eplb_off if ep else 0,
        eplb_counts_off=eplb_counts_off if ep else 0,
        eplb_plan_off=eplb_plan_off if ep else 0,
    )
