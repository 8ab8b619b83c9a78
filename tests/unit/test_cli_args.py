"""Every flag of every `xpod` subcommand is checked before anything runs (issue 8, item 8).

A bad value must give one line `xpod <cmd>: error: ...` naming the flag and exit status 2, never a
traceback, and must be refused before any pod launches: `Pod.launch` fails the test here, so these
stay unit tests (no process is ever started). Good values still parse as before.
"""

from __future__ import annotations

import argparse

import pytest

from bench import alltoall, common, p2p, ring
from memory.errors import ConfigError, PodError
from runtime import cli
from runtime.cli import argtypes, decode
from runtime.pod import Pod

NO_DIR = "/nonexistent-xpod-dir/out.json"

BAD = [
    # xpod run
    (["run", "--size", "abc"], "--size"),
    (["run", "--size", "0"], "--size"),
    (["run", "--size", "-5"], "--size"),
    (["run", "--size", "1.5M"], "--size"),
    (["run", "--size", "100G"], "--size"),
    (["run", "--rounds", "0"], "--rounds"),
    (["run", "--rounds", "x"], "--rounds"),
    (["run", "--dies", "0"], "--dies"),
    (["run", "--dies", "300"], "--dies"),
    (["run", "--lanes", "0"], "--lanes"),
    (["run", "--lanes", "100"], "--lanes"),
    (["run", "--slot-bytes", "100"], "--slot-bytes"),
    (["run", "--ring-slots", "1"], "--ring-slots"),
    (["run", "--timeout", "0"], "--timeout"),
    (["run", "--timeout", "1e6"], "--timeout"),
    (["run", "--timeout", "nan"], "--timeout"),
    (["run", "--config", "/nonexistent-xpod.toml"], "--config"),
    (["run", "--trace", NO_DIR], "--trace"),
    # xpod layout
    (["layout", "--dies", "-1"], "--dies"),
    (["layout", "--lanes", "abc"], "--lanes"),
    (["layout", "--ring-slots", "0"], "--ring-slots"),
    (["layout", "--slot-bytes", "96.5"], "--slot-bytes"),
    # xpod clean
    (["clean", "--bogus"], "--bogus"),
    # xpod decode
    (["decode", "--block-size", "0"], "--block-size"),
    (["decode", "--block-size", "100000000"], "--block-size"),
    (["decode", "--batch", "0"], "--batch"),
    (["decode", "--batch", "-3"], "--batch"),
    (["decode", "--steps", "0"], "--steps"),
    (["decode", "--prompt-len", "0"], "--prompt-len"),
    (["decode", "--prompt-len", "500", "--steps", "100"], "--prompt-len"),
    (["decode", "--temperature", "-1"], "--temperature"),
    (["decode", "--temperature", "hot"], "--temperature"),
    (["decode", "--timeout", "0"], "--timeout"),
    (["decode", "--model", "bogus"], "--model"),
    (["decode", "--eplb", "maybe"], "--eplb"),
    (["decode", "--eplb", "on", "--redundant", "40"], "--eplb"),
    (["decode", "--eplb", "on", "--eplb-every", "0"], "--eplb-every"),
    (["decode", "--eplb", "compare", "--steps", "5"], "--steps"),
    (["decode", "--repeat", "0"], "--repeat"),
    (["decode", "--eplb", "compare", "--repeat", "3"], "--repeat"),
    (["decode", "--eplb", "on", "--dies-per-node", "3"], "--eplb"),
    (["decode", "--eplb-policy", "random"], "--eplb-policy"),
    (["decode", "--quant", "int4"], "--quant"),
    (["decode", "--protocol", "fsed"], "--protocol"),
    (["decode", "--dies", "0"], "--dies"),
    (["decode", "--dies", "3"], "--dies"),  # 32 experts do not split over 3 dies
    (["decode", "--seed", "-1"], "--seed"),
    (["decode", "--pin", "maybe"], "--pin"),
    (["decode", "--wait", "never"], "--wait"),
    (["decode", "--json", ""], "--json"),
    (["decode", "--json", "/"], "--json"),
    (["decode", "--trace", NO_DIR], "--trace"),
    # xpod bench p2p
    (["bench", "p2p", "--dies", "1"], "--dies"),
    (["bench", "p2p", "--dies", "0"], "--dies"),
    (["bench", "p2p", "--variants", "mte,foo"], "--variants"),
    (["bench", "p2p", "--variants", ""], "--variants"),
    (["bench", "p2p", "--sizes", "0"], "--sizes"),
    (["bench", "p2p", "--sizes", "8,abc"], "--sizes"),
    (["bench", "p2p", "--sizes", ","], "--sizes"),
    (["bench", "p2p", "--sizes", "8G"], "--sizes"),
    (["bench", "p2p", "--cores", "0"], "--cores"),
    (["bench", "p2p", "--cores", "100"], "--cores"),
    (["bench", "p2p", "--repeat", "0"], "--repeat"),
    (["bench", "p2p", "--iters-scale", "0"], "--iters-scale"),
    (["bench", "p2p", "--iters-scale", "-1"], "--iters-scale"),
    (["bench", "p2p", "--slot-bytes", "100"], "--slot-bytes"),
    (["bench", "p2p", "--ring-slots", "1"], "--ring-slots"),
    (["bench", "p2p", "--plot", NO_DIR], "--plot"),
    # xpod bench ring
    (["bench", "ring", "--dies", "0"], "--dies"),
    (["bench", "ring", "--dies", "1"], "--dies"),
    (["bench", "ring", "--dies", "8,abc"], "--dies"),
    (["bench", "ring", "--dies", ""], "--dies"),
    (["bench", "ring", "--dies", "300"], "--dies"),
    (["bench", "ring", "--rounds", "0"], "--rounds"),
    (["bench", "ring", "--size", "0"], "--size"),
    (["bench", "ring", "--size", "x"], "--size"),
    (["bench", "ring", "--json", NO_DIR], "--json"),
    # xpod bench alltoall
    (["bench", "alltoall", "--iters", "-1"], "--iters"),
    (["bench", "alltoall", "--hidden", "0"], "--hidden"),
    (["bench", "alltoall", "--hidden", "10000000"], "--hidden"),
    (["bench", "alltoall", "--topk", "0"], "--topk"),
    (["bench", "alltoall", "--topk", "300"], "--topk"),
    (["bench", "alltoall", "--topk", "8", "--experts", "4", "--dies", "4"], "--topk"),
    (["bench", "alltoall", "--experts", "10"], "--experts"),
    (["bench", "alltoall", "--experts", "0"], "--experts"),
    (["bench", "alltoall", "--a2e", "--experts", "6"], "--experts"),
    (["bench", "alltoall", "--attention-dies", "1,2", "--expert-dies", "3,4,5"], "-dies"),
    (["bench", "alltoall", "--attention-dies", "4", "--expert-dies", "2"], "--attention-dies"),
    (["bench", "alltoall", "--attention-dies", "0"], "--attention-dies"),
    (["bench", "alltoall", "--expert-dies", "x"], "--expert-dies"),
    (["bench", "alltoall", "--protocol", "fsed"], "--protocol"),
    (["bench", "alltoall", "--protocol", ""], "--protocol"),
    (["bench", "alltoall", "--quant", "int4"], "--quant"),
    (["bench", "alltoall", "--quant", "int8,int4"], "--quant"),
    (["bench", "alltoall", "--repeat", "0"], "--repeat"),
    (["bench", "alltoall", "--seed", "-1"], "--seed"),
    (["bench", "alltoall", "--batch", "0"], "--batch"),
    (["bench", "alltoall", "--batch", "2000000"], "--batch"),
    (["bench", "alltoall", "--dies", "0"], "--dies"),
    (["bench", "alltoall", "--dies", "1,300"], "--dies"),
    (["bench", "alltoall", "--timeout", "-3"], "--timeout"),
    (["bench", "alltoall", "--iters-scale", "0"], "--iters-scale"),
    (["bench", "alltoall", "--config", "/nonexistent-xpod.toml"], "--config"),
    # commands
    (["bench", "foo"], "foo"),
    (["frob"], "frob"),
]


