"""The `shardwise` command. User errors exit 2 with one paragraph; nothing else prints a traceback
unless it is a bug."""

from __future__ import annotations

import argparse
import os
import re
import sys

from shardwise.cli.output import print_error
from shardwise.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Distributed training on PyTorch whose results do not change with the layout.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from shardwise.cli import (
        audit,
        compare,
        export,
        gc,
        inspect,
        launch,
        plan,
        register,
        report,
        scale,
        status,
        train,
        verify,
    )

    train.add_parser(sub)
    plan.add_parser(sub)
    inspect.add_parser(sub)
    verify.add_parser(sub)
    export.add_parser(sub)
    report.add_parser(sub)
    launch.add_parser(sub)
    status.add_parser(sub)
    compare.add_parser(sub)
    scale.add_parser(sub)
    audit.add_parser(sub)
    register.add_parser(sub)
    gc.add_parser(sub)
    return parser


#: a negative value (-5T, -16M, -1e-5): argparse takes one with a suffix or an exponent for an
#: option, not a value; no option of shardwise starts with a digit
_NEGATIVE = re.compile(r"^-\.?\d")


def attach_negative_values(argv: list[str]) -> list[str]:
    """`--tokens -5T` as `--tokens=-5T`, so the option's own check names what is wrong with the
    value (argparse said only "expected one argument")."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # what follows is positional, as given
            return out + argv[i:]
        if (arg.startswith("--") and "=" not in arg and i + 1 < len(argv)
                and _NEGATIVE.match(argv[i + 1])):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_negative_values(sys.argv[1:] if argv is None else argv))
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # what is still buffered, inside the handling below
        return code
    except UserError as err:
        print_error(str(err))
        return err.exit_code
    except KeyboardInterrupt:
        print_error("interrupted. Whatever the run wrote so far stays in its run directory.")
        return 130
    except BrokenPipeError:
        # the reader closed the pipe (`| head`, `| grep -m1`): stop as a Unix filter does, without
        # a traceback, and keep the interpreter's final flush from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
