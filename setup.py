"""Builds smfree_pg._C against the installed torch and a UCX (the libucx-cu13 wheel, or UCX_HOME)."""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def ucx_location():
    """(include dir, lib dir) of the UCX to build against."""
    home = os.environ.get("UCX_HOME")
    if home:
        return os.path.join(home, "include"), os.path.join(home, "lib")
    try:
        import libucx
    except ImportError as error:
        raise SystemExit(
            "smfree needs UCX: `pip install libucx-cu13`, or set UCX_HOME to a UCX install"
        ) from error
    root = os.path.dirname(libucx.__file__)
    return os.path.join(root, "include"), os.path.join(root, "lib")


def sources():
    return sorted(
        os.path.relpath(path, ROOT)
        for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True)
    )


ucx_include, ucx_lib = ucx_location()

extension = CppExtension(
    name="smfree_pg._C",
    sources=sources(),
    include_dirs=[os.path.join(ROOT, "csrc"), ucx_include],
    library_dirs=[ucx_lib],
    libraries=["ucp", "ucs"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    # The UCX libraries are found where the build found them.
    extra_link_args=[f"-Wl,-rpath,{ucx_lib}"],
)

setup(
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
