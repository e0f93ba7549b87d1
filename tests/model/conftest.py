import sys
from pathlib import Path

import pytest
import torch

# The kernel tests' harness (`kernel_harness.sees`: the API's one statement of which keys a query sees) for the
# model's mask tests.
sys.path.insert(0, str(Path(__file__).parent.parent / "kernels"))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The model tests use tiny tensors: one intra-op thread is faster and immune to a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
