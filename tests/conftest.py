import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# NOTE: pins the thread count of CPU runs (moe_lit.callbacks.threads.ThreadShare stays out), here
# and in the subprocesses tests start: runs a test compares bit for bit use the same kernels.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
# NOTE: fixtures shared by several test folders live in a helpers module, registered here.
pytest_plugins = ("tests.helpers.fixtures",)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # NOTE: the marker, not the keywords: keywords include directory names such as tests/gpu/.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
