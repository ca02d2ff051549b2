"""Command line: ``python -m embstore demo`` (the main job), ``bench``,
``inspect`` and ``cache-curve``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    commands = {
        "demo": "embstore.demo",
        "bench": "embstore.bench",
        "inspect": "embstore.inspect",
        "cache-curve": "embstore.gpu.curve",
    }
    if not args or args[0] not in commands:
        print(
            "usage: python -m embstore {demo,bench,inspect,cache-curve} [options] "
            "(--help after a command)",
            file=sys.stderr,
        )
        return 2
    import importlib

    module = importlib.import_module(commands[args[0]])
    return int(module.main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
