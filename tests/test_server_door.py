"""Issue 36: the local SGLang server's door and its key.

No secret at rest or in sight (no config holds the key: it is in a 0600 file `sglang.api_key_file` names, as
`snakemake --report` reads config files for the report; patched.json, the state file, the server's log
and command line, a start-up failure hide it), a key by default (a random one, kept 0600 in
the private state directory, sent by the client), the launcher owns its flags (each `launch_args` override
refused by name), and the two small ones (`run_name` bounded by the schema, a folder source of the wrong
kind named). The server is tests/fake_sglang.py, which keeps its door as SGLang 0.5.16 does.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # fake_sglang lives here
from conftest import listen_port
from fake_sglang import expected_states

from hsextract.config.guard import check_source_path
from hsextract.config.redaction import REDACTED, SECRET_KEYS, redact_command, redact_text
from hsextract.config.settings import fill_defaults
from hsextract.config.stale_lock import process_start
from hsextract.engines.base import CaptureSpec, Prompt
from hsextract.errors import ConfigError, EngineError
from hsextract.sglang import keyfile
from hsextract.sglang import server as hsrv
from hsextract.sglang.api import ServerGone, SGLangAPI
from hsextract.sglang.client import SGLangEngine
from hsextract.sglang.logscrub import copy_scrubbed

ROOT = Path(__file__).resolve().parents[1]
AUX = (1, 3, 5)
SPEC = CaptureSpec(aux_layers=AUX, final_state="post_norm")
KEY = "hsx-door-test-Zq8w1K5vXb3nT7yP"  # a configured key: searched for in every byte written


# ---- no secret in a config; one way to hide the key where it travels --------------------------------
def test_redaction_hides_the_secret_flags_only() -> None:
    assert redact_command(["py", "--api-key", KEY, "--port", "1", "--admin-api-key=x", "--ssl-keyfile-password",
                           "y"]) == ["py", "--api-key", REDACTED, "--port", "1", f"--admin-api-key={REDACTED}",
                                     "--ssl-keyfile-password", REDACTED]
    assert redact_text(f"a {KEY} b {KEY}", [KEY]) == f"a {REDACTED} b {REDACTED}"


INLINE_KEY = (
    "sglang.api_key: a config may not hold the key: `snakemake --report` reads every config file's text for the "
    "report, and `--config` puts it on the command line. Write the key alone into a file only you can read "
    "(chmod 600 FILE) and set sglang.api_key_file: FILE, or set neither: each server the workflow starts gets a "
    "random key"
)


@pytest.mark.parametrize("value", [KEY, "-" + KEY, KEY + " x", 12345, None, {"a": KEY}])
def test_a_key_in_a_config_is_refused_before_anything_reads_it(value: object) -> None:
    """Whatever its value (null too: the key is gone), before the schema could quote it."""
    with pytest.raises(ConfigError) as e:
        fill_defaults({"run_name": "a b", "sglang": {"api_key": value, "tpp": 1}})  # other errors come after
    assert str(e.value) == INLINE_KEY
    assert SECRET_KEYS == {"sglang.api_key": "sglang.api_key_file"}
    assert fill_defaults({"sglang": {"api_key_file": "k"}})["sglang"]["api_key_file"] == "k"


def test_the_cli_prints_no_key(tmp_path: Path) -> None:
    """`hsextract plan` merges config files as the workflow does: the key in one is refused, never printed."""
    (tmp_path / "c.yaml").write_text(f"sglang: {{api_key: '-{KEY}'}}\n")
    out = subprocess.run([sys.executable, "-m", "hsextract.cli", "plan", "--configfile", "config/kimi.yaml",
                          str(tmp_path / "c.yaml"),
                          "--samples", "10", "--mean-tokens", "100"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode != 0 and INLINE_KEY in out.stderr
    assert KEY not in out.stdout + out.stderr


def key_file(where: Path, text: str = KEY + "\n", mode: int = 0o600) -> Path:
    path = where / "api-key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_key_file_holds_the_key_alone_and_only_its_owner_reads_it(tmp_path: Path) -> None:
    assert keyfile.read_key_file(key_file(tmp_path)) == KEY  # a final newline (echo's) is no part of it
    assert keyfile.read_key_file(key_file(tmp_path, f"  {KEY}\r\n", 0o400)) == KEY
    assert keyfile.read_key_file(key_file(tmp_path, "k" * 1000)) == "k" * 1000
    path = tmp_path / "api-key"
    for mode in (0o640, 0o604, 0o620, 0o602, 0o610, 0o644):
        key_file(tmp_path, mode=mode)
        with pytest.raises(ConfigError) as e:
            keyfile.read_key_file(path)
        assert str(e.value) == (f"sglang.api_key_file: {path} has mode {mode:04o}: other users can read or change "
                                f"the key; run `chmod 600 {path}`")
    fix = f"write the server's API key alone into it and run `chmod 600 {path}`"
    path.unlink()
    with pytest.raises(ConfigError) as e:
        keyfile.read_key_file(path)
    unquoted = "(its value is not shown: a key written there by mistake would be)"
    assert str(e.value) == (f"sglang.api_key_file: names no existing file {unquoted}; give the path of a file of "
                            "mode 0600 that holds the server's API key alone")
    with pytest.raises(ConfigError) as e:  # the key itself, pasted as the path: too long a name
        keyfile.read_key_file("k" * 5000)
    assert str(e.value) == f"sglang.api_key_file: cannot be read (File name too long) {unquoted}"
    path.mkdir()
    with pytest.raises(ConfigError) as e:
        keyfile.read_key_file(path)
    assert str(e.value) == f"sglang.api_key_file: {path} is not a regular file; {fix}"
    path.rmdir()
    os.mkfifo(path, 0o600)  # opened without waiting for a writer
    with pytest.raises(ConfigError) as e:
        keyfile.read_key_file(path)
    assert str(e.value) == f"sglang.api_key_file: {path} is not a regular file; {fix}"
    path.unlink()
    assert keyfile.read_key_file(key_file(tmp_path, "k" * 16)) == "k" * 16
    # too short: guessed, and the log filter (which hides the key's bytes everywhere) would garble the log
    for text in ("", "\n", f"-{KEY}", f"{KEY} x", f'{KEY}"', f"{KEY}\\", f"{KEY}\n{KEY}", "k" * 1001, "ké",
                 "k" * 5000, "e", "k" * 15):
        key_file(tmp_path, text)
        with pytest.raises(ConfigError) as e:
            keyfile.read_key_file(path)
        assert str(e.value) == (
            f"sglang.api_key_file: {path} does not hold one key: printable ASCII without spaces, quotes or "
            "backslash, not starting with '-', 16 to 1,000 characters (the file holds the key alone; a random "
            "one: python3 -c 'import secrets; print(secrets.token_hex(32))')")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = key_file(tmp_path)
    os.chown(path, 12345, -1)
    with pytest.raises(ConfigError) as e:
        keyfile.read_key_file(path)
    assert str(e.value) == (f"sglang.api_key_file: {path} belongs to another user (uid 12345), who can read or "
                            f"change the key; write the server's API key alone into it and run `chmod 600 {path}`")


def test_the_config_check_reads_the_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At parse time, before any job: a missing or open key file stops the run; a good one passes, and the
    config (what dataset.json records) names the file, never the key."""
    from hsextract.config.checks import check
    from hsextract.sglang import config as sc

    cfg = {**door_config(tmp_path, monkeypatch), "engine": "sglang", "sglang": {"api_key_file": "k/api-key"}}
    with pytest.raises(ConfigError, match=r"^sglang.api_key_file: names no existing file \(its value is not shown"):
        check(cfg)
    (tmp_path / "k").mkdir()
    key_file(tmp_path / "k", mode=0o644)
    with pytest.raises(ConfigError, match=r"^sglang.api_key_file: k/api-key has mode 0644: "):
        check(cfg)
    (tmp_path / "k/api-key").chmod(0o600)
    s = check(cfg).settings
    assert sc.configured_key(s.extract) == KEY and KEY not in json.dumps(dict(s.config))
    assert check({**cfg, "engine": "transformers"}).settings.extract.sglang.api_key_file == "k/api-key"


