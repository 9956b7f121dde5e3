"""What a capture checks, on any device: inputs shaped to a bucket, which outputs are batched and
which dims carry the sequence, and a captured graph verified against eager.

A graph serves a call only if its padding cannot change the call's results: the real rows and
positions of a padded replay must equal eager on the real rows at the real length. Each check
raises :class:`CaptureFailed` with a scope that says what it rules out.
"""

from typing import Any, List, Optional, Sequence

import torch

from ..core.compare import CROSS_SHAPE_TOL, SAME_SHAPE_TOL, compare_leaves
from ..core.failures import CaptureFailed, Scope  # noqa: F401 - defined in core, which reads them; raised here
from ..core.records import cut
from ..core.tree import (
    BATCHED,
    WHOLE,
    OutputSpec,
    classify_outputs,
    flatten_outputs,
    unflatten_inputs,
)

Tensor = torch.Tensor


def tile_rows(x: Tensor, rows: int, size: int, batch_dim: int) -> Tensor:
    """A new ``size``-row tensor whose rows repeat the first ``rows`` rows of ``x`` in order.

    Padding rows are always copies of real rows: never uninitialised memory, which can hold
    NaN (poisoning a softmax) or an index out of range (a device assert in an embedding).
    """
    idx = torch.arange(size, device=x.device) % rows
    return x.narrow(batch_dim, 0, rows).index_select(batch_dim, idx)


def shape_leaf(t: Tensor, role, rows: int, length: Optional[int]) -> Tensor:
    """A new tensor: ``t`` with its rows repeated up to ``rows`` and its sequence cut or padded
    (with the role's pad value) to ``length``."""
    bd, sd, pad = role
    if bd is not None and t.shape[bd] != rows:
        t = tile_rows(t, t.shape[bd], rows, bd)
    if sd is not None and length is not None and t.shape[sd] != length:
        L = t.shape[sd]
        if length < L:
            t = t.narrow(sd, 0, length)
        else:
            shape = list(t.shape)
            shape[sd] = length
            out = t.new_full(shape, pad)
            out.narrow(sd, 0, L).copy_(t)
            return out
    return t.clone(memory_format=torch.contiguous_format)


def shape_inputs(leaves: Sequence[Tensor], roles, rows: int, length: Optional[int]) -> List[Tensor]:
    return [shape_leaf(t, r, rows, length) for t, r in zip(leaves, roles)]


def rows_and_length(leaves: Sequence[Tensor], roles):
    """The rows and sequence length of shaped leaves."""
    n = L = None
    for t, (bd, sd, _) in zip(leaves, roles):
        if bd is not None and n is None:
            n = t.shape[bd]
        if sd is not None and L is None:
            L = t.shape[sd]
    return n, L


def run_module(module, in_spec, leaves):
    args, kwargs = unflatten_inputs(in_spec, leaves)
    return module(*args, **kwargs)


def check_untouched(real: Sequence[Tensor], versions: Sequence[int], describe) -> None:
    """Raise if the forward wrote into one of its inputs (its version counter moved)."""
    for i, (t, v) in enumerate(zip(real, versions)):
        if t._version != v:
            raise CaptureFailed(
                f"the forward writes into its input {describe(i)} (an in-place operation on an input); such "
                "calls run eagerly, on the caller's own tensors, as the module does"
            )


