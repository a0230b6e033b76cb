"""Build script for torchstruct.

Install against the torch that is already installed:

    pip install --no-build-isolation -e .

The compiled extension ``torchstruct._C`` holds the op registrations
(``csrc/ops.cpp``), the CPU kernels (``csrc/cpu``) and, when they can be built,
the CUDA kernels (``csrc/cuda``). The CUDA kernels are built when all of these
hold (``_cuda_decision``):

* torch is a CUDA build (``torch.version.cuda`` is set);
* a CUDA toolkit is found (``CUDA_HOME`` / ``CUDA_PATH``, ``nvcc`` on ``PATH``
  or ``/usr/local/cuda``) and has ``bin/nvcc`` (a runtime-only CUDA install has
  none), ``include/cuda_runtime_api.h`` and ``libcudart`` (what the build
  includes and links);
* that nvcc's major version equals the major version of ``torch.version.cuda``;
* the GPU architectures are known: ``TORCH_CUDA_ARCH_LIST`` is set, or a GPU is
  visible to detect them from.

When neither ``CUDA_HOME`` nor ``CUDA_PATH`` is set and the ``nvcc`` on ``PATH``
is a link or wrapper script outside its toolkit (``/usr/local/bin/nvcc`` running
``/usr/local/cuda-13.0/bin/nvcc``), torch would take the folder above it
(``/usr/local``) for the toolkit; the build then uses the toolkit nvcc itself
reports instead, and says so (``_nvccs_toolkit``).

Otherwise the CPU kernels are built and one line says why the CUDA kernels were
skipped and how to get them; on a GPU the ops then run on PyTorch's own
multi-tensor ops (with a warning), see ``docs/performance.md``.

Environment variables:

* ``TORCHSTRUCT_NO_EXTENSION=1``: build no extension; the package runs on the
  pure-PyTorch implementation in ``torchstruct/_reference.py``.
* ``TORCHSTRUCT_NO_CUDA=1``: build the CPU kernels only, even with CUDA.
* ``TORCH_CUDA_ARCH_LIST``: the GPU architectures to build for (e.g.
  ``"8.0;9.0"``); needed when no GPU is visible at build time.
* ``MAX_JOBS``: parallel compile jobs (read by torch's ninja build).
"""

import glob
import os
import re
import shutil
import subprocess
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


def _major(version):
    """The major version of a ``"12.4"``-style string, or None."""
    match = re.match(r"\s*(\d+)", version or "")
    return int(match.group(1)) if match else None


def _cuda_decision(torch_cuda, cuda_home, nvcc_found, nvcc_version, arch_list, gpu_visible,
                   no_cuda=False, runtime_found=True):
    """Whether to build the CUDA kernels, from the facts of this machine.

    Arguments:
        torch_cuda: ``torch.version.cuda`` (None for a CPU build of torch).
        cuda_home: the CUDA toolkit directory torch found, or None.
        nvcc_found: whether ``<cuda_home>/bin/nvcc`` exists.
        nvcc_version: that nvcc's release (``"12.4"``), or None when unknown.
        arch_list: the value of ``TORCH_CUDA_ARCH_LIST`` (None or empty: unset).
        gpu_visible: whether a CUDA device is visible (torch detects the arch from it).
        no_cuda: ``TORCHSTRUCT_NO_CUDA`` is set.
        runtime_found: whether ``cuda_home`` has the CUDA runtime's header and library
            (``_has_runtime``).

    Returns:
        ``(True, None)`` to build them, else ``(False, reason)``: one line saying
        why they are skipped and how to get them.
    """
    if no_cuda:
        return False, ("TORCHSTRUCT_NO_CUDA is set; unset it to build the CUDA kernels")
    if not torch_cuda:
        return False, ("this torch is a CPU build; install a CUDA build of torch and a "
                       "matching CUDA toolkit to build the CUDA kernels")
    if not cuda_home:
        return False, (f"no CUDA toolkit found; install CUDA {torch_cuda} (with nvcc) and set "
                       f"CUDA_HOME, then reinstall")
    if not nvcc_found:
        return False, (f"CUDA_HOME={cuda_home} has no bin/nvcc (a runtime-only CUDA); install "
                       f"the CUDA {torch_cuda} toolkit and point CUDA_HOME at it, then reinstall")
    if not runtime_found:
        return False, (f"CUDA_HOME={cuda_home} has no CUDA runtime to build against "
                       f"(include/cuda_runtime_api.h and lib64/libcudart.so); point CUDA_HOME at "
                       f"the CUDA {torch_cuda} toolkit's own folder, then reinstall")
    if _major(nvcc_version) is None:
        return False, (f"could not read the version of {os.path.join(cuda_home, 'bin', 'nvcc')}; "
                       f"point CUDA_HOME at a working CUDA {torch_cuda} toolkit, then reinstall")
    if _major(nvcc_version) != _major(torch_cuda):
        return False, (f"nvcc {nvcc_version} in {cuda_home} does not match torch's CUDA "
                       f"{torch_cuda}; point CUDA_HOME at a CUDA {_major(torch_cuda)}.x toolkit, "
                       f"then reinstall")
    if not (arch_list or "").strip() and not gpu_visible:
        return False, ("no GPU is visible to detect the architectures from; set "
                       "TORCH_CUDA_ARCH_LIST (e.g. '8.0;9.0'), then reinstall")
    return True, None