# ---- the launcher owns the door ---------------------------------------------------------------------
# each flag the launcher sets, with what its refusal says to do instead
OVERRIDES = {
    "--model-path": "set `model`",
    "--model": "set `model`",
    "--host": "set `sglang.host`",
    "--port": "set `sglang.port`",
    "--tp": "set `sglang.tp`",
    "--tp-size": "set `sglang.tp`",
    "--tensor-parallel-size": "set `sglang.tp`",
    "--chunked-prefill-size": "set `sglang.chunked_prefill_size`",
    "--trust-remote-code": "set `trust_remote_code: true`",
    "--api-key": "set `sglang.api_key_file` (or nothing: each server gets a random key)",
    "--config": "it passes the API key file; give the file's options as launch_args",
    "--enable-return-hidden-states": "set `sglang.capture`",
    "--enable-return-aux-hidden-states": "set `sglang.capture`",
    "--speculative-algorithm": "set `sglang.capture`",
    "--return-aux-hidden-state-layer-ids": "set `aux_layers`",
    "--disable-prefill-cuda-graph": "set `sglang.prefill_cuda_graph`",
    "--disable-radix-cache": "the launcher passes it unless share_prefixes is on (which needs the radix cache); "
                             "remove it",
    "--skip-tokenizer-init": "the client sends token ids; remove it",
}


def test_every_launcher_flag_is_listed() -> None:
    assert hsrv.LAUNCHER_FLAGS == OVERRIDES
    # whatever the launcher itself passes is among them
    cfg = hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", chunked_prefill_size=8,
                            trust_remote_code=True)
    for capture in ("plugin", "builtin"):
        cmd = hsrv.build_command(hsrv.ServerConfig(**{**cfg.__dict__, "capture": capture}), 0, "/k.yaml")
        assert {a for a in cmd if a.startswith("--")} <= set(OVERRIDES)


@pytest.mark.parametrize("flag", sorted(OVERRIDES))
def test_each_launch_args_override_is_refused_with_its_message(flag: str) -> None:
    want = rf"^sglang.launch_args\[2\]: {flag} is set by the launcher itself; {_re(OVERRIDES[flag])}$"
    for args in (("--mem-fraction-static", "0.8", flag, "x"), ("--mem-fraction-static", "0.8", f"{flag}=x")):
        with pytest.raises(ConfigError, match=want):  # in the launcher, called directly
            hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", launch_args=args)
        with pytest.raises(ConfigError, match=want):  # at config-check time, before any job
            hsrv.check_launch_args(list(args))


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_abbreviations_are_refused_and_sglangs_own_flags_pass() -> None:
    """SGLang's argparse takes an unambiguous beginning of a flag: `--hos 0.0.0.0` is `--host 0.0.0.0`."""
    with pytest.raises(ConfigError, match=r"^sglang.launch_args\[0\]: --hos \(an abbreviation of --host\) is set "
                                          r"by the launcher itself; set `sglang.host`$"):
        hsrv.check_launch_args(["--hos", "0.0.0.0"])
    with pytest.raises(ConfigError, match=r"--api-k \(an abbreviation of --api-key\)"):
        hsrv.check_launch_args(["--api-k=x"])
    # --ssl-keyfile is SGLang's own flag (an exact match wins), values and short flags are not flags
    hsrv.check_launch_args(["--ssl-keyfile", "/k.pem", "--mem-fraction-static", "0.85", "--served-model-name",
                            "host", "-h", "--"])


