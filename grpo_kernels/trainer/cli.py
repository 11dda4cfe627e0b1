"""What the commands (`python -m grpo_kernels.train`, `.compare`, `.evaluate`) share: a parser whose errors are one
line (and which answers `--version`), and `run`, which turns a user error into `error: <what to do>` and exit status 2.

A user error is an exception of a type in `USER_ERRORS`, raised anywhere in the command: the library names the
argument, the expected and the received value, and that line is what the user sees. `--debug` shows the traceback
instead. Warnings (a checkpoint skipped as unreadable, ...) print as one `warning: ...` line each.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn

from grpo_kernels import __version__
from grpo_kernels.trainer import run_names

USER_ERRORS = (ValueError, TypeError, OSError, ImportError)  # a bad option, a missing file, a missing package
EXIT_USER_ERROR = 2  # argparse's status for a bad command line
EXIT_INTERRUPTED = 130
DEBUG_FLAG = "--debug"
RESUME_HINT = "--resume continues from the last checkpoint"
MAX_ERROR = 500  # characters of an argparse error line (it repeats the value given)


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line, `error: ...`, without the (long) usage."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**{"allow_abbrev": False, **kwargs})  # `--step 10` is an error, not `--steps 10`
        self.add_argument(DEBUG_FLAG, action="store_true", help="show the traceback of an error (else one line)")
        self.add_argument("--version", action="version", version=f"grpo-kernels {__version__}")

    def error(self, message: str) -> NoReturn:
        message = message if len(message) <= MAX_ERROR else message[: MAX_ERROR - 3] + "..."
        print(f"error: {message}{self._did_you_mean(message)} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)

    def _did_you_mean(self, message: str) -> str:
        """`; did you mean --steps?` for an unknown option close to a known one, else ''."""
        unknown = re.search(r"unrecognized arguments: (--?[\w-]+)", message)
        if unknown is None:
            return ""
        options = [option for action in self._actions for option in action.option_strings]
        close = difflib.get_close_matches(unknown.group(1), options, n=1)
        return f"; did you mean {close[0]}?" if close else ""


def run(command: Callable[[Sequence[str]], object], argv: Sequence[str] | None = None) -> None:
    """Call `command(argv)`: a user error prints `error: ...` on stderr and exits with status 2, Ctrl-C exits with
    130, both in one line; with `--debug` among the arguments they raise as usual."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_deepspeed_notices()
    if DEBUG_FLAG in argv:
        command(argv)
        return
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            command(argv)
        except USER_ERRORS as error:
            run_names.release_unused()
            print(f"error: {one_line(error)}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt as interrupt:  # a command may say what it kept and how to continue
            print(f"interrupted: {one_line(interrupt) if str(interrupt) else RESUME_HINT}", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)


def _quiet_deepspeed_notices() -> None:
    """Keep DeepSpeed's import-time notices (accelerator detection, on stdout) out of the progress lines.

    The commands never run DeepSpeed, but accelerate imports it when it is installed; its errors still print.
    """
    logging.getLogger("DeepSpeed").addFilter(_errors_only)  # adding the same filter twice keeps one


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def one_line(error: BaseException) -> str:
    """The error's message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {one_line(message if isinstance(message, Warning) else Warning(message))}", file=sys.stderr)
