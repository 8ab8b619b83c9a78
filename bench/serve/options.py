"""What one `xpod bench serve` run was asked for: `Options`, every flag already checked (the
parts read it and never argparse), and `BenchError`, which stops a run."""

from __future__ import annotations

from dataclasses import dataclass, field

PROG = "xpod bench serve"


class BenchError(Exception):
    """The benchmark cannot go on (the server failed, did not answer, refused the prompts)."""


@dataclass(frozen=True)
class MTSpec:
    """The shape of a multi-turn workload (KVPOOL.md §5.1's defaults for the small model)."""

    conversations: int = 32
    turns: int = 6
    system_len: int = 256
    families: int = 1
    user_len: int = 48
    output_len: int = 32
    think_s: float = 1.0
    stagger_s: float = 0.25
    skew: bool = False

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    @property
    def max_context(self) -> int:
        """Tokens of the longest conversation's last turn with its reply: BOS + S + T (U + O)."""
        return 1 + self.system_len + self.turns * (self.user_len + self.output_len)


@dataclass(frozen=True)
class Options:
    url: str | None
    launch: bool
    server_argv: tuple[str, ...]  # `xpod serve` flags after `serve` (launch)
    dies: int  # of the launched server (0 with --url: read from /metrics)
    model: str
    max_num_seqs: int
    protocol: str
    quant: str | None
    max_model_len: int  # 0 with --url: read from /v1/models
    endpoint: str
    num_prompts: int
    request_rate: float
    burstiness: float
    ramp: tuple[str, float, float] | None
    max_concurrency: int | None
    dataset: str
    input_len: int
    output_len: int
    range_ratio: float
    prefix_len: int
    pr_prefix_len: int
    pr_suffix_len: int
    pr_num_prefixes: int
    pr_output_len: int
    dataset_path: str | None
    file_rows: tuple[tuple[str, int | None], ...]
    ignore_eos: bool
    temperature: float
    goodput: dict
    percentile_metrics: tuple[str, ...]
    metric_percentiles: tuple[float, ...]
    seed: int
    json: str | None
    plot: str | None
    rate_sweep: tuple[float, ...]
    quick: bool
    ttft: bool
    ttft_probes: int
    save_detailed: bool
    show_progress: bool
    request_timeout_s: float
    client_batch: bool = True
    repeat: int = 1
    lb_compare: bool = False
    model_overrides: dict = field(default_factory=dict)  # the server's, for xpod decode
    # PD (--prefill-dies / --decode-dies): the PD layout's parts, kept in the colocated
    # layout's copy too (same interference streams, same TTFT load)
    prefill_dies: int = 0
    decode_dies: int = 0
    layout: str = ""  # "pd" or "colocated" with --prefill-dies, "" otherwise
    compare_colocated: bool = False
    colocated_argv: tuple[str, ...] = ()  # `xpod serve` flags of the colocated layout
    burst_prompts: int = 8
    burst_len: int = 1024
    notes: tuple[str, ...] = ()  # what the flags changed on their own (progress lines)
    # --dataset multi-turn (bench.serve.multiturn) and --compare-pool (bench.serve.mt_compare)
    mt: MTSpec | None = None
    block_size: int = 16  # the server's KV block (the ideal hit rate's unit)
    compare_pool: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (layout, its server flags)

    @property
    def decode_groups(self) -> int:
        """Groups that decode: the decode dies of a PD layout (and of its colocated copy, so
        that both see the same load), else every die."""
        return self.decode_dies or self.dies

    @property
    def load_concurrency(self) -> int:
        """Requests in flight in the TTFT phase's loaded part (probe included)."""
        return self.max_concurrency or self.decode_groups * self.max_num_seqs

    @property
    def baseline_dies(self) -> int:
        """Dies of the `xpod decode` baseline: the decode part of a PD layout, else all."""
        return self.decode_dies if self.layout == "pd" else self.dies

    @property
    def interference(self) -> bool:
        """Run the interference phase (idle decode TPOT, then under a burst of long
        prompts): with --prefill-dies, on either layout."""
        return bool(self.layout)

    @property
    def interference_streams(self) -> int:
        """K: decode streams of the interference phase, 2 per decode die."""
        return 2 * self.decode_groups
