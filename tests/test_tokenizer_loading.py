"""Tokenizer loading (hsextract.prepare.tokenizer_loading): custom code only behind `trust_remote_code`, refused at
parse time, and a load failure of custom code that names the import and the transformers range that works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
import yaml
from chatfix import TEMPLATES, make_tokenizer
from test_config import write_model, write_reference

from hsextract.config.checks import check
from hsextract.errors import ConfigError
from hsextract.prepare.tokenizer_loading import load_tokenizer, remote_tokenizer_code, unresolved_imports

ROOT = Path(__file__).resolve().parents[1]
V = transformers.__version__


def custom_code_dir(d: Path, module: str, body: str) -> Path:
    """A tokenizer directory whose tokenizer_config.json maps AutoTokenizer to `<module>.CustomTokenizer`."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": [f"{module}.CustomTokenizer", None]}, "tokenizer_class": "CustomTokenizer"}))
    (d / f"{module}.py").write_text(body)
    return d


# The import Kimi-K2-Thinking's tokenization_kimi.py had until Moonshot moved it (transformers 5 removed it).
OLD_IMPORT = """from transformers import PreTrainedTokenizer
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode


class CustomTokenizer(PreTrainedTokenizer):
    pass
"""


def test_fast_tokenizer_loads_without_trust(tmp_path: Path) -> None:
    make_tokenizer("llama3").save_pretrained(tmp_path / "tok")
    assert remote_tokenizer_code(tmp_path / "tok") is None
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.is_fast and tok("Hello there")["input_ids"] == make_tokenizer("llama3")("Hello there")["input_ids"]


def test_custom_code_refused_without_trust(tmp_path: Path) -> None:
    d = custom_code_dir(tmp_path / "ctok", "tokenization_custom", OLD_IMPORT)
    code = remote_tokenizer_code(d)
    assert code is not None and code.class_ref == "tokenization_custom.CustomTokenizer"
    assert code.module_file == d / "tokenization_custom.py"
    with pytest.raises(ConfigError) as e:
        load_tokenizer(d)
    assert str(e.value) == (
        f"trust_remote_code: the tokenizer of {d} is custom code ({d}/tokenizer_config.json auto_map AutoTokenizer "
        f"-> tokenization_custom.CustomTokenizer), which transformers runs only with trust_remote_code: true. "
        f"Read {d}/tokenization_custom.py; if you trust it, set `trust_remote_code: true` in the config "
        f"(config/kimi.yaml does), or pass --trust-remote-code to `hsextract masks`.")


def test_parse_time_check_refuses_custom_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "m")
    custom_code_dir(tmp_path / "m", "tokenization_custom", OLD_IMPORT)
    write_reference(tmp_path / "ref.pt")
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    c = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    c.update(model="m", make_tiny_model=False, reference_sample="ref.pt", capture="custom", aux_layers=[1, 2, 3],
             aux_layers_convention="hidden_states", sources=[{"path": "c.jsonl", "format": "messages"}],
             trust_remote_code=False, chat_template="{{ messages }}")
    with pytest.raises(ConfigError,
                       match=r"^trust_remote_code: the tokenizer of m is custom code \(m/tokenizer_config"):
        check(c)
    c["trust_remote_code"] = True
    assert check(c).n_records == 1
    # a separate `tokenizer` is the one checked
    make_tokenizer("llama3").save_pretrained(tmp_path / "fast")
    c.update(tokenizer="fast", trust_remote_code=False)
    assert check(c).n_records == 1


@pytest.mark.skipif(not V.startswith("5."), reason="the import moved in transformers 5")
def test_code_written_for_transformers_4_names_the_import_and_range(tmp_path: Path) -> None:
    d = custom_code_dir(tmp_path / "tok4", "tokenization_old", OLD_IMPORT)
    assert unresolved_imports(d / "tokenization_old.py") == [
        ("transformers.models.gpt2.tokenization_gpt2", "bytes_to_unicode")]
    with pytest.raises(ConfigError) as e:
        load_tokenizer(d, trust_remote_code=True)
    msg = str(e.value)
    assert msg.startswith(
        f"tokenizer: {d}/tokenization_old.py was written for another transformers major version: it imports "
        f"transformers.models.gpt2.tokenization_gpt2.bytes_to_unicode, which transformers {V} does not have (it "
        f"resolves in `transformers>=4.57,<5`). Install `transformers>=4.57,<5` for this tokenizer, or use a "
        f"revision of the checkpoint whose tokenizer file imports it from its current place (bytes_to_unicode is "
        f"in transformers.convert_slow_tokenizer in transformers 4 and 5). Load error: ImportError: cannot import "
        f"name 'bytes_to_unicode' from 'transformers.models.gpt2.tokenization_gpt2'"), msg


