import os
import sys

import pytest

# The harness and the rank-side helpers live here; ranks import the test modules from here too.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hosts  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "multihost: emulated hosts in network namespaces (needs root; skipped "
        "elsewhere, saying why)")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    mine = [item for item in items if str(item.fspath).startswith(here)]
    for item in mine:
        item.add_marker(pytest.mark.multihost)
    reason = hosts.unavailable() if mine else None
    if reason:
        skip = pytest.mark.skip(reason=f"no namespace hosts here: {reason}")
        for item in mine:
            item.add_marker(skip)
