"""What `xpod generate` prints of a PD pod's KV transfers and a split pod's roles."""

from __future__ import annotations


def print_pd_stats(pd: dict) -> None:
    """A PD pod's KV transfers."""
    print(f"\n  PD pod: prefill dies {pd['prefill_dies']}, decode dies {pd['decode_dies']}:"
          f" {pd['transfers']} KV transfers, {pd['bytes'] / 1e6:.2f} MB in {pd['copy_s'] * 1e3:.2f}"
          f" ms of copy ({pd['gbps']:.2f} GB/s), {pd['failed']} failed,"
          f" {pd['checksum_mismatches']} checksum mismatches")  # fmt: skip
    for link, v in sorted(pd["links"].items()):
        print(f"  link {link:>6}: {v['transfers']:>4} transfers {v['bytes'] / 1e6:8.2f} MB"
              f" {v['gbps']:6.2f} GB/s  {v['state']}")  # fmt: skip


def print_split_stats(sp: dict) -> None:
    """A split pod's roles: time shares, the expert idle share, A2E / E2A per step."""
    a, e = sp["attention_share"], sp["expert_share"]
    print(
        f"\n  split pod: attention dies {sp['attention_dies']} in {sp['domains']} domain(s) x"
        f" {sp['microbatches']} micro-batch(es), expert dies {sp['expert_dies']}, {sp['steps']}"
        " steps"
    )
    print("  attention dies' forward time: " + ", ".join(f"{k} {v:.0%}" for k, v in a.items()))
    print("  expert dies' time: " + ", ".join(f"{k} {v:.0%}" for k, v in e.items())
          + f" (idle = waiting for A2E input: {sp['expert_idle_share']:.0%})")  # fmt: skip
    print(f"  A2E {sp['a2e_ms_per_step']:.2f} ms, E2A {sp['e2a_ms_per_step']:.2f} ms per step"
          " (an attention die's calls, all layers)")  # fmt: skip


__all__ = ["print_pd_stats", "print_split_stats"]
