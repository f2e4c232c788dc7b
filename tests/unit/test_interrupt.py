"""Ctrl-C is never lost: a KeyboardInterrupt the interpreter drops (raised inside a __del__) is raised again at
the next safe point (tdpipe/interrupt.py)."""
import signal
import threading
from concurrent.futures import Future

import pytest

from tdpipe.interrupt import deferred_sigint, raise_if_dropped, result_or_interrupt, sticky_sigint


@pytest.fixture
def sticky():
    old = signal.signal(signal.SIGINT, sticky_sigint)
    yield
    signal.signal(signal.SIGINT, old)
    try:
        raise_if_dropped()
    except KeyboardInterrupt:
        pass


class _SigintInDel:
    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)  # the handler's KeyboardInterrupt is raised here, then dropped


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_dropped_inside_del_is_raised_at_the_next_safe_point(sticky):
    _SigintInDel()  # the interpreter reports "Exception ignored in ... __del__" and carries on
    with pytest.raises(KeyboardInterrupt):
        raise_if_dropped()
    raise_if_dropped()  # raised once only


def test_a_ctrl_c_that_surfaced_is_still_raised_once(sticky):
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):  # the caller cannot tell; the CLI exits on the first one anyway
        raise_if_dropped()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_dropped_ctrl_c_ends_a_wait_on_a_thread_the_held_import_lock_blocks(sticky):
    """What a fault test saw at start-up: the Ctrl-C dropped in importlib's weakref callback left the global
    import lock held by the main thread, whose wait for the tokenizer thread (importing) never ended."""
    import _imp
    import sys

    fut: Future = Future()

    def importer() -> None:  # blocks on the import lock until the main thread gives it back
        sys.modules.pop("this", None)
        import contextlib
        with contextlib.redirect_stdout(None):
            __import__("this")
        fut.set_result("imported")

    _imp.acquire_lock()
    try:
        t = threading.Thread(target=importer, daemon=True)
        t.start()
        t.join(0.3)
        assert t.is_alive() and not fut.done()  # held by the lock
        _SigintInDel()  # dropped
        with pytest.raises(KeyboardInterrupt):
            result_or_interrupt(fut)
    finally:
        _imp.release_lock()
    t.join(10)
    assert fut.result(0) == "imported"


def test_a_wait_returns_the_result_and_raises_what_the_thread_raised():
    ok: Future = Future()
    threading.Timer(0.25, ok.set_result, ("done",)).start()  # after a few polls
    assert result_or_interrupt(ok) == "done"
    bad: Future = Future()
    bad.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        result_or_interrupt(bad)


def test_deferred_section_hands_the_ctrl_c_to_the_sticky_handler(sticky):
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint():
            signal.raise_signal(signal.SIGINT)  # only noted inside
            noted = True
    assert noted


def test_a_dropped_ctrl_c_prints_no_traceback_and_still_interrupts():
    """The CLI's setting (install_sticky_sigint): the interpreter's "Exception ignored ... Traceback" for a
    KeyboardInterrupt raised inside a __del__ is not printed, and the Ctrl-C is raised at the next safe point."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import signal
        from tdpipe.interrupt import install_sticky_sigint, raise_if_dropped
        install_sticky_sigint()
        class D:
            def __del__(self):
                signal.raise_signal(signal.SIGINT)
        D()
        print("went on")
        try:
            raise_if_dropped()
        except KeyboardInterrupt:
            print("raised")
        class E:
            def __del__(self):
                raise ValueError("other unraisable")
        E()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["went", "on", "raised"], r.stderr
    assert "KeyboardInterrupt" not in r.stderr, r.stderr
    assert "other unraisable" in r.stderr  # anything else is still reported


@pytest.mark.slow  # starts a Python process that imports torch
def test_the_command_imports_torch_before_ctrl_c_becomes_a_keyboard_interrupt():
    """torch's import runs Python beneath C++, where a KeyboardInterrupt aborts the process: the `tdpipe`
    command imports it while a Ctrl-C still ends the process at once, then installs the sticky handler; the
    simulator, which needs no torch, does not import it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import signal, sys
        import tdpipe.cli as cli, tdpipe.interrupt as it, tdpipe.sim.cli as sim_cli
        seen = []
        it.install_sticky_sigint = lambda: seen.append("torch" in sys.modules)
        cli.cmd_generate = sim_cli.run = lambda a: 0
        signal.signal(signal.SIGINT, cli._interrupted_while_starting)
        cli.main(["simulate"])
        cli.main(["generate", "hello"])
        print(seen)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["[False,", "True]"], r.stderr
