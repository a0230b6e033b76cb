"""setup.py's choice of building the CUDA kernels (``_cuda_decision``), tested on its facts."""
import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_setup():
    path = os.path.join(REPO, "setup.py")
    spec = importlib.util.spec_from_file_location("torchstruct_setup", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the functions, builds nothing
    return module


setup_py = _load_setup()

HAPPY = dict(torch_cuda="12.4", cuda_home="/usr/local/cuda", nvcc_found=True,
             nvcc_version="12.6", arch_list=None, gpu_visible=True, no_cuda=False,
             runtime_found=True)


def decide(**changes):
    return setup_py._cuda_decision(**{**HAPPY, **changes})


def test_happy_path_with_a_visible_gpu():
    assert decide() == (True, None)


def test_happy_path_with_an_arch_list_and_no_gpu():
    assert decide(gpu_visible=False, arch_list="8.0;9.0") == (True, None)


def test_runtime_only_cuda_without_nvcc():
    build, reason = decide(nvcc_found=False, nvcc_version=None)
    assert not build
    assert "/usr/local/cuda has no bin/nvcc" in reason and "CUDA_HOME" in reason


def test_nvcc_major_differs_from_torch():
    build, reason = decide(nvcc_version="13.0")
    assert not build
    assert "nvcc 13.0" in reason and "torch's CUDA 12.4" in reason and "12.x" in reason


def test_no_gpu_and_no_arch_list():
    for arch_list in (None, "", "  "):
        build, reason = decide(gpu_visible=False, arch_list=arch_list)
        assert not build
        assert "TORCH_CUDA_ARCH_LIST" in reason


def test_no_cuda_env():
    build, reason = decide(no_cuda=True)
    assert not build and "TORCHSTRUCT_NO_CUDA" in reason


def test_cpu_torch_and_no_toolkit():
    build, reason = decide(torch_cuda=None)
    assert not build and "CPU build" in reason
    build, reason = decide(cuda_home=None, nvcc_found=False, nvcc_version=None)
    assert not build and "no CUDA toolkit" in reason


def test_unreadable_nvcc_version():
    build, reason = decide(nvcc_version=None)
    assert not build and "version" in reason


@pytest.mark.parametrize("version, major", [("12.4", 12), ("13.0", 13), ("11", 11), (None, None),
                                            ("", None), ("abc", None)])
def test_major(version, major):
    assert setup_py._major(version) == major


def test_a_toolkit_folder_without_the_runtime():
    """nvcc found, but no header or library to build against (torch took /usr/local for the
    toolkit, from a wrapper script in /usr/local/bin): the CPU kernels, not a failed link."""
    build, reason = decide(cuda_home="/usr/local", runtime_found=False)
    assert not build
    assert "CUDA_HOME=/usr/local has no CUDA runtime" in reason
    assert "cuda_runtime_api.h" in reason and "libcudart" in reason and "12.4" in reason


def test_every_reason_is_one_line():
    cases = [dict(no_cuda=True), dict(torch_cuda=None), dict(cuda_home=None),
             dict(nvcc_found=False), dict(nvcc_version=None), dict(nvcc_version="11.8"),
             dict(gpu_visible=False), dict(runtime_found=False)]
    for case in cases:
        build, reason = decide(**case)
        assert not build and reason and "\n" not in reason


def test_facts_of_this_machine_and_the_printed_line(tmp_path):
    """Run the real detection (torch, CUDA_HOME, nvcc) of this machine on a runtime-only
    CUDA directory: it decides not to build and says why in one line."""
    (tmp_path / "lib64").mkdir()
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {os.path.join(REPO, 'setup.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "import torch\n"
        "from torch.utils import cpp_extension\n"
        f"cpp_extension.CUDA_HOME = {str(tmp_path)!r}\n"
        "facts = m._cuda_facts(torch, cpp_extension)\n"
        "assert facts['nvcc_found'] is False and facts['nvcc_version'] is None, facts\n"
        "print(m._cuda_decision(**facts)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_setup_py_still_runs_as_a_script():
    env = dict(os.environ, TORCHSTRUCT_NO_EXTENSION="1")
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "torchstruct"


def test_extensions_print_one_line_when_cuda_is_skipped():
    """On this machine (a CPU torch, or TORCHSTRUCT_NO_CUDA) the extension is the CPU one and
    setup.py prints exactly one line saying why."""
    code = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('s', {os.path.join(REPO, 'setup.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "ext, cmd = m.extensions()\n"
        "print(sorted({s.rsplit('.', 1)[-1] for s in ext[0].sources}))\n"
    )
    env = dict(os.environ, TORCHSTRUCT_NO_CUDA="1")
    env.pop("TORCHSTRUCT_NO_EXTENSION", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['cpp']"
    lines = [line for line in out.stderr.splitlines() if line.startswith("torchstruct:")]
    assert len(lines) == 1 and "CUDA kernels skipped" in lines[0]
    assert "TORCHSTRUCT_NO_CUDA" in lines[0]


def _nvcc():
    import shutil

    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    candidates.append(shutil.which("nvcc") or "")
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def test_cuda_launch_tables_on_the_host(tmp_path):
    """The CUDA kernels' chunk tables (passed as kernel arguments, csrc/cuda/multi_tensor.cuh)
    cover every chunk once, within the table sizes: host code, built with nvcc, no GPU."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    exe = tmp_path / "multi_tensor_host"
    build = subprocess.run(
        [nvcc, "-std=c++20", "-O1", "-I", os.path.join(REPO, "csrc"),
         "-I", os.path.join(torch_dir, "include"),
         os.path.join(REPO, "csrc", "tests", "multi_tensor_host.cu"),
         "-L", os.path.join(torch_dir, "lib"), "-lc10",
         f"-Xlinker=-rpath={os.path.join(torch_dir, 'lib')}", "-o", str(exe)],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr


def test_cuda_kernels_compile_for_hopper(tmp_path):
    """Every CUDA source compiles (device code for sm_90, host code) with the nvcc found and the
    installed torch's headers, as the extension's CUDA build compiles it: no GPU needed, so a
    compile error is caught before a GPU machine is at hand. A CPU build of torch ships the
    c10/cuda headers but not the one header its CUDA build generates
    (``c10/cuda/impl/cuda_cmake_macros.h``); that one is written here as a CUDA build writes it."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    import glob
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    includes = [os.path.join(REPO, "csrc"), *cpp_extension.include_paths(),
                sysconfig.get_paths()["include"]]
    generated = os.path.join("c10", "cuda", "impl", "cuda_cmake_macros.h")
    if not any(os.path.isfile(os.path.join(d, generated)) for d in includes):
        stub = tmp_path / "include" / generated
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path / "include"))
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    flags = ["-std=c++20", "-O1", "-c", "-Xcompiler", "-fPIC",
             "-gencode", "arch=compute_90,code=sm_90", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             "-DTORCH_EXTENSION_NAME=_C", "-DTORCHSTRUCT_WITH_CUDA",
             *cpp_extension.COMMON_NVCC_FLAGS, *(f"-I{d}" for d in includes)]
    sources = sorted(glob.glob(os.path.join(REPO, "csrc", "cuda", "*.cu")))
    assert sources, "no CUDA sources found"
    builds = {src: subprocess.Popen([nvcc, *flags, src, "-o", str(tmp_path / (os.path.basename(src) + ".o"))],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for src in sources}
    failed = {}
    for src, proc in builds.items():
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            failed[os.path.basename(src)] = "\n".join(
                line for line in out.splitlines() if "error" in line)[-3000:] or out[-3000:]
    assert not failed, failed
    for src in sources:
        assert (tmp_path / (os.path.basename(src) + ".o")).stat().st_size > 0


# ------------------------------------------------------------------ which toolkit nvcc belongs to
def _toolkit(root, header=True, lib="lib64"):
    """A fake CUDA toolkit folder: bin/nvcc, and the runtime's header and library if asked."""
    (root / "bin").mkdir(parents=True)
    if header:
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime_api.h").write_text("")
    if lib:
        (root / lib).mkdir()
        (root / lib / "libcudart.so.13").write_text("")
    return root


def _script(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text + "\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("header, lib, expected", [
    (True, "lib64", True), (True, "lib", True), (True, None, False), (False, "lib64", False)])
def test_has_runtime(tmp_path, header, lib, expected):
    assert setup_py._has_runtime(str(_toolkit(tmp_path / "cuda", header, lib))) is expected


def test_has_runtime_of_no_folder(tmp_path):
    assert setup_py._has_runtime(None) is False
    assert setup_py._has_runtime(str(tmp_path / "missing")) is False


@pytest.mark.skipif(sys.platform == "win32", reason="shell scripts stand in for nvcc")
def test_toolkit_of_reads_what_nvcc_reports(tmp_path):
    top = tmp_path / "cuda-13.0"
    nvcc = _script(tmp_path / "bin" / "nvcc", f"echo '#$ _NVVM_BRANCH_=nvvm' >&2\n"
                                              f"echo '#$ TOP={top}/bin/..' >&2")
    assert setup_py._toolkit_of(nvcc) == str(top)
    silent = _script(tmp_path / "other" / "nvcc", "exit 1")
    assert setup_py._toolkit_of(silent) is None
    assert setup_py._toolkit_of(str(tmp_path / "no-such-nvcc")) is None


@pytest.mark.skipif(sys.platform == "win32", reason="shell scripts stand in for nvcc")
def test_a_wrapper_nvcc_points_the_build_at_its_own_toolkit(tmp_path):
    """/usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc: torch would take /usr/local
    for the toolkit and the link would fail (no libcudart there); nvcc's own toolkit is used."""
    real = _toolkit(tmp_path / "cuda-13.0")
    wrapper = _script(tmp_path / "local" / "bin" / "nvcc", f"echo '#$ TOP={real}/bin/..' >&2")

    def which(name):
        return wrapper if name == "nvcc" else None

    assert setup_py._nvccs_toolkit({}, which) == str(real)
    # a folder chosen by the user is theirs
    assert setup_py._nvccs_toolkit({"CUDA_HOME": "/opt/cuda"}, which) is None
    assert setup_py._nvccs_toolkit({"CUDA_PATH": "/opt/cuda"}, which) is None
    # no nvcc on PATH: torch's own guess (/usr/local/cuda) stands
    assert setup_py._nvccs_toolkit({}, lambda name: None) is None


@pytest.mark.skipif(sys.platform == "win32", reason="shell scripts stand in for nvcc")
def test_an_nvcc_inside_a_whole_toolkit_or_beside_none_is_left_alone(tmp_path):
    whole = _toolkit(tmp_path / "cuda")
    inside = _script(whole / "bin" / "nvcc", "echo '#$ TOP=/elsewhere/bin/..' >&2")
    assert setup_py._nvccs_toolkit({}, lambda name: inside) is None  # torch's guess is right
    broken = _toolkit(tmp_path / "broken", header=False, lib=None)
    wrapper = _script(tmp_path / "local" / "bin" / "nvcc", f"echo '#$ TOP={broken}/bin/..' >&2")
    # nvcc's own toolkit has no runtime either: nothing better to offer, the decision says why
    assert setup_py._nvccs_toolkit({}, lambda name: wrapper) is None


def test_the_nvcc_of_this_machine_reports_a_whole_toolkit():
    import shutil

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    top = setup_py._toolkit_of(nvcc)
    assert top is not None and os.path.isfile(os.path.join(top, "bin", "nvcc"))
    assert setup_py._has_runtime(top)
