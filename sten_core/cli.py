"""The ``sten`` command.

    sten plugins          installed plugins as JSON (name, version, available, reason, layouts, hooks)
    sten demo             sparsify a small model and show what ran where

Errors in the arguments print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no traceback
        self.exit(2, f"sten: error: {message}\n")


def _cmd_plugins(args: argparse.Namespace) -> int:
    from . import plugins

    print(json.dumps(plugins.plugin_report(), indent=2))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sten", description="STen: sparsity for PyTorch")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    p = sub.add_parser("plugins", help="list installed plugins as JSON")
    p.set_defaults(func=_cmd_plugins)
    p = sub.add_parser("demo", help="sparsify a small model and show what ran where")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except ValueError as error:  # bad user input: one line, no traceback
        print(f"sten: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
