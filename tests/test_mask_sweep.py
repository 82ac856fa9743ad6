"""tests/mask_sweep.py, the maintainers' sweep over real chat templates: on the fixture templates whose special
tokens their own text names, it computes exactly the golden masks; compare reports every differing case."""

import json
from pathlib import Path

import mask_sweep
from chatfix import TEMPLATES
from mask_golden import EXPECTED

# the fixtures whose bos and eos the template's text writes (the others only name `bos_token`; the sweep gives
# them <s>, so their texts differ from the golden ones by that token)
SELF_NAMED = ["harmony", "qwen3", "kimi_k25", "mistral", "qwq", "glm45", "glm47"]


def test_the_sweep_computes_the_golden_masks(tmp_path: Path) -> None:
    for family in SELF_NAMED:
        (tmp_path / f"{family}.jinja").write_text((TEMPLATES / f"{family}.jinja").read_text())
    assert mask_sweep.main(["run", "--templates", str(tmp_path), "--out", str(tmp_path / "a.json")]) == 0
    result = json.loads((tmp_path / "a.json").read_text())
    assert sorted(result) == sorted(SELF_NAMED)
    for family in SELF_NAMED:
        for (flags, name), want in EXPECTED[family].items():
            got = result[family][f"{name}/{flags}/auto"]
            assert [s["marked"] for s in got] == want, (family, flags, name)


def test_compare_names_every_differing_case(tmp_path: Path, capsys) -> None:
    a = {"t1": {"_specials": ["<s>"], "single/default/auto": [{"marked": "x⟦y⟧", "input_ids": [1, 2],
                                                               "loss_mask": [0, 1], "turn": 1}]},
         "t2": {"single/default/auto": "TemplateError: no"}}
    b = json.loads(json.dumps(a))
    b["t1"]["single/default/auto"][0]["loss_mask"] = [1, 1]
    b["t3"] = {"single/default/auto": []}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert mask_sweep.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "3 templates, 4 cases: 2 identical, 2 differ"
    assert out[1::3] == ["t1 single/default/auto", "t3 single/default/auto"]
    assert out[5:] == ["  a: missing", "  b: no samples"]
    assert mask_sweep.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert capsys.readouterr().out == "2 templates, 3 cases: 3 identical, 0 differ\n"
