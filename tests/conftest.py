import os

import pytest
import torch

# NOTE: one torch thread per test process, here and in the subprocesses tests start (OMP_NUM_THREADS;
# moe_lit.callbacks.threads.ThreadShare stays out): `make test` runs one pytest-xdist worker per
# core, and runs a test compares bit for bit use the same kernels however many workers there are.
# A test that needs more threads sets them itself; OMP_NUM_THREADS set outside pytest is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# NOTE: fixtures shared by several test folders live in a helpers module, registered here.
pytest_plugins = ("tests.helpers.fixtures",)


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):  # what pytest-xdist sets in a worker of --dist loadgroup
        keep_xdist_groups(items)
        # NOTE: the slow tests go first (a stable sort, the same on every worker): loadgroup (make
        # test) hands out one test at a time in this order, so the long ones spread over the workers
        # at the start and short ones fill the end, instead of a long test started last running
        # alone. (--dist load sends long runs of consecutive tests: there this order would not help.)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # NOTE: the marker, not the keywords: keywords include directory names such as tests/gpu/.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def keep_xdist_groups(items) -> None:
    """Give each test marked ``xdist_group(NAME)`` the ``@NAME`` nodeid suffix by which loadgroup keeps a group
    on one worker (a module's module-scoped runs are then made once, not once per worker).

    NOTE: pytest-xdist 3.8 writes that suffix to ``item._nodeid``, which pytest 9.2 no longer reads (the
    id lives in ``item._id``): without this the groups are silently ignored. A suffixed id is left alone.
    """
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{mark.args[0] if mark.args else mark.kwargs['name']}")


@pytest.fixture(autouse=True, scope="session")
def private_user_cache(tmp_path_factory):
    """Point ``XDG_CACHE_HOME`` (the precision probes' per-machine cache) at this run's temp folder.

    NOTE: a test (or the command it starts) must neither read a choice another run cached in the
    user's ~/.cache nor leave one there; subprocesses inherit the variable.
    """
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    patch.undo()
