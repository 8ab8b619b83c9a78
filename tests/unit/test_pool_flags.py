"""`--kv-pool` and the `--pool-*` flags of the commands that build an engine (serve, generate,
`bench serve --server-args`), the figures by source (runtime.engine.cache_stats), their
`/metrics` families over a fake engine (runtime.api.pool_metrics) and `bench serve`'s deltas.
No process starts here: launching a pod fails the test."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.serve import scrape
from bench.serve.flags import check_server_args
from memory.errors import ConfigError
from runtime import cli
from runtime.api.metrics import Metrics
from runtime.cli import generate, serve
from runtime.cli.argtypes import Parser, flag_error
from runtime.cli.engine_flags import ENGINE_FLAGS
from runtime.engine.cache_stats import cache_lines, cache_summary, prompt_sources
from runtime.engine.pool_config import PoolConfig, quota_blocks
from runtime.pod import Pod


@pytest.fixture(autouse=True)
def no_pod(monkeypatch):
    def launch(*args, **kwargs):
        raise AssertionError("a pod was launched: the flags were not checked before it")

    monkeypatch.setattr(Pod, "launch", launch)


def serve_config(*argv: str):
    p = Parser(prog="xpod serve")
    serve.add_args(p)
    return serve.parse_options(p.parse_args(["--model", "tiny", "--dies", "2", *argv])).engine


def refused(*argv: str) -> str:
    with pytest.raises(ConfigError) as e:
        serve_config(*argv)
    return str(e.value)


def run_cli(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


# -- flags -----------------------------------------------------------------------------------------


def test_no_pool_by_default():
    assert serve_config().kv_pool is None


def test_kv_pool_defaults():
    assert serve_config("--kv-pool").kv_pool == PoolConfig()
    assert PoolConfig().dram_mib == 256 and PoolConfig().ssd_mib == 0


def test_every_pool_flag_reaches_the_pool_config(tmp_path):
    d = tmp_path / "ssd"
    cfg = serve_config("--kv-pool", "--pool-dram-mib", "16", "--pool-ssd-mib", "8", "--pool-dir",
                       str(d), "--pool-admit", "second_hit", "--pool-store", "off",
                       "--pool-min-hit-blocks", "3", "--pool-load-timeout", "0.5")  # fmt: skip
    assert cfg.kv_pool == PoolConfig(dram_mib=16.0, ssd_mib=8.0, pool_dir=str(d),
                                     admit="second_hit", store="off", min_hit_blocks=3,
                                     load_timeout_s=0.5)  # fmt: skip
    assert d.is_dir()  # checked (and made) before anything starts, as the pool's shell would


def test_relative_pool_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = serve_config("--kv-pool", "--pool-ssd-mib", "4", "--pool-dir", "here")
    assert cfg.kv_pool.pool_dir == os.path.join(str(tmp_path), "here")


@pytest.mark.parametrize("flag, value", [
    ("--pool-dram-mib", "16"), ("--pool-ssd-mib", "4"), ("--pool-dir", "/tmp"),
    ("--pool-admit", "second_hit"), ("--pool-store", "off"), ("--pool-min-hit-blocks", "2"),
    ("--pool-load-timeout", "1"), ("--pool-quota", "a=1"), ("--pool-load-by", "server"),
    ("--pool-decode-load", "off"),
])  # fmt: skip
def test_a_pool_flag_without_kv_pool_is_refused(flag, value):
    assert refused(flag, value) == f"argument {flag}: needs --kv-pool"


def test_kv_pool_refused_without_the_prefix_cache():
    nocache = refused("--kv-pool", "--no-prefix-cache")
    assert nocache.startswith("argument --kv-pool") and "--no-prefix-cache" in nocache


def test_kv_pool_over_hosts_has_one_server_per_host():
    cfg = serve_config("--kv-pool", "--hosts", "1,1")
    assert cfg.kv_pool is not None and cfg.pool_servers == 2
    cfg = serve_config("--kv-pool", "--dies", "4", "--hosts", "3,1")
    assert cfg.pool_servers == 2
    assert serve_config("--kv-pool").pool_servers == 1


def test_the_hosts_dram_tiers_must_fit_together(monkeypatch):
    from memory import pool_layout

    # /dev/shm with room for one 64 MiB tier but not two (the emulated hosts' servers)
    monkeypatch.setattr(pool_layout, "shm_free_bytes", lambda: 100 << 20)
    assert serve_config("--kv-pool", "--pool-dram-mib", "64").kv_pool is not None
    msg = refused("--kv-pool", "--pool-dram-mib", "64", "--hosts", "1,1")
    assert msg.startswith("argument --pool-dram-mib") and "2 hosts' DRAM tiers" in msg


def test_kv_pool_on_a_pd_pod_is_accepted():
    cfg = serve_config("--kv-pool", "--prefill-dies", "1", "--decode-dies", "1")
    assert cfg.kv_pool is not None and cfg.pd is not None


def test_pool_store_all_is_accepted():
    assert serve_config("--kv-pool", "--pool-store", "all").kv_pool.store == "all"


def test_pool_load_by():
    assert serve_config("--kv-pool").kv_pool.load_by == "master"
    assert serve_config("--kv-pool", "--pool-load-by", "server").kv_pool.load_by == "server"
    with pytest.raises(ConfigError, match="kv_pool.load_by: 'die' must be master or server"):
        PoolConfig(load_by="die")


def test_kv_pool_on_a_split_pod_is_accepted():
    cfg = serve_config("--kv-pool", "--attention-dies", "2", "--expert-dies", "2")
    assert cfg.kv_pool is not None and cfg.expert_dies == 2 and cfg.dies == 2


def test_pool_sizes_refused_naming_the_flag():
    big = refused("--kv-pool", "--pool-dram-mib", "1e9")
    assert big.startswith("argument --pool-dram-mib") and "give a smaller size" in big
    small = refused("--kv-pool", "--pool-dram-mib", "0.001")
    assert small.startswith("argument --pool-dram-mib") and "holds no block" in small
    ssd = refused("--kv-pool", "--pool-ssd-mib", "0.001")
    assert ssd.startswith("argument --pool-ssd-mib") and "holds no block" in ssd


def test_pool_dir_refused_naming_the_flag(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    msg = refused("--kv-pool", "--pool-ssd-mib", "4", "--pool-dir", str(foreign))
    assert msg.startswith(f"argument --pool-dir {foreign}") and "notes.txt" in msg
    assert (foreign / "notes.txt").read_text() == "mine"
    a_file = tmp_path / "file"
    a_file.write_text("")
    msg = refused("--kv-pool", "--pool-ssd-mib", "4", "--pool-dir", str(a_file))
    assert msg.startswith("argument --pool-dir") and "not a directory" in msg
    msg = refused("--kv-pool", "--pool-dir", str(tmp_path / "x"))
    assert msg.startswith("argument --pool-dir") and "--pool-ssd-mib" in msg
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--pool-dram-mib", "8"], "--pool-dram-mib"),
    (["serve", "--kv-pool", "--pool-dram-mib", "0"], "--pool-dram-mib"),
    (["serve", "--kv-pool", "--pool-admit", "never"], "--pool-admit"),
    (["serve", "--kv-pool", "--pool-store", "decode"], "--pool-store"),
    (["serve", "--kv-pool", "--pool-min-hit-blocks", "-1"], "--pool-min-hit-blocks"),
    (["serve", "--kv-pool", "--pool-load-timeout", "0"], "--pool-load-timeout"),
    (["generate", "--prompt", "x", "--pool-store", "off"], "--pool-store"),
    (["generate", "--prompt", "x", "--kv-pool", "--no-prefix-cache"], "--kv-pool"),
    (["bench", "serve", "--launch", "--server-args", "--kv-pool --pool-dram-mib 1e9"],
     "--pool-dram-mib"),
])  # fmt: skip
def test_cli_refusal_is_one_line_with_status_2(argv, flag, capsys):
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("xpod") and ": error: " in err and flag in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_pool_quota_flags():
    cfg = serve_config("--kv-pool", "--pool-quota", "a=1", "--pool-quota", "team=b=0.5")
    assert cfg.kv_pool.quotas == {"a": 1.0, "team=b": 0.5}  # the last '=' splits
    assert serve_config("--kv-pool").kv_pool.quotas == {}
    twice = refused("--kv-pool", "--pool-quota", "a=1", "--pool-quota", "a=2")
    assert twice == "argument --pool-quota: namespace 'a' given twice"
    small = refused("--kv-pool", "--pool-quota", "a=0.00001")
    assert small.startswith("argument --pool-quota a=1e-05: smaller than one block"), small
    dflt = serve_config("--kv-pool", "--pool-quota", "=2", "--pool-quota", "a=1")
    assert dflt.kv_pool.quotas == {"": 2.0, "a": 1.0}  # "": the default namespace
    assert quota_blocks(dflt.kv_pool.quotas, 1 << 20) == {None: 2, "a": 1}


@pytest.mark.parametrize("value", ["a", "=", "a=", "a=0", "a=-1", "a=nan", "a=inf", "a=x"])
def test_a_bad_pool_quota_is_one_line_with_status_2(value, capsys):
    assert run_cli(["generate", "--prompt", "x", "--kv-pool", "--pool-quota", value]) == 2
    err = capsys.readouterr().err
    assert "error: argument --pool-quota:" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("quotas", [{None: 1.0}, {1: 1.0}, {"a": 0}, {"a": -1.0}, {"a": True},
                                    {"a": float("nan")}, {"a": float("inf")}, {"a": "1"},
                                    [("a", 1.0)]])  # fmt: skip
def test_pool_config_refuses_bad_quotas(quotas):
    with pytest.raises(ConfigError, match="kv_pool.quotas") as e:
        PoolConfig(quotas=quotas)
    assert str(flag_error(e.value, ENGINE_FLAGS)).startswith("argument --pool-quota:")


def test_quota_blocks():
    assert quota_blocks({"a": 1.0, "b": 2.5}, 1 << 20) == {"a": 1, "b": 2}
    assert quota_blocks({}, 4096) == {}
    with pytest.raises(ConfigError, match="--pool-quota a=0.5: smaller than one block"):
        quota_blocks({"a": 0.5}, 1 << 20)


def test_generate_cache_salt():
    p = Parser(prog="xpod generate")
    generate.add_args(p)

    def opts(*argv: str):
        args = p.parse_args(["--model", "tiny", "--dies", "2", "--prompt", "hi", *argv])
        return generate.parse_options(args)

    assert opts().cache_salt is None and opts("--cache-salt", "tenant-1").cache_salt == "tenant-1"
    for bad in ("", "x" * 257):
        with pytest.raises(ConfigError, match="argument --cache-salt"):
            opts("--cache-salt", bad)


def test_generate_and_bench_serve_take_the_pool_flags():
    p = Parser(prog="xpod generate")
    generate.add_args(p)
    args = p.parse_args(["--model", "tiny", "--dies", "2", "--prompt", "hi", "--kv-pool",
                         "--pool-dram-mib", "8"])  # fmt: skip
    assert generate.parse_options(args).engine.kv_pool == PoolConfig(dram_mib=8.0)
    eng = check_server_args(("--model", "tiny", "--dies", "2", "--kv-pool", "--pool-admit",
                             "second_hit"))  # fmt: skip
    assert eng.kv_pool == PoolConfig(admit="second_hit")


def test_pool_config_errors_name_the_flags():
    for field, flag in (("dram_mib", "--pool-dram-mib"), ("admit", "--pool-admit"),
                        ("min_hit_blocks", "--pool-min-hit-blocks")):  # fmt: skip
        err = flag_error(ConfigError(f"kv_pool.{field}: bad"), ENGINE_FLAGS)
        assert str(err).startswith(f"argument {flag}:")


# -- figures by source -----------------------------------------------------------------------------


def master(query: int, hit: int, pool: int | None = None, **more) -> dict:
    s = {"prefix_query_tokens": query, "prefix_hit_tokens": hit, **more}
    if pool is not None:
        s["pool_hit_tokens"] = pool
    return s


def test_prompt_sources():
    assert prompt_sources(master(200, 96, 96)) == {"local": 0, "pool": 96, "computed": 104}
    assert prompt_sources(master(200, 160, 96)) == {"local": 64, "pool": 96, "computed": 40}
    assert prompt_sources(master(200, 64)) == {"local": 64, "pool": 0, "computed": 136}
    # landed, not admitted yet: the pool's tokens are in, the hit is not
    assert prompt_sources(master(0, 0, 96)) == {"local": 0, "pool": 96, "computed": 0}
    assert prompt_sources(None) == {"local": 0, "pool": 0, "computed": 0}


def test_cache_summary_and_lines():
    stats = {0: master(101, 0, 0, pool_put_blocks=6),
             1: master(101, 96, 96, pool_loads=1, pool_load_bytes=147456,
                       pool_load_ns=2_000_000)}  # fmt: skip
    pool = {"pool_stored_blocks": 6, "index_entries": 6, "index_dram_used": {0: 6},
            "index_ssd_used": {0: 0}, "n_slots": 682, "ssd_blocks": 0, "up": True}  # fmt: skip
    c = cache_summary(stats, pool)
    assert (c["local_tokens"], c["pool_tokens"], c["computed_tokens"]) == (0, 96, 106)
    assert c["pool_rate"] == round(96 / 202, 4) and c["hit_rate"] == c["pool_rate"]
    assert c["loads"] == 1 and c["load_ms_mean"] == 2.0 and c["offered_blocks"] == 6
    assert c["dram_used_blocks"] == 6 and c["stored_blocks"] == 6
    lines = cache_lines(c)
    assert lines[0].startswith("prompt tokens by source: local 0 (0.0%), pool 96 (47.5%)")
    assert lines[1].startswith("kv pool loads: 1 (0 fell back") and "DRAM 6/682" in lines[2]
    assert len(cache_lines(cache_summary(stats, None))) == 1  # no pool: the sources only


# -- /metrics --------------------------------------------------------------------------------------


class FakePool:
    def __init__(self):
        self.calls = 0

    def stats(self) -> dict:
        self.calls += 1
        return {"pool_lookups": 2, "pool_hints": 1, "pool_stored_blocks": 6,
                "pool_server_restarts": 1, "index_entries": 6, "index_dram_used": {0: 6},
                "index_ssd_used": {0: 2}, "n_slots": 682, "ssd_blocks": 40,
                "slot_bytes": 24576, "index_evictions": 3, "up": True}  # fmt: skip


def samples(m: Metrics) -> dict:
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def fake_engine(stats: dict, pool=None):
    return SimpleNamespace(config=SimpleNamespace(dies=2), stats=stats, masters=[], outputs=[],
                           pod=None, observer=None, pool=pool)  # fmt: skip


def by_source(s: dict, group: int, source: str) -> float:
    return s[("xpod_prompt_tokens_by_source_total", (("group", str(group)), ("source", source)))]


def test_metrics_by_source_without_a_pool():
    m = Metrics(fake_engine({0: master(100, 32), 1: master(50, 0)}))
    s = samples(m)
    assert by_source(s, 0, "local") == 32 and by_source(s, 0, "computed") == 68
    assert by_source(s, 1, "pool") == 0 and by_source(s, 1, "computed") == 50
    assert not any(name.startswith("xpod_pool_") for name, _ in s)


def test_metrics_of_the_pool():
    stats = {0: master(101, 0, 0, pool_put_blocks=6, pool_waiting=1),
             1: master(101, 96, 96, pool_loads=1, pool_load_bytes=147456,
                       pool_load_ns=5_000_000, pool_query_tokens=100)}  # fmt: skip
    pool = FakePool()
    s = samples(Metrics(fake_engine(stats, pool)))
    assert pool.calls >= 1
    assert by_source(s, 1, "pool") == 96 and by_source(s, 1, "local") == 0
    assert s[("xpod_pool_hits_total", (("group", "1"),))] == 96
    assert s[("xpod_pool_queries_total", (("group", "1"),))] == 100
    assert s[("xpod_pool_load_seconds_total", (("group", "1"),))] == pytest.approx(0.005)
    assert s[("xpod_pool_offered_blocks_total", (("group", "0"),))] == 6
    assert s[("xpod_pool_requests_waiting", (("group", "0"),))] == 1
    assert s[("xpod_pool_lookups_total", ())] == 2
    assert s[("xpod_pool_stored_blocks_total", ())] == 6
    assert s[("xpod_pool_server_restarts_total", ())] == 1
    assert s[("xpod_pool_evictions_total", ())] == 3
    assert s[("xpod_pool_blocks", (("tier", "ssd"),))] == 2
    assert s[("xpod_pool_capacity_blocks", (("tier", "dram"),))] == 682
    assert s[("xpod_pool_server_up", ())] == 1


def test_metrics_of_quota_refusals():
    pool = FakePool()
    pool.stats = lambda: {"pool_quota_refused_blocks": 5, "up": True}
    s = samples(Metrics(fake_engine({0: master(10, 0, 0)}, pool)))
    assert s[("xpod_pool_quota_refused_blocks_total", ())] == 5


def test_local_tokens_never_go_down_while_a_load_waits_for_admission():
    stats = {0: master(200, 64, 0), 1: master(0, 0)}
    m = Metrics(fake_engine(stats, FakePool()))
    assert by_source(samples(m), 0, "local") == 64
    stats[0] = master(200, 64, 96)  # 6 blocks landed; their request not admitted yet
    assert by_source(samples(m), 0, "local") == 64
    stats[0] = master(300, 160, 96)  # admitted: its 96 tokens hit
    assert by_source(samples(m), 0, "local") == 64
    stats[0] = master(20, 16, 0)  # a new master (restart): counting from 0 again
    assert by_source(samples(m), 0, "local") == 16


def test_bench_serve_figures_by_source():
    def snap(local, pool, computed, loads=0.0, secs=0.0, nbytes=0.0):
        out = {"xpod_prompt_tokens_by_source_total": [
            ({"group": "0", "source": "local"}, local), ({"group": "0", "source": "pool"}, pool),
            ({"group": "0", "source": "computed"}, computed)]}  # fmt: skip
        if loads:
            out.update(xpod_pool_loads_total=[({"group": "0"}, loads)],
                       xpod_pool_load_seconds_total=[({"group": "0"}, secs)],
                       xpod_pool_load_bytes_total=[({"group": "0"}, nbytes)])  # fmt: skip
        return out

    s0, s1 = snap(10, 0, 90), snap(30, 96, 194, loads=2, secs=0.004, nbytes=4e6)

    def d(name, **labels):
        return scrape.total(s1, name, **labels) - scrape.total(s0, name, **labels)

    f = scrape.cache_figures(d)
    assert (f["local_prompt_tokens"], f["pool_prompt_tokens"], f["computed_prompt_tokens"]) == (
        20, 96, 104)  # fmt: skip
    assert f["pool_hit_rate"] == pytest.approx(96 / 220)
    assert f["hit_rate"] == pytest.approx(116 / 220)
    assert f["pool_loads"] == 2 and f["pool_load_gbps"] == pytest.approx(1.0)
    assert scrape.cache_figures(lambda name, **labels: 0.0) == {}


def test_pool_decode_load_flag():
    assert serve_config("--kv-pool").kv_pool.decode_load is True
    assert serve_config("--kv-pool", "--pool-decode-load", "off").kv_pool.decode_load is False
