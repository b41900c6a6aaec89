"""An extension built against another torch is refused at load with both versions named and the
command that rebuilds it, instead of pybind11's "referenced unknown base type"."""

import pytest
import torch

from smfree_pg import _registration
from smfree_pg._registration import check_torch_version


def test_the_same_torch_passes():
    assert check_torch_version("2.13.0+cpu", "2.13.0+cpu") is None


def test_another_torch_names_both_versions_and_the_rebuild():
    problem = check_torch_version("2.11.0+cu130", "2.13.0+cpu")
    assert "built against torch 2.11.0+cu130" in problem
    assert "runs torch 2.13.0+cpu" in problem
    assert "pip install --no-build-isolation -e ." in problem and "make install" in problem


def test_an_extension_that_records_no_version_is_rebuilt():
    problem = check_torch_version(None, "2.13.0+cpu")
    assert "records no torch version" in problem and "make install" in problem


def test_the_built_extension_records_the_running_torch():
    from smfree_pg._built_with import TORCH_VERSION

    assert TORCH_VERSION == torch.__version__
    assert _registration.extension().SmFreeBackend is not None


def test_loading_under_another_torch_raises_before_binding(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.raises(ImportError, match=r"built against torch .* runs torch 2\.99\.0"):
        _registration.extension()
