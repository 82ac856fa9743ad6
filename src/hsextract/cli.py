"""The `hsextract` command. One subparser and one small function per subcommand; add new ones in SUBCOMMANDS."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from hsextract import atomic
from hsextract.errors import HsxError


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _add_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check shards against a reference sample and content rules",
                       description="Check shards; write a JSON report per shard; "
                                   "exit 1 with one line per failed shard.")
    p.add_argument("shards", nargs="+", metavar="SHARD")
    p.add_argument("--reference", required=True, metavar="REF.pt", help="a speculators v1 sample file (data_N.pt)")
    dest = p.add_mutually_exclusive_group()
    dest.add_argument("--report-dir", metavar="DIR", help="write DIR/<shard stem>.json per shard")
    dest.add_argument("--report", metavar="FILE", help="write the report here (one shard only)")
    p.add_argument("--vocab-size", type=_positive_int,
                   help="upper bound for input_ids; a shard's own vocab_size is kept where it is smaller")
    p.add_argument("--same-model", action="store_true",
                   help="the reference comes from the shards' model: compare hidden sizes too")
    p.set_defaults(func=cmd_validate)


def _report_paths(args: argparse.Namespace) -> list[Path | None]:
    """Each shard's report file (None: no report), checked before any shard is read: a path that cannot
    be written would otherwise fail only after all the validation work."""
    if not (args.report or args.report_dir):
        return [None] * len(args.shards)
    option, kind = ("--report", "file") if args.report else ("--report-dir", "folder")
    paths = [Path(args.report)] if args.report else [Path(args.report_dir) / f"{Path(s).stem}.json"
                                                     for s in args.shards]
    inputs = [Path(p) for p in (*args.shards, args.reference) if os.path.exists(p)]
    for path in paths:
        same = next((p for p in inputs if os.path.exists(path) and os.path.samefile(path, p)), None)
        if same is not None:
            raise HsxError(f"{option}: the report {path} would overwrite the input {same}; "
                           f"choose another {kind}")
        if path.is_dir():
            raise HsxError(f"{option}: {path} is a folder, where a report file would go; " + (
                "name a file, or use --report-dir for a folder of reports" if args.report
                else "move that folder away or choose another --report-dir"))
        blocked = atomic.blocked_parent(path)
        if blocked:
            raise HsxError(f"{option}: {blocked[0]} is {blocked[1]}, so the report {path} cannot be written; "
                           f"choose another {kind}")
    return paths


def cmd_validate(args: argparse.Namespace) -> int:
    from hsextract.config import reference
    from hsextract.report.validate import failure_line, validate_shard

    if args.report and len(args.shards) != 1:
        raise HsxError(f"--report names one file but {len(args.shards)} shards were given; use --report-dir")
    if args.report_dir:  # one report per shard stem: two shards of one name would overwrite each other's
        stems: dict[str, str] = {}
        for shard in args.shards:
            if stems.setdefault(Path(shard).stem, shard) != shard:
                raise HsxError(f"--report-dir: {stems[Path(shard).stem]} and {shard} would both write "
                               f"{Path(args.report_dir) / (Path(shard).stem + '.json')}; validate them apart")
    from hsextract.progress import bar

    for shard in args.shards:  # a run or shards folder: its shards are what was meant
        if os.path.isdir(shard):
            folder = Path(shard, "shards") if Path(shard, "shards").is_dir() else Path(shard)
            raise HsxError(f"{shard} is a folder; validate takes shard files: give {folder / '*.hss'}")
    report_paths = _report_paths(args)
    ref = reference.load(args.reference, key="--reference")
    failed = samples = tokens = 0
    for shard, report_path in bar(list(zip(args.shards, report_paths, strict=True)), desc="validate", unit="shard"):
        report = validate_shard(shard, ref, vocab_size=args.vocab_size, report_path=report_path,
                                same_model=args.same_model, reference_name=args.reference)
        samples += report["num_samples"] or 0
        tokens += report["num_tokens"] or 0
        line = failure_line(report)
        if line:
            failed += 1
            print(line)
    if failed:
        print(f"{failed} of {len(args.shards)} shards failed validation", file=sys.stderr)
        return 1
    print(f"validated {len(args.shards)} of {len(args.shards)} shards: all passed ({samples} samples, {tokens} tokens)")
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    from hsextract.export import FORMATS

    p = sub.add_parser("export", help="rewrite a run's shards in another trainer's layout",
                       description="Stream every sample of RUN_DIR (a run's results folder, or a shards folder) "
                                   "into OUT_DIR, built beside it and renamed onto it once whole; one export into "
                                   "a folder at a time (another, running, holds .<OUT_DIR's name>.lock beside it).")
    p.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier export in OUT_DIR once the new one is whole (both take space until then)")
    p.add_argument("--allow-missing", action="store_true",
                   help="export the shards that are present and match dataset.json, warning about the others")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from hsextract.export import FinalNormWarning, export

    with warnings.catch_warnings():  # export() already printed it to stderr; once is enough on a terminal
        warnings.simplefilter("ignore", FinalNormWarning)
        summary = export(args.run_dir, args.out_dir, args.fmt, force=args.force, allow_missing=args.allow_missing)
    print(f"exported {summary['num_samples']} samples ({summary['num_tokens']} tokens) as {args.fmt} "
          f"to {summary['data_path']}")
    li = summary["layers"]
    sgl = li["sglang_0.5.16"]
    sgl_ids = sgl["eagle_aux_hidden_state_layer_ids"]
    print(f"layers: {li['stored']['meaning']}; {li['consumer']}: {li[li['consumer']]}")
    print(f"drafter config eagle_aux_hidden_state_layer_ids: vLLM {li['vllm']['eagle_aux_hidden_state_layer_ids']}, "
          f"SGLang 0.5.16 {sgl_ids if sgl_ids is not None else '(' + sgl['note'] + ')'} "
          f"(all in {summary['out_dir']}/layers.json)")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="metadata, counts and compression of a shard")
    p.add_argument("shard", metavar="SHARD")
    p.add_argument("--samples", action="store_true", help="list every sample: index, seq_len, trained tokens, id")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from hsextract.shard.inspect import format_info, shard_info

    info = shard_info(args.shard, samples=args.samples)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="tokens, bytes, GPU-hours and jobs of a run before it starts",
                       description="Estimate a run of RECORDS input records under a workflow config: tokens, raw "
                                   "and stored bytes (the codec's measured ratio), each export format's bytes, the "
                                   "shared filesystem's total, shards, chunk jobs, GPU-hours, disk per node. The "
                                   "config is checked as far as it can be without the data, tokenizer, reference "
                                   "sample and key file (snakemake -n checks the rest).")
    p.add_argument("--configfile", nargs="+", required=True, metavar="YAML",
                   help="workflow config file(s), later ones overriding earlier ones key by key (as snakemake does)")
    p.add_argument("--records", "--samples", dest="records", type=int, required=True,
                   help="input records (conversations) of the run, what prompts_per_chunk counts; with split_turns "
                        "one gives a sample per turn (--samples: the former name)")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--mean-tokens", type=float,
                     help="tokens per input record as prepare stores them, after the chat template: the sum over "
                          "the samples it gives (split_turns: one per turn, each holding the conversation up to it)")
    tok.add_argument("--prepare-summary", metavar="JSON",
                     help="results/<run>/prompts/summary.json of a prepare run on a sample of the sources: "
                          "tokens per input record measured there (drops included)")
    p.add_argument("--tokens-per-s", type=float,
                   help="extraction throughput of one node: tokens the engine computes per second (an extract "
                        "log's computed_tokens_per_s; with share_prefixes each shared prefix counts once)")
    p.add_argument("--nodes", type=int, default=1, help="nodes extracting in parallel (default 1)")
    p.add_argument("--gpus-per-node", type=int,
                   help="GPUs per node (default: sglang.tp x sglang.replicas, or 1 for transformers on cuda)")
    p.add_argument("--hidden-size", type=int,
                   help="hidden size when `model` is not a local directory (Kimi-K2.5: 7168)")
    p.add_argument("--chunks-per-job", type=int, default=1,
                   help="extract jobs one cluster job runs one after the other (Snakemake job groups; default 1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)


def _configfile_config(paths: Sequence[str]) -> dict:
    """The config of `snakemake --configfile PATHS...`: later files override key by key inside mappings,
    merged by Snakemake's own function so that the plan sees what the workflow will."""
    import yaml

    from hsextract.errors import ConfigError

    try:
        from snakemake.utils import update_config
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "snakemake":
            raise
        raise ConfigError("snakemake is not installed; hsextract plan merges --configfile files as the workflow "
                          "does and needs the workflow extra: pip install -e .[workflow]") from None
    from hsextract.capture import check_conventions_said

    config: dict = {}
    layers = []
    for path in paths:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"--configfile: cannot read {path} ({e})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--configfile: {path} is not a mapping of config keys")
        layers.append((path, loaded))
        update_config(config, loaded)
    check_conventions_said(layers)
    return config