def test_custom_code_missing_package(tmp_path: Path) -> None:
    body = "import hsx_no_such_package_xyz\nfrom transformers import PreTrainedTokenizer\n\n\n" \
           "class CustomTokenizer(PreTrainedTokenizer):\n    pass\n"
    d = custom_code_dir(tmp_path / "tokpkg", "tokenization_pkg", body)
    with pytest.raises(ConfigError, match=(
            rf"^tokenizer: {d}/tokenization_pkg.py needs a package that is not installed \(This modeling file "
            r"requires the following packages that were not found in your environment: hsx_no_such_package_xyz")):
        load_tokenizer(d, trust_remote_code=True)


def test_custom_code_failing_otherwise_names_the_major(tmp_path: Path) -> None:
    body = "from transformers import PreTrainedTokenizer\n\n\nclass CustomTokenizer(PreTrainedTokenizer):\n" \
           "    def __init__(self, **kwargs):\n        raise AttributeError('no attribute _added_tokens_encoder')\n"
    d = custom_code_dir(tmp_path / "tokattr", "tokenization_attr", body)
    major = V.split(".")[0]
    other = ">=4.57,<5" if major == "5" else ">=5,<6"
    with pytest.raises(ConfigError) as e:
        load_tokenizer(d, trust_remote_code=True)
    assert str(e.value) == (
        f"tokenizer: the custom tokenizer code {d}/tokenization_attr.py failed to load under transformers {V} "
        f"(AttributeError: no attribute _added_tokens_encoder). Custom tokenizer files are written against one "
        f"transformers major version; if the file predates transformers {major}, try `transformers{other}`.")


def test_unloadable_tokenizer_names_the_source(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=rf"^cannot load a tokenizer from {tmp_path}/empty: "):
        load_tokenizer(tmp_path / "empty", trust_remote_code=True)


def test_a_path_that_is_no_folder_is_said_so_not_taken_for_a_hub_id(tmp_path: Path) -> None:
    (tmp_path / "f.json").write_text("{}")
    for source, why in ((tmp_path / "missing", "no such folder"), ("./missing", "no such folder"),
                        (tmp_path / "f.json", "not a folder")):
        with pytest.raises(ConfigError) as e:
            load_tokenizer(source)
        assert str(e.value) == (f"cannot load a tokenizer from {source}: {why}; give the model's (or tokenizer's) "
                                "folder, or a hub id such as org/name")


def test_parse_time_check_names_a_folder_without_tokenizer_or_template(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint folder of weights alone failed at prepare with transformers' word about sentencepiece or tiktoken
    not installed, after the dry run had passed; a whole tokenizer without a chat template failed at prepare too.
    Both now refused at the parse, naming the key to set; a copy of config.json alone still plans."""
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "m")
    (tmp_path / "m/tokenizer_config.json").unlink()
    write_reference(tmp_path / "ref.pt")
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    c = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    c.update(model="m", make_tiny_model=False, reference_sample="ref.pt", capture="custom", aux_layers=[1, 2, 3],
             aux_layers_convention="hidden_states", sources=[{"path": "c.jsonl", "format": "messages"}])
    assert check(c).n_records == 1  # config.json alone: a copy for a dry run without the weights (README)
    (tmp_path / "m/model.safetensors").write_bytes(b"")  # a checkpoint: its tokenizer is expected beside it
    with pytest.raises(ConfigError, match=r"^cannot load a tokenizer from m: the folder holds no tokenizer files "
                                          r"\(none of tokenizer.json, tokenizer_config.json, .*\); set `tokenizer:` "):
        check(c)
    with pytest.raises(ConfigError, match=r"^cannot load a tokenizer from m: the folder holds no tokenizer files"):
        load_tokenizer("m")
    tok = make_tokenizer("llama3")
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "m")
    with pytest.raises(ConfigError, match=r"^the tokenizer at m has no chat template \(no chat_template.jinja, no "
                                          r"chat_template in tokenizer_config.json\): set `chat_template`"):
        check(c)
    c["chat_template"] = str(TEMPLATES / "llama3.jinja")
    assert check(c).n_records == 1
