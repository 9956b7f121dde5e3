"""A mixture of experts' decode step with shapes a graph can hold.

transformers runs a model's experts (Mixtral, Qwen2-MoE, OLMoE, ...) through an interface of
implementations. Its default, ``grouped_mm``, sorts the step's tokens by expert and hands
PyTorch's grouped matrix product offsets that it checks on the host, which a capture refuses;
``eager`` loops over the experts a step picked, a number known only on the device. Its
``batched_mm`` gathers each picked expert's weights per token and runs one batched product:
the same arithmetic with shapes fixed by the number of tokens, so a graph holds it. At a decode
step's few tokens that gather reads what the step reads anyway, once per token and expert.

:class:`batched_experts` sets the models' experts to ``batched_mm`` around decode steps only
(a prompt's forward of thousands of tokens keeps the model's own: gathering weights per token
there would cost memory in proportion to the prompt). The name is written into each config's
own field, as :mod:`graphwrap.decoding.kernels.attention` does for attention, so graphwrap's watch of
the module sees the same value at every step.
"""

import threading

FIELD = "_experts_implementation_internal"  # what transformers' config property reads
NAME = "batched_mm"
REPLACED = ("grouped_mm", "eager")  # the implementations a graph cannot hold
_LOCK = threading.Lock()


def _registered() -> bool:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    return NAME in ALL_EXPERTS_FUNCTIONS


def experts_configs(model) -> list:
    """The configs the model's experts read their implementation from (none for a model without
    transformers' experts interface)."""
    out, seen = [], set()
    for m in model.modules():
        config = getattr(m, "config", None)
        if (config is not None and id(config) not in seen and hasattr(m, "has_gate") and hasattr(m, "is_transposed")
                and FIELD in vars(config)):
            seen.add(id(config))
            out.append(config)
    return out


class batched_experts:
    """Within the block, the model's experts run ``batched_mm`` where they ran ``grouped_mm`` or
    ``eager``; an implementation the user chose otherwise is left as it is."""

    def __init__(self, model):
        configs = experts_configs(model)
        self.configs = configs if configs and _registered() else []
        self.set = []

    def __bool__(self) -> bool:
        return bool(self.configs)

    def __enter__(self):
        with _LOCK:
            self.set = [(c, vars(c)[FIELD]) for c in self.configs if vars(c).get(FIELD) in REPLACED]
            for c, _ in self.set:
                object.__setattr__(c, FIELD, NAME)
        return self

    def __exit__(self, *exc):
        with _LOCK:
            for c, old in self.set:
                if vars(c).get(FIELD) == NAME:
                    object.__setattr__(c, FIELD, old)
            self.set = []
