"""Build script for torchstruct.

Install against the torch that is already installed:

    pip install --no-build-isolation -e .

The compiled extension ``torchstruct._C`` holds the op registrations
(``csrc/ops.cpp``), the CPU kernels (``csrc/cpu``) and, when torch was built
with CUDA and a CUDA toolkit is found, the CUDA kernels (``csrc/cuda``).

Environment variables:

* ``TORCHSTRUCT_NO_EXTENSION=1``: build no extension; the package runs on the
  pure-PyTorch implementation in ``torchstruct/_reference.py``.
* ``TORCHSTRUCT_NO_CUDA=1``: build the CPU kernels only, even with CUDA.
* ``MAX_JOBS``: parallel compile jobs (read by torch's ninja build).
"""

import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _sources(pattern):
    # Relative paths: setuptools rejects absolute source paths in some versions.
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _uses_openmp(torch):
    # at::parallel_for is a header template: with torch's OpenMP backend it only
    # runs in parallel when the extension itself is compiled with OpenMP.
    try:
        info = torch.__config__.parallel_info()
    except Exception:
        return False
    return "parallel backend: OpenMP" in info and sys.platform.startswith("linux")


def extensions():
    if _flag("TORCHSTRUCT_NO_EXTENSION"):
        return [], {}

    import torch
    from torch.utils import cpp_extension

    with_cuda = (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and not _flag("TORCHSTRUCT_NO_CUDA")
    )

    sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")
    # No -std flag: BuildExtension adds the standard this torch was built with.
    cxx = ["-O3"]
    link = []
    if _uses_openmp(torch):
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    define_macros = []
    extra_compile_args = {"cxx": cxx}

    if with_cuda:
        sources += _sources("csrc/cuda/*.cu")
        define_macros.append(("TORCHSTRUCT_WITH_CUDA", None))
        extra_compile_args["nvcc"] = ["-O3", "--expt-relaxed-constexpr"]
        ext_cls = cpp_extension.CUDAExtension
    else:
        ext_cls = cpp_extension.CppExtension

    ext = ext_cls(
        name="torchstruct._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define_macros,
        extra_compile_args=extra_compile_args,
        extra_link_args=link,
    )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True)
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = extensions()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
