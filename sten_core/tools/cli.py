"""The ``sten`` command.

    sten plugins          installed plugins as JSON (name, version, available, reason, layouts, hooks)
    sten demo             sparsify a small model and show what ran where
    sten bench [bert]     the paper's Fig. 2: BERT-base layer forward time per layout and sparsity
    sten bench linear     the same for one linear layer (--shape OUTxIN --tokens N)
    sten explain [MODEL]  run a model once and show, per call, what ran, conversions, fallbacks

Examples:
    sten bench --quick                       # ~1 minute: table, CSV, JSON and PNG under bench-out/
    sten bench --layouts dense,torch_csr,nm --sparsities 50,75,90 --threads 1,2
    sten bench linear --shape 3072x768 --tokens 1024
    sten explain bert                        # the built-in example
    sten explain mypkg.models:make_model     # a factory returning (model, inputs)

Errors in the arguments print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Sequence


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no traceback
        self.exit(2, f"sten: error: {message}\n")


def _cmd_plugins(args: argparse.Namespace) -> int:
    """The report, also under ``STEN_STRICT_PLUGINS=1`` when a plugin failed to load (then the
    error on stderr and status 1): the command that says why a plugin is missing must not crash."""
    from sten_core import plugins

    try:
        plugins.ensure_loaded()
        error = None
    except plugins.PluginLoadError as raised:
        error = raised
    print(json.dumps(plugins.plugin_report(skipped=True), indent=2))   # every installed plugin
    if error is not None:
        print(f"sten: error: {error}", file=sys.stderr)
        return 1
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from sten_core.tools.demo import run_demo

    run_demo()
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from sten_core.tools.bench import bench

    result = bench(args.target, quick=args.quick, layouts=args.layouts, sparsities=args.sparsities,
                   threads=args.threads, device=args.device, dtype=args.dtype, out=args.out, batch=args.batch,
                   seq_len=args.seq_len, size=args.size, shape=args.shape, tokens=args.tokens, repeats=args.repeats,
                   progress=False if args.no_progress else None)
    return 1 if any(row.get("error") for row in result["rows"]) else 0  # a layout failed to run


def _cmd_explain(args: argparse.Namespace) -> int:
    from sten_core.tools.explain import format_report
    from sten_core.tools.explain_targets import EXAMPLES, load_target, run_explained

    extra = {"size": args.size, "batch": args.batch, "seq_len": args.seq_len} if args.model in EXAMPLES else {}
    model, inputs = load_target(args.model, **extra)
    report = run_explained(model, inputs, backward=args.backward)
    print(json.dumps(report.as_dicts(), indent=2) if args.json else format_report(report))
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="forward time per layout and sparsity (the paper's Fig. 2)",
                       description="Forward time of a BERT-base encoder layer (or one linear layer) with its "
                                   "Linear weights in every available layout, at sparsities 50-95 %.")
    p.add_argument("target", nargs="?", default="bert", choices=("bert", "linear"),
                   help="bert: BertLayer(BertConfig()), six weights; linear: one nn.Linear (default: bert)")
    p.add_argument("--quick", action="store_true", help="few sparsities and repeats, batch 2 (about a minute)")
    p.add_argument("--layouts", help="comma-separated: dense,torch_coo,torch_csr,scipy_csr,nm,grouped_nm,paper_nm,2:4,block "
                                     "(default: all available here)")
    p.add_argument("--sparsities", help="percentages or fractions, e.g. 50,75,90 (default 50,60,70,80,90,95)")
    p.add_argument("--threads", help="intra-op thread counts, e.g. 1,2 (default: torch's)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument("--dtype", help="float32, float16 or bfloat16 (default float32 on CPU, float16 on CUDA)")
    p.add_argument("--out", default="bench-out", help="directory for the CSV, JSON and PNG (default bench-out)")
    p.add_argument("--batch", type=int, help="batch size (default 8, --quick 2)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--size", default="base", choices=("base", "tiny"), help="bert: BERT size (tiny: smoke test)")
    p.add_argument("--shape", default="3072x768", help="linear: weight shape OUTxIN (default 3072x768)")
    p.add_argument("--tokens", type=int, help="linear: input rows (default batch*seq-len)")
    p.add_argument("--repeats", type=int, help="timed runs per configuration (default 10, --quick 3)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: one only when stderr is a terminal)")
    p.set_defaults(func=_cmd_bench)


def _add_explain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="run a model once and show what the dispatcher did",
                       description="Runs MODEL once and prints, per operator call, which implementation ran, "
                                   "every conversion and every dense fallback with the decorator that removes it.")
    p.add_argument("model", nargs="?", default="bert",
                   help="'bert' (built-in example) or module:factory returning (model, inputs)")
    p.add_argument("--backward", action="store_true", help="also run backward (sum of the first output)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--size", default="base", choices=("base", "tiny"), help="built-in example: BERT size")
    p.add_argument("--batch", type=int, default=2, help="built-in example: batch (default 2)")
    p.add_argument("--seq-len", type=int, default=16, help="built-in example: sequence length (default 16)")
    p.set_defaults(func=_cmd_explain)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sten", description="STen: sparsity for PyTorch")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    p = sub.add_parser("plugins", help="list installed plugins as JSON")
    p.set_defaults(func=_cmd_plugins)
    p = sub.add_parser("demo", help="sparsify a small model and show what ran where")
    p.set_defaults(func=_cmd_demo)
    _add_bench(sub)
    _add_explain(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
            return args.func(args)
    except ValueError as error:  # bad user input: one line, no traceback
        print(f"sten: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
