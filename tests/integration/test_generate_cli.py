"""`xpod generate` (runtime/cli/generate.py) run in-process through `runtime.cli.main`.

The runs start real pods (2 dies, tiny model, a few tokens per request); the autouse leak check
of tests/conftest.py fails a test that leaves a process or a /dev/shm entry. Bad input must be
refused before anything starts: those tests make `Engine.launch` and `Pod.launch` fail the test.
"""

from __future__ import annotations

import io
import json

import pytest

from runtime import cli, engine
from runtime.cli import generate
from runtime.model import decode, encode
from runtime.pod import Pod

BASE = ["generate", "--dies", "2", "--model", "tiny", "--timeout", "30"]
PROMPTS = ["hello", "the pod is a set of dies", "experts", "a", "attention runs data parallel"]
SUMMARY_KEYS = (
    "requests",
    "prompt tokens",
    "output tokens",
    "wall seconds",
    "output tokens/s",
    "TTFT p50/p99 ms",
    "TPOT p50/p99 ms",
    "E2E p50/p99 ms",
    "bubble_p50_ms",
    "step_p50_ms",
)


def run_cli(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


@pytest.fixture
def no_launch(monkeypatch):
    """Bad input must be refused before any process starts."""

    def launch(*args, **kwargs):
        raise AssertionError("a pod was launched: the input was not checked before it")

    monkeypatch.setattr(engine.Engine, "launch", launch)
    monkeypatch.setattr(Pod, "launch", launch)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# -- runs ---------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_prompts_file_prints_completions_and_summary_and_writes_json(tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS[0] + "\n\n" + "\n".join(PROMPTS[1:]) + "\n  \n")  # blanks skipped
    out_json = tmp_path / "out.json"
    argv = [*BASE, "--prompts", str(path), "--max-tokens", "6", "--ignore-eos"]
    assert run_cli([*argv, "--json", str(out_json)]) == 0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    assert "launching 2 dies, model tiny" in cap.err and "5/5 requests" in cap.err
    doc = json.loads(out_json.read_text())
    reqs = doc["requests"]
    assert [r["id"] for r in reqs] == list(range(5))
    assert [r["prompt"] for r in reqs] == PROMPTS
    for r in reqs:
        assert r["finish_reason"] == "length" and not r["error"]
        assert r["output_tokens"] == len(r["token_ids"]) == 6
        assert r["prompt_tokens"] == len(encode(r["prompt"]))
        assert r["text"] == decode(r["token_ids"])
        assert 0 < r["ttft_ms"] <= r["e2e_ms"] and r["group"] in (0, 1)
    lines = _lines(cap.out)
    assert lines[:5] == [f"[{r['id']}] length: {generate.escape(r['token_ids'])}" for r in reqs]
    for key in SUMMARY_KEYS:
        assert key in cap.out, key
    assert "5 (stop 0, length 5, abort 0, error 0)" in cap.out
    s = doc["summary"]
    assert s["requests"] == 5 and s["output_tokens"] == 30
    assert s["finish_reasons"]["length"] == 5
    assert s["prompt_tokens"] == sum(len(encode(p)) for p in PROMPTS)
    assert s["output_tokens_per_s"] > 0 and s["ttft_ms"]["p50"] > 0
    assert len(s["groups"]) == 2 and sum(g["requests"] for g in s["groups"]) == 5
    for g in s["groups"]:
        assert g["final_stats"] and g["steps"] > 0 and g["step_p50_ms"] > 0
        assert g["kv_total"] > 0 and 0 < g["kv_peak_usage"] <= 1


@pytest.mark.timeout(120)
def test_stdin_and_prompt_flags_quiet(monkeypatch, capsys):
    """`--prompt` texts come first (ids 0, 1, ...), then the lines of `--prompts -`."""
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n\nsecond line\n"))
    argv = [*BASE, "--prompt", "zero", "--prompts", "-", "--max-tokens", "3", "--quiet"]
    assert run_cli([*argv, "--temperature", "0.8", "--seed", "3", "--async-depth", "1"]) == 0
    cap = capsys.readouterr()
    assert "3 prompts" in cap.err and "3/3 requests" in cap.err
    assert "requests          3 (" in cap.out
    assert not any(ln.startswith("[") for ln in cap.out.splitlines()), "--quiet printed outputs"


@pytest.mark.timeout(120)
def test_stop_token_ends_the_request(tmp_path, capsys):
    """Greedy decoding is deterministic: the run again with one of its tokens as a stop token
    ends there, the stop token included."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    argv = [*BASE, "--prompt", "the pod", "--max-tokens", "8", "--ignore-eos"]
    assert run_cli([*argv, "--json", str(first)]) == 0
    toks = json.loads(first.read_text())["requests"][0]["token_ids"]
    k = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
    assert run_cli([*argv, "--stop-token-ids", str(toks[k]), "--json", str(second)]) == 0
    r = json.loads(second.read_text())["requests"][0]
    assert r["finish_reason"] == "stop" and r["token_ids"] == toks[: k + 1]
    assert "1 (stop 1, length 0, abort 0, error 0)" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_ctrl_c_tears_the_engine_down(monkeypatch, capsys):
    """KeyboardInterrupt while waiting: status 130, every process and segment gone (the leak
    check of conftest)."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "_wait", interrupted)
    assert run_cli([*BASE, "--prompt", "hello", "--max-tokens", "4"]) == 130
    assert "interrupted" in capsys.readouterr().err


# -- refused before anything starts -------------------------------------------------------------

BAD = [
    (["--prompt", "a", "--max-tokens", "0"], "--max-tokens"),
    (["--prompts", "/nonexistent-xpod-dir/prompts.txt"], "--prompts"),
    (["--prompt", "a", "--stop-token-ids", "abc"], "--stop-token-ids"),
    (["--prompt", "a", "--stop-token-ids", "999"], "--stop-token-ids"),  # vocab is 259
    (["--prompt", "a", "--stop-token-ids", "-1"], "--stop-token-ids"),
    (["--prompt", "a", "--async-depth", "3"], "--async-depth"),
    (["--prompt", "a", "--lb", "foo"], "--lb"),
    (["--prompt", "a", "--temperature", "-1"], "--temperature"),
    ([], "--prompts"),  # no prompt at all
    (["--prompt", "a", "--dies", "3"], "--dies"),  # 16 experts do not split over 3 dies
    (["--prompt", "a", "--dies", "0"], "--dies"),
    (["--prompt", "a", "--model", "huge"], "--model"),
    (["--prompt", "a", "--num-blocks", "3"], "--num-blocks"),  # less than one context
    (["--prompt", "a", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["--prompt", "a", "--max-num-batched-tokens", "100000000"], "--max-num-batched-tokens"),
    (["--prompt", "a", "--block-size", "0"], "--block-size"),
    (["--prompt", "a", "--protocol", "fsed"], "--protocol"),
    (["--prompt", "a", "--quant", "int4"], "--quant"),
    (["--prompt", "a", "--pin", "maybe"], "--pin"),
    (["--prompt", "a", "--gc-every", "-1"], "--gc-every"),
    (["--prompt", "a", "--seed", "x"], "--seed"),
    (["--prompt", "a", "--timeout", "1e6"], "--timeout"),
    (["--prompt", "a", "--json", "/"], "--json"),
]


def _assert_refused(argv: list[str], flag: str, capsys) -> str:
    assert run_cli([*BASE, *argv]) == 2
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err and not cap.out
    assert len(cap.err.strip().splitlines()) == 1, cap.err
    assert cap.err.startswith("xpod generate: error: argument "), cap.err
    assert flag in cap.err, cap.err
    return cap.err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, flag", BAD, ids=[" ".join(a) or "no-prompt" for a, _ in BAD])
def test_bad_flags_are_one_line_with_status_2(argv, flag, no_launch, capsys):
    _assert_refused(argv, flag, capsys)


@pytest.mark.timeout(120)
def test_prompts_file_without_a_prompt_or_not_utf8_is_refused(
    tmp_path, monkeypatch, no_launch, capsys
):
    blank, binary = tmp_path / "blank.txt", tmp_path / "binary.txt"
    blank.write_text("\n  \n\n")
    binary.write_bytes(b"ok\n\xff\xfe\n")
    assert "has no prompt" in _assert_refused(["--prompts", str(blank)], "--prompts", capsys)
    assert "UTF-8" in _assert_refused(["--prompts", str(binary)], "--prompts", capsys)
    monkeypatch.setattr("sys.stdin", io.StringIO("\n\n"))
    assert "has no prompt" in _assert_refused(["--prompts", "-"], "--prompts", capsys)


@pytest.mark.timeout(120)
def test_prompt_longer_than_the_context_is_refused_before_launch(tmp_path, no_launch, capsys):
    """A prompt whose tokens + --max-tokens exceed the model's context (tiny: 256) is refused
    with exit status 2 before the engine starts, naming the prompt (its id and line) and the
    flags; no request runs."""
    path = tmp_path / "prompts.txt"
    path.write_text("short\n" + "x" * 300 + "\n")
    err = _assert_refused(["--prompts", str(path), "--max-tokens", "4"], "--prompts", capsys)
    assert "prompt 1 (line 2 of" in err and "301 tokens" in err and "256" in err
    # fits alone, not with the tokens asked for
    err = _assert_refused(["--prompt", "y" * 200, "--max-tokens", "64"], "--max-tokens", capsys)
    assert "prompt 0 (--prompt 1) has 201 tokens" in err


# -- output helpers -------------------------------------------------------------------------------


def test_escape_shows_every_byte():
    assert generate.escape(list(b"hi\n\t\\")) == "hi\\n\\t\\\\"
    assert generate.escape([0x1B, 0xFF, 0x7F, 257]) == "\\x1b\\xff\\x7f"  # EOS (257) skipped
    assert generate.escape(list("é€".encode())) == "é€"
    assert generate.escape(list("\u2028".encode())) == "\\u2028"
