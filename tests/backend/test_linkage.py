"""The build and the doctor refuse an extension that links libstdc++ statically; the installed
one does not."""

import importlib.machinery
import importlib.util
import shutil
import subprocess

import pytest

from smfree_pg import doctor
from smfree_pg.linkage import needed_libraries, static_libstdcxx_problem

SOURCE = """
#include <sstream>
#include <string>
std::string render(long value) { std::ostringstream out; out << value; return out.str(); }
"""

needs_toolchain = pytest.mark.skipif(not (shutil.which("c++") and shutil.which("readelf")),
                                     reason="needs a C++ compiler and readelf")


def build(tmp_path, name, *flags):
    source = tmp_path / "render.cpp"
    source.write_text(SOURCE)
    library = tmp_path / name
    subprocess.run(["c++", "-shared", "-fPIC", *flags, str(source), "-o", str(library)],
                   check=True, timeout=120)
    return str(library)


@needs_toolchain
def test_a_shared_libstdcxx_passes_and_a_static_one_is_refused(tmp_path):
    shared = build(tmp_path, "shared.so")
    static = build(tmp_path, "static.so", "-static-libstdc++")
    assert any(name.startswith("libstdc++.so") for name in needed_libraries(shared))
    assert static_libstdcxx_problem(shared, "c++") is None
    problem = static_libstdcxx_problem(static, "c++")
    assert problem.startswith(f"{static} does not load libstdc++.so: c++ linked libstdc++ into it "
                              "statically")
    assert "CXX=/usr/bin/g++ make install" in problem


@needs_toolchain
def test_the_installed_extension_loads_the_shared_libstdcxx():
    origin = importlib.util.find_spec("smfree_pg._C").origin
    assert static_libstdcxx_problem(origin) is None


@needs_toolchain
def test_doctor_reports_a_static_extension_without_running_it(tmp_path, monkeypatch, capsys):
    static = build(tmp_path, "static.so", "-static-libstdc++")
    monkeypatch.setattr(doctor.importlib.util, "find_spec",
                        lambda name: importlib.machinery.ModuleSpec(name, None, origin=static))
    monkeypatch.setattr(doctor, "collect", lambda: pytest.fail("the extension ran"))
    assert doctor.main([]) == 1
    assert f"{static} does not load libstdc++.so" in capsys.readouterr().err


def test_a_file_readelf_cannot_read_is_an_error(tmp_path):
    if not shutil.which("readelf"):
        pytest.skip("needs readelf")
    text = tmp_path / "not-elf.so"
    text.write_text("not an ELF file")
    with pytest.raises(RuntimeError, match=r"readelf -d .*not-elf\.so failed"):
        needed_libraries(str(text))