def test_other_doors_and_written_keys_are_closed() -> None:
    """SGLang 0.5.16 starts a gRPC server beside HTTP that checks no key (--grpc-port, SGLANG_GRPC_PORT, the SMG
    modes, a sidecar on it), and pickles its arguments, the key among them, into --crash-dump-folder."""
    grpc = ("may not be given; it starts a gRPC server on sglang.host beside HTTP, which does not check the API key; "
            "the workflow speaks HTTP: remove it")
    for args, what in ((["--grpc-port", "40000"], "--grpc-port"), (["--smg-grpc-mode"], "--smg-grpc-mode"),
                       (["--grpc-mode"], "--grpc-mode"), (["--sidecar", "m"], "--sidecar"),
                       (["--grpc-p=1"], "--grpc-p (an abbreviation of --grpc-port)")):
        with pytest.raises(ConfigError) as e:
            hsrv.check_launch_args(args)
        assert str(e.value) == f"sglang.launch_args[0]: {what} {grpc}"
    with pytest.raises(ConfigError) as e:
        hsrv.check_launch_args(["--tp-size-x", "--crash_dump_folder", "/tmp/d"])  # an unknown flag passes
    assert str(e.value) == (
        "sglang.launch_args[1]: --crash_dump_folder (a spelling of --crash-dump-folder) may not be given; SGLang "
        "pickles its arguments, the API key among them, and the last requests into that folder on a crash or a "
        "stop; remove it")
    # secrets the launcher does not set: refused as such, not as its own flags
    with pytest.raises(ConfigError) as e:
        hsrv.check_launch_args(["--admin_api_key", KEY])
    assert str(e.value) == ("sglang.launch_args[0]: --admin_api_key (a spelling of --admin-api-key) may not be given; "
                            "a key on the command line is visible to every local user (ps); remove it")
    with pytest.raises(ConfigError) as e:
        hsrv.check_launch_args(["--ssl-keyfile-password=x"])
    assert str(e.value) == ("sglang.launch_args[0]: --ssl-keyfile-password may not be given; a password on the "
                            "command line is visible to every local user (ps); remove it")
    # --api_key: SGLang's parser refuses it, and the failed start's command would show the value
    with pytest.raises(ConfigError, match=r"^sglang.launch_args\[0\]: --api_key \(a spelling of --api-key\) is set"):
        hsrv.check_launch_args(["--api_key", KEY])
    with pytest.raises(ConfigError) as e:
        hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", env={"SGLANG_GRPC_PORT": "1"})
    assert str(e.value) == f"sglang.env: SGLANG_GRPC_PORT: {grpc.removeprefix('may not be given; ')}"
    cfg = hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm")
    env = hsrv.build_env(cfg, Path("/d"), base={"SGLANG_GRPC_PORT": "40001", "PATH": "/bin"})
    assert "SGLANG_GRPC_PORT" not in env and env["PATH"] == "/bin"  # inherited from the job's shell: dropped


def test_every_spelling_of_a_secret_flag_is_redacted() -> None:
    from hsextract.config.redaction import redact_command

    assert redact_command(["--api_key", "A", "--api-k", "B", "--api-key", "C", "--api-key=D", "--admin-api-key",
                           "E", "--ssl-keyfile", "/k.pem", "--ssl-keyfile-pass=F", "--tp", "2"]) == [
        "--api_key", "<redacted>", "--api-k", "<redacted>", "--api-key", "<redacted>", "--api-key=<redacted>",
        "--admin-api-key", "<redacted>", "--ssl-keyfile", "/k.pem", "--ssl-keyfile-pass=<redacted>", "--tp", "2"]


def test_schema_errors_do_not_quote_where_a_key_could_be() -> None:
    from hsextract.config.settings import fill_defaults

    for sglang, want in (({"launch_args": f"--api-key {KEY}"}, "sglang.launch_args: the value (not shown: it could "
                          "hold a key) is not of type 'array'"),
                         ({"launch_args": [{"k": KEY}]}, "sglang.launch_args[0]: the value (not shown: it could hold "
                          "a key) is not of type 'string'"),
                         ({"server_url": f"https://h/{KEY}"}, "sglang.server_url: the value (not shown: it could "
                          "hold a key) does not match '^http://'")):
        with pytest.raises(ConfigError) as e:
            fill_defaults({"sglang": sglang})
        assert str(e.value) == f"{want} (workflow/schemas/config.schema.yaml)" and KEY not in str(e.value)


def test_config_check_refuses_an_override_before_any_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hsextract.config.checks import check

    cfg = door_config(tmp_path, monkeypatch)
    cfg.update(engine="sglang", sglang={"launch_args": ["--host", "0.0.0.0"]})
    with pytest.raises(ConfigError, match=r"^sglang.launch_args\[0\]: --host is set by the launcher itself; set "
                                          r"`sglang.host`$"):
        check(cfg)
    cfg["engine"] = "transformers"  # no server, but the config dataset.json records: refused all the same
    with pytest.raises(ConfigError, match=r"^sglang.launch_args\[0\]: --host is set by the launcher itself"):
        check(cfg)
    cfg["sglang"] = {"launch_args": ["--mem-fraction-static", "0.8"]}
    check(cfg)


@pytest.mark.parametrize("flag", sorted(hsrv.CAPTURE_FLAGS))
def test_flags_under_which_the_capture_misses_rows_are_refused(flag: str) -> None:
    """SGLang 0.5.16 runs rows outside the capture under two-batch overlap (DeepSeek's layers after the dense ones
    outside the capturing loop), PD multiplexing (forward_batch_split_prefill, not hooked) and context
    parallelism (a request's rows over the ranks)."""
    assert set(hsrv.CAPTURE_FLAGS) == {
        "--enable-two-batch-overlap", "--enable-pdmux", "--enable-prefill-cp", "--attn-cp-size",
        # 0.5.16's alias and deprecated spellings
        "--attention-context-parallel-size", "--enable-prefill-context-parallel",
        "--enable-nsa-prefill-context-parallel", "--enable-dsa-prefill-context-parallel"}
    for args in (["--mem-fraction-static", "0.8", flag], ["--mem-fraction-static", "0.8", f"{flag}=2"]):
        with pytest.raises(ConfigError) as e:
            hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", launch_args=tuple(args))
        assert str(e.value) == f"sglang.launch_args[2]: {flag} may not be given; {hsrv.CAPTURE_FLAGS[flag]}"
    with pytest.raises(ConfigError, match=r"^sglang.launch_args\[0\]: --enable-two-batch \(an abbreviation of "
                                          r"--enable-two-batch-overlap\) may not be given; two-batch overlap runs "):
        hsrv.check_launch_args(["--enable-two-batch"])


