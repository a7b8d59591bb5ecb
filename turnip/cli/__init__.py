"""The ``turnip`` command. Each subcommand module exposes ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = ("turnip.cli.compile_cmds", "turnip.cli.sim_cmds", "turnip.cli.run_cmds")


def format_nbytes(n) -> str:
    """Bytes in the largest binary unit that fits: '1.50 GiB', '768 B'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turnip",
        description="Compile computations larger than GPU memory into offloading memgraphs; "
        "verify, simulate, run and report on them.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
