"""`xpod serve --kv-pool` end to end: a prompt that one die computed is loaded from the pool on
the other (round-robin balancing sends the same prompt to the other die the second time, where
the die-local prefix cache has nothing), `/metrics` says so (pool hits, prompt tokens by
source), the output is the same token for token (batch-invariant mode, greedy), and nothing of
the pool (its server, its segment) is left behind."""

from __future__ import annotations

import json

import pytest

from runtime.model import encode
from tests.integration.test_api_server import ServerProc, metric, settle
from tests.waiting import wait_for

BLOCK = 16
PROMPT = "the pod is a machine of many dies, and every die has a memory of its own. " * 2


def complete(s: ServerProc) -> dict:
    status, _, data = s.post("/v1/completions", {
        "model": "xpod-tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert status == 200, data
    return json.loads(data)


def by_source(m: dict, source: str) -> float:
    return sum(metric(m, "xpod_prompt_tokens_by_source_total", group=g, source=source)
               for g in (0, 1))  # fmt: skip


@pytest.mark.timeout(120)
def test_second_die_loads_the_prompt_from_the_pool():
    n_prompt = len(encode(PROMPT))
    assert n_prompt > 3 * BLOCK
    s = ServerProc("--kv-pool", "--pool-dram-mib", "16", "--lb", "round_robin",
                   "--batch-invariant", "--block-size", str(BLOCK))  # fmt: skip
    try:
        m0 = settle(s)  # the warm-up's requests counted already
        first = complete(s)
        full = (n_prompt - 1) // BLOCK  # the blocks a prefix match may use (at most len - 1)
        wait_for(lambda: metric(s.metrics(), "xpod_pool_stored_blocks_total") >= full,
                 what="the first prompt's blocks stored in the pool")  # fmt: skip
        second = complete(s)
        # the masters' stats reach /metrics after the response: wait on the counter (it only
        # grows), else an idle group's stats from before the request read as settled
        wait_for(
            lambda: (
                sum(metric(s.metrics(), "xpod_pool_hits_total", group=g) for g in (0, 1))
                >= full * BLOCK
            ),
            what="the pool hit in /metrics",
        )
        m = settle(s)
        a, b = first["choices"][0], second["choices"][0]
        assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
        details = [u.pop("prompt_tokens_details") for u in (first["usage"], second["usage"])]
        assert first["usage"] == second["usage"]
        assert details == [{"cached_tokens": 0}, {"cached_tokens": full * BLOCK}]  # the load
        hits = [metric(m, "xpod_pool_hits_total", group=g) for g in (0, 1)]
        assert hits[0] == 0 and hits[1] == full * BLOCK, hits  # round robin: group 1 loaded
        src = {k: by_source(m, k) - by_source(m0, k) for k in ("local", "pool", "computed")}
        # neither die had it in its own cache: the first computed it, the second loaded it
        assert src == {"local": 0, "pool": full * BLOCK, "computed": 2 * n_prompt - full * BLOCK}
        assert metric(m, "xpod_pool_loads_total", group=1) == 1
        assert metric(m, "xpod_pool_load_fallbacks_total", group=1) == 0
        assert metric(m, "xpod_pool_crc_mismatches_total", group=1) == 0
        assert metric(m, "xpod_pool_load_bytes_total", group=1) > 0
        assert metric(m, "xpod_pool_blocks", tier="dram") == full
        assert metric(m, "xpod_pool_server_up") == 1
    finally:
        s.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("output_procs", [False, True])
def test_pd_usage_counts_the_prefill_dies_cached_tokens(output_procs):
    """A PD pod: the prefill die's prefix hit (the second time, its cache holds the prompt) is
    the usage's `cached_tokens`, also when the decode group's output process renders it (its
    own master admits the request with every prompt token transferred)."""
    n_prompt = len(encode(PROMPT))
    extra = ("--output-procs",) if output_procs else ()
    s = ServerProc("--prefill-dies", "1", "--decode-dies", "1", "--kv-pool", "--pool-dram-mib",
                   "16", "--block-size", str(BLOCK), *extra)  # fmt: skip
    try:
        settle(s)
        first = complete(s)
        second = complete(s)
        full = (n_prompt - 1) // BLOCK
        details = [u["prompt_tokens_details"] for u in (first["usage"], second["usage"])]
        assert details == [{"cached_tokens": 0}, {"cached_tokens": full * BLOCK}]
        assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    finally:
        s.stop()