@pytest.mark.parametrize("flag", ["--cuda-graph-backend-prefill", "--enable-breakable-cuda-graph",
                                  "--enforce-piecewise-cuda-graph", "--cuda-graph-config"])
def test_flags_that_turn_the_prefill_graphs_back_on_are_refused(flag: str) -> None:
    """SGLang 0.5.16 applies the per-phase backend (and its deprecated spellings) and an explicit graph config over
    --disable-prefill-cuda-graph: whether prefills run on graphs is sglang.prefill_cuda_graph's alone."""
    what = ("it turns on SGLang's prefill CUDA graphs, which `sglang.prefill_cuda_graph` decides (the launcher passes "
            "--disable-prefill-cuda-graph unless it is true)")
    if flag == "--cuda-graph-config":
        what += "; give the decode graphs' settings with their own flags (--cuda-graph-max-bs-decode, ...)"
    with pytest.raises(ConfigError) as e:
        hsrv.check_launch_args(["--cuda-graph-max-bs-decode", "16", flag, "x"])
    assert str(e.value) == f"sglang.launch_args[2]: {flag} may not be given; {what}"
    hsrv.check_launch_args(["--cuda-graph-max-bs-decode", "16", "--disable-piecewise-cuda-graph"])


def test_prefill_graphs_with_a_pre_norm_state_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-norm state comes from a hook on the final norm, inside the graphed decoder, which SGLang 0.5.16's
    breakable prefill graphs replay without running it."""
    from hsextract.config.checks import check

    want = ("sglang.prefill_cuda_graph: true with final_state {}: SGLang replays its prefill CUDA graphs without the "
            "final norm's hook that takes the pre-norm state (never run here); set sglang.prefill_cuda_graph: false "
            "(the default) or final_state: post_norm")
    for final_state in ("pre_norm", "both"):
        with pytest.raises(ConfigError) as e:
            hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state=final_state, prefill_cuda_graph=True)
        assert str(e.value) == want.format(final_state)
    assert hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", prefill_cuda_graph=True)
    cfg = door_config(tmp_path, monkeypatch)
    cfg.update(engine="sglang", sglang={"prefill_cuda_graph": True})
    with pytest.raises(ConfigError) as e:  # before any job
        check(cfg)
    assert str(e.value) == want.format("pre_norm")
    cfg["sglang"] = {"prefill_cuda_graph": False}
    check(cfg)
    # an external server is started by its owner: the key starts nothing (config/README.md says what to pass)
    cfg["sglang"] = {"prefill_cuda_graph": True, "server_url": "http://127.0.0.1:1", "dump_dir": str(tmp_path / "d")}
    check(cfg)


def test_the_replicas_gpus_add_up_before_any_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hsextract.config.checks import check

    cfg = door_config(tmp_path, monkeypatch)
    for sglang, n in (({"tp": 3, "gpus": [0, 1]}, 2), ({"tp": 3, "gpus": list(range(8))}, 8)):
        cfg.update(engine="sglang", sglang=sglang)
        with pytest.raises(ConfigError) as e:
            check(cfg)
        assert str(e.value) == f"sglang.gpus lists {n} devices; 1 replicas x tp 3 use 3: list exactly those"
    with pytest.raises(ConfigError, match=r"^sglang.gpus lists 2 devices; 2 replicas x tp 2 use 4"):
        hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", tp=2, replicas=2, gpus=(0, 1))
    cfg.update(sglang={"port": 65535, "replicas": 2})  # the ports too (an extract job's OverflowError otherwise)
    with pytest.raises(ConfigError, match=r"^sglang.port: replica r listens on port \+ r, so 2 replicas from port "
                                          r"65535 reach 65536"):
        check(cfg)


def test_a_url_with_credentials_is_refused_without_quoting_it() -> None:
    for cfg, where in (({"sglang": {"server_url": f"http://u:{KEY}@h:30000"}}, "sglang.server_url"),
                       ({"sglang": {"servers": ["http://h:1", f"http://{KEY}@h:2/x"]}}, "sglang.servers[1]"),
                       ({"regenerate": {"server_url": f"http://u:{KEY}@h"}}, "regenerate.server_url")):
        with pytest.raises(ConfigError) as e:
            fill_defaults(cfg)
        assert str(e.value) == (f"{where}: the URL holds credentials (user:password@), which dataset.json and the "
                                "logs would record; give the server's address alone, and its key in a file "
                                "(sglang.api_key_file, regenerate.api_key_file)")
    fill_defaults({"sglang": {"server_url": "http://h:30000/a@b"}})  # an @ in the path is no credential


def test_the_launcher_refuses_a_remote_host_without_a_key() -> None:
    remote = hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", host="0.0.0.0")
    with pytest.raises(ConfigError, match=r"^sglang.host: 0.0.0.0 is not a loopback address: a server there needs "
                                          r"an API key file$"):
        hsrv.build_command(remote)
    cmd = hsrv.build_command(remote, 0, "/state/private/replica-0.yaml")
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd[-2:] == ["--config", "/state/private/replica-0.yaml"]
    keyed = hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", api_key=KEY)
    with pytest.raises(ConfigError, match="never on its command line"):
        hsrv.build_command(keyed)
    assert KEY not in repr(keyed) and KEY not in " ".join(hsrv.build_command(keyed, 0, "/k.yaml"))
    local = hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm")
    assert "--config" not in hsrv.build_command(local)  # a bare loopback server (tests, benches): allowed


def test_share_prefixes_keeps_the_radix_cache_on_and_tells_the_plugin() -> None:
    """docs/SHARED_PREFIX.md 5.1: with share_prefixes the launch leaves out --disable-radix-cache and sets
    HSEXTRACT_SHARED_PREFIX=1; the flag is part of the server's identity, so a flat run never reuses its server."""
    flat = hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm")
    shared = hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", share_prefixes=True)
    a, b = hsrv.build_command(flat), hsrv.build_command(shared)
    assert "--disable-radix-cache" in a and [x for x in a if x != "--disable-radix-cache"] == b
    assert hsrv.build_env(flat, Path("/d"), base={})["HSEXTRACT_SHARED_PREFIX"] == "0"
    assert hsrv.build_env(shared, Path("/d"), base={})["HSEXTRACT_SHARED_PREFIX"] == "1"
    assert hsrv.config_hash(flat, 0) != hsrv.config_hash(shared, 0)


