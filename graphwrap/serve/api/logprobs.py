"""Tokens' log-probabilities in the API's two forms: completions' (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and chat's (``content``, a list of tokens
with their bytes and their step's most likely tokens).

The log-probabilities are the model's own: its logits' log-softmax, before temperature, top-k,
top-p and penalties (what the batch computes in ``graphwrap.decoding.engine.sampling.logprobs``). A
log-probability of minus infinity is written as -9999.0 (JSON has no infinity).
"""

import math
from typing import Any, Dict, List, Tuple

from .client import TokenLogprob

FLOOR = -9999.0


def _num(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


def completion(entries: List[TokenLogprob], offset: int) -> Tuple[Dict[str, Any], int]:
    """Completions' ``logprobs`` for ``entries``, the first token's text at ``offset`` characters
    into the choice's text; and the offset after them. Each step's dict of most likely tokens
    holds the chosen token too."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.text)
        lps.append(_num(e.logprob))
        top = {t: _num(v) for t, v in e.top}
        top.setdefault(e.text, _num(e.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(e.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def chat(entries: List[TokenLogprob]) -> Dict[str, Any]:
    """Chat's ``logprobs`` for ``entries``."""
    return {"content": [{"token": e.text, "logprob": _num(e.logprob), "bytes": list(e.text.encode()),
                         "top_logprobs": [{"token": t, "logprob": _num(v), "bytes": list(t.encode())}
                                          for t, v in e.top]} for e in entries]}
