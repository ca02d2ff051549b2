"""Running test workloads on several Python threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_concurrently(*targets: Callable[[], object]) -> list[BaseException]:
    """Run each target on its own thread, all at once; return what they raised."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], object]) -> None:
        try:
            target()
        except BaseException as e:  # reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
