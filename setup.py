"""Build the compiled core. Everything else (metadata, extras, tools) lives in pyproject.toml.

Environment switches:
  ZEPHON_CYTHON_DEBUG=1  bounds/wraparound/initialized checks on, -O0 -g
  ZEPHON_SANITIZE=1      build with AddressSanitizer and UBSan
  ZEPHON_ONLY=a,b        build only these kernel modules (faster edit-compile loops)
  ZEPHON_NO_EXTENSIONS=1 install without the kernels (the Makefile's pip installs use it: its
                         build step compiles them in place, once, instead of every install)
"""

import os
import sys
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
DEBUG = os.environ.get("ZEPHON_CYTHON_DEBUG") == "1"
SANITIZE = os.environ.get("ZEPHON_SANITIZE") == "1"
ONLY = {name for name in os.environ.get("ZEPHON_ONLY", "").split(",") if name}
NO_EXTENSIONS = os.environ.get("ZEPHON_NO_EXTENSIONS") == "1"

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "binding": True,
    "embedsignature": True,
}

compile_args: list[str] = []
link_args: list[str] = []
if sys.platform != "win32":
    compile_args += ["-O0", "-g"] if DEBUG else ["-O3"]
    if SANITIZE:
        compile_args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
        link_args += ["-fsanitize=address,undefined"]

extensions = [
    Extension(
        f"zephon._core.{pyx.stem}",
        [str(pyx.relative_to(HERE))],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
    for pyx in sorted((HERE / "zephon" / "_core").glob("*.pyx"))
    if not ONLY or pyx.stem in ONLY
]


class ParallelBuildExt(build_ext):
    """Compiles the extensions on every CPU unless ``--parallel`` says otherwise: every pip install
    of the project builds them, and on two cores that takes half the time."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1


setup(
    ext_modules=[]
    if NO_EXTENSIONS
    else cythonize(extensions, compiler_directives=directives, nthreads=0),
    cmdclass={"build_ext": ParallelBuildExt},
)