# ---- the key file and the log filter ----------------------------------------------------------------
def test_key_file_is_private_and_read_only_when_it_is(tmp_path: Path) -> None:
    path = keyfile.key_path(tmp_path / "server", 3)
    assert path == (tmp_path / "server/private/replica-3.yaml").absolute()
    keyfile.write_key(path, KEY)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert path.read_text() == f'api-key: "{KEY}"\n'  # SGLang's --config YAML: its flag, as a key
    assert keyfile.read_key(path) == KEY
    path.chmod(0o644)
    assert keyfile.read_key(path) is None  # readable by others: not trusted as the server's key
    path.chmod(0o600)
    (tmp_path / "link.yaml").symlink_to(path)
    assert keyfile.read_key(tmp_path / "link.yaml") is None
    os.mkfifo(tmp_path / "fifo.yaml", 0o600)
    assert keyfile.read_key(tmp_path / "fifo.yaml") is None  # not opened for a blocking read
    (tmp_path / "other.yaml").write_text("api-key: [1]\n")
    (tmp_path / "other.yaml").chmod(0o600)
    assert keyfile.read_key(tmp_path / "other.yaml") is None and keyfile.read_key(tmp_path / "none") is None
    new = keyfile.new_key()
    assert len(new) == 64 and int(new, 16) >= 0 and new != keyfile.new_key()


def test_the_log_filter_hides_a_key_split_anywhere(tmp_path: Path) -> None:
    text = f"server_args=ServerArgs(api_key='{KEY}', port=1)\nand again {KEY}{KEY}; {KEY[:5]} is not it\n".encode()
    want = text.replace(KEY.encode(), REDACTED.encode())
    for cut in range(len(text) + 1):
        for step in (1, 7):  # every split of the key across reads
            chunks = [text[:cut], *(text[i:i + step] for i in range(cut, len(text), step))]
            with open(tmp_path / "log", "wb") as out:
                copy_scrubbed(iter(chunks), out, [KEY.encode()])
            assert (tmp_path / "log").read_bytes() == want, (cut, step)


