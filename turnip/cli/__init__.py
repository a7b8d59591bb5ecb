"""The ``turnip`` command. Each subcommand module exposes ``register(subparsers)``.

Errors (one path for every subcommand, in ``main``):

- An *expected* failure ends the command with one line on stderr, ``error: <what>; <what to do>``, and exit
  status 2 or 1. 2 = bad usage: an unknown flag, a value out of range or of the wrong form, a name the
  model or the profile list does not know, a named input file that is missing or not what it should be
  (plan, profile, config, weights, runs.csv), an output path whose directory is missing or not writable
  (checked before any work). 1 = the request was well formed but could not be carried out: an infeasible
  budget (``BudgetError``), a plan too large to compile without ``--force``, a missing GPU, driver or
  package, a failed or stalled run, violations found by ``verify``, a failed ``--check``, an I/O error
  while writing. argparse's own errors (unknown flag, ``--runs x``, an invalid choice) raise
  ``SystemExit(2)`` after the usage line, as argparse does; everything else is *returned* by ``main``.
- Commands raise ``CliError(message, code)`` for what they check themselves; ``as_cli_error`` maps the
  library's typed exceptions (``BudgetError``, ``PlanFormatError``, ``PlanError``, ``BackendError``, ``VertexFailed``,
  ``RuntimeStall``, ``CudaError``, ``MemoryError``, ``ImportError`` of a missing package, ``OSError``) to
  one in one place.
- ``turnip --debug COMMAND ...`` (or ``--debug`` after the command) prints the traceback of an expected
  failure before its ``error:`` line.
- Anything else is a bug in turnip: a line saying so (and how to report it) is printed, then the exception
  propagates with its traceback (exit status 1 from the ``turnip`` script).
- Ctrl-C prints ``interrupted`` and exits 130; output files are written atomically (``turnip.fileio``), so
  none is left half-written.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = ("turnip.cli.compile_cmds", "turnip.cli.sim_cmds", "turnip.cli.run_cmds", "turnip.cli.calibrate_cmds",
                   "turnip.cli.train_cmds", "turnip.cli.generate_cmds")
FAILED = 1  # the command could not be carried out
USAGE = 2  # bad usage or argument (argparse's convention)
OUR_PACKAGES = ("turnip", "sim", "analysis", "cuda_kernels")
REPORT_BUG = (
    "turnip: internal error: this is a bug in turnip, not a problem with your input. Please report it with "
    "the full command line, `pip show turnip` and the traceback below."
)


class CliError(Exception):
    """An expected failure: ``main`` prints ``error: <message>`` and returns ``code`` (1 failed, 2 usage)."""

    def __init__(self, message: str, code: int = FAILED):
        super().__init__(message)
        self.code = code


def format_nbytes(n) -> str:
    """Bytes in the largest binary unit that fits: '1.50 GiB', '768 B'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_bound(bound: dict, digits: int = 2) -> str:
    """A lower bound's parts in ms, the host's apart: it is reported beside the bound, not in it
    (``turnip.machine.bound.lower_bound``: a faster host beats the profile's median costs)."""
    parts = ", ".join(f"{k.removesuffix('_ns')} {v / 1e6:.{digits}f}" for k, v in bound.items()
                      if k not in ("lower_bound_ns", "host_ns"))  # fmt: skip
    host = f"; host {bound['host_ns'] / 1e6:.{digits}f}, not in the bound" if "host_ns" in bound else ""
    return parts + host


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each flag's default, except where there is none to show (None, False) or the help
    text already says it."""

    def _get_help_string(self, action):
        h = action.help or ""
        if action.default in (None, False) or "default" in h:
            return h
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one ``error:`` line (after the usage line), exit status 2."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(USAGE, f"error: {self.prog}: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("turnip")
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        ver = "source tree"
    p = Parser(
        prog="turnip",
        description="Compile computations larger than GPU memory into offloading memgraphs; "
        "verify, simulate, run and report on them.",
    )
    debug_help = "show the traceback of an error (before its error: line)"
    p.add_argument("--debug", action="store_true", help=debug_help)
    p.add_argument("--version", action="version", version=f"turnip {ver}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for sp in sub.choices.values():  # also after the command: `turnip compile --debug ...`
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    return p


def _one_line(text: str, limit: int = 600) -> str:
    s = "; ".join(part.strip().removesuffix(":") for part in str(text).splitlines() if part.strip())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def as_cli_error(e: BaseException) -> CliError | None:
    """The one-line error for an expected exception, or None for a bug."""
    if isinstance(e, CliError):
        return e
    from turnip.memgraph.build import BudgetError
    from turnip.memgraph.io import PlanFormatError
    from turnip.runtime.errors import BackendError, PlanError, RuntimeStall, VertexFailed

    if isinstance(e, BudgetError):  # "<what>. <advice>." -> "<what>; <advice>."
        what, sep, todo = _one_line(e).rpartition(". ")
        if sep and todo:
            return CliError(f"{what}; {todo[0].lower()}{todo[1:]}", FAILED)
        return CliError(f"{_one_line(e)}; raise --budget or use smaller tiles (--tile t=...)", FAILED)
    if isinstance(e, PlanError):
        return CliError(f"the plan fails the checks made before loading it: {_one_line(e)}; compile it again "
                        "(`turnip compile -o`)", USAGE)  # fmt: skip
    if isinstance(e, PlanFormatError):
        return CliError(f"{_one_line(e)}; pass a plan written by `turnip compile -o` (compile it again if it "
                        "came from another version)", USAGE)  # fmt: skip
    if isinstance(e, RuntimeStall):
        return CliError(f"the run stalled: {_one_line(e, 300)}; raise --stall-s if the vertices are just slow, "
                        "else rerun with --debug and report it", FAILED)  # fmt: skip
    if isinstance(e, VertexFailed | BackendError):
        return CliError(f"{_one_line(e)}; rerun with --debug for the traceback", FAILED)
    if type(e).__name__ == "CudaError":
        return CliError(f"CUDA error: {_one_line(e)}; check the GPU and its driver (nvidia-smi), or use "
                        "--backend cpu", FAILED)  # fmt: skip
    if isinstance(e, MemoryError):
        return CliError("out of host memory; use a smaller --seq, --budget or fewer --layers (or a larger "
                        "--tile t=... for fewer vertices)", FAILED)  # fmt: skip
    if isinstance(e, ImportError) and (e.name or "").split(".")[0] not in OUR_PACKAGES:
        what = f"the Python package {e.name!r} is not installed" if e.name else _one_line(e)
        return CliError(f"{what}; on a GPU machine `pip install -e '.[cuda]'` installs the GPU packages "
                        "(--backend cpu needs none)", FAILED)  # fmt: skip
    if isinstance(e, BrokenPipeError):
        return CliError("output closed early (broken pipe); let the reader take the whole output", FAILED)
    if isinstance(e, OSError):
        if e.filename is not None:
            return CliError(f"{e.filename}: {e.strerror or e}; check the path, its permissions and free space",
                            FAILED)  # fmt: skip
        return CliError(f"{_one_line(e)}; check the driver and libraries it names (--debug shows where)", FAILED)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        err = as_cli_error(e)
        if err is None:
            print(REPORT_BUG, file=sys.stderr)
            raise
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return err.code
