"""What `pip install .` declares, read from setuptools' metadata without building anything: the
engines' plugin entry points, the standard build system, and the backends it asks CMake for. The
build itself is the `packaging` ctest label (tests/CMakeLists.txt)."""

import configparser
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_entry_points_of_both_engines(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "-q", "egg_info",
                    "--egg-base", str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    info = next(tmp_path.glob("*.egg-info"))
    points = configparser.ConfigParser()
    points.read(info / "entry_points.txt")
    assert points["vllm.general_plugins"]["eplb"] == "eplb.integrations.vllm:plugin"
    assert points["sglang.srt.plugins"]["eplb"] == "eplb.integrations.sglang:plugin"


def test_standard_build_and_backends_where_found():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert 'build-backend = "setuptools.build_meta"' in text
    setup = open(os.path.join(ROOT, "setup.py")).read()
    for backend in ("UCX", "GLOO", "MPI"):
        assert f'"-DEPLB_WITH_{backend}=AUTO"' in setup
