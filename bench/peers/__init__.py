"""Peer baselines of `xpod bench p2p` and `xpod bench alltoall` over other transports.

p2p (`run_peer`, `p2p.py`): the same ping-pong as the xpod rows, over a shared-memory floor,
pyzmq, a pipe and mpi4py. alltoall (`run_a2a_peer`, `a2a.py`): the byte pattern of one
expert-parallel dispatch and its combine, moved by mpi4py Alltoallv under mpirun or by a pyzmq
PUSH/PULL all-to-all between N forked processes. `procs.py` forks the peer processes and
collects their results; `mpi.py` runs mpirun (`bench/mpi_peer.py` in every rank) and reads rank
0's rows back.
"""

from bench.peers.a2a import (
    A2A_PEER_TRANSPORTS,
    a2a_block_bytes,
    a2a_byte,
    a2a_check,
    a2a_merge_ranks,
    a2a_send_buffer,
    a2a_timed,
    iters_for_budget,
    run_a2a_peer,
)
from bench.peers.mpi import mpi_a2a_command, mpi_available, mpi_command, mpirun
from bench.peers.p2p import PEER_TRANSPORTS, SIDE_BYTE, iters_for, run_peer, warmup_for

__all__ = [
    "A2A_PEER_TRANSPORTS",
    "PEER_TRANSPORTS",
    "SIDE_BYTE",
    "a2a_block_bytes",
    "a2a_byte",
    "a2a_check",
    "a2a_merge_ranks",
    "a2a_send_buffer",
    "a2a_timed",
    "iters_for",
    "iters_for_budget",
    "mpi_a2a_command",
    "mpi_available",
    "mpi_command",
    "mpirun",
    "run_a2a_peer",
    "run_peer",
    "warmup_for",
]
