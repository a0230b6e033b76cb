"""Shared pytest fixtures and markers for the torchstruct test-suite."""
import os

import pytest
import torch
from hypothesis import settings

from torchstruct import _ops

# CI runs the property tests on a fixed sequence of examples (a red CI must mean a real
# regression); elsewhere every run draws new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped when none is available)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="CUDA is not available")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # not item.keywords: it holds path names
            item.add_marker(skip_cuda)


def _require_compiled() -> bool:
    return os.environ.get("TORCHSTRUCT_REQUIRE_COMPILED", "0") == "1"


@pytest.fixture(params=["compiled", "fallback", "reference"])
def backend(request):
    """Run the test once per backend, with ``_ops.use_backend`` switched: the compiled
    kernels, PyTorch's multi-tensor ops (what a device without compiled kernels runs)
    and the pure-PyTorch reference.

    ``compiled`` is skipped when the extension is not built, unless
    ``TORCHSTRUCT_REQUIRE_COMPILED=1`` (then a missing extension fails the test).
    """
    name = request.param
    if name == "compiled" and not _ops.compiled_available():
        message = f"torchstruct._C is not available ({_ops._C_IMPORT_ERROR})"
        if _require_compiled():
            pytest.fail(message + " and TORCHSTRUCT_REQUIRE_COMPILED=1")
        pytest.skip(message)
    with _ops.use_backend(name):
        yield name


@pytest.fixture
def swapping():
    """Module conversions and ``load_state_dict`` swap tensors (PyTorch's future behaviour)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.fixture
def group():
    """A one-process gloo group for the test (DDP on the CPU)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_process_group():
    """A one-process gloo group and a one-device CPU mesh, for DTensor parameters."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_module
    except ImportError:
        pytest.skip("DTensor is not available in this torch")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,)), distribute_module
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (the machine may be shared: more
    threads only add contention), the count restored afterwards. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
