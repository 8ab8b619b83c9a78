"""`python -m bench.peers`: the p2p peer baselines alone, one table on stdout."""

from bench.common import print_table
from bench.peers.p2p import PEER_TRANSPORTS, run_peer
from runtime.cli.argtypes import Parser, choice_list, positive_float, size_list


def main() -> None:
    parser = Parser(prog="python -m bench.peers", description="peer baselines of xpod bench p2p")
    parser.add_argument(
        "--transports", type=choice_list(PEER_TRANSPORTS), default=",".join(PEER_TRANSPORTS)
    )
    parser.add_argument("--sizes", type=size_list, default="8,4096,64K,1M,8M")
    parser.add_argument("--iters-scale", type=positive_float, default=1.0)
    parser.add_argument("--no-pin", action="store_true")
    cli = parser.parse_args()
    all_rows = []
    for name in cli.transports:
        all_rows += run_peer(name, cli.sizes, cli.iters_scale, not cli.no_pin)
    columns = [("transport", "transport", ""), ("size_bytes", "size", "size")]
    columns += [("p50_us", "p50_us", ".2f"), ("p99_us", "p99_us", ".2f")]
    columns += [("min_us", "min_us", ".2f"), ("gbps", "GB/s", ".3f")]
    columns += [("cpu_s_per_die", "cpu_s", ".3f"), ("iters", "iters", "d")]
    print_table(all_rows, columns)


if __name__ == "__main__":
    main()