def output_kinds(module, spec, roles, real, ref_real, ref_pad, size, seq, batch_dim, out_spec):
    """Which outputs are batched and their sequence dims, from outputs at two different shapes
    (the padded warm-up and the real rows, or another eager run where those coincide)."""
    m, Lr = rows_and_length(real, roles)
    if m != size and (seq is None or Lr != seq):
        other, n2, L2 = ref_real, m, Lr
    else:
        n2 = m if m != size else (size - 1 if size > 1 else 2)
        L2 = None if seq is None else (Lr if Lr != seq else (seq - 1 if seq > 1 else 2))
        try:
            other, _ = flatten_outputs(run_module(module, spec, shape_inputs(real, roles, n2, L2)))
        except Exception as e:  # noqa: BLE001 - it ran at the bucket's shape: this one is graphwrap's
            raise CaptureFailed(f"the forward fails at {n2} rows{'' if L2 is None else f' and length {L2}'}, where "
                                f"it runs at {size}: {type(e).__name__}: {str(e).strip()[:200]}; such inputs run "
                                "eagerly", e) from e
    kinds, seq_dims, problems = classify_outputs(ref_pad, size, other, n2, batch_dim, out_spec, seq, L2)
    if problems:
        raise CaptureFailed(next(iter(problems.values())), scope=Scope.SEQ if seq is not None else Scope.KEY)
    whole = [i for i, (k, s) in enumerate(zip(kinds, seq_dims)) if k == WHOLE and not s]
    msg = compare_leaves([ref_pad[i] for i in whole], [other[i] for i in whole], CROSS_SHAPE_TOL,
                         names=lambda j: f"output {out_spec.describe(whole[j])}")
    if msg:
        raise CaptureFailed(f"{msg}: an output without a batch dimension changes with the batch, so it cannot "
                            "come from a padded graph")
    return kinds, seq_dims


def check_rebuild(spec: OutputSpec, leaves) -> None:
    """Every call rebuilds the output from its parts: check that this gives back the output.

    A container whose constructor takes other arguments than what it holds (a dict subclass
    that wants a name first, say) could otherwise come back empty, or raise on every call.
    """
    try:
        back, back_spec = flatten_outputs(spec.rebuild(leaves))
    except Exception as e:  # noqa: BLE001 - whatever the type's constructor raises
        raise CaptureFailed(f"the output cannot be rebuilt from its parts: {type(e).__name__}: {e}", e) from e
    if back_spec != spec or len(back) != len(leaves) or not all(map(_same_leaf, back, leaves)):
        where = spec.first_difference(back_spec) if back_spec != spec else "a part of it"
        raise CaptureFailed(
            f"the output cannot be rebuilt from its parts: rebuilt, it is not what the module returned ({where} "
            "differs; a container type whose constructor takes other arguments than its contents?)"
        )


def _same_leaf(a, b) -> bool:
    if a is b:
        return True
    try:
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                    and bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))))
        return bool(a == b)
    except Exception:  # noqa: BLE001 - what cannot be compared is not known to be the same
        return False


def _perturb(rows: Tensor, batch_dim: int) -> Tensor:
    # Other valid rows: the same rows in reverse order, and for floats halved as well
    # (halving keeps non-negative float indices in range, unlike noise or a sign flip).
    p = rows.flip(batch_dim)
    if p.is_floating_point() or p.is_complex():
        p = p * 0.5
    return p


