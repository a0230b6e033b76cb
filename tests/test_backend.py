"""Backend selection: torchstruct._ops.backend(), use_backend, TORCHSTRUCT_BACKEND."""
import os
import subprocess
import sys

import pytest
import torch

from torchstruct import _ops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code, **env):
    full_env = dict(os.environ)
    full_env.pop("TORCHSTRUCT_BACKEND", None)
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_backend_value():
    assert _ops.backend() in ("compiled", "fallback", "reference")
    if os.environ.get("TORCHSTRUCT_BACKEND", "") not in ("reference", "fallback"):
        assert _ops.backend() == ("compiled" if _ops.compiled_available() else "reference")


def test_compiled_device_types():
    types = _ops.compiled_device_types()
    if _ops.compiled_available():
        assert "cpu" in types
        assert set(types) <= {"cpu", "cuda"}
    else:
        assert types == ()


def test_require_compiled_env():
    if os.environ.get("TORCHSTRUCT_REQUIRE_COMPILED", "0") == "1":
        assert _ops.compiled_available(), f"extension missing: {_ops._C_IMPORT_ERROR}"


def test_use_backend_switches_and_restores():
    before = _ops.backend()
    with _ops.use_backend("reference"):
        assert _ops.backend() == "reference"
    assert _ops.backend() == before


def test_use_backend_restores_on_error():
    before = _ops.backend()
    with pytest.raises(KeyError):
        with _ops.use_backend("reference"):
            raise KeyError("boom")
    assert _ops.backend() == before


def test_use_backend_nests():
    before = _ops.backend()
    with _ops.use_backend("reference"):
        if _ops.compiled_available():
            with _ops.use_backend("compiled"):
                assert _ops.backend() == "compiled"
        assert _ops.backend() == "reference"
    assert _ops.backend() == before


def test_use_backend_fallback_without_the_extension_too():
    before = _ops.backend()
    with _ops.use_backend("fallback"):
        assert _ops.backend() == "fallback"
        assert _ops.global_norm([torch.tensor([3.0, 4.0])]).item() == 5.0
    assert _ops.backend() == before


def test_backend_of_a_device():
    with _ops.use_backend("reference"):
        assert _ops.backend("cpu") == "reference"
    with _ops.use_backend("fallback"):
        assert _ops.backend("cpu") == "fallback"
    if _ops.compiled_available():
        with _ops.use_backend("compiled"):
            assert _ops.backend("cpu") == "compiled"
            assert _ops.backend("cuda") == (
                "compiled" if "cuda" in _ops.compiled_device_types() else "fallback")


def test_use_backend_rejects_unknown_name():
    with pytest.raises(ValueError, match="backend"):
        with _ops.use_backend("fast"):
            pass


def test_use_compiled_without_extension_raises():
    if _ops.compiled_available():
        pytest.skip("extension is built")
    with pytest.raises(RuntimeError, match="not available"):
        with _ops.use_backend("compiled"):
            pass


def test_backend_in_fixture(backend):
    assert _ops.backend() == backend


def test_env_forces_reference():
    code = (
        "from torchstruct import _ops\n"
        "import torch\n"
        "print(_ops.backend(), _ops.global_norm([torch.tensor([3.0, 4.0])]).item())"
    )
    assert _run(code, TORCHSTRUCT_BACKEND="reference") == "reference 5.0"


def test_env_default_picks_compiled_when_built():
    code = "from torchstruct import _ops\nprint(_ops.backend(), _ops.compiled_available())"
    name, available = _run(code).split()
    assert name == ("compiled" if available == "True" else "reference")
    assert available == str(_ops.compiled_available())


def test_env_forced_reference_never_calls_the_op():
    if not _ops.compiled_available():
        pytest.skip("extension is not built")
    # With the reference forced, the compiled op is still registered but unused.
    code = (
        "import torch\n"
        "from torchstruct import _ops, _reference\n"
        "calls = []\n"
        "real = _reference.global_norm\n"
        "_reference.global_norm = lambda t, p: calls.append(1) or real(t, p)\n"
        "_ops.global_norm([torch.ones(3)], 2.0)\n"
        "print(len(calls), hasattr(torch.ops.torchstruct, 'global_norm'))"
    )
    assert _run(code, TORCHSTRUCT_BACKEND="reference") == "1 True"


def test_public_backend_is_the_seam():
    import torchstruct

    assert torchstruct.backend() == _ops.backend()
    with _ops.use_backend("reference"):
        assert torchstruct.backend() == "reference"