# ---- a server the launcher starts -------------------------------------------------------------------
def door_cfg(tmp_path: Path, **kw) -> hsrv.ServerConfig:
    kw.setdefault("env", {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}"})
    return hsrv.ServerConfig(model=str(tmp_path / "model"), aux_layers=AUX, module="fake_sglang",
                             port=listen_port(3), run_name="door", startup_timeout_s=60, stop_grace_s=5,
                             final_state="post_norm", **kw)


def request(url: str, method: str, path: str, key: str | None) -> int:
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        body = json.dumps({"rid": "x", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}})
        c.request(method, path, body=body if method == "POST" else None,
                  headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def group_members(pgid: int) -> list[int]:
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if os.getpgid(int(p.name)) == pgid:
                out.append(int(p.name))
        except (ProcessLookupError, PermissionError):
            pass
    return out


def test_a_started_server_gets_a_random_key_that_only_its_clients_send(tmp_path: Path) -> None:
    state = tmp_path / "server"
    cfg = door_cfg(tmp_path)
    h = hsrv.ensure_server(state, cfg)
    try:
        key = h.api_key
        assert key is not None and len(key) == 64  # a fresh random key: none was configured
        kf = state / "private/replica-0.yaml"
        assert keyfile.read_key(kf) == key and kf.stat().st_mode & 0o777 == 0o600
        assert (state / "private").stat().st_mode & 0o777 == 0o700
        # no key on a command line (world-readable), in the environment, the state file or the log
        members = group_members(h.pid)
        assert len(members) == 2  # the server and its log filter, one process group
        for pid in members:
            assert key.encode() not in cmdline(pid)
            assert key.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        assert cmdline(h.pid).split(b"\0")[-3:-1] == [b"--config", str(kf).encode()]
        assert key not in (state / "replica-0.json").read_text() and key not in repr(h)
        # the door: only the key opens it; /health stays open, as SGLang's
        assert request(h.url, "POST", "/generate", None) == 401
        assert request(h.url, "POST", "/generate", "wrong-" + key) == 401
        assert request(h.url, "GET", "/health", None) == 200
        # the engine sends it (the handle carries it): the chunk is extracted
        ps = [Prompt(i, f"s{i}", list(range(3 + i, 40 + 5 * i))) for i in range(6)]
        got = list(SGLangEngine(h, SPEC, timeout_s=10, concurrency=3).extract(ps))
        for r, p in zip(got, ps, strict=True):
            assert all(a.equal(b) for a, b in zip(r.hidden_states, expected_states(p.input_ids, len(AUX) + 1),
                                                  strict=True))
        # a later job reuses the server and reads its key from the private file
        again = hsrv.ensure_server(state, cfg)
        assert (again.pid, again.api_key) == (h.pid, key)
        # a configured key that is not the running server's: a fresh server with that key
        keyed = hsrv.ensure_server(state, door_cfg(tmp_path, api_key=KEY))
        assert keyed.pid != h.pid and keyed.api_key == KEY and keyfile.read_key(kf) == KEY
        assert request(keyed.url, "POST", "/generate", key) == 401
        log = (state / "replica-0.log").read_bytes()
        # what the server printed went through the filter: its settings line names the key as hidden
        assert log.count(f"api_key='{REDACTED}'".encode()) == 2
        assert key.encode() not in log and KEY.encode() not in log
    finally:
        hsrv.stop_servers(state, grace_s=5)
    assert not kf.exists() and list(state.glob("replica-*.json")) == []


def test_a_port_taken_while_the_server_loads_gets_no_key(tmp_path: Path) -> None:
    """Another local user binds the port in the minutes a model loads and answers /health: the launcher sends
    /health no key (SGLang does not ask for one there) and gives the key only to a port its server's process
    group holds, so the squatter reads nothing and the start fails, naming the process."""
    import http.server
    import threading

    state = tmp_path / "server"
    cfg = door_cfg(tmp_path, api_key=KEY, launch_args=("--startup-delay", "600"))  # the port free for minutes
    seen: list[str] = []

    class Squatter(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(str(self.headers))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    def squat() -> None:  # as soon as the launcher has checked the port is free and written the key file
        while not (state / "private/replica-0.yaml").exists():
            if done.wait(0.01):
                return
        squatter = http.server.HTTPServer((cfg.host, cfg.port), Squatter)
        bound.set()
        while not done.is_set():
            squatter.handle_request()
        squatter.server_close()

    done, bound = threading.Event(), threading.Event()
    t = threading.Thread(target=squat)
    t.start()
    try:
        with pytest.raises(EngineError) as e:
            hsrv.ensure_server(state, cfg)
    finally:
        done.set()
        if bound.is_set():
            request(f"http://{cfg.host}:{cfg.port}", "GET", "/health", None)  # wakes handle_request
        t.join()
    assert str(e.value).startswith(f"port {cfg.port} on 127.0.0.1 answers, but process {os.getpid()} (")
    assert "not the server started here" in str(e.value) and "the key was not sent" in str(e.value)
    assert seen and all("Authorization" not in h and KEY not in h for h in seen)
    assert list(state.glob("replica-*.json")) == [] and not (state / "private/replica-0.yaml").exists()


def test_a_port_taken_after_the_server_died_gets_no_key(tmp_path: Path) -> None:
    """The server dies mid-chunk (OOM, a CUDA fault) and another local user binds its port, answering /health:
    the engine sends that port no key, neither in a new request nor in a retry, and the chunk fails saying so."""
    import http.server
    import signal
    import threading

    state = tmp_path / "server"
    cfg = door_cfg(tmp_path, api_key=KEY)
    h = hsrv.ensure_server(state, cfg)
    seen: list[tuple[str, str | None]] = []

    class Squatter(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        do_GET = do_POST = answer

        def log_message(self, *args: object) -> None:
            pass

    try:
        engine = SGLangEngine(h, SPEC, timeout_s=10, concurrency=2, retries=2, backoff_s=0.01)
        assert len(list(engine.extract([Prompt(0, "s0", list(range(3, 30)))]))) == 1
        os.killpg(h.pid, signal.SIGKILL)
        os.waitpid(h.pid, 0)  # this process started it: reaped, the port is free
        squatter = http.server.ThreadingHTTPServer((cfg.host, cfg.port), Squatter)
        t = threading.Thread(target=squatter.serve_forever)
        t.start()
        try:
            assert h.gone() == f"its process {h.pid} has exited"
            with pytest.raises(EngineError) as e:
                list(engine.extract([Prompt(9, "s9", list(range(5, 40)))]))
            # a retry's health check sees the port held by another process (were the server itself alive)
            alive = subprocess.Popen(["sleep", "600"], process_group=0)
            try:
                assert hsrv.ServerHandle(url=h.url, dump_dir=h.dump_dir, pid=alive.pid).gone(thorough=True) == (
                    f"port {cfg.port} is no longer its own alone (process {os.getpid()} ({psutil.Process().name()}))")
            finally:
                alive.kill()
                alive.wait()
            request(h.url, "GET", "/health", None)
        finally:
            squatter.shutdown()
            squatter.server_close()
            t.join()
    finally:
        hsrv.stop_servers(state, grace_s=5)
    assert str(e.value).startswith(f"sample 's9' (index 9): POST /generate not sent: the server at {h.url} is gone "
                                   f"(its process {h.pid} has exited), and whatever takes its port could read the "
                                   "key. The chunk fails, no shard is written; rerun to restart the server.")
    assert seen == [("/health", None)]  # the test's own probe: no request of the engine reached the port


def test_a_process_start_is_read_whatever_its_name() -> None:
    """process_start (a started server's identity) reads /proc/<pid>/stat's field 22 behind a command name of any
    bytes (a process sets its own: ")", spaces, no UTF-8), equal to psutil's start time less the boot time; a pid
    gone is None, so a handle that recorded a start calls it not alive."""
    code = ("import ctypes, sys; ctypes.CDLL(None).prctl(15, b'a) b 1 2 \\xff\\xfe', 0, 0, 0); print(flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()  # its name is set
        assert Path(f"/proc/{proc.pid}/comm").read_bytes() == b"a) b 1 2 \xff\xfe\n"
        started = process_start(proc.pid)
        since_boot = psutil.Process(proc.pid).create_time() - psutil.boot_time()
        assert abs(int(started) / os.sysconf("SC_CLK_TCK") - since_boot) < 0.05
        assert hsrv._alive(proc.pid, started) and not hsrv._alive(proc.pid, started + "0")
    finally:
        proc.stdin.close()
        proc.wait()
    assert process_start(proc.pid) is None and not hsrv._alive(proc.pid, started)


def test_a_port_the_live_server_no_longer_holds_gets_no_key() -> None:
    """The server's process lives, but its port is another's (a server that closed its socket to shut down; a pid
    another process reuses, which its start time tells apart): no keyed request goes there."""
    import http.server
    import threading

    seen: list[str | None] = []

    class Squatter(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = subprocess.Popen(["sleep", "600"], process_group=0)  # alive, in a group of its own, no socket
    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", listen_port(3)), Squatter)
    t = threading.Thread(target=squatter.serve_forever)
    t.start()
    try:
        url = f"http://127.0.0.1:{squatter.server_address[1]}"
        started = process_start(server.pid)
        h = hsrv.ServerHandle(url=url, dump_dir=Path("/nonexistent"), pid=server.pid, started=started, api_key=KEY)
        why = f"port {squatter.server_address[1]} is no longer its own alone (process {os.getpid()} ("
        assert h.gone().startswith(why) and h.gone(thorough=True).startswith(why)
        api = SGLangAPI(url, 10.0, api_key=KEY, gone=h.gone)
        with pytest.raises(ServerGone) as e:
            api.generate({"rid": "x"})
        assert str(e.value).startswith(f"POST /generate not sent: the server at {url} is gone ({why}")
        # another process under the server's pid: not the server, whatever it listens on
        reused = hsrv.ServerHandle(url=url, dump_dir=Path("/nonexistent"), pid=server.pid, started=f"{started}0")
        assert reused.gone() == f"its process {server.pid} has exited"
        assert hsrv.ServerHandle.from_json(h.to_json()) == h  # the start time is kept with the handle
    finally:
        squatter.shutdown()
        squatter.server_close()
        t.join()
        server.kill()
        server.wait()
    assert seen == []


def test_a_workflow_job_starts_the_server_with_a_key_and_sends_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through what an extraction job calls (sglang.config.engine_from_config), with no key configured."""
    from hsextract.config.settings import from_config
    from hsextract.sglang import config as sc

    monkeypatch.chdir(tmp_path)
    wrapper = fake_server_python(tmp_path)
    settings = from_config({**door_config(tmp_path, monkeypatch), "engine": "sglang", "run_name": "door-wf",
                            "sglang": {"python": str(wrapper), "port": listen_port(3) + 1}}).extract
    eng = sc.engine_from_config(settings, CaptureSpec(settings.aux_layers, settings.final_state), 0, tmp_path)
    try:
        key = eng.api._auth["Authorization"].removeprefix("Bearer ")
        assert key == keyfile.read_key(tmp_path / "results/door-wf/server/hosts" / socket.gethostname()
                                       / "private/replica-0.yaml")
        assert request(eng.url, "POST", "/generate", None) == 401
        assert eng.health() is None
    finally:
        sc.stop_local_servers(settings, tmp_path)


def test_a_start_up_failure_of_a_server_with_a_key_leaves_no_trace(tmp_path: Path) -> None:
    state = tmp_path / "server"
    cfg = door_cfg(tmp_path, api_key=KEY, launch_args=("--crash-at-start",))
    with pytest.raises(EngineError) as e:
        hsrv.ensure_server(state, cfg)
    msg = str(e.value)
    assert "exited with code 1 during start-up" in msg and "Not enough memory" in msg  # the log's tail
    assert f"api_key='{REDACTED}'" in msg and KEY not in msg
    log = (state / "replica-0.log").read_bytes()
    assert b"Not enough memory" in log and KEY.encode() not in log
    assert not (state / "private/replica-0.yaml").exists() and list(state.glob("replica-*.json")) == []
    for f in state.rglob("*"):
        assert not f.is_file() or KEY.encode() not in f.read_bytes(), f


def test_a_server_of_the_layout_before_hosts_is_stopped_at_the_run_start(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A server a release before the state folder per host started, recorded in results/<run>/server/ itself:
    onstart (stop_local_servers) stops it as before, so its port is free for this release's server (review)."""
    from hsextract.config.settings import from_config
    from hsextract.sglang import config as sc

    settings = from_config({**door_config(tmp_path, monkeypatch), "engine": "sglang", "run_name": "old"}).extract
    old = sc.server_dir(settings, tmp_path)
    old.mkdir(parents=True)
    procs = []

    def server(folder: Path) -> subprocess.Popen:
        dump = folder / f"dump-{len(procs)}"
        dump.mkdir(parents=True)
        proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(300)"],
                                process_group=0, env={**os.environ, "HSEXTRACT_DUMP_DIR": str(dump)},
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        # once it runs: Popen returns when exec closes its pipes, before the new program's environment (what
        # stop_servers reads from /proc to know its server) is set up; under load the stop saw none
        assert proc.stdout.readline() == "ready\n"
        h = hsrv.ServerHandle(url="http://127.0.0.1:1", dump_dir=dump, pid=proc.pid, started=process_start(proc.pid))
        (folder / "replica-0.json").write_text(h.to_json())
        return proc

    try:
        proc = server(old)
        assert sc.state_dir(settings, tmp_path) != old
        assert sc.stop_local_servers(settings, tmp_path) == [proc.pid]
        assert proc.wait(timeout=60) is not None and not (old / "replica-0.json").exists()
        # by hand, as config/README.md gives it: the run's server folder stops this host's servers and old ones
        here, before = server(sc.state_dir(settings, tmp_path)), server(old)
        assert sorted(json.loads(subprocess.run([sys.executable, "-m", "hsextract.sglang.server", "stop", str(old)],
                                                capture_output=True, text=True, check=True).stdout)["killed"]) == \
            sorted([here.pid, before.pid])
    finally:
        for p in procs:
            p.kill()


def test_patched_json_holds_no_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hsextract.config.settings import from_config
    from hsextract.sglang import compat
    from hsextract.sglang import config as sc

    class Report:
        def summary(self) -> dict:
            return {"ok": True, "sglang_version": "0.5.16", "capture_sources": ["plugin"],
                    "prefix_modes": ["flat", "shared"], "problems": []}

    monkeypatch.setattr(compat, "check_installed", lambda py: Report())
    monkeypatch.chdir(tmp_path)
    settings = from_config({**door_config(tmp_path, monkeypatch), "engine": "sglang",
                            "sglang": {"api_key_file": str(key_file(tmp_path)), "host": "10.0.0.7",
                                       "replicas": 2}}).extract
    out = tmp_path / "results/door/server/patched.json"
    info = sc.build_patched(settings, out, repo=ROOT, python=sys.executable, install=False)
    assert KEY.encode() not in out.read_bytes()
    for r, cmd in enumerate(info["launch"]):
        assert cmd[cmd.index("--config") + 1] == str(keyfile.key_path(tmp_path / "results/door/server/hosts/<host>", r))
        assert "--api-key" not in cmd and cmd[cmd.index("--host") + 1] == "10.0.0.7"


# ---- the two small ones -----------------------------------------------------------------------------
def test_a_long_run_name_is_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        fill_defaults({"run_name": "a" * 5000})
    assert str(e.value) == (f"run_name: '{'a' * 39}... (5000 characters) is too long "
                            "(workflow/schemas/config.schema.yaml)")
    fill_defaults({"run_name": "a" * 100})
    for bad in ("a/b", "..", "a\n", "-a", "a b"):
        with pytest.raises(ConfigError, match=r"^run_name: .* does not match"):
            fill_defaults({"run_name": bad})


def test_snakemake_stops_a_long_run_name_in_one_line(tmp_path: Path) -> None:
    snakemake = Path(sys.executable).with_name("snakemake")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([str(snakemake), "-n", "--cores", "1", "--config", f"run_name={'r' * 5000}"], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "OSError" not in text and "File name too long" not in text
    lines = [line for line in text.splitlines() if "run_name" in line]
    assert lines and all(len(line) < 300 for line in lines)
    assert any("run_name: 'rrrr" in line and "(5000 characters) is too long" in line for line in lines)


def test_a_folder_of_the_wrong_kind_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hsextract.config.checks import check

    folder = tmp_path / "conversations"
    folder.mkdir()
    (folder / "a.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=rf"^sources\[0\].path: {folder} is a folder but not a "
                                          r"`datasets.save_to_disk` dataset \(it has no state.json or "
                                          r"dataset_dict.json\); name a .jsonl"):
        check_source_path("sources[0].path", folder)
    cfg = door_config(tmp_path, monkeypatch)
    cfg["sources"] = [cfg["sources"][0], {"path": str(folder), "format": "auto"}]
    with pytest.raises(ConfigError, match=r"^sources\[1\].path: .* is a folder but not"):
        check(cfg)
    # the embedded default's tiny model trains its tokenizer on the first .jsonl source: the folder is still said
    # as the source it is, not as "sources has no .jsonl"
    tiny = {**cfg, "sources": cfg["sources"][1:], "make_tiny_model": True, "model": "resources/tiny-model"}
    with pytest.raises(ConfigError, match=r"^sources\[0\].path: .* is a folder but not"):
        check(tiny)
    (folder / "state.json").write_text("{}")
    check_source_path("sources[0].path", folder)


# ---- fixtures ---------------------------------------------------------------------------------------
def door_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A config config.check accepts: a 6-layer model's config.json (and a tokenizer_config.json with a chat
    template), a one-tensor reference (capture: mtp,
    the final state alone, so no layer list), ten conversations."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model/config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 6,
                                                             "hidden_size": 16}))
    (tmp_path / "model/tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    torch.save({"input_ids": torch.arange(3), "hidden_states": [torch.zeros(3, 16, dtype=torch.bfloat16)],
                "loss_mask": torch.ones(3, dtype=torch.int64)}, tmp_path / "ref.pt")
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(10)]
    (tmp_path / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"run_name": "door", "model": "model", "make_tiny_model": False, "reference_sample": "ref.pt",
            "capture": "mtp", "aux_layers": None, "prompts_per_chunk": 4,
            "sources": [{"path": "conv.jsonl", "format": "messages"}]}


