"""Builds smfree_pg._C against the installed torch and a UCX (the libucx-cu13 wheel, or UCX_HOME).

The CUDA code paths are always compiled (they need only cuda.h); the driver is loaded at run
time, so the same build runs on machines without a GPU.
"""

import glob
import hashlib
import importlib.util
import os
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def ucx_location():
    """(include dir, lib dir) of the UCX to build against."""
    home = os.environ.get("UCX_HOME")
    if home:
        # lib, or where distributions put it (lib64, Debian's lib/<multiarch>).
        candidates = [os.path.join(home, "lib"), os.path.join(home, "lib64")]
        candidates += sorted(glob.glob(os.path.join(home, "lib", "*-linux-gnu")))
        for lib in candidates:
            if os.path.exists(os.path.join(lib, "libucp.so")):
                return os.path.join(home, "include"), lib
        raise SystemExit(f"UCX_HOME={home}: no libucp.so in {', '.join(candidates)}")
    try:
        import libucx
    except ImportError as error:
        raise SystemExit(
            "smfree needs UCX: `pip install libucx-cu13`, or set UCX_HOME to a UCX install"
        ) from error
    root = os.path.dirname(libucx.__file__)
    return os.path.join(root, "include"), os.path.join(root, "lib")


CUDA_HEADERS_MISSING = """smfree needs the CUDA headers (cuda.h), even for a CPU-only build: the CUDA
code paths are always compiled and the driver is loaded at run time. Install either
  - the CUDA toolkit (cuda.h in $CUDA_HOME/include or /usr/local/cuda/include), or
  - the pip package that ships them: `pip install nvidia-cuda-runtime` (CUDA 13)
    or `pip install nvidia-cuda-runtime-cu12` (CUDA 12)
and build again."""


def cuda_include():
    """cuda.h, for the driver API smfree loads at run time (nothing links against CUDA).

    From a CUDA toolkit first, else from the nvidia-cuda-runtime wheels (CUDA-enabled torch
    wheels depend on them): nvidia/cu13/include or nvidia/cuda_runtime/include.
    """
    from torch.utils.cpp_extension import CUDA_HOME

    for home in (os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda.h")):
            return os.path.join(home, "include")
    wheel_headers = pip_cuda_includes()
    if wheel_headers:
        return wheel_headers[0]
    raise SystemExit(CUDA_HEADERS_MISSING)


def pip_cuda_includes():
    """The include folders with cuda.h among the installed nvidia-* wheels, newest CUDA first."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = [
        os.path.dirname(header)
        for root in spec.submodule_search_locations
        for header in glob.glob(os.path.join(root, "*", "include", "cuda.h"))
    ]
    # nvidia/cu13 before nvidia/cuda_runtime (CUDA 12).
    return sorted(found, key=lambda path: "cu13" not in path)


def sources():
    return sorted(
        os.path.relpath(path, ROOT)
        for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True)
    )


def load_linkage():
    """python/smfree_pg/linkage.py, loaded by path: the package is not on the build's path."""
    path = os.path.join(ROOT, "python", "smfree_pg", "linkage.py")
    spec = importlib.util.spec_from_file_location("smfree_linkage", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Build(BuildExtension.with_options(use_ninja=True)):
    """Keeps its objects between builds, and refuses an extension that would crash when it runs
    (linkage.py says why)."""

    def finalize_options(self):
        super().finalize_options()
        # `pip install -e .` builds in a new temporary folder each time, which recompiles every
        # source. One folder per Python environment under build/ lets ninja recompile only the
        # sources that changed (it also recompiles those whose flags changed, e.g. UCX_HOME).
        environment = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
        self.build_temp = os.path.join(ROOT, "build", "objects", environment)

    def build_extension(self, ext):
        super().build_extension(ext)
        path = self.get_ext_fullpath(ext.name)
        try:
            problem = load_linkage().static_libstdcxx_problem(path, os.environ.get("CXX", "c++"))
        except RuntimeError as error:
            print(f"smfree: the extension's linkage was not checked: {error}", file=sys.stderr)
            return
        if problem:
            os.remove(path)
            raise SystemExit(problem)


def record_torch_version():
    """python/smfree_pg/_built_with.py: the torch this build binds, which smfree_pg checks before
    it loads the extension (_registration.check_torch_version)."""
    path = os.path.join(ROOT, "python", "smfree_pg", "_built_with.py")
    text = (
        '"""Written by setup.py: the torch smfree_pg._C was built against."""\n\n'
        f"TORCH_VERSION = {str(torch.__version__)!r}\n"
    )
    with open(path, "w") as out:
        out.write(text)


ucx_include, ucx_lib = ucx_location()
record_torch_version()

extension = CppExtension(
    name="smfree_pg._C",
    sources=sources(),
    include_dirs=[os.path.join(ROOT, "csrc"), ucx_include, cuda_include()],
    library_dirs=[ucx_lib],
    libraries=["ucp", "ucs"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    # The UCX libraries are found where the build found them.
    extra_link_args=[f"-Wl,-rpath,{ucx_lib}"],
)

setup(
    ext_modules=[extension],
    cmdclass={"build_ext": Build},
)
