"""launcher.core.errors: the exceptions users see, their exit codes, and the one line each is shown as."""

from __future__ import annotations

from launcher.core.errors import Interrupted, LauncherError, TrainingFailed, error_line, one_line


def test_exit_codes_say_how_a_job_ended():
    assert (LauncherError.exit_code, TrainingFailed.exit_code, Interrupted.exit_code) == (2, 1, 143)
    assert issubclass(TrainingFailed, LauncherError) and issubclass(Interrupted, LauncherError)


def test_the_line_is_the_first_of_the_message():
    assert one_line(ValueError("bad value\n  more detail\n")) == "bad value"
    assert one_line(ValueError("\n\n  indented first line  \nsecond")) == "indented first line"
    assert one_line(ValueError("bad value\nmore"), named=True) == "ValueError: bad value"


def test_an_empty_message_is_the_exception_class():
    assert one_line(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert one_line(KeyboardInterrupt(), named=True) == "KeyboardInterrupt"


def test_a_long_line_is_cut_to_the_limit():
    line = one_line(RuntimeError("x" * 50), limit=20)
    assert line == "x" * 17 + "..." and len(line) == 20
    assert one_line(RuntimeError("short"), limit=20) == "short"


def test_an_error_raised_in_a_dataloader_worker_is_its_last_line():
    """torch re-raises a worker's exception in the main process with the worker's traceback in its message."""
    message = (
        "Caught LauncherError in DataLoader worker process 0.\n"
        "Original Traceback (most recent call last):\n"
        '  File "collate.py", line 10, in __call__\n'
        "launcher.core.errors.LauncherError: data.path=x.json: record 3 has no image\n"
    )
    assert one_line(LauncherError(message)) == "data.path=x.json: record 3 has no image"
    plain = "Caught ValueError in DataLoader worker process 1.\nTraceback ...\nsomething without a class\n"
    assert one_line(RuntimeError(plain)) == "something without a class"


def test_a_jobs_error_line_is_its_error_else_its_last_line():
    assert error_line("starting\nerror: first\nmore\nerror: the last one\ntail\n") == "the last one"
    assert error_line("one\n  two  \n\n") == "two"
    assert error_line("") == "no output"
    assert len(error_line("error: " + "x" * 900)) == 500
