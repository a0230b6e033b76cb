"""Two gloo processes on 127.0.0.1, bounded in time, for the distributed tests.

``run(scenario)`` spawns two fresh processes ("spawn" context), each calling
``scenario(rank, checks)`` inside a gloo process group; a scenario appends ``(name, ok, message)``
to ``checks``. The parent waits for both verdicts with a deadline and terminates the processes
when it passes: a hang fails the test, it never hangs the suite. ``scenario`` must be a
module-level function (it is pickled by name).
"""
import datetime
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
DEADLINE = 60.0  # seconds for a whole run (start-up of two interpreters included)


def gloo_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, port, scenario, results):
    """Child process: run ``scenario(rank, checks)`` in a gloo group; put ``(rank, error, checks)``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    checks, error = [], None
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
            timeout=datetime.timedelta(seconds=30),
        )
        scenario(rank, checks)
    except BaseException:  # noqa: BLE001 - reported to the parent
        error = traceback.format_exc()
    results.put((rank, error, checks))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        pass


def run(scenario) -> dict:
    """Run ``scenario`` on two ranks; return ``{rank: checks}`` or fail with the reasons."""
    name = scenario.__name__
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, port, scenario, results), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    start, got = time.monotonic(), {}
    try:
        while len(got) < WORLD:
            left = DEADLINE - (time.monotonic() - start)
            if left <= 0:
                break
            try:
                rank, error, checks = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            got[rank] = (error, checks)
    finally:
        for p in procs:
            p.join(timeout=max(0.5, min(5.0, DEADLINE - (time.monotonic() - start))))
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    missing = [r for r in range(WORLD) if r not in got]
    if missing:
        pytest.fail(f"{name}: rank(s) {missing} gave no result within {DEADLINE:.0f} s "
                    f"(hang or crash; exit codes {[p.exitcode for p in procs]})")
    errors = {r: e for r, (e, _) in got.items() if e}
    if errors:
        pytest.fail(f"{name}: " + "\n".join(f"rank {r}:\n{e}" for r, e in errors.items()))
    return {r: checks for r, (_, checks) in got.items()}


def failed(per_rank: dict) -> list:
    """The failed checks of every rank, as lines."""
    return [f"rank {r}: {name}: {msg}" for r, checks in per_rank.items()
            for name, ok, msg in checks if not ok]


def check(checks, name, ok, msg="") -> None:
    checks.append((name, bool(ok), msg))


def close(a, b, rtol=1e-5, atol=1e-6) -> bool:
    return torch.allclose(a, b, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- shared scenario data
BATCH = 8  # examples per step, split evenly over the ranks


def small_model(seed: int = 0):
    """The small MLP the distributed scenarios train (the same on every rank, by seed)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def batch():
    """One full batch ``(x, y)``, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 2, generator=g)


def half(t, rank: int):
    """Rank ``rank``'s share of a full batch."""
    n = BATCH // WORLD
    return t[rank * n:(rank + 1) * n]


# ----------------------------------------------------------------------------- checks across ranks
def every_rank(ok: bool, group=None) -> bool:
    """Whether ``ok`` holds on every rank (a collective)."""
    import torch.distributed as dist

    t = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(t, group=group)
    return t.item() == dist.get_world_size(group)


def same_on_all_ranks(tensors, group=None) -> bool:
    """Whether ``tensors`` (a list) are bitwise the same on every rank (a collective); False
    for an empty list."""
    import torch.distributed as dist

    t = torch.cat([x.detach().reshape(-1).double() for x in tensors] or [torch.zeros(0)])
    every = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, t, group=group)
    return t.numel() > 0 and all(torch.equal(every[0], o) for o in every[1:])


def raises_on_every_rank(checks, label, step, words=()):
    """``step()`` must raise a ``RuntimeError`` on every rank whose message names ``words``;
    returns the message (None when it did not raise)."""
    message = None
    try:
        step()
    except RuntimeError as e:
        message = str(e)
    check(checks, f"{label}: an error on every rank", every_rank(message is not None),
          str(message))
    check(checks, f"{label}: the message names the parameters",
          message is not None and all(w in message for w in words), str(message))
    return message
