"""`xpod bench alltoall`: expert-parallel dispatch + combine latency over batch size and EP degree.

One row per (transport, protocol, quant, dies, batch), in the nccl-tests manner; with `--peers`
the same byte pattern is moved, in the same run, by mpi4py Alltoallv and by a pyzmq all-to-all.

Definitions (every transport measures them the same way):
- routing: each die draws, for each of its `batch` tokens, `topk` distinct experts uniformly at
  random (generator seeded with (seed, die_id)); the same routing in every iteration, and the
  peers move the per-destination message counts it gives (`counts[src][dst]`). `--routing
  skew`: the experts are drawn without replacement with Zipf popularity 1 / rank (ranks a
  permutation seeded by `seed`, the same on every die), so a few experts (and dies) are hot.
- dedup (`--protocol pull-dedup,fused-dedup`): the same collective with `dispatch(...,
  dedup=True)`: one message per (token, destination die) instead of per (token, expert);
  bytes count those messages (each dispatch message also carries its expert list, 12 bytes
  per entry, not counted: below 1 % of a row at hidden 7168).
- one iteration: barrier, dispatch, barrier, combine; dispatch and combine are timed on every die
  with perf_counter_ns, and the collective's time is the maximum over dies. p50 / p99 / min are
  over the timed iterations after warm-up; total = dispatch + combine of the same iteration.
  Expert outputs are a preallocated float32 array (no expert compute is timed).
- bytes per die (mean over the sending dies; a message is one routed (token, expert) pair, the
  die's own experts included, as nccl-tests counts a rank's own block): dispatch = messages x
  (hidden + 4-byte scale) with int8, x 4 x hidden with none; combine = messages x 4 x hidden.
- algbw = (dispatch + combine bytes per die) / total p50; busbw = algbw x (N-1)/N (nccl-tests'
  alltoall factor; 1 for A2E, where no message stays on its die); aggregate = sending dies x
  bytes per die / total p50.
- memcpy_gbps: one core's np.copyto bandwidth copying one die's dispatch bytes and its combine
  bytes once (each as one buffer), measured in the launcher during the same run; copy limit =
  cores x memcpy_gbps; copy_ratio = aggregate / copy limit.
- cpu_s_per_die: time.process_time() of the timed loop (barriers included), mean over dies.
- A2E (`--a2e` or `--protocol a2e`): pods of A attention + X expert dies, comm.a2e / comm.e2a;
  bytes per attention die; `metadata_writes` = fields an attention die writes per step.

Per (dies, batch) one pod sized for that batch runs every protocol x quant row, then the peers.
The package: `inputs` (points, routing, tokens), `dies` (what each die runs and times), `measure`
(xpod and peer rows), `options` (flags, the plan), `report` (repeats, summary), `driver` (a run).
"""

from bench.alltoall.driver import main, run
from bench.alltoall.inputs import Point, counts_matrix, default_experts, routing, tokens
from bench.alltoall.measure import a2a_row
from bench.alltoall.options import add_args, parse_options

__all__ = [
    "Point",
    "a2a_row",
    "add_args",
    "counts_matrix",
    "default_experts",
    "main",
    "parse_options",
    "routing",
    "run",
    "tokens",
]