@pytest.fixture(autouse=True)
def no_pod(monkeypatch):
    """Refusing bad input must come before any process: launching a pod fails the test."""

    def launch(*args, **kwargs):
        raise AssertionError("a pod was launched: the input was not checked before it")

    monkeypatch.setattr(Pod, "launch", launch)


def run_cli(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("argv, flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_naming_the_flag_with_status_2(argv, flag, capsys):
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.strip(), "no error message"
    assert "Traceback" not in err
    assert flag in err, err
    assert len(err.strip().splitlines()) <= 2, err
    assert err.startswith("xpod"), err
    assert ": error: " in err, err


def test_enough_bad_cases_over_every_subcommand():
    assert len(BAD) >= 40
    cmds = {a[0] if a[0] != "bench" else " ".join(a[:2]) for a, _ in BAD}
    for cmd in ("run", "decode", "layout", "clean", "bench p2p", "bench ring", "bench alltoall"):
        assert cmd in cmds, cmd


def test_error_names_the_subcommand(capsys):
    assert run_cli(["bench", "ring", "--dies", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "xpod bench ring: error: argument --dies: 0 is not an integer >= 2\n"
    assert run_cli(["decode", "--block-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "xpod decode: error: argument --block-size: 0 is not an integer >= 1\n"


# -- errors once the options are checked -----------------------------------------------------------


def test_pod_failure_keeps_status_1(monkeypatch, capsys):
    def launch(*args, **kwargs):
        raise PodError("die 1 crashed")

    monkeypatch.setattr(Pod, "launch", launch)
    assert run_cli(["run", "--dies", "2", "--size", "4K"]) == 1
    assert "xpod: PodError: die 1 crashed" in capsys.readouterr().err


def test_config_error_of_a_die_keeps_status_1(monkeypatch, capsys):
    def launch(*args, **kwargs):
        e = ConfigError("lanes: bad")
        e.die_id = 1
        raise e

    monkeypatch.setattr(Pod, "launch", launch)
    assert run_cli(["run", "--dies", "2"]) == 1
    assert "ConfigError" in capsys.readouterr().err


def test_config_error_of_the_launcher_is_status_2(monkeypatch, capsys):
    def launch(*args, **kwargs):
        raise ConfigError("this CPU does not guarantee total store order\nRun on x86-64.")

    monkeypatch.setattr(Pod, "launch", launch)
    assert run_cli(["run", "--dies", "2"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the "launching" progress line
    assert last == "xpod run: error: this CPU does not guarantee total store order Run on x86-64."


# -- good input still parses -----------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    "text, n",
    [("8", 8), ("4096", 4096), ("4k", 4096), ("4K", 4096), ("1M", 1 << 20), ("64MiB", 64 << 20),
     ("1g", 1 << 30), ("2KB", 2048), (" 3 ", 3)],
)  # fmt: skip
def test_parse_size(text, n):
    assert argtypes.parse_size(text) == n
    assert argtypes.size(text) == n
    assert common.parse_size is argtypes.parse_size


@pytest.mark.parametrize("text", ["0", "-1", "abc", "", "1.5M", "K"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        argtypes.parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError):
        argtypes.size(text)


def test_fmt_size_reads_back():
    for n in (8, 100, 4096, 1 << 20, 3 << 20):
        assert argtypes.parse_size(argtypes.fmt_size(n)) == n
    assert common.fmt_size(1 << 20) == "1M"


def test_list_and_number_types():
    assert argtypes.int_list(2)("2, 4,,8") == [2, 4, 8]
    assert argtypes.size_list("8,4K") == [8, 4096]
    assert argtypes.choice_list(("a", "b"))("b,a") == ["b", "a"]
    assert argtypes.positive_int("7") == 7
    assert argtypes.nonneg_int("0") == 0
    assert argtypes.positive_float("0.5") == 0.5
    assert argtypes.nonneg_float("0") == 0.0
    assert argtypes.int_range(1, 3)("3") == 3
    for bad in ("4", "0", "1.0"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"not an integer in \[1, 3\]"):
            argtypes.int_range(1, 3)(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="not one of a, b"):
        argtypes.choice_list(("a", "b"))("a,c")
    with pytest.raises(argparse.ArgumentTypeError, match="empty"):
        argtypes.int_list()(" , ")


def test_run_defaults_and_sizes():
    args = parse("run")
    assert args.size == 1 << 20 and args.rounds == 5 and args.dies == 4
    assert parse("run", "--size", "1M").size == 1048576
    assert parse("run", "--size", "64KiB", "--rounds", "2").size == 64 << 10


def test_decode_options(tmp_path):
    args = parse("decode", "--dies", "2", "--model", "tiny", "--quant", "int8",
                 "--json", str(tmp_path / "d.jsonl"), "--temperature", "0.7")  # fmt: skip
    opts = decode.parse_options(args)
    assert (opts.dies, opts.batch, opts.steps, opts.prompt_len) == (2, 8, 32, 64)
    assert opts.quant == "int8" and opts.model == "tiny" and opts.temperature == 0.7
    assert decode.parse_options(parse("decode")).quant is None
    cmp = decode.parse_options(parse("decode", "--dies", "8", "--eplb", "compare"))
    assert cmp.batch == 64 and cmp.eplb == "compare" and cmp.eplb_config.redundant_per_die == 1
    on = decode.parse_options(parse("decode", "--eplb", "on", "--redundant", "2",
                                    "--eplb-every", "5", "--eplb-policy", "deepseek"))  # fmt: skip
    assert (on.batch, on.eplb_config.redundant_per_die, on.eplb_config.every) == (8, 2, 5)


def test_p2p_options():
    opts = p2p.parse_options(parse("bench", "p2p", "--quick", "--sizes", "8,4K"))
    assert opts.sizes == [8, 4096] and opts.cores == [1, 2] and opts.config.num_dies == 2
    assert opts.variants == list(p2p.DEFAULT_VARIANTS)
    opts = p2p.parse_options(parse("bench", "p2p", "--cores", "1,8", "--variants", "dma"))
    assert opts.cores == [1, 8] and opts.variants == ["dma"] and opts.config.lanes == 8
    assert opts.sizes == common.parse_sizes(p2p.DEFAULT_SIZES)


def test_ring_options():
    opts = ring.parse_options(parse("bench", "ring", "--dies", "2,4", "--size", "4K", "--quick"))
    assert opts.pods == [(2, 200), (4, 100)] and opts.size == 4096
    assert ring.parse_options(parse("bench", "ring")).pods == [(8, 250)]


def test_alltoall_options():
    opts = alltoall.parse_options(parse("bench", "alltoall"))
    assert opts.dies == [8] and opts.batches == [1, 8, 16, 32, 64, 128]
    assert opts.protocols == ["pull", "fused"] and opts.quants == ["int8", "none"]
    args = parse("bench", "alltoall", "--a2e", "--attention-dies", "1", "--expert-dies", "2,4",
                 "--quick", "--iters", "0", "--hidden", "64", "--topk", "2")  # fmt: skip
    opts = alltoall.parse_options(args)
    assert opts.a2e_pods == [(1, 2), (1, 4)] and "a2e" in opts.protocols
    assert opts.batches == [1, 16, 128] and opts.iters == 0


def test_layout_runs_without_a_pod(capsys):
    assert cli.main(["layout", "--dies", "2"]) == 0
    assert "pod total: 2 regions" in capsys.readouterr().out


def test_flag_error_names_the_flag():
    e = argtypes.flag_error(ConfigError("num_dies: 0 must be >= 1"), {"num_dies": "--dies"})
    assert str(e) == "argument --dies: num_dies: 0 must be >= 1"
    e = argtypes.flag_error(ConfigError("wait: 'x' bad"), {"num_dies": "--dies"}, "pod.toml")
    assert str(e) == "argument --config: wait: 'x' bad"
    flags = {"app_bytes": "--size/--dies", "slot_bytes": "--slot-bytes"}
    e = argtypes.flag_error(ConfigError("app_bytes/ring_slots/slot_bytes: too big"), flags)
    assert str(e).startswith("argument --size/--dies/--slot-bytes: ")
