"""The serving engine's flags, defined once for `xpod generate`, `xpod serve` and the benchmarks
that launch an engine, and the checked EngineConfig they make (`engine_config`: its PodConfig
too, so a bad combination is refused before anything starts, naming the flag)."""

from __future__ import annotations

import argparse
import os

from memory import pool_layout
from memory.errors import ConfigError
from runtime.cli.argtypes import (
    flag_error,
    int_range,
    nonneg_float,
    nonneg_int,
    output_file,
    positive_float,
    positive_int,
)
from runtime.cli.hosts import add_host_args, host_fields
from runtime.cli.model_flags import (
    add_alltoall_flags,
    add_eplb_flags,
    add_model_flags,
    add_pin_flag,
    add_spec_flags,
    add_split_flags,
    eplb_config,
    model_overrides,
    quant_of,
    spec_of,
    split_dies,
)
from runtime.engine import EngineConfig
from runtime.engine.pool_config import PoolConfig, quota_blocks

# Fields named by EngineConfig / ModelConfig / PodConfig / SamplingParams errors -> their flags
ENGINE_FLAGS = {
    "preset": "--model",
    "score_bias": "--score-bias",
    "eplb": "--eplb/--redundant/--model",
    "num_dies": "--dies",
    "expert_dies": "--dies/--attention-dies/--expert-dies",
    "num_experts": "--experts/--dies/--expert-dies/--model",
    "domains": "--domains",
    "microbatches": "--microbatches",
    "split": "--attention-dies/--expert-dies/--domains",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "a2a_max_batch": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "num_blocks": "--num-blocks",
    "app_bytes": "--num-blocks/--block-size/--max-num-seqs/--model",
    "serve_slot_bytes": "--max-num-seqs/--max-num-batched-tokens/--block-size",
    "async_depth": "--async-depth",
    "lb_policy": "--lb",
    "queue_ahead": "--queue-ahead",
    "stream_interval": "--stream-interval",
    "gc_every": "--gc-every",
    "pin": "--pin",
    "timeout_s": "--timeout",
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "seed": "--seed",
    "stop_token_ids": "--stop-token-ids",
    "inject": "--inject",
    "stall_timeout_s": "--stall-timeout",
    "op_timeout_s": "--op-timeout",
    "heartbeat_timeout_s": "--heartbeat-timeout",
    "max_restarts": "--max-restarts",
    "prefill_dies": "--prefill-dies",
    "decode_dies": "--decode-dies",
    "decode_blocks": "--decode-blocks",
    "kv_policy": "--kv-policy",
    "kv_lease_s": "--kv-lease",
    "kv_timeout_s": "--kv-timeout",
    "speculative": "--speculative-config/--num-speculative-tokens/--mtp-draft",
    "kv_pool": "--kv-pool",
    "kv_pool.dram_mib": "--pool-dram-mib",
    "kv_pool.ssd_mib": "--pool-ssd-mib",
    "kv_pool.admit": "--pool-admit",
    "kv_pool.store": "--pool-store",
    "kv_pool.min_hit_blocks": "--pool-min-hit-blocks",
    "kv_pool.load_timeout_s": "--pool-load-timeout",
    "kv_pool.load_by": "--pool-load-by",
    "kv_pool.quotas": "--pool-quota",
    "kv_pool.decode_load": "--pool-decode-load",
}
# The KV pool's flags (None: not given) -> their PoolConfig field and default
POOL_FLAGS = {
    "--pool-dram-mib": ("dram_mib", 256.0),
    "--pool-ssd-mib": ("ssd_mib", 0.0),
    "--pool-dir": ("pool_dir", None),
    "--pool-admit": ("admit", "always"),
    "--pool-store": ("store", "prompt"),
    "--pool-min-hit-blocks": ("min_hit_blocks", 1),
    "--pool-load-timeout": ("load_timeout_s", 2.0),
    "--pool-load-by": ("load_by", "master"),
    "--pool-quota": ("quotas", None),  # [(ns, MiB)] -> {ns: MiB}
    "--pool-decode-load": ("decode_load", "on"),  # on | off -> bool
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's flags (`xpod generate`, `xpod serve`, `xpod bench serve --launch`)."""
    add = p.add_argument
    add("--dies", type=positive_int, default=4,
        help="dies = DP groups (default 4); with --attention-dies, the pod's dies")  # fmt: skip
    add_model_flags(p)
    add_host_args(p)
    add("--max-num-seqs", type=positive_int, default=8, help="batch limit per group (default 8)")
    add(
        "--max-num-batched-tokens",
        type=positive_int,
        default=128,
        help="token budget of one step per die (default 128: a 64-token prompt's prefill and"
        " the decode rows of its group fit in one step)",
    )
    add("--block-size", type=positive_int, default=16, help="KV block, tokens (default 16)")
    add(
        "--num-blocks",
        type=nonneg_int,
        default=0,
        help="KV blocks per die (default 0: max-num-seqs full contexts)",
    )
    add(
        "--async-depth",
        type=int_range(1, 2),
        default=2,
        help="2 = plan step n+1 while step n runs (default), 1 = synchronous",
    )
    add("--no-prefix-cache", action="store_true", help="do not reuse the KV of prompt prefixes")
    add(
        "--lb",
        default="least_kv",
        choices=("least_kv", "round_robin", "prefix"),
        help="DP load balancing (default least_kv; prefix: KV-centric, the group whose recent"
        " prompts share the most leading blocks, less its reserved KV: a baseline for the KV"
        " pool's load-only routing)",
    )
    add_alltoall_flags(p)
    add(
        "--gc-every",
        type=nonneg_int,
        default=0,
        help="0 = automatic GC; N = freeze after warm-up, collect every N steps",
    )
    add_pin_flag(p, "dies and masters")
    add_eplb_flags(p, ("off", "on"), every=64, window="busy")
    add(
        "--trace",
        type=output_file,
        default=None,
        metavar="FILE",
        help="write a Perfetto timeline (masters above dies) to FILE when done",
    )
    add_split_flags(p, "serve")
    add_pd_flags(p)
    add_pool_flags(p)
    add_spec_flags(p)
    add_reliability_flags(p)


def add_pd_flags(p: argparse.ArgumentParser) -> None:
    """Prefill-decode disaggregation (runtime.engine.pd)."""
    g = p.add_argument_group("prefill-decode disaggregation")
    add = g.add_argument
    add("--prefill-dies", type=nonneg_int, default=0, metavar="P",
        help="a PD pod: P prefill dies (dies 0..P-1) and --decode-dies decode dies, each part"
        " its own lockstep EP group; the KV moves once, zero-copy, prefill -> decode"
        " (replaces --dies)")  # fmt: skip
    add("--decode-dies", type=nonneg_int, default=0, metavar="D", help="decode dies of a PD pod")
    add("--decode-blocks", type=nonneg_int, default=0, metavar="N",
        help="KV blocks of a decode die (default: --num-blocks)")  # fmt: skip
    add("--kv-policy", default="recompute", choices=("fail", "recompute"),
        help="a failed KV transfer: send the request again (recompute, default) or end it with"
        " an error event (fail)")  # fmt: skip
    add("--no-kv-checksum", action="store_true",
        help="no crc32 of the KV transfers (by default the prefill die sends the source's and"
        " the decode die checks what landed, timed apart from the copy)")  # fmt: skip
    add("--kv-lease", type=positive_float, default=30.0, metavar="S",
        help="a prefill die frees unread KV after S seconds (default 30)")  # fmt: skip
    add("--kv-timeout", type=positive_float, default=2.0, metavar="S",
        help="a decode die probes the link of a request waiting S seconds for its KV; no echo"
        " within S more: the link is dead (default 2)")  # fmt: skip


def add_pool_flags(p: argparse.ArgumentParser) -> None:
    """The pod-wide KV pool (runtime.engine.pool_shell; docs/serving.md "KV pool")."""
    g = p.add_argument_group("KV pool")
    add = g.add_argument
    add("--kv-pool", action="store_true",
        help="a pod-wide KV pool: a prompt prefix any die computed is loaded, not recomputed,"
        " on every die (a pool server's DRAM tier, optionally an SSD tier)")  # fmt: skip
    add("--pool-dram-mib", type=positive_float, default=None, metavar="N",
        help="the pool's DRAM tier, MiB of /dev/shm (default 256)")  # fmt: skip
    add("--pool-ssd-mib", type=nonneg_float, default=None, metavar="N",
        help="the pool's SSD tier, MiB of block files (default 0: none)")  # fmt: skip
    add("--pool-dir", default=None, metavar="DIR",
        help="the SSD tier's directory, kept and re-indexed at the next start (default: a"
        " directory in the run directory, removed at exit)")  # fmt: skip
    add("--pool-admit", default=None, choices=("always", "second_hit"),
        help="store a block at once (always, default) or once two lookups missed it")  # fmt: skip
    add("--pool-store", default=None, choices=("prompt", "all", "off"),
        help="store new full prompt blocks after prefill (prompt, default), also a finished"
        " request's generated blocks (all: a conversation's next turn hits its reply), or"
        " nothing (off: loads only)")  # fmt: skip
    add(
        "--pool-min-hit-blocks",
        type=nonneg_int,
        default=None,
        metavar="N",
        help="load a pool hit of N blocks or more, recompute a smaller one (default 1)",
    )
    add("--pool-load-timeout", type=positive_float, default=None, metavar="S",
        help="a load not done in S seconds falls back to recompute (default 2)")  # fmt: skip
    add("--pool-load-by", default=None, choices=("master", "server"),
        help="who copies a DRAM hit into a die's blocks: its master, from the mapped tier"
        " (default: no message on the critical path), or the pool server on an order"
        " (hits on the SSD tier always: promoted first)")  # fmt: skip
    add("--pool-decode-load", default=None, choices=("on", "off"),
        help="a PD pod: the decode die takes the prompt's prefix from its own cache and the"
        " pool itself, and the KV link carries the rest (on, default), or the link carries"
        " every prompt token (off)")  # fmt: skip
    add(
        "--pool-quota",
        type=quota_arg,
        action="append",
        default=None,
        metavar="NS=MIB",
        help="at most MIB of the DRAM tier for the blocks of namespace NS (the requests whose"
        " cache_salt is NS; an empty NS, `=MIB`: the requests without one): a block past it is"
        " not stored; repeatable (default: none)",
    )


def quota_arg(text: str) -> tuple[str, float]:
    """An argparse type: `NS=MIB` (a namespace, empty for the default one: `=MIB`; a finite
    number of MiB > 0)."""
    ns, eq, mib = text.rpartition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"{text!r} is not NS=MIB (a namespace and its MiB)")
    return ns, positive_float(mib)


