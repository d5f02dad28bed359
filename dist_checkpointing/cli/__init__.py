"""``python -m dist_checkpointing`` (also the ``dist-checkpointing`` console script).

Subcommands: ``inspect``, ``show``, ``verify``, ``convert``, ``rm``, ``diff``. Every
bad input ends with one line on stderr and a non-zero exit code (2 for bad input,
1 for a failed verification or a difference found), never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from .ui import CliError

__all__ = ["build_parser", "main", "main_exit"]


def _cmd_verify(args: argparse.Namespace) -> int:
    from .ui import progress
    from .verify import digest_bytes, verify_checkpoint

    with progress(digest_bytes(os.fspath(args.dir)), "verify") as bar:
        report = verify_checkpoint(args.dir, bar)
    for problem in report.problems:
        print(f"FAIL {problem}")
    if report.ok:
        digests = f", {report.digests_checked} sha256 digest(s)" if report.digests_checked else ""
        print(
            f"OK {report.path}: {report.checked_files} data file(s){digests}, "
            f"checksums {report.checksums}"
        )
    return 0 if report.ok else 1


def _dispatch(args: argparse.Namespace) -> int:
    from . import commands, convert

    handlers = {
        "inspect": commands.cmd_inspect,
        "show": commands.cmd_show,
        "diff": commands.cmd_diff,
        "rm": commands.cmd_rm,
        "convert": convert.cmd_convert,
        "verify": _cmd_verify,
    }
    return handlers[args.command](args)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dist-checkpointing", description="Inspect, verify and convert sharded checkpoints."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="backend, completeness, files and a table of keys")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--key", metavar="PATTERN", help="only keys matching this glob")
    p = sub.add_parser("show", help="statistics of one tensor or a slice of it")
    p.add_argument("dir")
    p.add_argument("key")
    p.add_argument("--slice", help='numpy-style, e.g. "0:2, :, 3" (reads only those bytes)')
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("verify", help="completeness, file sizes and checksums; exit 0 or 1")
    p.add_argument("dir")
    p = sub.add_parser(
        "convert", help="to torch.save, safetensors, a sharded checkpoint, or the other layout"
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument(
        "--to",
        required=True,
        choices=("torch", "safetensors", "dist", "torch_dist", "raw_bytes"),
        help="torch/safetensors: files; dist: sharded from a file; torch_dist/raw_bytes: "
        "a sharded checkpoint in that layout",
    )
    p.add_argument("--keys", metavar="PATTERN", help="only tensors matching this glob")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (5GB)")
    p.add_argument("--ranks", type=int, default=1, help="ranks of the output (--to dist)")
    p = sub.add_parser("rm", help="remove tensors by key prefix (remove_sharded_tensors)")
    p.add_argument("dir")
    p.add_argument("--prefix", required=True)
    p.add_argument("--dry-run", action="store_true", help="only list what would go")
    p = sub.add_parser("diff", help="keys, shapes and dtypes that differ; exit 1 if any")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--values", action="store_true", help="also the max abs difference")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if not args.verbose else "default")
            return _dispatch(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except BrokenPipeError:  # the reader of our output went away (e.g. `| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an unforeseen input: still one line
        from .source import one_line

        print(f"error: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return 2


def main_exit() -> None:
    """Entry point of the ``dist-checkpointing`` console script."""
    raise SystemExit(main())
