"""Whether the cache of rows gives a model what its own cache gives it.

Before the shared batch serves a model, two short prompts of different lengths are decoded a
few steps both ways, eagerly: through the rows (joined prefill, per-row lengths, the 4-D mask
over a window), in each layout of the cache (whole rows, and blocks of a pool handed out of
order, read in place by the paged attention where it runs), and alone through the model's own cache. A model whose attention, positions or
cache the rows do not reproduce (a sliding window, positions of its own, a cache of another
kind) is left to the one-call loop, with the reason.
"""

from typing import Optional

import torch

from ..cache.pages import PagedStore
from ..cache.rows import RowStore
from ..kernels import paged_attention
from ..kernels.attention import folding
from .step import (
    ChunkStep,
    DecodeStep,
    MixedStep,
    PieceStep,
    PrefillStep,
    Prompts,
    cache_layout,
    layer_windows,
    output_cache,
)

STEPS = 4


def probe(model, device, rows: bool = True, in_place: Optional[bool] = None) -> Optional[str]:
    """None where the rows reproduce the model's own decoding, else why not (``rows``: the
    whole-rows layout is probed too, where the batch may use it; ``in_place``: the paged pool is
    read in place by the kernel, as the batch will, default where the kernel runs at all)."""
    try:
        return _probe(model, torch.device(device), rows, in_place)
    except Exception as e:  # noqa: BLE001 - a model the rows cannot drive at all
        return f"decoding through graphwrap's cache of rows failed ({type(e).__name__}: {e})"


def _probe(model, device, rows: bool, in_place: Optional[bool]) -> Optional[str]:
    keys, values = cache_layout(model, device)
    if keys is None:
        return ("the model's own cache has no per-layer keys and values of full attention or of one sliding window "
                "(another kind of layer?)")
    kernel = paged_attention.available() and device.type == "cuda" if in_place is None else in_place
    stores = [RowStore(4, 32, device)] if rows else []
    for store in stores + [PagedStore(4, 32, device, 4, 4 * 8 + 5, kernel=kernel)]:
        if isinstance(store, PagedStore):
            store.kernel = folding(model, store).store is not None
            store.layer_windows = layer_windows(model)
        store.allocate(keys, values)
        if isinstance(store, PagedStore):  # rows 0 and 1 take blocks out of order, as a busy pool hands them out
            store.assign([0, 1, 2], [[9, 33, 17, 5, 25, 30, 28, 8], [24, 12, 6, 20, 7, 11, 13, 32],
                                     [14, 21, 10, 15, 16, 18, 19, 22]])  # (blocks 0-4: the rows' scratch)
        why = _through(model, device, store)
        if why is not None:
            return why if isinstance(store, RowStore) else f"{why}, through the paged cache"
    return None


def _through(model, device, store) -> Optional[str]:
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if vocab < 2:
        return "the model's config has no vocab_size"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (3, 6)]
    step, prefill = DecodeStep(model), PrefillStep(model)
    rows = [1, 0]
    with torch.no_grad():
        logits = prefill(*Prompts(4, 32, store.scratch).inputs(prompts, rows, (3, 8), device),
                         store.prompt_window(8))[:2]
        got = [logits[[1, 0]].float()]  # by row
        want, caches = [], []
        for p in prompts:  # (a mask, as generate passes: a model may warn of padding without one)
            out = model(input_ids=torch.tensor([p], device=device), attention_mask=_ones(len(p), device),
                        use_cache=True, return_dict=True)
            want.append(out.logits[0, -1].float())
            caches.append(output_cache(out))
        # A long prompt's pieces: the second prompt again, into row 2, in two pieces.
        chunk, p = ChunkStep(model), prompts[1]
        for a, b in ((0, 4), (4, len(p))):
            piece = chunk(torch.tensor([p[a:b]], device=device), a, store.chunk_window(2, a, b - a))
        why = _differ(piece[0].float(), want[1], model)
        if why is not None:
            return f"{why}, for a prompt in pieces"
        if isinstance(store, PagedStore):  # the pieces as their graphs run them, the last one padded
            why = _pieces(model, device, store, p, want[1])
            if why is not None:
                return f"{why}, for a prompt in pieces read from the device"
        ids = torch.zeros((2, 1), dtype=torch.long, device=device)
        for k in range(STEPS):
            ref = torch.stack(want[::-1])  # rows 0, 1 hold prompts 1, 0
            why = _differ(got[-1], ref, model)
            if why is not None:
                return why
            ids[:, 0] = ref.argmax(-1)
            with folding(model, store):
                got.append(step(ids, store.window(32)).float())
            for i, (p, c) in enumerate(zip(prompts, caches)):
                tok = ids[1 - i:2 - i]
                out = model(input_ids=tok, attention_mask=_ones(len(p) + k + 1, device), use_cache=True,
                            return_dict=True, **{step.cache_name: c})
                want[i] = out.logits[0, -1].float()
        return _differ(got[-1], torch.stack(want[::-1]), model)