def pool_of(args: argparse.Namespace) -> PoolConfig | None:
    """The PoolConfig of --kv-pool and the --pool-* flags (None without --kv-pool);
    ConfigError naming the flag: a --pool-* flag without --kv-pool, --kv-pool without the prefix
    cache."""
    given = {f: getattr(args, f[2:].replace("-", "_"), None) for f in POOL_FLAGS}
    if not getattr(args, "kv_pool", False):
        for flag, value in given.items():
            if value is not None:
                raise ConfigError(f"argument {flag}: needs --kv-pool")
        return None
    if getattr(args, "no_prefix_cache", False):
        raise ConfigError("argument --kv-pool: not with --no-prefix-cache: loaded blocks join"
                          " the prefix cache")  # fmt: skip
    if given["--pool-dir"] is not None and not given["--pool-ssd-mib"]:
        raise ConfigError("argument --pool-dir: needs --pool-ssd-mib > 0 (the SSD tier it"
                          " holds)")  # fmt: skip
    fields = {POOL_FLAGS[f][0]: POOL_FLAGS[f][1] if v is None else v for f, v in given.items()}
    quotas: dict[str, float] = {}
    for ns, mib in fields["quotas"] or ():
        if ns in quotas:
            raise ConfigError(f"argument --pool-quota: namespace {ns!r} given twice")
        quotas[ns] = mib
    fields["quotas"] = quotas
    fields["decode_load"] = fields["decode_load"] == "on"
    if fields["pool_dir"] is not None:  # the pool server may run from another directory
        fields["pool_dir"] = os.path.abspath(fields["pool_dir"])
    return PoolConfig(**fields)


