"""A process of a gloo group ends after its exit handlers and before interpreter finalization
(boost_compile/process_exit.py): gloo's threads outlive the process group, and one that asks
for the GIL while the interpreter finalizes aborts the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from boost_compile.process_exit import exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**environ, **(env or {})})


@pytest.mark.parametrize("code, status", [(None, 0), (0, 0), (2, 2), (143, 143), ("a message", 1)])
def test_the_status_is_sys_exits(code, status, capsys):
    assert exit_code(code) == status
    assert capsys.readouterr().err == ("a message\n" if isinstance(code, str) else "")


def test_exit_handlers_run_output_is_flushed_and_nothing_is_finalized():
    """An atexit handler runs, block-buffered stdout (a pipe) reaches the reader, and an object
    whose __del__ would speak at finalization never does: the interpreter was not finalized."""
    proc = python("""
        import atexit, sys
        from boost_compile.process_exit import exit_without_finalizing

        class Finalized:
            def __del__(self):
                print("finalized", file=sys.stderr)

        kept = Finalized()
        atexit.register(lambda: print("exit handler"))
        sys.stdout.write("unflushed line\\n")
        exit_without_finalizing(5)
        print("after the exit")
    """)
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout == "unflushed line\nexit handler\n"
    assert "finalized" not in proc.stderr


RECORDED_EXIT = """
    import os, sys
    import boost_compile.train.app as app

    def recorded(code):
        print("exit_without_finalizing", code, flush=True)
        os._exit(7)

    app.exit_without_finalizing = recorded
    app.main(["trainer=quick", "trainer.steps=0"])
"""


def test_a_torchrun_worker_refused_by_validation_ends_through_it():
    """Under torchrun (WORLD_SIZE set) a refused config's exit 2 goes through
    exit_without_finalizing; without a launcher it is a plain SystemExit(2)."""
    worker = python(RECORDED_EXIT, env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert worker.returncode == 7, worker.stdout + worker.stderr
    assert "exit_without_finalizing 2" in worker.stdout
    assert "trainer.steps" in worker.stderr
    alone = python(RECORDED_EXIT)
    assert alone.returncode == 2, alone.stdout + alone.stderr
    assert "exit_without_finalizing" not in alone.stdout and "trainer.steps" in alone.stderr
