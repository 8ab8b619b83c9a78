"""`PoolConfig`: the KV pool's knobs (`EngineConfig.kv_pool`; runtime.engine.pool_shell runs
it). Its own module: the engine's config imports it without the pool's processes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memory.errors import ConfigError


@dataclass(frozen=True)
class PoolConfig:
    """The KV pool of an engine (`EngineConfig.kv_pool`).

    dram_mib: the DRAM tier (one pool server's shared-memory segment).
    ssd_mib: the SSD tier (block files; 0: none). pool_dir: where (None: a directory in the
        run directory, removed at close; a given one persists, re-indexed at start).
    admit: "always" | "second_hit" (a block is stored once two lookups missed it).
    store: "prompt" (new full prompt blocks after prefill) | "all" (also, at a request's end,
        the full blocks of the tokens it generated: a conversation's next turn, whose prompt
        holds this reply, hits them on any die) | "off" (loads only).
    min_hit_blocks: a smaller pool hit is not loaded (recomputed).
    load_timeout_s: a load not complete by then falls back to recompute.
    lease_s: how long a lookup pins its hit. restarts: a dead pool server is restarted this
        many times (then the pool is off: every prompt recomputes).
    load_by: "master": a die's master copies a DRAM hit from the server's tier (mapped) into
        its die's blocks itself, no message on the critical path; "server": the pool server
        copies it on a `load` order (hits on the SSD tier always go that way: promoted first).
    quotas: namespace (a request's cache salt) -> the most MiB of the DRAM tier its blocks may
        hold (a block past it is not stored: counted, never an error; the shell refuses a
        quota under one block at start). The namespace "" is the default one (the requests
        without a cache salt, which is never empty: 1 to 256 characters).
    decode_load: a PD pod's decode die takes the prompt's prefix from its own prefix cache and
        the pool (copied by its master) and the KV link carries the rest; False: the link
        carries every prompt token (the prefill die still loads the hit to compute the rest).
    """

    dram_mib: float = 256.0
    ssd_mib: float = 0.0
    pool_dir: str | None = None
    admit: str = "always"
    store: str = "prompt"
    min_hit_blocks: int = 1
    load_timeout_s: float = 2.0
    lease_s: float = 10.0
    restarts: int = 3
    load_by: str = "master"
    quotas: dict[str, float] = field(default_factory=dict)
    decode_load: bool = True

    def __post_init__(self) -> None:
        for name in ("dram_mib", "ssd_mib", "load_timeout_s", "lease_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise ConfigError(f"kv_pool.{name}: {v!r} must be a number >= 0")
        if self.dram_mib <= 0:
            raise ConfigError(f"kv_pool.dram_mib: {self.dram_mib!r} must be > 0")
        if self.admit not in ("always", "second_hit"):
            raise ConfigError(f"kv_pool.admit: {self.admit!r} must be always or second_hit")
        if self.load_by not in ("master", "server"):
            raise ConfigError(f"kv_pool.load_by: {self.load_by!r} must be master or server")
        if self.store not in ("prompt", "all", "off"):
            raise ConfigError(f"kv_pool.store: {self.store!r} must be prompt, all or off")
        if not isinstance(self.quotas, dict):
            raise ConfigError(f"kv_pool.quotas: {self.quotas!r} must map namespaces to MiB")
        for ns, mib in self.quotas.items():
            if not isinstance(ns, str):
                raise ConfigError(f"kv_pool.quotas: namespace {ns!r} must be a string ('': the"
                                  " default namespace)")  # fmt: skip
            if isinstance(mib, bool) or not isinstance(mib, int | float) or not 0 < mib < math.inf:
                raise ConfigError(f"kv_pool.quotas: {ns}={mib!r} must be a finite number of MiB"
                                  " > 0")  # fmt: skip
        if not isinstance(self.decode_load, bool):
            raise ConfigError(f"kv_pool.decode_load: {self.decode_load!r} must be a bool")
        for name in ("min_hit_blocks", "restarts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"kv_pool.{name}: {v!r} must be an int >= 0")


def quota_blocks(quotas: dict[str, float], slot_bytes: int) -> dict[str | None, int]:
    """`PoolConfig.quotas` (MiB per namespace) in blocks of slot_bytes, keyed as the index keys
    namespaces (None: the default one, ""); ConfigError naming the flag for a quota smaller
    than one block."""
    out = {}
    for ns, mib in quotas.items():
        n = int(mib * (1 << 20)) // slot_bytes
        if n < 1:
            raise ConfigError(f"argument --pool-quota {ns}={mib:g}: smaller than one block of"
                              f" {slot_bytes} B")  # fmt: skip
        out[ns or None] = n
    return out


__all__ = ["PoolConfig", "quota_blocks"]
