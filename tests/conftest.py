import logging

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_clean():
    torch.manual_seed(0)
    yield
    if HAS_CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture
def fp32_exact():
    """TF32 off (matrix products and cuDNN): fp32 graph and eager then agree to rounding, so a
    graph's tokens can be compared with eager's exactly and a wrong answer stands out."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture
def gw_log(caplog):
    caplog.set_level(logging.INFO, logger="graphwrap")
    return caplog


def pytest_sessionfinish(session, exitstatus):
    """The local Ray instance of the Ray tests, if they started one, shut down once at the end."""
    import sys

    helpers = sys.modules.get("helpers")
    if helpers is not None:
        helpers.ray_stop()
