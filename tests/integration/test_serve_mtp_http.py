"""`xpod serve --num-speculative-tokens`: the OpenAI-compatible server with MTP, and its
`/metrics` (vLLM's spec_decode counters) checked against what the requests received: with
`ignore_eos` and no stop token every request gets its prefill's token plus, per verify row,
one token and the drafts it accepted (a row never drafts past max_tokens), so

    generated tokens = requests + verify rows + accepted draft tokens

and the accepted tokens per position add up to the accepted tokens."""

from __future__ import annotations

import pytest

from tests.integration.test_api_server import ServerProc, metric, settle


@pytest.mark.timeout(180)
def test_spec_decode_metrics_add_up_to_the_tokens_served():
    s = ServerProc("--num-speculative-tokens", "2", "--mtp-draft", "fit", "--max-num-seqs", "4")
    try:
        n, total = 6, 0
        for i in range(n):
            status, _, data = s.post("/v1/completions", {
                "model": "xpod-tiny", "prompt": f"request {i} of the pod", "max_tokens": 20 + i,
                "ignore_eos": True, "temperature": 0})  # fmt: skip
            assert status == 200, data
            import json

            usage = json.loads(data)["usage"]
            total += usage["completion_tokens"]
            assert usage["completion_tokens"] == 20 + i
        m = settle(s)
        g = (0, 1)
        rows = sum(metric(m, "xpod_spec_decode_verify_rows_total", group=x) for x in g)
        acc = sum(metric(m, "xpod_spec_decode_num_accepted_tokens_total", group=x) for x in g)
        drafts = sum(metric(m, "xpod_spec_decode_num_drafts_total", group=x) for x in g)
        dtok = sum(metric(m, "xpod_spec_decode_num_draft_tokens_total", group=x) for x in g)
        per = sum(metric(m, "xpod_spec_decode_num_accepted_tokens_per_pos_total", group=x,
                         position=j) for x in g for j in (0, 1))  # fmt: skip
        gen = sum(metric(m, "xpod_generation_tokens_total", group=x) for x in g)
        assert gen == total == n + rows + acc
        assert per == acc and 0 < drafts <= rows and drafts <= dtok <= 2 * drafts
        assert sum(metric(m, "xpod_mtp_seconds_total", group=x) for x in g) > 0
    finally:
        s.stop()
