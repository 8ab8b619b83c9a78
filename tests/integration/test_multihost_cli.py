"""`--hosts` on the model commands: `xpod decode --hosts 2,2 --check` bit-equal over MPI,
`xpod generate --hosts 2,2` (MPI and mirror) giving the same completions as one host, and
bad host flags refused before anything starts."""

from __future__ import annotations

import json

import pytest

from runtime import cli

GEN = ["generate", "--dies", "4", "--model", "tiny", "--max-tokens", "8", "--timeout", "60",
       "--prompt", "The pod is", "--prompt", "Experts run"]  # fmt: skip


def run_cli(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def completions(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("[")]


@pytest.mark.timeout(300)
def test_decode_across_hosts_is_bit_equal(tmp_path):
    out = tmp_path / "d.json"
    argv = ["decode", "--dies", "4", "--hosts", "2,2", "--model", "tiny", "--batch", "4",
            "--prompt-len", "8", "--steps", "4", "--check", "--json", str(out)]  # fmt: skip
    assert run_cli(argv) == 0
    s = json.loads(out.read_text().splitlines()[-1])
    assert (s["hosts"], s["fabric"], s["mismatched_tokens"]) == ("2,2", "mpi", 0)
    assert s["logits_bit_equal"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fabric", ["mpi", pytest.param("mirror", marks=pytest.mark.multihost)])
def test_generate_across_hosts_gives_the_one_host_completions(fabric, capsys):
    assert run_cli(GEN) == 0
    one = completions(capsys.readouterr().out)
    assert run_cli([*GEN, "--hosts", "2,2", "--fabric", fabric]) == 0
    assert completions(capsys.readouterr().out) == one and len(one) == 2


@pytest.mark.parametrize(
    "argv, match",
    [
        (["decode", "--fabric", "mirror"], "only with --hosts"),
        (["decode", "--dies", "3", "--hosts", "2,2"], "makes 4 dies"),
        (["decode", "--hosts", "2,,2"], "empty entry"),
        (
            [
                "generate",
                "--hosts",
                "1,1",
                "--prefill-dies",
                "1",
                "--decode-dies",
                "1",
                "--prompt",
                "x",
            ],
            "one host",
        ),  # fmt: skip
        (["bench", "alltoall", "--hosts", "2,2", "--dies", "6"], "one pod of 4"),
    ],
)
def test_bad_host_flags_are_refused(argv, match, capsys):
    assert run_cli(argv) != 0
    assert match in capsys.readouterr().err
