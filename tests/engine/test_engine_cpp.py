"""Builds the engine's plain C++ tests (no torch, no UCX) into one binary and runs them: one
.cpp per engine component in this folder, main.cpp runs what they register."""

import concurrent.futures
import glob
import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCES = ["Matcher.cpp", "Wire.cpp", "TensorDesc.cpp", "Op.cpp", "GroupConfig.cpp", "Log.cpp",
           "Config.cpp", "Spin.cpp", "PeerAddress.cpp",
           "cuda/FlagSegment.cpp", "cuda/CudaDriver.cpp", "cuda/Capture.cpp", "cuda/IpcExport.cpp",
           "cuda/IpcCache.cpp", "cuda/DeviceMemory.cpp", "cuda/Event.cpp", "cuda/Stream.cpp",
           "cuda/StreamMemoryOps.cpp", "cuda/Copies.cpp", "cuda/LocalCopies.cpp",
           "cuda/Bounce.cpp",
           "cuda/PinnedMemory.cpp", "channels/copy_engine/StagingRing.cpp",
           "channels/copy_engine/RingMemory.cpp", "channels/copy_engine/ChannelData.cpp",
           "channels/copy_engine/EagerLanes.cpp", "channels/copy_engine/CollectiveRecords.cpp",
           "channels/copy_engine/CopyEngineContext.cpp",
           "channels/copy_engine/DirectProtocol.cpp", "channels/copy_engine/StagedProtocol.cpp",
           "channels/copy_engine/EagerProtocol.cpp", "channels/copy_engine/CollectiveLanes.cpp",
           "channels/copy_engine/CollectiveProtocol.cpp",
           "channels/captured/GraphWait.cpp",
           "channels/captured/CapturedAnnouncement.cpp",
           "channels/captured/PostedRecvs.cpp", "CudaOps.cpp",
           "channels/loopback/LoopbackPairing.cpp",
           "OpControl.cpp", "ProgressLoop.cpp", "ProgressThread.cpp", "Channel.cpp", "Peer.cpp",
           "ProcessWatch.cpp", "Failures.cpp"]


def cuda_include():
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda.h")):
            return os.path.join(home, "include")
    pytest.skip("no cuda.h (set CUDA_HOME)")


# Mutated inputs per parser in fuzz_tests.cpp: the plain run's few catch a parser that stopped
# refusing; the sanitizers' run is the fuzzing itself.
PLAIN_FUZZ_INPUTS = 20_000
# A million per parser, all 11 parsers, ran clean under the sanitizers on a 2-core machine (92
# tests passed, 0 findings, 129 s of wall clock); CI runs fewer, from the same seed, to keep the
# test near two minutes with its build.
SANITIZED_FUZZ_INPUTS = 100_000
SANITIZERS = ["-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
              "-fno-omit-frame-pointer"]


def build(tmp_path, name, flags):
    """Compiles each source on its own, as many at once as there are CPUs, then links."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        pytest.skip("no C++ compiler")
    binary = tmp_path / name
    sources = sorted(glob.glob(os.path.join(HERE, "*.cpp")))
    sources += [os.path.join(ROOT, "csrc", "engine", source) for source in SOURCES]
    objects = tmp_path / f"{name}.objects"
    objects.mkdir()
    # Unused parameters allowed, as in the extension's build: Channel.h's default members have them.
    base = [compiler, "-std=c++17", "-O1", *flags, "-Wall", "-Wextra", "-Wno-unused-parameter",
            "-Werror",
            "-I", os.path.join(ROOT, "csrc"), "-I", cuda_include()]

    def compile_one(index_source):
        index, source = index_source
        target = objects / f"{index}.o"
        subprocess.run([*base, "-c", source, "-o", str(target)], check=True, timeout=600)
        return str(target)

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        compiled = list(pool.map(compile_one, enumerate(sources)))
    subprocess.run([compiler, *flags, *compiled, "-o", str(binary), "-ldl", "-pthread"],
                   check=True, timeout=300)
    return binary


def run(binary, fuzz_inputs, timeout, env=None):
    result = subprocess.run([str(binary), "--fuzz-inputs", str(fuzz_inputs)], capture_output=True,
                            text=True, timeout=timeout, env=env)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].endswith(" 0 failed")
    return result


def test_engine_unit_tests(tmp_path):
    run(build(tmp_path, "engine_tests", []), PLAIN_FUZZ_INPUTS, timeout=120)


def test_engine_unit_tests_under_sanitizers(tmp_path):
    """The same tests built with AddressSanitizer and UBSan, any report fatal: a read past a
    peer's record, or undefined behaviour on a fuzzed value, fails the run."""
    binary = build(tmp_path, "engine_tests_sanitized", SANITIZERS)
    env = dict(os.environ, ASAN_OPTIONS="abort_on_error=1:detect_leaks=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    result = run(binary, SANITIZED_FUZZ_INPUTS, timeout=600, env=env)
    fuzzed = [line for line in result.stdout.splitlines() if line.strip().startswith("fuzz ")]
    assert len(fuzzed) == 11 and all(" 0 findings" in line for line in fuzzed), result.stdout
