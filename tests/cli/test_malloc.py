"""slm.cli.malloc: when the command line re-executes itself under huge-page malloc, and with what."""

import os
import subprocess
import sys
import time

import pytest
from helpers import ROOT

from slm.cli import malloc


def test_adds_the_tunable_and_hands_on_the_start():
    env = malloc.reexec_env({"PATH": "/bin"}, 123.25, glibc=True)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "SLM_PROCESS_START": "123.25"}


def test_keeps_the_users_other_tunables():
    env = malloc.reexec_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, 1.0, glibc=True)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("environ", [
    {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},  # the user's explicit choice
    {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},  # already re-executed: never a second time
    {"SLM_NO_REEXEC": "1"},
])
def test_goes_on_without_reexecuting(environ):
    assert malloc.reexec_env(environ, 1.0, glibc=True) is None


def test_nothing_to_do_without_glibc():  # macOS, musl: the variable would mean nothing
    assert malloc.reexec_env({}, 1.0, glibc=False) is None


def test_process_start_is_taken_out_of_the_environment(monkeypatch):
    monkeypatch.setenv("SLM_PROCESS_START", "42.5")
    assert malloc.process_start(99.0) == 42.5
    assert "SLM_PROCESS_START" not in os.environ
    assert malloc.process_start(99.0) != 99.0 or not sys.platform.startswith("linux")  # then /proc's record


def test_process_start_is_when_the_process_started():
    # bracketed by the parent's clock before the spawn and the child's first reading (the kernel's record is
    # to 10 ms)
    before = time.time()
    code = ("import time; t = time.time(); import sys; sys.path.insert(0, '.'); from slm.cli.malloc import "
            "process_start; print(process_start(), t)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    start, first = map(float, r.stdout.split())
    assert before - 0.02 <= start <= first + 0.02


def test_child_environment_gets_the_tunable_unless_the_user_chose():
    assert malloc.with_huge_pages({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert malloc.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
