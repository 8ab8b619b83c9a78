"""`--dataset multi-turn` of `xpod bench serve`: conversations whose every turn resends the
whole history, the closed-loop client that plays them, and the trace's ideal hit rate.

After LMCache's multi-round QA, SGLang's `bench_multiturn.py` and vLLM's
`generate_multi_turn.json` (KVPOOL.md §5.1), all generated from the seed, nothing downloaded:
C conversations of T turns; each starts with a system prompt of S tokens (BOS + S printable
bytes) shared by every conversation of its family (G families; `skew`: family 0 takes half of
the conversations, the others share the rest); turn t sends

    system + (U_1 + R_1) + ... + (U_{t-1} + R_{t-1}) + U_t

as token ids (`/v1/completions` takes a list of ids), U_i the conversation's own U printable
bytes of turn i and R_i the server's own reply to turn i as it returned its ids
(`return_token_ids`: the tokenizer is bytes, a reply's text is never re-encoded). Replies are
O tokens (`ignore_eos`). Conversation c starts at c x `stagger_s`; a turn is sent when the
previous reply is complete plus an exponential think time of mean `think_s` (drawn from the
seed: the same in every run): a closed loop, so a slower server sends fewer turns per second.

The ideal hit rate of a trace (the prompts in the order they were sent) is the share of prompt
tokens that lie in full blocks (the server's block size) of a prefix some earlier prompt
already had, counting at most (len - 1) // block_size blocks of a prompt (the server computes
the last prompt token for its logits, as `sched.kv.KVManager.match_by_prefix` does): what a
pod-wide cache that never forgets would hit. `with_replies`: earlier prompts' replies count
too (what a die-local cache, which keeps decoded blocks, could hit on the die that served the
previous turn; the KV pool stores prompt blocks only).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.serve.client import Client, RequestResult
from bench.serve.dataset import Request
from bench.serve.options import MTSpec
from bench.serve.scrape import total
from runtime.model import BOS

PRINTABLE = (32, 127)  # the bytes of the generated text: printable ASCII


@dataclass(frozen=True)
class Conversation:
    index: int
    family: int
    start_s: float  # when its first turn goes, from the start of the run
    system: tuple[int, ...]  # BOS + the family's system prompt
    users: tuple[tuple[int, ...], ...]  # the user tokens of each turn
    thinks: tuple[float, ...]  # think time before turns 2..T (s)


def _bytes(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(*PRINTABLE, size=n))


def family_of(spec: MTSpec, rng: np.random.Generator) -> np.ndarray:
    """Each conversation's family: round robin over the G families (with `skew`: family 0 for
    half of them, the rest round robin over the others), in a seeded order."""
    c, g = spec.conversations, spec.families
    if spec.skew and g > 1:
        half = c // 2
        fam = np.concatenate([np.zeros(half, np.int64), 1 + np.arange(c - half) % (g - 1)])
    else:
        fam = np.arange(c) % g
    return rng.permutation(fam)


def make_conversations(spec: MTSpec, seed: int) -> list[Conversation]:
    """The workload of `spec`, the same for the same seed (whatever the server replies)."""
    srng = np.random.default_rng([seed, 1 << 24])
    systems = [(BOS, *_bytes(srng, spec.system_len)) for _ in range(spec.families)]
    fam = family_of(spec, np.random.default_rng([seed, 1 << 25]))
    out = []
    for c in range(spec.conversations):
        rng = np.random.default_rng([seed, 1 << 26, c])
        users = tuple(_bytes(rng, spec.user_len) for _ in range(spec.turns))
        thinks = tuple(float(x) for x in rng.exponential(spec.think_s, spec.turns - 1))
        f = int(fam[c])
        out.append(Conversation(c, f, c * spec.stagger_s, systems[f], users, thinks))
    return out


def _chain(tokens: Sequence[int], n_blocks: int, bs: int) -> list[int]:
    """Chained hashes of the first `n_blocks` full blocks of `tokens`."""
    out, parent = [], 0
    for i in range(n_blocks):
        parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
        out.append(parent)
    return out


def ideal_hits(
    prompts: Sequence[Sequence[int]],
    block_size: int,
    replies: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Per prompt (in the order sent), its tokens an ideal prefix cache would hit: the full
    blocks of a prefix an earlier prompt (with `replies`: an earlier prompt + its reply but the
    last token, whose KV is never computed) already had, at most (len - 1) // block_size."""
    seen: set[int] = set()
    out = []
    for i, p in enumerate(prompts):
        hits = 0
        for h in _chain(p, (len(p) - 1) // block_size, block_size):
            if h not in seen:
                break
            hits += block_size
        out.append(hits)
        seq = list(p) + list(replies[i][:-1]) if replies is not None else p
        seen.update(_chain(seq, len(seq) // block_size, block_size))
    return out


def ideal_hit_rate(
    prompts: Sequence[Sequence[int]],
    block_size: int,
    replies: Sequence[Sequence[int]] | None = None,
) -> float:
    """Ideal hit tokens (`ideal_hits`) over all prompt tokens (0 for no prompt)."""
    n = sum(len(p) for p in prompts)
    return sum(ideal_hits(prompts, block_size, replies)) / n if n else 0.0


class MultiTurnRun:
    """The closed-loop client of one run: every conversation a task, its turns one after
    another. Call it as `measure`'s runner; `trace` then holds (prompt, reply ids) in the
    order the prompts were sent, `turn_of` each result's turn."""

    def __init__(self, spec: MTSpec, seed: int):
        self.spec, self.seed = spec, seed
        self.convs = make_conversations(spec, seed)
        self.trace: list[tuple[list[int], list[int]]] = []

    @property
    def num_requests(self) -> int:
        return self.spec.requests

    async def __call__(self, client: Client, bar, max_concurrency: int | None = None):
        """Play every conversation: (results by conversation then turn, duration, the
        perf_counter when the last turn was sent)."""
        spec = self.spec
        results: list[RequestResult] = [RequestResult() for _ in range(spec.requests)]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        last_sent = 0.0
        t0 = time.perf_counter()
        bar.t0 = t0

        async def send(req: Request, ids: list[int]) -> RequestResult:
            nonlocal last_sent
            if sem is None:
                last_sent = time.perf_counter()
                return await client.send(req, bar, ignore_eos=True, ids=ids)
            async with sem:
                last_sent = time.perf_counter()
                return await client.send(req, bar, ignore_eos=True, ids=ids)

        async def play(conv: Conversation) -> None:
            await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
            history = list(conv.system)
            for t in range(spec.turns):
                if t:
                    await asyncio.sleep(conv.thinks[t - 1])
                prompt = history + list(conv.users[t])
                ids: list[int] = []
                self.trace.append((prompt, ids))
                req = Request("", len(prompt), spec.output_len, token_ids=tuple(prompt))
                res = await send(req, ids)
                k = conv.index * spec.turns + t
                results[k] = res
                if res.ok and len(ids) != res.output_tokens:
                    res.ok = False
                    res.error = f"{len(ids)} token ids for {res.output_tokens} output tokens"
                if not res.ok:  # the conversation cannot go on without its reply
                    for j in range(k + 1, (conv.index + 1) * spec.turns):
                        results[j] = RequestResult(error=f"turn {t + 1} failed: {res.error}")
                        bar.finished()
                    return
                history = prompt + ids

        tasks = [asyncio.create_task(play(c)) for c in self.convs]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        duration = time.perf_counter() - t0
        bar.close()
        return results, duration, last_sent

    def figures(self, block_size: int, results: list[RequestResult]) -> dict:
        """The workload and its ideal hit rates (prompts as sent), TTFT p50 by turn."""
        spec = self.spec
        prompts = [p for p, _ in self.trace]
        replies = [r for _, r in self.trace]
        ttft_by_turn = []
        for t in range(spec.turns):
            v = [r.ttft * 1e3 for k, r in enumerate(results) if k % spec.turns == t and r.ok]
            ttft_by_turn.append(float(np.median(v)) if v else None)
        return {
            "mt_conversations": spec.conversations,
            "mt_turns": spec.turns,
            "mt_system_len": spec.system_len,
            "mt_system_prompts": spec.families,
            "mt_user_len": spec.user_len,
            "mt_output_len": spec.output_len,
            "mt_think_s": spec.think_s,
            "mt_stagger_s": spec.stagger_s,
            "mt_skew": spec.skew,
            "ideal_block_size": block_size,
            "ideal_prompt_tokens": sum(len(p) for p in prompts),
            "ideal_hit_rate": ideal_hit_rate(prompts, block_size),
            "ideal_hit_rate_replies": ideal_hit_rate(prompts, block_size, replies),
            "median_ttft_ms_by_turn": ttft_by_turn,
        }


def load_figures(s0: dict | None, s1: dict | None) -> dict:
    """Prompt tokens served per group over a run (`xpod_prompt_tokens_by_source_total`, every
    source; a counter that went down was reset and counts from 0) and their max / mean
    (`load_imbalance`), and the same of the computed ones (`computed_imbalance`); the engine's
    restarts in between (`xpod_engine_incarnation`: the pod restarted after a die was declared
    dead, its counters and caches started over); {} from a server without the counter."""
    name = "xpod_prompt_tokens_by_source_total"
    before = {tuple(sorted(lab.items())): v for lab, v in (s0 or {}).get(name, ())}
    served: dict[str, float] = {}
    computed: dict[str, float] = {}
    for lab, v in (s1 or {}).get(name, ()):
        v0 = before.get(tuple(sorted(lab.items())), 0.0)
        d, g = (v - v0 if v >= v0 else v), lab.get("group", "")
        served[g] = served.get(g, 0.0) + d
        computed[g] = computed.get(g, 0.0) + (d if lab.get("source") == "computed" else 0.0)
    if not served:
        return {}
    order = sorted(served, key=lambda g: (len(g), g))

    def imbalance(v: list[float]) -> float | None:
        mean = sum(v) / len(v)
        return max(v) / mean if mean else None

    restarts = total(s1, "xpod_engine_incarnation") - total(s0, "xpod_engine_incarnation")
    return {
        "engine_restarts": int(restarts),  # > 0: the counters were reset during the run
        "prompt_tokens_by_group": [int(served[g]) for g in order],
        "computed_tokens_by_group": [int(computed[g]) for g in order],
        "load_imbalance": imbalance([served[g] for g in order]),
        "computed_imbalance": imbalance([computed[g] for g in order]),
    }
