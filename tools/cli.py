"""The `puzzlekit` command line. Exit codes: 0 success, 1 failure, 2 usage error."""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import PuzzlekitError


def _inspect(args) -> int:
    from .. import ir
    from .default_model import model_path

    prog = ir.verify(ir.load(model_path(args.model), check_finite=args.check_finite), check_finite=args.check_finite)
    if args.json:
        counts = prog.param_counts()
        print(json.dumps({"model": str(model_path(args.model)), "ir": ir.print_program(prog),
                          "params_total": counts["total"], "params_active": counts["active"],
                          "mtp_params_total": counts["mtp_total"], "mtp_params_active": counts["mtp_active"],
                          "by_kind": counts["by_kind"]}, indent=2))
    else:
        print(ir.print_program(prog))
        print(ir.format_params(prog), end="")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="puzzlekit", description="A compiler for hybrid Mamba/MoE/attention LMs.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="verify a model and print its IR and parameter table")
    i.add_argument("model", nargs="?", help="checkpoint directory or config.json (default: the built-in model)")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--check-finite", action="store_true", help="also reject NaN/inf weights (reads every tensor)")
    i.set_defaults(run=_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # usage errors exit with 2
    try:
        return args.run(args)
    except PuzzlekitError as e:
        print(f"puzzlekit {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
