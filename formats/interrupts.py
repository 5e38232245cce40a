"""Ctrl-C as one line in the three commands. Start-up (argument parsing, imports) runs to its end with
the interrupt held, which is then raised as KeyboardInterrupt: an interrupt in the middle of an import
can surface as another exception (Python turns a KeyboardInterrupt inside a class body's
`__set_name__` into a RuntimeError). For later windows, `caused_by_interrupt` recognises an interrupt
wrapped that way. The hold starts at the first line of this project a command runs (the package
`kimistream.formats`, which every command's package imports first: `EARLY_INTERRUPTS`), or, for
`python -m`, when the command's module is imported (`hold_from_import`), so the console script's own
lines between that import and `main()` are covered too; only the interpreter's start-up before that
line (its site-packages, the console script's `import re`) ends the interpreter's way."""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

from kimistream.formats import EARLY_INTERRUPTS as _early     # interrupts noted before a command's main()


def hold_from_import(prog: str, module: str) -> None:
    """Called at the top of a command's module: when the process runs that command (its console
    script, or `python -m` the module), note SIGINT until `command` takes over. A library import of
    the module changes nothing."""
    if module != "__main__" and os.path.basename(sys.argv[0] if sys.argv else "") != prog:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda signum, frame: _early.append(signum))


@contextmanager
def held():
    """Inside the block SIGINT is only noted; at its end a noted interrupt raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted = []
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if noted:
        raise KeyboardInterrupt


def caused_by_interrupt(e: BaseException | None) -> bool:
    """e is, or was raised while handling or because of, a KeyboardInterrupt."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def say(text: str) -> None:
    """One message line on stderr, written by one call: print() writes the text and its newline
    separately, and an interrupt between the two would glue the next line to this one."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def command(prog: str, start, interrupted) -> int:
    """A command's main: `start()` (parse the arguments, import the work) runs with the interrupt held
    and returns the work, a callable giving the exit status. Ctrl-C at any point, even wrapped in
    another exception, prints "PROG: INTERRUPTED" (a string, or a callable that says what the
    interrupted work left) and returns 130. Messages name `prog`, also when the command runs as
    `python -m`."""
    sys.argv[0] = prog
    try:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)   # what held() restores after start-up
        if _early:
            raise KeyboardInterrupt
        with held():
            work = start()
        return work()
    except Exception as e:
        if not caused_by_interrupt(e):
            raise
    except KeyboardInterrupt:
        pass
    say(f"{prog}: {interrupted() if callable(interrupted) else interrupted}")
    return 130