def cmd_plan(args: argparse.Namespace) -> int:
    from hsextract.config.checks import check_plan
    from hsextract.config.plan import format_plan, plan
    from hsextract.errors import ConfigError

    config = _configfile_config(args.configfile)
    for key in ("model", "prompts_per_chunk"):  # aux_layers: a preset's come from the model's depth
        if key not in config:
            raise ConfigError(f"{key}: missing from {' + '.join(args.configfile)}; the plan needs it")
    result = plan(check_plan(config), args.records, chunks_per_job=args.chunks_per_job, mean_tokens=args.mean_tokens,
                  prepare_summary=args.prepare_summary, tokens_per_s=args.tokens_per_s, nodes=args.nodes,
                  gpus_per_node=args.gpus_per_node, hidden_size=args.hidden_size)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def _add_masks(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("masks", help="show which tokens of conversations the loss mask trains",
                       description="Render each conversation of a file with the model's chat template and print "
                                   "its samples as text, every run of trained tokens between ⟦ and ⟧: check a "
                                   "template by eye before spending GPU hours.")
    p.add_argument("--explain", required=True, metavar="CONVERSATIONS",
                   help="a conversations file (JSONL, JSON or parquet; any record format prepare reads) or a "
                        "saved Hugging Face dataset folder")
    p.add_argument("--split", metavar="NAME", help="the split to explain, of a DatasetDict folder with several")
    p.add_argument("--model", required=True, metavar="DIR", help="model (or tokenizer) directory or hub id")
    p.add_argument("--chat-template", metavar="FILE", help="a .jinja template instead of the tokenizer's own")
    p.add_argument("--chat-template-kwargs", default="{}", metavar="JSON",
                   help='extra template variables, e.g. \'{"thinking": true}\'')
    p.add_argument("--split-turns", default="auto", choices=("auto", "never", "always"))
    p.add_argument("--no-train-on-eot", action="store_true", help="as `train_on_eot: false`")
    p.add_argument("--no-train-on-reasoning", action="store_true", help="as `train_on_reasoning: false`")
    p.add_argument("--color", action="store_true", help="colour the trained spans (reasoning blue, eot yellow)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="load a tokenizer that is custom code (as `trust_remote_code: true`), e.g. Kimi-K2.5's")
    p.set_defaults(func=cmd_masks)


def cmd_masks(args: argparse.Namespace) -> int:
    from hsextract.errors import ConfigError
    from hsextract.masks.explain import explain
    from hsextract.masks.masker import ChatMasker
    from hsextract.prepare.tokenizer_loading import load_tokenizer

    try:
        kwargs = json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--chat-template-kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ConfigError("--chat-template-kwargs must be a JSON object")
    tokenizer = load_tokenizer(args.model, args.chat_template, trust_remote_code=args.trust_remote_code)
    masker = ChatMasker(tokenizer, train_on_eot=not args.no_train_on_eot,
                        train_on_reasoning=not args.no_train_on_reasoning, chat_template_kwargs=kwargs,
                        split_turns=args.split_turns)
    sys.stdout.write(explain(args.explain, masker, color=args.color, split=args.split))
    if not masker.stats["samples"]:
        raise ConfigError(f"{args.explain}: no conversation of it could be explained (each refusal is shown above, "
                          "with its reason)")
    return 0


# Each entry adds one subcommand to the parser; other modules append theirs here.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_validate, _add_export, _add_inspect, _add_plan,
                                                                 _add_masks]


def build_parser() -> argparse.ArgumentParser:
    from hsextract import __version__

    parser = argparse.ArgumentParser(prog="hsextract", description="EAGLE-3 hidden-state data: shards, checks, exports")
    parser.add_argument("--version", action="version", version=f"hsextract {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's flush at exit
        return rc
    except HsxError as e:
        print(f"hsextract {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback; the writers' temporary outputs unwound already
        print(f"\nhsextract {args.command}: interrupted; nothing partial was left (outputs are written whole or not "
              "at all)", file=sys.stderr)
        return 130  # as a process SIGINT ended
    except BrokenPipeError:  # `hsextract inspect --samples ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail
        return 141  # as a process SIGPIPE ended
    except OSError as e:  # the file system's refusal (permissions, a full disk, a path that cannot be made)
        where = f"{e.filename}: " if e.filename else ""
        print(f"hsextract {args.command}: error: {where}{e.strerror or e}; fix that path's permissions or free "
              "space, or choose another path (outputs are written whole or not at all)", file=sys.stderr)
        return 2


def entry() -> int:
    """The `hsextract` command: main, with SIGTERM unwinding the writers (no temporary output left behind)."""
    atomic.exit_on_sigterm()
    for stream in (sys.stdout, sys.stderr):  # a locale that cannot write ⟦ or a sample's name: escaped, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    return main()


if __name__ == "__main__":
    sys.exit(entry())
