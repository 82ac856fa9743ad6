"""Loss masks over a folder of real chat templates, to hold a change of `hsextract.masks` against the masks
before it (the golden fixtures pin 14 families; real templates are many more and cannot ship here).

    .venv/bin/python tests/mask_sweep.py run --templates DIR --out after.json     # in each checkout compared
    .venv/bin/python tests/mask_sweep.py compare before.json after.json          # differing cases, both sides

Each template gets chatfix's tiny BPE tokenizer with the special tokens its own text writes (jinja's lexer:
string literals and raw text) and a bos/eos among them (`<s>`/`</s>` where it only names `bos_token`); every
conversation of test_loss_mask_families (CONVS) is encoded under each of its FLAGS and each split mode, and each
sample recorded (marked text, ids, mask, turn), or the error's text. Templates that call `strftime_now` render
today's date: compare results of the same day.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from pathlib import Path

import jinja2
from chatfix import tokenizer_with
from test_loss_mask_families import CONVS, FLAGS
from transformers import PreTrainedTokenizerFast

from hsextract.masks.explain import marked
from hsextract.masks.masker import SPLIT_MODES, ChatMasker

SPECIAL = re.compile("|".join((
    r"<\|[^|<>\s]{1,60}\|>",  # <|im_start|>
    r"<｜[^｜<>]{1,60}｜>",  # <｜User｜>
    r"<\|[A-Za-z_][\w\-]{0,40}>", r"<[A-Za-z_][\w\-]{0,40}\|>",  # Gemma-4's <|turn> and <turn|>
    r"\[/?[A-Za-z][A-Za-z_]{1,40}\]",  # [INST], [gMASK]
    r"</?[A-Za-z_][\w\-]{0,40}>",  # <think>, <start_of_turn>
)))
BOS = (r"begin.of.sentence", r"begin_of_text", r"^<s>$", r"^<bos>$", r"^\[BOS\]$", r"startoftext", r"^<sop>$")
EOS = (r"end.of.sentence", r"^</s>$", r"^<eos>$", r"^\[EOS\]$", r"end_of_text", r"endoftext", r"eot_id", r"im_end",
       r"end_of_turn", r"^<\|end\|>$", r"^<\|return\|>$", r"^<\|eot\|>$")


def specials_of(template: str) -> list[str]:
    """The special-looking strings the template can write, in order of appearance."""
    try:
        texts = [v for _, kind, v in jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
                 .lex(template) if kind in ("data", "string")]
    except jinja2.TemplateSyntaxError:
        texts = [template]
    return list(dict.fromkeys(m[0] for text in texts for m in SPECIAL.finditer(text)))


def tokenizer_for(template: str) -> PreTrainedTokenizerFast:
    specials = specials_of(template)

    def pick(prefs: tuple[str, ...], default: str) -> str:
        return next((s for p in prefs for s in specials if re.search(p, s)), default)

    bos, eos = pick(BOS, "<s>"), pick(EOS, "</s>")
    return tokenizer_with(template, [*specials, *(t for t in (bos, eos) if t not in specials)], eos, bos)


def sweep(template: str) -> dict[str, object]:
    """case ("conversation/flags/split") -> its samples, or the error's text."""
    tok = tokenizer_for(template)
    out: dict[str, object] = {"_specials": [t.content for t in tok.added_tokens_decoder.values()]}
    for name, conv in CONVS.items():
        for flags, kw in FLAGS.items():
            for split in SPLIT_MODES:
                try:
                    samples = ChatMasker(tok, split_turns=split, **kw).encode(conv)
                    out[f"{name}/{flags}/{split}"] = [
                        {"marked": marked(s, tok), "input_ids": list(s.input_ids), "loss_mask": list(s.loss_mask),
                         "turn": s.turn} for s in samples]
                except Exception as e:  # noqa: BLE001 - the template's own raise_exception, or the masker's refusal
                    out[f"{name}/{flags}/{split}"] = f"{type(e).__name__}: {e}"
    return out


def differences(a: dict, b: dict) -> list[tuple[str, str, object, object]]:
    """(template, case, a's, b's) for every case recorded differently (or on one side only)."""
    return [(t, c, a.get(t, {}).get(c), b.get(t, {}).get(c)) for t in sorted(set(a) | set(b))
            for c in sorted(set(a.get(t, {})) | set(b.get(t, {}))) if a.get(t, {}).get(c) != b.get(t, {}).get(c)]


def _shown(v: object, width: int = 300) -> str:
    if v is None:
        return "missing"
    if not isinstance(v, list):
        return repr(v)[:width]
    return " | ".join(f"turn {s['turn']}: {s['marked'][-width:]!r}" for s in v) or "no samples"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--templates", type=Path, required=True, help="a folder of *.jinja")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        warnings.simplefilter("ignore")
        paths = sorted(args.templates.glob("*.jinja"))
        result = {}
        for i, p in enumerate(paths):
            result[p.stem] = sweep(p.read_text())
            print(f"[{i + 1}/{len(paths)}] {p.stem}", file=sys.stderr)
        args.out.write_text(json.dumps(result, ensure_ascii=False, indent=1, sort_keys=True))
        return 0
    a, b = json.loads(args.a.read_text()), json.loads(args.b.read_text())
    diff = differences(a, b)
    cases = sum(len(set(a.get(t, {})) | set(b.get(t, {}))) for t in set(a) | set(b))
    print(f"{len(set(a) | set(b))} templates, {cases} cases: {cases - len(diff)} identical, {len(diff)} differ")
    for t, case, x, y in diff:
        print(f"{t} {case}\n  a: {_shown(x)}\n  b: {_shown(y)}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