def _nvcc_version(nvcc):
    """The release of ``nvcc`` (``"12.4"``), or None."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out.stdout)
    return match.group(1) if match else None


def _has_runtime(cuda_home):
    """Whether the toolkit folder ``cuda_home`` holds the CUDA runtime's header and library,
    which torch's build includes (``<cuda_home>/include``) and links (``-lcudart`` from
    ``<cuda_home>/lib64``, or ``lib``)."""
    if not cuda_home or not os.path.isfile(os.path.join(cuda_home, "include",
                                                        "cuda_runtime_api.h")):
        return False
    if sys.platform == "win32":
        return True  # the import library's folder varies (lib/x64); the header decides
    return any(glob.glob(os.path.join(cuda_home, d, "libcudart.so*")) for d in ("lib64", "lib"))


def _toolkit_of(nvcc):
    """The toolkit folder ``nvcc`` compiles with, as it reports it (its ``TOP``, through any
    link or wrapper script), or None when it cannot say."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-E", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ TOP=(.+?)\s*$", out.stderr + "\n" + out.stdout, re.M)
    return os.path.normpath(match.group(1)) if match else None


def _nvccs_toolkit(environ, which=shutil.which):
    """The toolkit to build with when torch would guess it wrong, else None.

    With no ``CUDA_HOME`` / ``CUDA_PATH`` set, torch takes the folder above the folder of the
    ``nvcc`` on ``PATH``. When that folder has no CUDA runtime (``_has_runtime``) but the
    toolkit nvcc itself reports has one (nvcc is a link or a wrapper script), that toolkit.
    """
    if environ.get("CUDA_HOME") or environ.get("CUDA_PATH"):
        return None
    nvcc = which("nvcc")
    if nvcc is None or _has_runtime(os.path.dirname(os.path.dirname(nvcc))):
        return None
    top = _toolkit_of(nvcc)
    return top if _has_runtime(top) else None


def _cuda_facts(torch, cpp_extension):
    """The arguments of ``_cuda_decision`` for this machine."""
    cuda_home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    nvcc_found = bool(nvcc) and os.path.isfile(nvcc)
    try:
        gpu_visible = torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        gpu_visible = False
    return dict(
        torch_cuda=torch.version.cuda,
        cuda_home=cuda_home,
        nvcc_found=nvcc_found,
        nvcc_version=_nvcc_version(nvcc) if nvcc_found else None,
        arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST"),
        gpu_visible=gpu_visible,
        no_cuda=_flag("TORCHSTRUCT_NO_CUDA"),
        runtime_found=_has_runtime(cuda_home),
    )


def extensions():
    if _flag("TORCHSTRUCT_NO_EXTENSION"):
        return [], {}

    import torch

    # before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import
    top = (_nvccs_toolkit(os.environ)
           if torch.version.cuda and not _flag("TORCHSTRUCT_NO_CUDA") else None)
    if top is not None:
        os.environ["CUDA_HOME"] = top
        print(f"torchstruct: the nvcc on PATH belongs to the CUDA toolkit in {top}; CUDA_HOME "
              f"set to it", file=sys.stderr)
    from torch.utils import cpp_extension

    with_cuda, reason = _cuda_decision(**_cuda_facts(torch, cpp_extension))
    if reason is not None:
        print(f"torchstruct: building the CPU kernels only, CUDA kernels skipped: {reason}",
              file=sys.stderr)

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


# setuptools runs this file as __main__; tests import it (by path) for _cuda_decision.
if __name__ == "__main__":
    ext_modules, cmdclass = extensions()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
