"""`pip install .` for the Python module `eplb`: setuptools drives the project's CMake build of
the extension (target eplb_python) and packages it with the pure-Python files of python/eplb.

Two ways, the same result:

    pip install .                       # pyproject.toml: pip's isolated build fetches setuptools,
                                        # wheel, pybind11 and numpy from the package index
    pip install --no-build-isolation .  # offline, from Debian's packages (python3-setuptools,
                                        # python3-wheel, pybind11-dev, python3-numpy), e.g. in a
                                        # venv made with --system-site-packages
    python3 setup.py bdist_wheel        # a wheel in dist/

Either way the C++ libraries come from the system (scripts/install-deps.sh installs them), and
the control and data planes for more than one machine (gloo, MPI, UCX) are built wherever their
Debian packages are installed (EPLB_WITH_*=AUTO; `eplb.control_backends()` and
`eplb.transport_backends()` say what a build has). Extra CMake arguments:
EPLB_CMAKE_ARGS="-D... -D...".

The package declares the engines' plugin entry points, ``vllm.general_plugins`` and
``sglang.srt.plugins``, which do nothing unless EPLB_VLLM_POLICY / EPLB_SGLANG_POLICY is set
(docs/integrations.md).
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


def pybind11_hint():
    """Where pybind11's CMake files are when the building interpreter has the pybind11 package
    (pip's isolated build environment); Debian's pybind11-dev is found without a hint."""
    try:
        import pybind11
    except ImportError:
        return []
    return [f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"]


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
            "-DEPLB_WITH_UCX=AUTO",
            "-DEPLB_WITH_GLOO=AUTO",
            "-DEPLB_WITH_MPI=AUTO",
        ] + pybind11_hint() + shlex.split(os.environ.get("EPLB_CMAKE_ARGS", ""))
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
    # vLLM and SGLang run their plugins in every process they start; eplb's put its placement
    # behind the engine only when EPLB_VLLM_POLICY / EPLB_SGLANG_POLICY ask for it.
    entry_points={"vllm.general_plugins": ["eplb = eplb.integrations.vllm:plugin"],
                  "sglang.srt.plugins": ["eplb = eplb.integrations.sglang:plugin"]},
    python_requires=">=3.8",
    zip_safe=False,
)
