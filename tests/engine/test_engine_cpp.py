"""Builds the engine's plain C++ tests (no torch, no UCX) into one binary and runs them: one
.cpp per engine component in this folder, main.cpp runs what they register."""

import glob
import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCES = ["Matcher.cpp", "Wire.cpp", "TensorDesc.cpp", "Op.cpp", "Log.cpp", "Config.cpp", "Spin.cpp",
           "cuda/FlagSegment.cpp", "cuda/CudaDriver.cpp", "cuda/Capture.cpp", "cuda/IpcExport.cpp",
           "cuda/IpcCache.cpp", "cuda/DeviceMemory.cpp", "cuda/Event.cpp", "cuda/Stream.cpp",
           "cuda/StreamMemoryOps.cpp", "cuda/Copies.cpp", "cuda/Bounce.cpp",
           "cuda/PinnedMemory.cpp", "channels/copy_engine/StagingRing.cpp",
           "channels/copy_engine/RingMemory.cpp", "channels/copy_engine/ChannelData.cpp",
           "channels/copy_engine/EagerLanes.cpp", "channels/copy_engine/CollectiveRecords.cpp",
           "channels/captured/GraphWait.cpp",
           "channels/captured/CapturedAnnouncement.cpp",
           "channels/captured/PostedRecvs.cpp"]


def cuda_include():
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda.h")):
            return os.path.join(home, "include")
    pytest.skip("no cuda.h (set CUDA_HOME)")


def test_engine_unit_tests(tmp_path):
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        pytest.skip("no C++ compiler")
    binary = tmp_path / "engine_tests"
    tests = sorted(glob.glob(os.path.join(HERE, "*.cpp")))
    command = [compiler, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror",
               "-I", os.path.join(ROOT, "csrc"), "-I", cuda_include(), *tests,
               *[os.path.join(ROOT, "csrc", "engine", source) for source in SOURCES],
               "-o", str(binary), "-ldl", "-pthread"]
    subprocess.run(command, check=True, timeout=300)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].endswith(" 0 failed")
