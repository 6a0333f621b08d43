"""The `shardwise` command. User errors exit 2 with one paragraph; nothing else prints a traceback
unless it is a bug."""

from __future__ import annotations

import argparse
import os
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