def check_pool_fits(cfg: EngineConfig) -> None:
    """What the pool's shell would refuse at start, refused now (ConfigError naming the flag):
    a DRAM tier holding no block or more than /dev/shm or MemAvailable allows, an SSD tier
    holding no block, a --pool-dir that cannot be written or holds files not the pool's."""
    pool = cfg.kv_pool
    if pool is None:
        return
    m = cfg.model_config()
    dims = (m.kv_layers, cfg.block_size, m.kv_cache_dim)
    # emulated hosts (--hosts 2,2): every host's server and its DRAM tier on this machine
    n = cfg.pool_servers if not cfg.host_names else 1
    try:
        pool_layout.slots_for(pool.dram_mib * n, *dims)
    except ConfigError as e:
        more = f" (the {n} hosts' DRAM tiers together, all on this machine)" if n > 1 else ""
        raise ConfigError(_named(e, "--pool-dram-mib") + more) from None
    block = pool_layout.slot_bytes(*dims)
    if pool.ssd_mib and int(pool.ssd_mib * (1 << 20)) < block:
        raise ConfigError(f"argument --pool-ssd-mib: {pool.ssd_mib:g} MiB holds no block of"
                          f" {block} B")  # fmt: skip
    quota_blocks(pool.quotas, block)  # a quota under one block
    if pool.pool_dir is not None:
        try:
            pool_layout.check_pool_dir(pool.pool_dir)
        except ConfigError as e:
            raise ConfigError(_named(e, "--pool-dir")) from None


