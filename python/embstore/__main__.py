"""Command line: ``python -m embstore demo`` (the main job), ``bench``,
``inspect``, ``replicate`` and ``cache-curve``; ``--help`` lists them, ``--version``.
Every error a user can cause is one line on stderr with exit code 2
(``EMBSTORE_TRACEBACK=1`` shows the traceback of one found mid-run)."""

from __future__ import annotations

import os
import sys

from embstore.exceptions import EmbstoreError

#: Command -> (module with a ``main(argv) -> int``, one line on what it does).
COMMANDS = {
    "demo": (
        "embstore.demo",
        "train a factorization-machine CTR model on synthetic Criteo-like data (the main job)",
    ),
    "bench": ("embstore.bench", "the peer comparison: embstore against torch, dict, SparseAdam"),
    "inspect": ("embstore.inspect", "what a checkpoint holds, and whether every check holds"),
    "replicate": (
        "embstore.serving.replicate",
        "keep a serving host's copy of a trainer's published checkpoint (a path or URL)",
    ),
    "cache-curve": (
        "embstore.gpu.curve",
        "device-cache hit rate per cache size for a recorded key stream",
    ),
}


def usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = [
        "usage: python -m embstore COMMAND [options]",
        "",
        "An embedding store for huge sparse features. Commands:",
        *(f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()),
        "",
        "python -m embstore COMMAND --help   options of one command",
        "python -m embstore --version        the installed version",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        from embstore import __version__

        print(f"embstore {__version__}")
        return 0
    if args[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        print(
            f"\nerror: unknown command {args[0]!r} (commands: {', '.join(COMMANDS)})",
            file=sys.stderr,
        )
        return 2
    import importlib

    module = importlib.import_module(COMMANDS[args[0]][0])
    try:
        return int(module.main(args[1:]))
    except KeyboardInterrupt:
        print(f"python -m embstore {args[0]}: interrupted", file=sys.stderr)
        return 130
    except (EmbstoreError, OSError, ValueError, TypeError, ImportError) as e:
        # A user's mistake found once the work began (a path that cannot be
        # written, a damaged file, memory refused): one line, exit 2; the
        # traceback on request, for a report.
        if os.environ.get("EMBSTORE_TRACEBACK"):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(
            f"python -m embstore {args[0]}: error: {message} (EMBSTORE_TRACEBACK=1 shows where)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
