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


def test_the_cpu_peak_mfu_divides_by_names_when_it_was_measured(tmp_path, monkeypatch):
    """Issue 41: MFU is divided by the best matmul ever measured on this machine, so the run line says which figure
    and when it was measured; a faster measurement replaces it with its own date, a slower one does not."""
    import slm.train.throughput as tp

    cache = str(tmp_path / "cpu_peak.json")
    monkeypatch.setattr(tp, "measure_matmul_flops", lambda dtype: 50e9)
    peak, said = tp.cpu_peak_flops(cache)
    assert peak == 50e9 and "on this machine, 20" in said and "50 GFLOP/s this run" in said
    first = said.split("on this machine, ")[1].split(" (")[0]
    monkeypatch.setattr(tp, "measure_matmul_flops", lambda dtype: 40e9)
    peak, said = tp.cpu_peak_flops(cache)
    assert peak == 50e9 and f"on this machine, {first} (" in said and "40 GFLOP/s this run" in said
