"""The module's own state across a capture: one call changes it exactly as one eager call does.

A capture runs the forward several times besides the call it serves: a reference run, warm-ups,
checks at other shapes, verification replays, the race against eager. A forward that writes its
module's buffers (a step counter, running statistics, a cache kept in buffers) would see each of
those runs. :class:`Saved` copies the buffers before a capture and puts back, before each run
and at the end, every buffer whose version counter moved; what the forward wrote is then known,
and the engine serves such a module without padding, chunking or joining requests (each of
which would write state the eager call does not).

A state input may name the tensors a capture must put back (``capture_restores``, a list): the
shared decode batch's windows name the rows' lengths alone, since every run of one call writes
the same keys at the same places of a cache far too large to copy.
"""

from typing import Dict, List, Optional, Set, Tuple

import torch

from .failures import CaptureFailed

Tensor = torch.Tensor


class Saved:
    """The module's buffers as they were when a capture began."""

    __slots__ = ("items", "params", "written", "host", "host_written")

    def __init__(self, module: torch.nn.Module, states=()):
        named = list(module.named_buffers())
        self.host = []  # HostNumber: the numbers a state input keeps in Python
        for i, ref in enumerate(states):  # state inputs: a static cache's tensors
            restores = getattr(ref.obj, "capture_restores", None)
            tensors = state_tensors(ref.obj) if restores is None else restores
            named += [(f"{type(ref.obj).__name__}[{j}]", t) for j, t in enumerate(tensors)]
            self.host += state_numbers(ref.obj)
        self.host_written: Set[str] = set()
        with torch.inference_mode(False), torch.no_grad():
            # Inference tensors keep no version counter and cannot be written outside that mode.
            self.items: List[Tuple[str, Tensor, int, Tensor]] = [
                (name, t, t._version, t.clone()) for name, t in named if not t.is_inference()]
        self.params = [(name, p, p._version) for name, p in module.named_parameters() if not p.is_inference()]
        self.written: Set[str] = set()

    def restore(self):
        """Put back every buffer written since the capture began (on the current stream). An eager
        run bumps the version counter of what it writes; a graph replay does not, so a buffer
        once seen written is put back every time."""
        for i, (name, t, v, saved) in enumerate(self.items):
            if t._version != v or name in self.written:
                with torch.inference_mode(False), torch.no_grad():
                    t.copy_(saved)
                self.written.add(name)
                self.items[i] = (name, t, t._version, saved)
        for number in self.host:
            if number.moved():
                self.host_written.add(number.name)
                number.put_back()

    def check_host_state(self):
        """Raise CaptureFailed if the forward changed numbers a state input keeps in Python (a
        sliding-window cache's position as an int): a graph would replay them frozen, so such
        calls run eagerly. Call after a run, before :meth:`restore` puts them back."""

        changed = sorted({n.name for n in self.host if n.moved()} | self.host_written)
        if changed:
            raise CaptureFailed(f"the forward changes numbers its state keeps in Python ({', '.join(changed[:3])}): a "
                                "graph would replay them frozen, so these calls run eagerly")

    def check_params(self):
        """Raise CaptureFailed if the forward wrote into its parameters (they are not copied, so
        not put back: such a module runs eagerly; the run that found it stays)."""

        written = [name for name, p, v in self.params if p._version != v]
        if written:
            raise CaptureFailed(f"the forward writes into its parameters {', '.join(written[:3])}; such a module "
                                "runs eagerly")


# ---------------------------------------------------------------------------------- state inputs

DYNAMIC_CACHE = ("a cache that grows with every token (a DynamicCache) cannot be replayed by a graph: pass a static "
                 "cache (generate(..., cache_implementation=\"static\"), or a transformers StaticCache) for graphs")
NOT_ALLOCATED = ("the static cache is not allocated yet (its first call allocates it): this call runs eagerly, the "
                 "next ones are graphed")


def state_reason(obj) -> Optional[str]:
    """Whether an input object is state the forward reads and writes in place: None for a cache
    of fixed tensors (a transformers static cache: ``is_compileable``, every layer allocated;
    an encoder-decoder's pair of them, one for self-attention and one for cross-attention), a
    reason to run eagerly for a cache that cannot be (growing, or not allocated yet), and
    ``NOT_STATE`` for any other object."""
    parts = cache_parts(obj)
    if parts is not None:
        why = [state_reason(p) for p in parts]
        if NOT_STATE in why:
            return NOT_STATE
        return next((w for w in why if w is not None), None)
    layers = getattr(obj, "layers", None)
    if not isinstance(layers, list) or not hasattr(type(obj), "is_compileable"):
        return NOT_STATE
    try:
        compileable = bool(obj.is_compileable)
    except Exception:  # noqa: BLE001 - a property that cannot be read says no
        compileable = False
    if not compileable:
        return DYNAMIC_CACHE
    if any(_recurrent(layer) for layer in layers):
        return RECURRENT
    if not all(getattr(layer, "is_initialized", True) for layer in layers):
        return NOT_ALLOCATED
    return None