class Verifier:
    """Replays a captured graph against eager: on its own inputs, at a shorter length (padding
    along the sequence), on the real rows alone, and with other padding rows.

    Each replay, and the copy of the outputs it is judged by, is issued under ``guard`` (the
    graph shares its pool with graphs that serve calls); the eager runs and the comparisons,
    which wait for the device, are not.
    """

    def __init__(self, graph, module, spec, out_spec: OutputSpec, ref_pad, ref_real, real, guard, pad_check=True,
                 restore=lambda: None, rows_check=True):
        self.g, self.module, self.spec, self.out_spec = graph, module, spec, out_spec
        self.ref_pad, self.ref_real, self.real = ref_pad, ref_real, real
        self.guard, self.pad_check = guard, pad_check
        self.restore_state = restore  # every run starts from the module state the capture found
        self.rows_check = rows_check  # False: the graph serves only its own shape (nothing padded)
        self.names = lambda i: f"output {out_spec.describe(i)}"

    def _replay(self, n=None, L=None, write=None):
        """Replay (after ``write()``, if given) and copy the outputs out, cut to ``n`` rows and
        length ``L`` (all of them if ``n`` is None)."""
        g = self.g
        with self.guard():
            self.restore_state()
            if write is not None:
                write()
            g.replay()
            outs = g.static_outputs if n is None else [cut(o, k, s, g.batch_dim, n, L)
                                                       for o, k, s in zip(g.static_outputs, g.kinds, g.seq_dims)]
            return [o.clone() if isinstance(o, Tensor) else o for o in outs]

    def __call__(self):
        g = self.g
        saved = [t.clone() for t in g.static_inputs]
        restore = lambda: [t.copy_(s) for t, s in zip(g.static_inputs, saved)]  # noqa: E731
        try:
            full = self._replay()
            msg = compare_leaves(full, self.ref_pad, SAME_SHAPE_TOL, names=self.names)
            if msg:
                raise CaptureFailed(
                    f"replay differs from eager on the same inputs ({msg}); the forward probably does work on "
                    "the host (Python-side state, CPU tensors, random numbers) that a graph replays frozen")
            if g.seq is not None and self.pad_check:
                self._padded_positions(restore)
            if not self.rows_check:
                return
            m, Lr = rows_and_length(self.real, g.roles)
            msg = compare_leaves(self._replay(m, Lr, restore), self.ref_real, CROSS_SHAPE_TOL, names=self.names)
            if msg:
                raise CaptureFailed(
                    f"with {g.size - m} padding rows, the {m} real rows differ from eager on the real rows alone "
                    f"({msg}); the model mixes rows of the batch")
            self._other_padding_rows(m, restore)
        finally:
            with self.guard():
                restore()
                self.restore_state()

    def _padded_positions(self, restore):
        g = self.g
        _, Lr = rows_and_length(self.real, g.roles)
        Lv = Lr if Lr < g.seq else g.seq - 1
        if Lv < 1:
            return
        self.restore_state()
        want, _ = flatten_outputs(run_module(self.module, self.spec, shape_inputs(g.static_inputs, g.roles, g.size, Lv)))

        def write():
            restore()
            for t, (bd, sd, pad) in zip(g.static_inputs, g.roles):
                if sd is not None:
                    t.narrow(sd, Lv, g.seq - Lv).fill_(pad)

        msg = compare_leaves(self._replay(g.size, Lv, write), want, CROSS_SHAPE_TOL, names=self.names)
        if msg:
            raise CaptureFailed(
                f"at length {Lv} padded to {g.seq}, the real positions differ from eager at length {Lv} ({msg}); "
                "the model does not ignore padded positions (no attention mask, or pooling over every position)",
                scope=Scope.SEQ)

    def _other_padding_rows(self, m, restore):
        g = self.g
        size, bd = g.size, g.batch_dim
        if size < 2:
            return
        keep = m if m < size else size // 2
        before = _kept(self._replay(None, None, restore), g.kinds, keep, bd)

        def write():
            for t, (tbd, _, _) in zip(g.static_inputs, g.roles):
                if tbd is not None:
                    rows = t.narrow(tbd, keep, size - keep)
                    rows.copy_(_perturb(rows, tbd))

        after = _kept(self._replay(None, None, write), g.kinds, keep, bd)
        msg = compare_leaves(after, before, SAME_SHAPE_TOL, names=self.names)
        if msg:
            raise CaptureFailed(
                f"changing rows {keep}..{size - 1} of the batch changed the outputs of rows 0..{keep - 1} "
                f"({msg}); the model mixes rows of the batch (batch statistics, a reduction over dim "
                f"{bd}), so padding would change real results")


def _kept(outputs: Sequence[Any], kinds: Sequence[str], keep: int, batch_dim: int) -> List[Any]:
    out = []
    for o, k in zip(outputs, kinds):
        if k == BATCHED:
            out.append(o.narrow(batch_dim, 0, keep).clone())
        elif k == WHOLE:
            out.append(o.clone())
        else:
            out.append(o)
    return out
