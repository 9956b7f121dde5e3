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
        if bool((x > 1e6).any()):
            raise KeyError("a failure of the model's own")
        return self.net(x)


def make():
    return NoNaN().eval()


class Embedder(nn.Module):
    """Token embeddings masked by the attention mask: a text model in miniature."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8)

    def forward(self, input_ids, attention_mask):
        return self.emb(input_ids) * attention_mask.unsqueeze(-1)


def make_embedder():
    return Embedder().eval()


def tokenize(body):
    """A stand-in for a tokenizer: characters to ids, padded with 0, and the mask."""
    ids = [[1 + (ord(c) % 40) for c in t] for t in body["texts"]]
    n = max(len(i) for i in ids)
    return {"input_ids": torch.tensor([i + [0] * (n - len(i)) for i in ids]),
            "attention_mask": torch.tensor([[1] * len(i) + [0] * (n - len(i)) for i in ids])}


def mean_pool(out, inputs):
    m = inputs["attention_mask"].unsqueeze(-1).to(out.dtype)
    return (out * m).sum(1) / m.sum(1)


def make_small_bert():
    """A two-layer BertModel with fixed random weights (the same in every process)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=256)
    return transformers.BertModel(cfg).eval()


def bert_mean_pool(out, inputs):
    """Masked mean of a BertModel's last hidden state: one embedding per row."""
    return mean_pool(out.last_hidden_state, inputs)