def _ones(n: int, device) -> torch.Tensor:
    """The attention mask ``[1, n]`` of a sequence of ``n`` positions, none of them padding."""
    return torch.ones((1, n), dtype=torch.long, device=device)


def _pieces(model, device, store, prompt, want) -> Optional[str]:
    """``prompt`` through :class:`PieceStep` into row 3 (blocks out of order), 4 positions a
    piece over a window of 8, the last piece padded: its logits against the model's own."""
    store.assign([3], [[36, 23, 34, 26, 27, 35, 29, 31]])
    piece = PieceStep(model)
    for a in range(0, len(prompt), 4):
        ids = torch.zeros((1, 4), dtype=torch.long, device=device)
        ids[0, :len(prompt[a:a + 4])] = torch.tensor(prompt[a:a + 4], device=device)
        at = torch.tensor([a, len(prompt[a:a + 4]), 3], device=device)
        logits = piece(ids, at, store.piece_window(4, 8))
    return _differ(logits[0].float(), want, model)


def _differ(got: torch.Tensor, want: torch.Tensor, model) -> Optional[str]:
    p = next(model.parameters())
    tol = 1e-3 if p.dtype == torch.float32 else 5e-2
    scale = float(want.abs().max()) or 1.0
    err = float((got - want).abs().max())
    if err > tol * scale:
        return (f"decoding through graphwrap's cache of rows differs from the model's own cache (max error {err:.3g} "
                f"on logits of scale {scale:.3g})")
    return None


def probe_mixed(model, device) -> Optional[str]:
    """None where a mixed forward (:class:`~.step.MixedStep`: a step of the rows and a piece of a
    long prompt at once, the pool read in place) gives the model's own logits for both, else why
    not. Row 0 holds a prompt of 3 and steps; row 3 takes a prompt of 6 in pieces of 4, its
    second piece (2 valid positions, padded) in the mixed forward with the step of rows 0-3 (the
    piece's row among them)."""
    try:
        return _probe_mixed(model, torch.device(device))
    except Exception as e:  # noqa: BLE001 - a model the mixed forward cannot drive
        return f"a step and a piece in one forward failed ({type(e).__name__}: {e})"


def _probe_mixed(model, device) -> Optional[str]:
    keys, values = cache_layout(model, device)
    if keys is None:
        return "the model's own cache has no per-layer keys and values"
    store = PagedStore(4, 32, device, 4, 4 * 8 + 5, kernel=True)
    fold = folding(model, store)
    if fold.store is None:
        return "the model's attention is not read in place"
    store.layer_windows = layer_windows(model)
    store.allocate(keys, values)
    store.assign([0, 3], [[9, 33, 17, 5, 25, 30, 28, 8], [36, 23, 34, 26, 27, 35, 29, 31]])
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(1, vocab, (n,), generator=g).tolist() for n in (3, 6))
    with torch.no_grad(), fold:
        logits = PrefillStep(model)(*Prompts(4, 32, store.scratch).inputs([a], [0], (1, 8), device),
                                    store.prompt_window(8))[:1]
        token = int(logits[0].argmax())
        ids = torch.zeros((1, 4), dtype=torch.long, device=device)
        ids[0] = torch.tensor(b[:4], device=device)
        PieceStep(model)(ids, torch.tensor([0, 4, 3], device=device), store.piece_window(4, 32))
        store.lengths[3] = 4
        mixed = torch.zeros((1, 8), dtype=torch.long, device=device)
        mixed[0, 0] = token
        mixed[0, 4:6] = torch.tensor(b[4:], device=device)
        got = MixedStep(model)(mixed, torch.tensor([4, 2, 3], device=device), store.mixed_window(4, 4)).float()
        want_row = model(input_ids=torch.tensor([a + [token]], device=device),
                         attention_mask=_ones(len(a) + 1, device)).logits[0, -1].float()
        want_piece = model(input_ids=torch.tensor([b], device=device),
                           attention_mask=_ones(len(b), device)).logits[0, -1].float()
    why = _differ(got[0], want_row, model)
    if why is None:
        why = _differ(got[4], want_piece, model)
    if why is None and int(store.lengths[0]) != 4:
        why = "a mixed forward did not move its live row on"
    return why