def fake_server_python(where: Path) -> Path:
    """An executable that serves as `sglang.python`: `<it> -m sglang.launch_server ARGS` runs the fake."""
    exe = where / "fake-sglang-python"
    exe.write_text(f"#!/bin/sh\nshift 2\nPYTHONPATH={ROOT / 'tests'}:{ROOT / 'src'} exec {sys.executable} "
                   "-m fake_sglang \"$@\"\n")
    exe.chmod(0o755)
    return exe


def test_servers_of_more_gpus_or_nodes_and_flag_value_items_are_refused() -> None:
    """The launcher gives a replica sglang.tp GPUs: pipeline parallelism, data parallelism without DP attention and
    several nodes need more (refused, each with its message); `--tp 4` as one item is an unknown argument to SGLang."""
    gpus = ("runs {} x tp GPUs, but each replica is given sglang.tp of them (CUDA_VISIBLE_DEVICES); the capture was "
            "never run under it: for more servers use sglang.replicas")
    nodes = ("a server over several nodes is not one the launcher can start: start it yourself with the plugin and "
             "give its address as sglang.server_url (config/README.md)")
    for args, what, why in (
            (["--pp-size", "2"], "--pp-size", gpus.format("pipeline parallelism: pp")),
            (["--pipeline-parallel-size=2"], "--pipeline-parallel-size", gpus.format("pipeline parallelism: pp")),
            (["--dp-size", "2"], "--dp-size", gpus.format("data parallelism without --enable-dp-attention: dp")),
            (["--dp", "2"], "--dp (an abbreviation of --dp-size)",
             gpus.format("data parallelism without --enable-dp-attention: dp")),
            (["--nnodes", "2"], "--nnodes", nodes), (["--dist-init-addr", "h:5000"], "--dist-init-addr", nodes)):
        with pytest.raises(ConfigError) as e:
            hsrv.check_launch_args(args)
        assert str(e.value) == f"sglang.launch_args[0]: {what} may not be given; {why}"
    hsrv.check_launch_args(["--enable-dp-attention", "--dp-size", "2"])  # DP attention: dp within the tp GPUs
    for item, flag in (("--tp 4", "--tp"), ("--mem-fraction-static 0.85", "--mem-fraction-static"),
                       ("--api-key  secret", "--api-key")):
        with pytest.raises(ConfigError) as e:
            hsrv.check_launch_args(["--log-level", "info", item])
        assert str(e.value) == (
            f"sglang.launch_args[2]: {flag} and its value are one item, which SGLang's parser reads as one unknown "
            f"argument; give them as two items ({flag}, then the value) or as {flag}=<value>")
    hsrv.check_launch_args(["--served-model-name", "my model"])  # a value with a space is a value


def test_replicas_ports_past_the_last_one_are_a_config_error() -> None:
    want = ("sglang.port: replica r listens on port + r, so 2 replicas from port 65535 reach 65536, past the last "
            "port (65535); choose sglang.port <= 65534")
    with pytest.raises(ConfigError) as e:
        hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", port=65535, replicas=2)
    assert str(e.value) == want
    hsrv.ServerConfig(model="/m", aux_layers=AUX, final_state="post_norm", port=65534, replicas=2)
