"""How the built extension is linked against the C++ runtime.

torch and its libraries share one libstdc++. A compiler that links libstdc++ into the extension
statically (`-static-libstdc++`, which some toolchain wrappers add) gives the process a second
copy, and the extension's calls then mix the two: on the GPU machines such a build crashed
with SIGSEGV at its first `std::ostream` use, inside `init_process_group`. setup.py refuses such
a build (it loads this file by path) and the doctor reports one.
"""

from __future__ import annotations

import re
import subprocess

_NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]")


def needed_libraries(path: str) -> list[str]:
    """The shared libraries the ELF file at `path` names as needed, read with binutils' readelf."""
    try:
        result = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                                timeout=60)
    except FileNotFoundError as error:
        raise RuntimeError("readelf (binutils) is needed to check how smfree is linked") from error
    if result.returncode != 0:
        raise RuntimeError(f"readelf -d {path} failed: {result.stderr.strip()}")
    return _NEEDED.findall(result.stdout)


def static_libstdcxx_problem(path: str, compiler: str = "its compiler") -> str | None:
    """Why the extension at `path`, built with `compiler`, would crash; None if it is sound."""
    if any(name.startswith("libstdc++.so") for name in needed_libraries(path)):
        return None
    return (f"{path} does not load libstdc++.so: {compiler} linked libstdc++ into it statically, "
            "and mixing that second copy with torch's crashes (SIGSEGV) at the first use of "
            "std::ostream, inside init_process_group. Build with a compiler that links it as a "
            "shared library, e.g. `CXX=/usr/bin/g++ make install`")
