"""Models for the Ray Serve test, in a module of their own so that Ray's workers can import them."""

import torch
from torch import nn


class NoNaN(nn.Module):
    """A small MLP that refuses inputs with NaN, as a model with input checks would."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):
        if bool(torch.isnan(x).any()):
            raise ValueError("NaN in the input")
        return self.net(x)


def make():
    return NoNaN().eval()
