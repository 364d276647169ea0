"""pytest configuration: report how many modules this test process compiled; fixtures shared by
several test files."""

import sys

import pytest


@pytest.fixture(scope="session")
def ragged_module():
    """``common.ragged_modules``' getter, shared by the session (each key compiles once)."""
    from common import ragged_modules

    return ragged_modules()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    mod = sys.modules.get("fmha_iree")
    if mod is None or not hasattr(mod, "cache_stats"):
        return
    try:
        stats = mod.cache_stats()
    except Exception as e:  # pragma: no cover - diagnostics only
        terminalreporter.write_line(f"fmha_iree.cache_stats() failed: {e!r}")
        return
    terminalreporter.write_sep("-", "fmha_iree cache")
    terminalreporter.write_line(f"cache_stats(): {stats}")
