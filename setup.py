"""`pip install .` for the Python module `eplb`: setuptools drives the project's CMake build of
the extension (target eplb_python) and packages it with the pure-Python files of python/eplb.

Needs only what the Debian packages give (python3-setuptools, python3-wheel, pybind11-dev,
python3-dev, python3-numpy, cmake and the C++ dependencies of the library), so it works offline:

    pip install .                 # with Debian's pip, inside a venv (--system-site-packages)
    python3 setup.py bdist_wheel  # a wheel in dist/

There is deliberately no pyproject.toml: with one, pip builds in an isolated environment and
would have to download setuptools. Extra CMake arguments: EPLB_CMAKE_ARGS="-D... -D...".
"""

import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def project_version():
    """The version of the CMake project (one place to change it)."""
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("project(eplb") and "VERSION" in line:
                return line.split("VERSION", 1)[1].split()[0].rstrip(")")
    return "0.0.0"


class CMakeExtension(Extension):
    def __init__(self, name, target):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    """Configures the project with only what the module needs and builds its one target."""

    def build_extension(self, ext):
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        config = "Debug" if self.debug else "Release"
        args = [
            f"-DCMAKE_BUILD_TYPE={config}",
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DEPLB_WITH_PYTHON=ON",
            "-DEPLB_BUILD_TESTS=OFF",
            "-DEPLB_BUILD_BENCHMARKS=OFF",
            "-DEPLB_WITH_UCX=OFF",
            "-DEPLB_WITH_GLOO=OFF",
            "-DEPLB_WITH_MPI=OFF",
        ] + shlex.split(os.environ.get("EPLB_CMAKE_ARGS", ""))
        subprocess.run(["cmake", "-S", ROOT, "-B", build_dir] + args, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", build_dir, "--target", ext.target, "--config",
                        config, "-j", jobs], check=True)

        # The build tree's package folder holds the extension under its ABI-tagged name.
        built = os.path.join(build_dir, "python", "eplb")
        name = next((f for f in os.listdir(built) if f.startswith("_eplb") and f.endswith(".so")),
                    None)
        if name is None:
            raise RuntimeError(f"the CMake build produced no _eplb extension in {built}")
        destination = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        shutil.copyfile(os.path.join(built, name), destination)


setup(
    name="eplb",
    version=project_version(),
    description="Expert-parallel load balancer for Mixture-of-Experts inference",
    packages=["eplb", "eplb.integrations"],
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("eplb._eplb", target="eplb_python")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["numpy"],
    python_requires=">=3.8",
    zip_safe=False,
)
