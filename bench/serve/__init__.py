"""`xpod bench serve`: a vLLM-style serving benchmark against xpod's OpenAI-compatible server.

```
xpod bench serve --launch --dies 4 --max-concurrency 8 --ignore-eos --num-prompts 64
xpod bench serve --url http://127.0.0.1:8000 --request-rate 20 --burstiness 0.5 --json out.json
xpod bench serve --launch --max-concurrency 8 --ignore-eos --rate-sweep 0.25,0.5,0.75,1,1.25
```

It mirrors `vllm bench serve`: the same flags where they apply, the same summary block and JSON
keys (`completed`, `failed`, `duration`, `request_throughput`, `output_throughput`,
`mean_ttft_ms`, `median_tpot_ms`, `p99_itl_ms`, ...). Every request streams (`stream: true`,
`stream_options.include_usage`, `return_token_ids`): TTFT is the time to the first chunk that
carries text or token ids, ITL the gaps between such chunks, TPOT = (e2e - TTFT) / (output
tokens - 1), and output tokens are `usage.completion_tokens` (never a chunk count). A request
that gets an HTTP error, a bad SSE frame, an error event, no usage or a disconnect counts as
failed and keeps its error (the first few are printed); any failure makes the exit status 1.

Server: `--url` (a running server) or `--launch` (starts `xpod serve --port 0` as a child
process with `--dies`, `--model`, `--max-num-seqs`, `--lb`, `--output-procs` and the
`--server-args` passthrough, waits for `/health`, and at the end stops it with SIGTERM and
checks its exit status 0; on any error it is killed; nothing is left behind).

Datasets (nothing is downloaded): `random` (printable ASCII text, so a prompt of
`--random-input-len` tokens is BOS + that many bytes - 1; `--random-range-ratio` spreads input
and output lengths uniformly over [len (1 - r), len (1 + r)]; `--random-prefix-len` bytes of
text shared by every prompt in front), `prefix-repetition` (`--prefix-repetition-num-prefixes`
prefixes of `-prefix-len` bytes, each request one of them and its own `-suffix-len` bytes),
`file` (`--dataset-path`: JSONL lines `{"prompt": ..., "max_tokens"?: ...}`, taken in order and
cycled). Arrivals: gaps drawn from a gamma distribution of shape `--burstiness` (1 = Poisson)
and mean 1 / `--request-rate`, scaled so the last request goes at num_prompts / rate (vLLM's
way); `--ramp-up-strategy` moves the rate from `--ramp-up-start-rps` to `--ramp-up-end-rps`;
`--max-concurrency` caps the requests in flight (a semaphore, as vLLM's).

Multi-turn (`--dataset multi-turn`, `bench.serve.multiturn`): `--mt-conversations` C of
`--mt-turns` T, each turn resending the whole history as token ids (a system prompt of
`--mt-system-len` S tokens shared by all or by one of `--mt-system-prompts` G families,
`--mt-skew` giving family 0 half of them; every earlier turn's `--mt-user-len` U user tokens and
the server's own reply ids, `return_token_ids`), replies of `--random-output-len` O tokens
(default 32, ignore_eos), a closed loop (a turn goes when the previous reply is complete plus an
exponential think time of mean `--mt-think-time`; starts `--mt-stagger` s apart); the JSON adds
the trace's ideal hit rate (`ideal_hit_rate`, prompt blocks sent before; `_replies` with the
replies) and the prompt tokens per group (`load_imbalance`: max / mean). `--compare-pool
local,affinity,pool` (`bench.serve.mt_compare`) runs the same workload against one server per
layout (die-local cache with `least_kv`, `--lb prefix`, `--kv-pool` with `least_kv`) and
evaluates the KV pool's bars over them (`--repeat R`: R rounds, every other one in reverse
order, medians of the rounds' ratios).

Extras, from `/metrics` (scraped every 0.2 s while the run goes, as deltas over the run): KV
balance (time-averaged max/mean KV usage over groups, over the scrapes whose mean is > 0),
dummy-step share (dummy steps over all die steps: with rows or dummy), scheduling bubble per
step, MoE wait share, attention imbalance, prefix hit rate, step time (the first and last
scrapes wait 1.2 s: an idle group's master reports its die's dummy steps at its next
heartbeat); CPU seconds of the client (this process, its /metrics parsing included) and of
the server by role (shell, masters, outputs, dies), also per output token. With `--launch`:
`xpod decode` at the same dies and global batch (`--max-concurrency`, else dies x
max-num-seqs), prompt length `--random-input-len` and `--random-output-len` steps, run in the
same run (the server up and idle), `ratio_to_decode` = output_throughput /
decode_tokens_per_s (decode steps only) and `ratio_to_decode_with_prefill` (against decode's
prefill + decode time: the same work); `--repeat R` alternates R decode / main-run pairs and
reports the median pair (`pairs` has them all).

TTFT phase (`--ttft`; on by default with `--launch`, off with `--quick` unless given): (a) idle
server: probes of `--random-input-len` tokens and `max_tokens` 1 sent one at a time: TTFT p50,
and the prefill time per request from `/metrics` (`xpod_step_seconds` over the phase: only
those prefills ran); (b) under decode load: concurrency - 1 long `ignore_eos` requests keep
running while probes go one after another: TTFT p50 / p99 and the step time under load. The
bounds of SERVING.md 6.2 are reported next to them: idle p50 <= prefill + 5 ms, under load
p50 <= prefill + 2 steps + 5 ms.

`--rate-sweep F1,F2,...`: after the main run (at `--request-rate inf`: the saturation phase,
whose request throughput is the capacity), one run of `--num-prompts` at each rate F x capacity
with open-loop arrivals (no client concurrency cap: requests queue in the server, so TTFT shows
the queueing): a table (and with `--plot` a PNG) of TTFT and TPOT p50 / p99 and goodput
(`request_goodput` with `--goodput`, else the request throughput) against the rate; the knee is
the first rate whose TTFT p50 exceeds twice the lowest rate's, or whose goodput stops rising
(within 2 %). Without `--rate-sweep`, `--plot` draws the latency CDFs of the main run.

`--json FILE` writes one JSON object: the vLLM keys plus the extras above, the options and the
run info (date, git sha). `--quick`: a short run (at most 32 prompts, lengths at most 32).

Prefill-decode disaggregation (with `--launch`):

```
xpod bench serve --launch --prefill-dies 2 --decode-dies 4 --compare-colocated \
    --rate-sweep 0.25,0.5,0.75,1,1.25 --goodput ttft:200 tpot:30 --json pd.json
```

`--prefill-dies P --decode-dies D` (together, instead of `--dies`; not with `--url`) launches
`xpod serve --prefill-dies P --decode-dies D` (dies 0..P-1 prefill, the rest decode; pinned to
core 0 and core 1) with `--replay-check`, and adds to the run: the interference phase
(`bench.serve.interference`, before the main run: the decode TPOT of K = 2 x D streams idle,
then while `--burst-prompts` N (default 8) prompts of `--burst-len` L tokens (default 1024)
arrive at once: `idle_tpot_ms`, `burst_tpot_p99_ms` (over streams, each its mean gap in the
burst window: a request's TPOT), their ratio against the 1.2 bar, and the single gaps' ITL); from
`/metrics` over the main run the KV transfer rate (`kv_transfer_gbps`), the TTFT split (queue +
prefill + transfer + first step against the client's TTFT, the slack stated) and the KV
integrity counters (`checksum_mismatches`, ...); `xpod bench p2p`'s zero-copy bandwidth at the
mean transfer size, measured in the same run once the server is gone (`p2p_zero_copy_gbps`,
`kv_over_p2p` against the 0.8 bar) and, in the same pod, the KV link's own ping-pong at that
size (`kv_link_alone_gbps`: the protocol without the serving load on its core); the replay of
every step the server ran (`replay_bit_equal`: not bit-equal makes the exit status 1); and the
`xpod decode` baseline on the D decode dies (HTTP / decode against the 0.85 bar).
`--max-num-seqs` defaults to ceil(max-concurrency / D). When a burst prompt does not fit the
model's context the server gets `--max-seq-len` (2 x L rounded up to 256, at least 512), and
says so.

`--compare-colocated` then runs the same phases, the same requests and the same arrival times
(same seed) against a colocated server of the same P + D dies (`--dies P+D`, the same model and
flags, the PD-only ones dropped; also with `--replay-check`, so that both log their steps):
every die prefills and decodes in one lockstep step, so a long prompt's prefill stalls the
running decodes. The rate sweep of both layouts runs at fractions of the PD layout's measured
capacity (identical arrivals). If the model's experts do not split over P, D and P + D dies,
both servers get `--experts` (the next multiple that does), and it is said. The report puts
the layouts side by side (`bench.serve.pd_report`); `--json` writes `{"pd": {...},
"colocated": {...}, "comparison": {...}, ...}`, each layout with at least `completed`,
`failed`, `output_throughput`, `goodput` (the best goodput of the sweep: DistServe's measure
under the `--goodput` SLOs), `p99_tpot_ms`, `idle_tpot_ms`, `burst_tpot_p99_ms`,
`median_ttft_ms`, and the PD one `kv_transfer_gbps`, `p2p_zero_copy_gbps`,
`replay_bit_equal`, `checksum_mismatches`. Without `--compare-colocated` the JSON is the PD
layout's flat object, as for any run, with these keys in it.
"""

from bench.serve.dataset import arrival_times
from bench.serve.driver import main, run
from bench.serve.flags import add_args, parse_options
from bench.serve.options import Options
from bench.serve.stats import summarize

__all__ = ["Options", "add_args", "arrival_times", "main", "parse_options", "run", "summarize"]
