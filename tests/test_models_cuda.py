"""Real models on a GPU: torchvision's resnet18 and a transformers BERT from its config."""

import pytest
import torch
from helpers import (
    assert_same,
    check_bert,
    eager_answer,
    small_bert,
)

from graphwrap import GraphedModule

pytestmark = pytest.mark.cuda
DEV = "cuda"


def test_resnet18_from_torchvision():
    tv = pytest.importorskip("torchvision")
    model = tv.models.resnet18().to(DEV).eval()
    gm = GraphedModule(model, buckets=[1, 2, 4, 8])
    for n in (1, 3, 8, 2):
        x = torch.randn(n, 3, 64, 64, device=DEV)
        assert_same(gm(x), eager_answer(model, x), tol=2e-2)
    assert gm.stats()["eager_calls"] == {}


def test_bert_from_config():
    model, cfg = small_bert(pytest.importorskip("transformers"), DEV)
    gm = GraphedModule(model, buckets=[1, 4, 8])
    assert gm.config is model.config
    check_bert(gm, model, cfg, (1, 3, 8, 6), DEV)
    assert gm.stats()["eager_calls"] == {}, gm.stats()