def cache_parts(obj) -> Optional[tuple]:
    """An encoder-decoder cache's two caches (self-attention, cross-attention); None for any
    other object. The cross-attention cache is written once, by the prompt's forward, and read
    by every step after it (the cache's ``is_updated`` flags say so: they are watched)."""
    own = getattr(obj, "self_attention_cache", None), getattr(obj, "cross_attention_cache", None)
    if any(p is None or not isinstance(getattr(p, "layers", None), list) for p in own):
        return None
    return own


_RECURRENT: Dict[type, bool] = {}  # asked on every call, of each layer: once per type


def _recurrent(layer) -> bool:
    t = type(layer)
    got = _RECURRENT.get(t)
    if got is None:
        got = _RECURRENT[t] = any(c.__name__ == "LinearAttentionCacheLayerMixin" for c in t.__mro__)
    return got


RECURRENT = ("a cache with recurrent (Mamba or linear-attention) layers runs eagerly: graphs of NemotronH's steps "
             "gave other tokens than eager on an H100, a cause not yet found")


NOT_STATE = "not state"
INFERENCE_STATE = ("the state input's tensors were made under torch.inference_mode(): a capture cannot write "
                   "them (it runs outside that mode); make the cache outside inference_mode (no_grad serves)")


def state_tensors(obj, depth: int = 3) -> List[Tensor]:
    """The tensors an object holds (in its attributes, and theirs, and in lists and dicts of
    them, ``depth`` levels down), each once, in a fixed order. A transformers cache's are read
    straight from its layers' attributes (keys, values, the position counter): this runs on
    every call."""
    parts = cache_parts(obj)
    layers = [x for p in parts for x in p.layers] if parts is not None else getattr(obj, "layers", None)
    if isinstance(layers, list) and layers:
        fast = [v for layer in layers for v in vars(layer).values() if isinstance(v, Tensor)]
        if fast:
            return fast
    out, seen = [], set()

    def walk(x, d):
        if isinstance(x, Tensor):
            if id(x) not in seen:
                seen.add(id(x))
                out.append(x)
            return
        if d == 0 or isinstance(x, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
            return
        if isinstance(x, (list, tuple)):
            for v in x:
                walk(v, d - 1)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, d - 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (torch.nn.Module, type)):
            for v in vars(x).values():
                walk(v, d - 1)

    walk(obj, depth)
    return out


_NUMBERS = (int, float, bool, str, type(None))


class HostNumber:
    """A plain number (or string, None) a state input keeps in Python: an attribute, or an
    entry of a dict attribute (a layer's ``has_previous_state`` by index), as it was."""

    __slots__ = ("holder", "key", "value", "item", "name")

    def __init__(self, holder, key, value, item: bool, name: str):
        self.holder, self.key, self.value, self.item, self.name = holder, key, value, item, name

    def now(self):
        if self.item:
            return self.holder.get(self.key, self.value)
        return getattr(self.holder, self.key, self.value)

    def moved(self) -> bool:
        now = self.now()
        return now is not self.value and now != self.value

    def put_back(self) -> None:
        if self.item:
            self.holder[self.key] = self.value
        else:
            setattr(self.holder, self.key, self.value)


def state_numbers(obj) -> List[HostNumber]:
    """The plain numbers (and strings, None) a state input and its layers keep as attributes,
    or as values of dict attributes: what a forward could change on the host, out of a graph's
    sight."""
    caches = [obj, *(cache_parts(obj) or ())]
    holders = caches + [x for c in caches for x in (getattr(c, "layers", None) or []) if hasattr(x, "__dict__")]
    out = []
    for h in holders:
        if not hasattr(h, "__dict__") or isinstance(h, Tensor):
            continue
        for a, v in vars(h).items():
            if isinstance(v, _NUMBERS):
                out.append(HostNumber(h, a, v, False, f"{type(h).__name__}.{a}"))
            elif isinstance(v, dict) and len(v) <= 64:
                out += [HostNumber(v, k, x, True, f"{type(h).__name__}.{a}[{k!r}]")
                        for k, x in v.items() if isinstance(x, _NUMBERS)]
    return out


class StateRef:
    """A state input in a call's spec: the object itself (given to the forward as it is), equal
    only to the same object holding the same tensors at the same addresses (a tensor: the same
    memory and layout), so a cache whose tensors were allocated again is another key (no graph
    replays on memory it no longer owns; the key holds the object, so its memory lives on)."""

    __slots__ = ("obj", "ident", "ptrs", "inference", "_hash")

    def __init__(self, obj):
        self.obj = obj
        tensors = state_tensors(obj)
        self.ptrs = tuple(t.data_ptr() for t in tensors)
        self.inference = any(t.is_inference() for t in tensors)  # made under torch.inference_mode
        # A tensor is the same state as another view of its memory with the same layout (a
        # caller may pass a fresh view each call); any other object only as itself.
        self.ident = (tuple(obj.shape), obj.stride(), obj.dtype, obj.device) if isinstance(obj, Tensor) else id(obj)
        self._hash = hash((self.ident, self.ptrs))

    def __eq__(self, other):
        return isinstance(other, StateRef) and other.ident == self.ident and other.ptrs == self.ptrs

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"{type(self.obj).__name__}@{id(self.obj):#x}"
