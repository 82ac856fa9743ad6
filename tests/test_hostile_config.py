"""Hostile configs: YAML alias bombs (bounded before anything expands them, Snakemake's validate included),
self-referencing YAML, sources that are FIFOs or devices (refused without being opened)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hsextract.config.guard import MAX_CONFIG_VALUES, check_bounded, check_source_path
from hsextract.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def alias_bomb(key: str, depth: int = 9) -> str:
    """Billion laughs: level k is 10 aliases of level k-1; depth 9 expands to 10^9 strings from 500 bytes."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{k}: &l{k} [" + ",".join([f"*l{k - 1}"] * 10) + "]" for k in range(1, depth)]
    return f"{key}:\n" + "\n".join("  " + line for line in lines) + "\n"


def limited(code: str, *args: str, limit_mb: int = 600) -> subprocess.CompletedProcess:
    """Run `code` in a child whose address space may grow by `limit_mb` MB after its imports."""
    pre = ("import resource\n"
           "vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1]) * 1024\n"
           f"resource.setrlimit(resource.RLIMIT_AS, (vm + ({limit_mb} << 20),) * 2)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-c",
                           "import yaml, hsextract.config.guard, hsextract.config.settings\n" + pre + code, *args],
                          capture_output=True, text=True, env=env, timeout=600, check=False)


@pytest.mark.parametrize("key", ["bomb", "chat_template_kwargs", "sources"])
def test_alias_bomb_is_refused_before_anything_expands_it(tmp_path: Path, key: str) -> None:
    (tmp_path / "bomb.yaml").write_text(alias_bomb(key))
    code = ("import sys, yaml\nfrom hsextract.config.guard import check_bounded\n"
            "from hsextract.config.settings import fill_defaults\nfrom hsextract.errors import ConfigError\n"
            "cfg = yaml.safe_load(open(sys.argv[1]))\n"
            "for f in (check_bounded, fill_defaults):\n"
            "    try:\n        f(cfg)\n    except ConfigError as e:\n        print(type(e).__name__, e)\n")
    out = limited(code, str(tmp_path / "bomb.yaml"), limit_mb=200)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith(f"ConfigError config: more than {MAX_CONFIG_VALUES} values when aliases are expanded "
                               f"(near {key}.l8[")


def test_snakemake_refuses_an_alias_bomb_in_bounded_memory(tmp_path: Path) -> None:
    """Through the Snakefile: our check runs before Snakemake's validate, whose error message would print the
    whole expanded config (10^9 strings here)."""
    (tmp_path / "bomb.yaml").write_text(alias_bomb("bomb"))
    snakemake = Path(sys.executable).with_name("snakemake")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(["prlimit", f"--as={3 << 30}", str(snakemake), "-n", "--configfile",
                          str(tmp_path / "bomb.yaml")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert out.returncode != 0
    assert f"config: more than {MAX_CONFIG_VALUES} values when aliases are expanded" in out.stdout + out.stderr
    assert len(out.stdout + out.stderr) < 20_000


def test_self_referencing_yaml_is_refused() -> None:
    cfg = yaml.safe_load("a: &a [1, *a]\n")  # a list that holds itself
    with pytest.raises(ConfigError, match=r"^config: a(\[1\])+: nested more than 64 levels deep$"):
        check_bounded(cfg)


def test_the_bundled_configs_are_far_below_the_bound() -> None:
    for p in sorted((ROOT / "config").glob("*.yaml")):
        assert check_bounded(yaml.safe_load(p.read_text()) or {}) < MAX_CONFIG_VALUES // 100, p


def test_non_regular_sources_are_refused_without_opening_them(tmp_path: Path) -> None:
    fifo = tmp_path / "conversations.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "link.jsonl").symlink_to(fifo)
    cases = {str(fifo): "is a FIFO", str(tmp_path / "link.jsonl"): "is a FIFO", "/dev/zero": "is a device",
             str(tmp_path / "missing.jsonl"): "does not exist"}
    for path, what in cases.items():
        with pytest.raises(ConfigError) as e:
            check_source_path("sources[0].path", path)
        assert str(e.value).startswith(f"sources[0].path: {path} {what}")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds/state.json").write_text("{}")
    check_source_path("sources[0].path", tmp_path / "ds")  # a dataset folder (save_to_disk)
    (tmp_path / "a.jsonl").write_text("{}\n")
    check_source_path("sources[0].path", tmp_path / "a.jsonl")


def test_a_source_its_reader_cannot_count_is_named(tmp_path: Path) -> None:
    from hsextract.prepare.conversations import count_records

    (tmp_path / "a.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds/state.json").write_text("garbage")
    for bad, what in (("empty.parquet", "ArrowInvalid: "), ("ds", "JSONDecodeError: ")):
        with pytest.raises(ConfigError) as e:
            count_records([{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / bad)}])
        assert str(e.value).startswith(f"sources[1].path: cannot read the records of {tmp_path / bad} ({what}")
    assert count_records([{"path": str(tmp_path / "a.jsonl")}]) == 1


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "gpu-node-7"])
def test_non_loopback_host_needs_an_api_key_or_allow_remote(host: str, capsys: pytest.CaptureFixture) -> None:
    from hsextract.config.guard import check_remote

    with pytest.raises(ConfigError, match=rf"^sglang.host: {host} is not a loopback address: the server would accept"):
        check_remote({"engine": "sglang", "sglang": {"host": host, "api_key_file": None, "allow_remote": False}})
    check_remote({"engine": "sglang", "sglang": {"host": host, "api_key_file": "key.txt", "allow_remote": False}})
    assert capsys.readouterr().err == ""
    check_remote({"engine": "sglang", "sglang": {"host": host, "api_key_file": None, "allow_remote": True}})
    assert capsys.readouterr().err.startswith(f"hsextract: warning: sglang.host {host} is not a loopback address")
    check_remote({"engine": "transformers", "sglang": {"host": host}})  # no server is started


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost"])
def test_loopback_hosts_need_no_key(host: str) -> None:
    from hsextract.config.guard import check_remote

    check_remote({"engine": "sglang", "sglang": {"host": host, "api_key_file": None, "allow_remote": False}})


@pytest.mark.parametrize("host", ["::1", "::", "fe80::1"])
def test_an_ipv6_host_is_refused_at_parse_time(host: str) -> None:
    """The launcher probes its port over IPv4 and the client writes http://host:port unbracketed: an IPv6 host
    passed the loopback check and ended the job in a bare socket.gaierror."""
    from hsextract.config.guard import check_remote

    with pytest.raises(ConfigError) as e:
        check_remote({"engine": "sglang", "sglang": {"host": host, "api_key_file": "k", "allow_remote": True}})
    assert str(e.value) == (f"sglang.host: {host} is an IPv6 address, which the launcher does not serve: use "
                            "127.0.0.1 (loopback), an IPv4 address or a host name")
    with pytest.raises(ConfigError) as e:
        check_remote({"engine": "sglang", "sglang": {"host": "localhost:30000", "api_key_file": None}})
    assert str(e.value) == ("sglang.host: localhost:30000 holds a ':': give the interface alone (127.0.0.1, say) and "
                            "the port as sglang.port")