def _named(err: ConfigError, flag: str) -> str:
    """A pool_layout message (`--pool-... VALUE: why`) as `argument FLAG VALUE: why`, FLAG
    this command's spelling."""
    msg = " ".join(str(err).split())
    if msg.startswith("--pool-") and " " in msg:
        return f"argument {flag} {msg.split(' ', 1)[1]}"
    return f"argument {flag}: {msg}"


def add_reliability_flags(p: argparse.ArgumentParser) -> None:
    """Fault detection, recovery and injection (runtime.engine.supervisor / faults)."""
    g = p.add_argument_group("reliability")
    add = g.add_argument
    add("--no-recover", action="store_true",
        help="a die / master / output process that dies or hangs ends the engine (every request"
        " fails) instead of a restart that resumes every request")  # fmt: skip
    add("--op-timeout", type=positive_float, default=0.5, metavar="S",
        help="deadline of a serving step's collective waits: past it, a lost write (rollback)"
        " or, if a die or master is stopped, a hang (restart); raise it on a machine whose"
        " processes stall for longer (default 0.5)")  # fmt: skip
    add("--no-rollback", action="store_true",
        help="a link fault or lost write restarts instead of re-running the step")  # fmt: skip
    add("--stall-timeout", type=positive_float, default=1.0, metavar="S",
        help="no die progress for S seconds under load = hang (default 1)")  # fmt: skip
    add("--heartbeat-timeout", type=positive_float, default=1.5, metavar="S",
        help="a group silent to the heartbeat for S seconds = hang (default 1.5)")  # fmt: skip
    add("--max-restarts", type=positive_int, default=3, metavar="N",
        help="more than N restarts in 60 s: give up (default 3)")  # fmt: skip
    add("--inject", default="", metavar="PLAN",
        help="fault plan, e.g. 'kill:die=2,step=300; stop:master=1,at=5s,for=0.3s'"
        " (kinds kill, stop, kvfault, err, drop, delay; targets die, master, output; when"
        " step=S and / or at=T; @FILE reads the plan from a file)")  # fmt: skip
    add("--fault-log", type=output_file, default=None, metavar="FILE",
        help="append every fault injected, detected, recovered to FILE as JSON lines")  # fmt: skip


def engine_config(args: argparse.Namespace, **extra) -> EngineConfig:
    """The EngineConfig of the engine flags (and `extra` fields); ConfigError names the flag."""
    try:
        args.dies, host_cfg = host_fields(args, args.dies, 4)
        if host_cfg.get("hosts") and (args.prefill_dies or args.decode_dies):
            raise ConfigError("--hosts: a PD pod runs on one host (--prefill-dies/--decode-dies)")
        dies, att, exp = split_dies(args)
        cfg = EngineConfig(
            dies=att or dies,
            expert_dies=exp,
            domains=args.domains,
            microbatches=args.microbatches,
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            async_depth=args.async_depth,
            prefix_cache=not args.no_prefix_cache,
            lb_policy=args.lb,
            protocol=args.protocol,
            quant=quant_of(args),
            combine_dtype=args.combine_dtype,
            gc_every=args.gc_every,
            pin=args.pin,
            timeout_s=args.timeout,
            trace=args.trace or "",
            model_overrides=model_overrides(args),
            eplb=eplb_config(args) if args.eplb == "on" else None,
            recover=not args.no_recover,
            stall_timeout_s=args.stall_timeout,
            op_timeout_s=args.op_timeout,
            rollback=not args.no_rollback,
            heartbeat_timeout_s=args.heartbeat_timeout,
            max_restarts=args.max_restarts,
            inject=args.inject,
            fault_log=args.fault_log or "",
            prefill_dies=args.prefill_dies,
            decode_dies=args.decode_dies,
            decode_blocks=args.decode_blocks,
            kv_policy=args.kv_policy,
            kv_lease_s=args.kv_lease,
            kv_timeout_s=args.kv_timeout,
            kv_checksum=not args.no_kv_checksum,
            speculative=spec_of(args),
            kv_pool=pool_of(args),
            **host_cfg,
            **extra,
        )  # fmt: skip
        cfg.pod_config()  # the pod it sizes must be valid too
        check_pool_fits(cfg)
        if cfg.speculative is not None and cfg.speculative.transcript:
            raise ConfigError(
                f"speculative: the {cfg.speculative.draft} draft reads a transcript of the same"
                " requests without MTP (future output): benchmarks only (xpod bench engine,"
                " xpod decode); serve with real or fit"
            )
    except ConfigError as e:
        raise flag_error(e, ENGINE_FLAGS) from None
    return cfg
