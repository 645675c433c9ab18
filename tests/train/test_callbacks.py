"""slm.train.callbacks: the console's progress bar where a person watches, plain lines in a pipe."""

import sys
import types

from slm.train.callbacks import progress_bar


def test_progress_bar_in_a_notebook_kernel_and_not_in_a_pipe(monkeypatch):
    assert progress_bar(10) is None  # pytest's stderr is not a terminal: log lines
    ZMQInteractiveShell = type("ZMQInteractiveShell", (), {})
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    bar = progress_bar(10)
    assert bar is not None and bar.total == 10
    bar.close()
