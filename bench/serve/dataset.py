"""The requests of a run and when they go: the datasets `random`, `prefix-repetition` and
`file` (nothing is downloaded), their fit in the model's context, and vLLM's gamma arrivals.
The `multi-turn` dataset is `bench.serve.multiturn` (a closed loop: no arrival times)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from bench.serve.options import Options
from memory.errors import ConfigError
from runtime.model import encode

CHAT_OVERHEAD = len(encode("<|user|>\n\n<|assistant|>\n", bos=False))  # openai_api.chat_prompt


@dataclass(frozen=True)
class Request:
    """One request of a dataset: its prompt text, prompt tokens (BOS included) and max_tokens;
    `token_ids`: the prompt as token ids instead of text (multi-turn: sent as they are)."""

    prompt: str
    prompt_len: int
    max_tokens: int
    token_ids: tuple[int, ...] = ()


def read_jsonl(path: str) -> tuple[tuple[str, int | None], ...]:
    """(prompt, max_tokens or None) of every line of a JSONL file; ConfigError naming the line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"argument --dataset-path: {path}:{i}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{where}: not JSON: {e}") from None
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ConfigError(f'{where}: want {{"prompt": "non-empty text", ...}}')
            mt = obj.get("max_tokens")
            if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
                raise ConfigError(f"{where}: max_tokens must be an integer >= 1")
            rows.append((prompt, mt))
    if not rows:
        raise ConfigError(f"argument --dataset-path: {path} has no prompts")
    return tuple(rows)


def random_text(rng: np.random.Generator, n: int) -> str:
    """`n` printable ASCII characters (one byte token each)."""
    return rng.integers(32, 127, size=n, dtype=np.uint8).tobytes().decode("ascii")


def _lens(rng: np.random.Generator, n: int, length: int, ratio: float, lo: int) -> np.ndarray:
    if ratio == 0:
        return np.full(n, length, dtype=np.int64)
    a, b = max(lo, math.floor(length * (1 - ratio))), max(lo, math.ceil(length * (1 + ratio)))
    return rng.integers(a, b + 1, size=n)


def make_requests(opts: Options, n: int, phase: int) -> list[Request]:
    """`n` requests of the dataset; random prompts differ between phases (no prefix hits)."""
    rng = np.random.default_rng([opts.seed, phase])
    if opts.dataset == "file":
        rows = [opts.file_rows[i % len(opts.file_rows)] for i in range(n)]
        return [Request(p, len(encode(p)), mt or opts.output_len) for p, mt in rows]
    if opts.dataset == "prefix-repetition":
        prng = np.random.default_rng([opts.seed, 1 << 20])  # the same prefixes in every phase
        prefixes = [random_text(prng, opts.pr_prefix_len) for _ in range(opts.pr_num_prefixes)]
        which = rng.permutation(np.arange(n) % opts.pr_num_prefixes)
        out = []
        for k in which:
            text = prefixes[k] + random_text(rng, opts.pr_suffix_len)
            out.append(Request(text, len(text) + 1, opts.pr_output_len))
        return out
    shared = random_text(np.random.default_rng([opts.seed, 1 << 21]), opts.prefix_len)
    ins = _lens(rng, n, opts.input_len, opts.range_ratio, 2)
    outs = _lens(rng, n, opts.output_len, opts.range_ratio, 1)
    out = []
    for i_len, o_len in zip(ins, outs, strict=True):
        text = shared + random_text(rng, int(i_len) - 1)
        out.append(Request(text, len(text) + 1, int(o_len)))
    return out


def probe_requests(opts: Options, n: int, phase: int) -> list[Request]:
    """TTFT probes: random prompts of --random-input-len tokens, max_tokens 1."""
    rng = np.random.default_rng([opts.seed, 1 << 22, phase])
    return [
        Request(t, len(t) + 1, 1) for t in (random_text(rng, opts.input_len - 1) for _ in range(n))
    ]


def context_len(opts: Options, req: Request) -> int:
    """Prompt tokens as the server counts them (chat: the template's too) + max_tokens."""
    return req.prompt_len + (CHAT_OVERHEAD if opts.endpoint == "chat" else 0) + req.max_tokens


def check_context(opts: Options, reqs: list[Request], max_len: int) -> None:
    worst = max(reqs, key=lambda r: context_len(opts, r))
    if context_len(opts, worst) <= max_len:
        return
    flags = {
        "random": "--random-input-len/--random-output-len/--random-prefix-len",
        "prefix-repetition": "--prefix-repetition-prefix-len/-suffix-len/-output-len",
        "file": "--dataset-path",
    }[opts.dataset]
    raise ConfigError(
        f"argument {flags}: a request of {worst.prompt_len} prompt tokens and"
        f" max_tokens {worst.max_tokens} does not fit the model's context of"
        f" {max_len} tokens"
    )


def arrival_times(
    n: int,
    rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    ramp: tuple[str, float, float] | None = None,
) -> np.ndarray:
    """Send times (s from the start) of `n` requests, vLLM's way.

    Gaps come from a gamma distribution of shape `burstiness` and mean 1 / rate (burstiness 1:
    Poisson arrivals; < 1 burstier; > 1 steadier; their coefficient of variation is
    1 / sqrt(burstiness)); then every time is scaled so that the last one is n / rate. rate inf:
    every request at 0. `ramp` = (linear | exponential, start, end): request i's gap is drawn at
    the rate start -> end at i / (n - 1), without the rescaling.
    """
    rng = np.random.default_rng(seed)
    if ramp is not None:
        kind, lo, hi = ramp
        x = np.arange(n) / max(n - 1, 1)
        rates = lo + (hi - lo) * x if kind == "linear" else lo * (hi / lo) ** x
        rates = np.maximum(rates, 1e-9)
        return np.cumsum(rng.gamma(burstiness, 1.0 / (rates * burstiness)))
    if math.isinf(rate):
        return np.zeros(n)
    t = np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n))
    return t * ((n / rate) / t[-1]) if t[-1] > 0 else t
