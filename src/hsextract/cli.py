"""The `hsextract` command. One subparser and one small function per subcommand; add new ones in SUBCOMMANDS."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from hsextract.errors import HsxError


def _add_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check shards against a reference sample and content rules",
                       description="Check shards; write a JSON report per shard; exit 1 with one line per failed shard.")
    p.add_argument("shards", nargs="+", metavar="SHARD")
    p.add_argument("--reference", required=True, metavar="REF.pt", help="a speculators v1 sample file (data_N.pt)")
    dest = p.add_mutually_exclusive_group()
    dest.add_argument("--report-dir", metavar="DIR", help="write DIR/<shard stem>.json per shard")
    dest.add_argument("--report", metavar="FILE", help="write the report here (one shard only)")
    p.add_argument("--vocab-size", type=int, help="upper bound for input_ids when the shard metadata has no vocab_size")
    p.add_argument("--same-model", action="store_true",
                   help="the reference comes from the shards' model: compare hidden sizes too")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from hsextract.validate import failure_line, load_reference, validate_shard

    if args.report and len(args.shards) != 1:
        raise HsxError(f"--report names one file but {len(args.shards)} shards were given; use --report-dir")
    ref = load_reference(args.reference)
    failed = 0
    for shard in args.shards:
        report_path = args.report or (Path(args.report_dir) / f"{Path(shard).stem}.json" if args.report_dir else None)
        report = validate_shard(shard, ref, vocab_size=args.vocab_size, report_path=report_path,
                                same_model=args.same_model)
        line = failure_line(report)
        if line:
            failed += 1
            print(line)
    if failed:
        print(f"{failed} of {len(args.shards)} shards failed validation", file=sys.stderr)
    return 1 if failed else 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    from hsextract.export import FORMATS

    p = sub.add_parser("export", help="rewrite a run's shards in another trainer's layout",
                       description="Stream every sample of RUN_DIR (a run's results folder, or a shards folder) into OUT_DIR.")
    p.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR, overwriting")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from hsextract.export import FinalNormWarning, export

    with warnings.catch_warnings():  # export() already printed it to stderr; once is enough on a terminal
        warnings.simplefilter("ignore", FinalNormWarning)
        summary = export(args.run_dir, args.out_dir, args.fmt, force=args.force)
    print(f"exported {summary['num_samples']} samples ({summary['num_tokens']} tokens) as {args.fmt} "
          f"to {summary['data_path']}")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="metadata, counts and compression of a shard")
    p.add_argument("shard", metavar="SHARD")
    p.add_argument("--samples", action="store_true", help="list every sample: index, seq_len, trained tokens, id")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from hsextract.inspect_shard import format_info, shard_info

    info = shard_info(args.shard, samples=args.samples)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


# Each entry adds one subcommand to the parser; other modules append theirs here.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_validate, _add_export, _add_inspect]


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
        return args.func(args)
    except HsxError as e:
        print(f"hsextract {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
