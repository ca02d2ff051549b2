"""What every ``python -m embstore`` command shares: a parser whose help shows
each option's default and whose errors are one line with exit code 2, checks
of optional dependencies before any work starts, and phase lines that draw a
bar only on a terminal."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from typing import NoReturn

from embstore._deps import install_hint

#: Exit code of a refused command line or input (argparse's own).
USAGE_ERROR = 2


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (paragraphs kept); every option that has a
    default value shows it (flags and options without one say so in words)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            text += " (default: %(default)s)"
        return text


def plain(doc: str | None) -> str:
    """A module docstring as help text: RST's double backticks dropped."""
    return re.sub(r"``([^`]+)``", r"\1", doc or "")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit 2): the
    command, what was wrong, and where the options are listed."""

    def __init__(self, prog: str, doc: str | None) -> None:
        super().__init__(prog=prog, description=plain(doc), formatter_class=_Formatter)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, said so when it is not."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def require(parser: Parser, module: str, extra: str, why: str) -> None:
    """Refuse the command line (exit 2, before any work) when ``module`` is
    not installed; the message says how to install it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        parser.error(f"{why} needs {module}, which is not installed: {install_hint(extra)}")


def phase(text: str) -> None:
    """One line on stderr saying what the command does now."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()
