"""Multi-token prediction speculative decoding (DeepSeek-V3's MTP module, 001 §4.6): the
speculative config, the draft modes, the acceptance rule and one speculative step over a pod.

One step of every die (the verify-first order of vLLM / SGLang: the same work as 001's loop,
cut at another point; a die's state between steps is tokens only, its last token and drafts):

1. verify: the main forward over each decoding request's row `[last] + drafts` (1 + k_r
   positions) and over prefill chunks as usual; logits at every verify row and each sampling
   chunk's last row, and every row's final-normed hidden;
2. sample every verify position with the draw the non-speculative path uses for that output
   index (`sample_rows`: greedy, or `rng([seed, index])`), and accept draft j iff it equals the
   sample at its position (`accept`): the emitted tokens are exactly the non-speculative ones;
3. MTP sub-forward 1 over the new positions (a verify row's accepted ones with the tokens that
   follow them, a prefill chunk's with its next prompt token or the sampled one): draft 1 per
   request from its last row;
4. sub-forwards 2..k: one row per request, the previous draft at the next position, the
   previous sub-forward's normed row as hidden: draft j.

Rejected positions are not freed: the next row starts at the first unaccepted position and
overwrites them, in the main layers and the MTP layer alike. Every die runs all k sub-forwards
every step (the MTP module's MoE is a pod-wide collective), empty or not.

Draft modes (a random-weight model accepts ~1/vocab of its own MTP drafts):
- `real`: the MTP module's argmax with its seeded weights (honest overhead, proves the output
  is the model's);
- `fit`: the same with `eh_proj` fitted on the model's own greedy text (`runtime.model.mtp_fit`):
  a trained MTP by self-distillation, acceptance measured, not dialled (the default);
- `oracle`: the MTP forward runs, its argmax is replaced by the request's own future tokens from
  a transcript of an MTP-off run (acceptance 1 under batch invariance; benchmarks only);
- `synthetic:p1[,p2]`: the oracle's drafts, draft j replaced by another token with probability
  1 - p_j, seeded by (the request's seed, output index, j): expected tokens per step
  1 + p1 + p1 p2, the output still the model's (benchmarks only).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from memory.errors import ConfigError
from runtime.model.sampler import sample_rows, seed_key

DRAFTS = ("real", "fit", "oracle", "synthetic")
MAX_K = 2  # drafts per step: a second one reuses the one MTP module (001 §4.6: 2.26 tokens)
SYNTH_TAG = 0x4D5450  # "MTP": the synthetic corruption's seed tag


@dataclass(frozen=True)
class SpecConfig:
    """`--speculative-config` (vLLM's keys): `num_speculative_tokens` k drafts per step from
    the MTP module, their source `draft` and, for `synthetic`, each position's acceptance."""

    k: int
    draft: str = "fit"
    acceptance: tuple[float, ...] = ()
    method: str = "mtp"

    def __post_init__(self) -> None:
        if self.method != "mtp":
            raise ConfigError(f"speculative method: {self.method!r}; xpod speculates with mtp")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ConfigError(f"num_speculative_tokens: an int >= 0, got {self.k!r}")
        if self.k > MAX_K:
            raise ConfigError(
                f"num_speculative_tokens: {self.k} > {MAX_K} needs a second MTP module, which"
                f" xpod does not build (the second draft reuses the first module)"
            )
        if self.draft not in DRAFTS:
            raise ConfigError(f"draft: {self.draft!r} is not one of {', '.join(DRAFTS)}"
                              " (synthetic as synthetic:p1[,p2])")  # fmt: skip
        if self.draft == "synthetic":
            p = self.acceptance
            if not p or len(p) > MAX_K or any(not 0 <= x <= 1 for x in p):
                raise ConfigError(f"synthetic: 1..{MAX_K} acceptance rates in [0, 1] (draft j"
                                  f" takes rate j, or the last), got {list(p)}")  # fmt: skip
        elif self.acceptance:
            raise ConfigError(f"acceptance: only for the synthetic draft, not {self.draft}")

    @property
    def transcript(self) -> bool:
        """Whether the drafts come from a transcript of the same requests (oracle, synthetic)."""
        return self.draft in ("oracle", "synthetic")

    @property
    def label(self) -> str:
        """`fit`, `synthetic:0.9,0.4`, ..."""
        if self.draft == "synthetic":
            return "synthetic:" + ",".join(f"{p:g}" for p in self.acceptance)
        return self.draft

    def rate(self, j: int) -> float:
        """Synthetic: the acceptance of draft j (0-based; the last rate for later ones)."""
        return self.acceptance[min(j, len(self.acceptance) - 1)]

    def to_dict(self) -> dict:
        return {"method": self.method, "num_speculative_tokens": self.k, "draft": self.label}


def parse_draft(text: str) -> tuple[str, tuple[float, ...]]:
    """`real` / `fit` / `oracle` / `synthetic:0.9[,0.4]` -> (draft, acceptance)."""
    name, _, rest = str(text).partition(":")
    if name != "synthetic":
        if rest:
            raise ConfigError(f"draft: {text!r}: only synthetic takes rates (synthetic:0.9)")
        return name, ()
    try:
        rates = tuple(float(x) for x in rest.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"draft: {text!r}: synthetic:p1[,p2] with rates in [0, 1]") from None
    return name, rates


def spec_config(json_text: str | None = None, k: int | None = None,
                draft: str | None = None) -> SpecConfig | None:  # fmt: skip
    """The speculative config of `--speculative-config JSON` and the shortcuts
    `--num-speculative-tokens K`, `--mtp-draft MODE` (a shortcut overrides the JSON's key);
    None when nothing asks for speculation (or k = 0 without a JSON). ConfigError names the
    bad key."""
    doc: dict = {}
    if json_text:
        try:
            doc = json.loads(json_text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative-config: not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ConfigError("speculative-config: a JSON object")
        known = {"method", "num_speculative_tokens", "draft", "acceptance"}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(
                f"speculative-config: unknown keys {unknown} (known: {sorted(known)})"
            )
    if k is not None:
        doc["num_speculative_tokens"] = k
    if draft is not None:
        doc["draft"] = draft
    if json_text and "num_speculative_tokens" not in doc:
        raise ConfigError("speculative-config: num_speculative_tokens is required")
    if not doc.get("num_speculative_tokens"):
        if draft is not None and k is None and not json_text:
            raise ConfigError("mtp-draft: needs --num-speculative-tokens (or a speculative config)")
        if doc.get("num_speculative_tokens", 0) == 0:
            return None  # k = 0: speculation off
    name, rates = parse_draft(doc.get("draft", "fit"))
    if "acceptance" in doc:
        acc = doc["acceptance"]
        if not isinstance(acc, list) or not all(isinstance(x, int | float) for x in acc):
            raise ConfigError(f"speculative-config: acceptance: a list of rates, got {acc!r}")
        rates = tuple(float(x) for x in acc)
    return SpecConfig(doc["num_speculative_tokens"], name, rates, doc.get("method", "mtp"))


# -- one request's row of a speculative step ------------------------------------------------


@dataclass
class SpecRow:
    """One segment of a die's speculative step.

    Fields:
        rid, tokens, start: the segment (`tokens` fed at positions start..; a decoding
            request's `[last] + drafts`).
        drafts: how many of `tokens` are drafts (its last `drafts` tokens); 0 for a prefill
            chunk or a row without drafts.
        sample: whether the row samples (a verify row, or the final prefill chunk: its last
            position).
        index: output index of the first token the row samples.
        temperature, seed: its sampling.
        next_token: a non-final prefill chunk's next prompt token (its MTP row needs it).
        want: drafts to make for the next step (0: none, the request is not decoding on).
        transcript: oracle / synthetic: the request's tokens by output index (an MTP-off run).
    """

    rid: int
    tokens: list[int]
    start: int
    drafts: int = 0
    sample: bool = True
    index: int = 0
    temperature: float = 0.0
    seed: int | tuple = 0
    next_token: int | None = None
    want: int = 0
    transcript: Sequence[int] | None = None


@dataclass
class SpecOut:
    """A row's result: the tokens it emitted (y_0..y_a), drafts accepted (a), the drafts for
    the next step, the logits of its sampled positions, and the MTP module's own argmax drafts
    (what `real` / `fit` would have drafted: oracle / synthetic replace them)."""

    emitted: list[int] = field(default_factory=list)
    accepted: int = 0
    drafts: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None
    model_drafts: list[int] = field(default_factory=list)


def accept(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Drafts accepted: the leading j with `drafts[j] == sampled[j]` (sampled[j] is the token
    the non-speculative path emits at that position; a draft that matches it is that token)."""
    a = 0
    for d, y in zip(drafts, sampled, strict=False):
        if int(d) != int(y):
            break
        a += 1
    return a


def transcript_draft(spec: SpecConfig, row: SpecRow, index: int, j: int, vocab: int) -> int:
    """Oracle / synthetic draft j (0-based) predicting the token at output `index`: the
    transcript's, or for synthetic with probability 1 - p_j another one, `(t + 1 + r) % vocab`
    (never the transcript's), seeded by (the row's seed, index, j) only. Past the transcript's
    end: token 0 (a draft that will most likely be rejected)."""
    tr = row.transcript
    if tr is None or index >= len(tr):
        return 0
    t = int(tr[index])
    if spec.draft == "oracle":
        return t
    rng = np.random.default_rng([SYNTH_TAG, *seed_key(row.seed), int(index), int(j)])
    u, r = rng.random(), int(rng.integers(0, vocab - 1))
    return t if u < spec.rate(j) else (t + 1 + r) % vocab


# -- one speculative step over a pod ---------------------------------------------------------

MainFn = Callable[[list[list[tuple]], list[np.ndarray]], tuple[list, list]]
MTPFn = Callable[[int, list[list[tuple]], list[np.ndarray]], tuple[list, list]]


def spec_step(spec: SpecConfig, rows: list[list[SpecRow]], run_main: MainFn, run_mtp: MTPFn,
              vocab: int) -> list[list[SpecOut]]:  # fmt: skip
    """One speculative step of every die (module docstring), rows `[die][i]`.

    `run_main(segments, logit_rows)` runs the main forward of every die (segments `[die]` of
    `(rid, tokens, start)`, logit row indices per die) -> (logits per die, normed hidden per
    die); `run_mtp(j, segments, hidden)` sub-forward j of every die -> (last-row logits per
    die, last-row normed hidden per die). A single die calls it with one-element lists; the
    single-process reference with every die's. Returns each row's `SpecOut`."""
    segs, lrows = [], []
    for die_rows in rows:
        seg, lr, lo = [], [], 0
        for r in die_rows:
            seg.append((r.rid, list(r.tokens), r.start))
            n = len(r.tokens)
            if r.sample:
                first = lo + n - 1 - r.drafts
                lr.extend(range(first, lo + n))
            lo += n
        segs.append(seg)
        lrows.append(np.array(lr, np.int64))
    logits, hidden = run_main(segs, lrows)
    outs: list[list[SpecOut]] = []
    mtp_segs, mtp_hidden = [], []
    for d, die_rows in enumerate(rows):
        die_out, mseg, mhid, at, lo = [], [], [], 0, 0
        for r in die_rows:
            o = SpecOut()
            n = len(r.tokens)
            if r.sample:
                m = r.drafts + 1
                lg = logits[d][at : at + m]
                at += m
                samp = [{"temperature": r.temperature, "seed": r.seed, "index": r.index + j}
                        for j in range(m)]  # fmt: skip
                ys = sample_rows(lg, samp)
                o.accepted = accept(r.tokens[n - r.drafts :], ys)
                o.emitted = [int(y) for y in ys[: o.accepted + 1]]
                o.logits = lg
                keep = n - r.drafts + o.accepted  # positions whose tokens were right
                nxt = list(r.tokens[1:keep]) + [o.emitted[-1]]
                mseg.append((r.rid, nxt, r.start))
                mhid.append(hidden[d][lo : lo + keep])
            elif r.next_token is not None:  # a non-final prefill chunk
                mseg.append((r.rid, list(r.tokens[1:]) + [int(r.next_token)], r.start))
                mhid.append(hidden[d][lo : lo + n])
            lo += n
            die_out.append(o)
        outs.append(die_out)
        mtp_segs.append(mseg)
        width = hidden[d].shape[1] if len(hidden[d].shape) == 2 else 0
        mtp_hidden.append(np.concatenate(mhid) if mhid else np.zeros((0, width), np.float32))
    _drafts(spec, rows, outs, mtp_segs, mtp_hidden, run_mtp, vocab)
    return outs


def _drafts(spec, rows, outs, mtp_segs, mtp_hidden, run_mtp, vocab) -> None:
    """The k MTP sub-forwards of every die and each row's drafts for the next step."""
    if spec.k == 0:
        return
    # which rows each die's sub-forward j covers: those of its MTP segments wanting >= j drafts
    owners = [[i for i, r in enumerate(die_rows) if r.sample or r.next_token is not None]
              for die_rows in rows]  # fmt: skip
    segs, hid = mtp_segs, mtp_hidden
    for j in range(spec.k):
        logits, normed = run_mtp(j, segs, hid)
        nsegs, nhid, nown = [], [], []
        for d, die_rows in enumerate(rows):
            seg, keep, own = [], [], []
            for s, i in enumerate(owners[d]):
                r, o = die_rows[i], outs[d][i]
                if r.want <= j or not r.sample:
                    continue
                arg = int(np.argmax(logits[d][s]))
                o.model_drafts.append(arg)
                if spec.transcript:
                    idx = r.index + o.accepted + 1 + j  # the output index it predicts
                    o.drafts.append(transcript_draft(spec, r, idx, j, vocab))
                else:
                    o.drafts.append(arg)
                if j + 1 < min(r.want, spec.k):  # chain: this draft at the next position
                    pos = r.start + len(r.tokens) - r.drafts + o.accepted + j
                    seg.append((r.rid, [o.drafts[-1]], pos))
                    keep.append(normed[d][s])
                    own.append(i)
            nsegs.append(seg)
            width = normed[d].shape[1] if len(normed[d].shape) == 2 else 0
            nhid.append(np.stack(keep) if keep else np.zeros((0, width), np.float32))
            nown.append(own)
        segs, hid, owners = nsegs, nhid, nown


# -- a fixed batch decoded speculatively (xpod decode, the reference) -------------------------


@dataclass
class SpecStream:
    """One request of a fixed-batch speculative decode: what it emitted, where its next row
    starts, its drafts, and its accounting."""

    rid: int
    prompt: list[int]
    seed: int | tuple
    transcript: Sequence[int] | None = None
    tokens: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    pos: int = 0
    num_drafts: int = 0  # verify rows that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_K)
    model_agree: int = 0  # oracle / synthetic: drafts the MTP module's argmax also made
    logits: list[np.ndarray] = field(default_factory=list)


class SpecDecoder:
    """The rows of each step of a fixed batch (`streams[die]`) and their bookkeeping: step 0
    prefills every prompt (one chunk) and samples its first token; every later step is one
    verify row per request, `[last] + drafts` with k_r = min(k, room) drafts. A step emits
    1..1 + k_r tokens per request; `steps` steps emit at least `steps + 1` tokens each."""

    def __init__(self, spec: SpecConfig, streams: list[list[SpecStream]], temperature: float,
                 max_seq_len: int, keep_logits: bool = False):  # fmt: skip
        self.spec, self.streams, self.temperature = spec, streams, temperature
        self.max_seq_len, self.keep_logits = max_seq_len, keep_logits

    def rows(self, step: int) -> list[list[SpecRow]]:
        out = []
        for die in self.streams:
            rows = []
            for s in die:
                if step == 0:
                    rows.append(SpecRow(s.rid, list(s.prompt), 0, 0, True, 0, self.temperature,
                                        s.seed, None, self.spec.k, s.transcript))  # fmt: skip
                    continue
                room = self.max_seq_len - s.pos - 1 - self.spec.k
                k_r = max(0, min(len(s.drafts), room))
                rows.append(SpecRow(s.rid, [s.tokens[-1]] + s.drafts[:k_r], s.pos, k_r, True,
                                    len(s.tokens), self.temperature, s.seed, None, self.spec.k,
                                    s.transcript))  # fmt: skip
            out.append(rows)
        return out

    def take(self, step: int, rows: list[list[SpecRow]], outs: list[list[SpecOut]]) -> None:
        for die, die_rows, die_outs in zip(self.streams, rows, outs, strict=True):
            for s, r, o in zip(die, die_rows, die_outs, strict=True):
                s.tokens.extend(o.emitted)
                s.pos = r.start + len(r.tokens) - r.drafts + o.accepted
                s.drafts = list(o.drafts)
                if r.drafts:
                    s.num_drafts += 1
                    s.draft_tokens += r.drafts
                    s.accepted_tokens += o.accepted
                    for j in range(o.accepted):
                        s.accepted_per_pos[j] += 1
                if self.spec.transcript:
                    s.model_agree += sum(int(a == b) for a, b in zip(o.model_drafts, o.drafts,
                                                                     strict=False))  # fmt: skip
                if self.keep_logits:
                    s.logits.append(o.logits)


def reference_decode(pod, prompts: list[list[list[int]]], ids: list[list[int]], steps: int,
                     spec: SpecConfig, temperature: float = 0.0, seed: int = 0,
                     transcripts: dict[int, Sequence[int]] | None = None,
                     keep_logits: bool = False) -> list[list[SpecStream]]:  # fmt: skip
    """The fixed-batch speculative decode of `xpod decode` on a single-process
    `runtime.model.reference.ReferencePod` `pod` (prompts and request ids per die): prefill,
    then `steps` verify steps, each request's draws keyed by `(seed, request, index)`. Its
    streams (tokens, accounting, verify logits) are what the pod's must equal bit for bit."""
    cfg = pod.cfg
    tr = transcripts or {}
    streams = [[SpecStream(r, list(p), (seed, r), tr.get(r))
                for r, p in zip(ids[d], prompts[d], strict=True)]
               for d in range(len(ids))]  # fmt: skip
    dec = SpecDecoder(spec, streams, temperature, cfg.max_seq_len, keep_logits)
    for s in range(steps + 1):
        rows = dec.rows(s)

        def run_main(segs, lrows, s=s):
            pod.rewind(segs, range(cfg.n_layers))
            return pod.step(segs, s, lrows, hidden=True)

        def run_mtp(j, segs, hidden):
            pod.rewind(segs, [cfg.mtp_layer(j)])
            return pod.mtp(j, segs, hidden)

        dec.take(s, rows, spec_step(spec, rows, run_main, run_mtp, cfg.vocab_size))
    return streams


def positions_needed(prompt_len: int, steps: int, k: int) -> int:
    """KV positions a request of a fixed-batch speculative decode can reach: its prompt, up to
    1 + k per step, and the chained MTP rows past the last one."""
    return prompt_len + (1 + k) * steps + k


def stats(streams: Sequence[SpecStream], spec: SpecConfig) -> dict:
    """vLLM's speculative-decoding figures over `streams` (docs: JSON keys of issue 31)."""
    drafts = sum(s.num_drafts for s in streams)
    dtok = sum(s.draft_tokens for s in streams)
    acc = sum(s.accepted_tokens for s in streams)
    per_pos = [sum(s.accepted_per_pos[j] for s in streams) for j in range(spec.k)]
    return {
        "spec_tokens": spec.k,
        "draft_mode": spec.label,
        "num_drafts": drafts,
        "num_draft_tokens": dtok,
        "num_accepted_tokens": acc,
        "acceptance_rate": acc / dtok if dtok else None,
        "acceptance_per_pos": [p / drafts if drafts else None for p in per_pos],
        "mean_acceptance_length": 1 + acc / drafts if drafts else None,
    }


__all__ = ["DRAFTS", "MAX_K", "SpecConfig", "SpecDecoder", "SpecOut", "SpecRow", "SpecStream",
           "accept", "parse_draft", "positions_needed", "reference_decode", "spec_config",
           "spec_step", "stats", "transcript_draft"]  # fmt: skip
