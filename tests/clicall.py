"""Running ``turnip`` in-process for the CLI tests."""

import contextlib
import io

from turnip.cli import main


def call(argv):
    """(exit status, stdout, stderr) of ``turnip argv`` run in-process; argparse's SystemExit caught."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()
