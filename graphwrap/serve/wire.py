"""Requests over HTTP: a JSON body read into the module's inputs, within limits, and outputs
written back as JSON; which status a failure gets. Plain Python, tested on a CPU.

A body holds one array, ``{"inputs": [[...], ...]}``, or named inputs, ``{"inputs":
{"input_ids": [[...]], "attention_mask": [[...]]}}`` (given to the module as keyword inputs).
Every answer is JSON: ``{"outputs": ...}`` or ``{"error": "..."}``; numbers that are not
finite are sent as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (JSON has no such
numbers).
Each input's dtype comes from a fixed list of names, never from the client's text unchecked:
the server's ``dtypes`` option, else the body's ``"dtype"`` (one array) or ``"dtypes"`` (per
name) if it is one of :data:`DTYPES`, else int64 for ids and masks (``*_ids``, ``*_mask``) and
float32 for the rest.
"""

import json
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from ..errors import GraphwrapError

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
# Exceptions of a model that refuses an input it was given (a wrong width, a wrong dtype, a value
# it checks): the client's request cannot be processed (422). Anything else is the server's (500).
REJECTED = (GraphwrapError, ValueError, TypeError, IndexError)
# Words of PyTorch's messages for inputs an operator refuses, matched in lower case.
_REJECTED_WORDS = ("shape", "size", "dtype", "expected", "mat1", "dimension", "index out of range", "scalar type")
_NOT_FINITE = {float("nan"): "NaN", float("inf"): "Infinity", float("-inf"): "-Infinity"}


class RequestError(Exception):
    """A request answered with ``status`` and ``message`` instead of outputs."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Limits:
    """What one request may hold; past a limit, status 413."""

    max_body_bytes: int = 4 << 20
    max_rows: int = 64  # along the first dimension of each input
    max_length: int = 4096  # along the sequence dimension of the inputs that have one (the module's seq_dim)
    # input name -> the number of ids its embedding holds: its values must lie in [0, bound) (422
    # otherwise). On a GPU an id out of range is a device-side assert that leaves the replica's
    # CUDA context unusable, so it is checked on the host first. The server fills in
    # ``input_ids`` and ``token_type_ids`` from a Hugging Face model's config where not given.
    id_bounds: Optional[Mapping[str, int]] = None
    # Whether inputs may hold NaN and infinities (JSON has no such numbers; Python's parser takes
    # NaN, Infinity and numbers past float64 such as 1e400): refused with 400 unless True.
    non_finite: bool = False

    def __post_init__(self):
        for name in ("max_body_bytes", "max_rows", "max_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GraphwrapError(f"{name} must be an int >= 1, got {v!r}")
        if self.id_bounds is not None and not isinstance(self.id_bounds, Mapping):
            raise GraphwrapError(f"id_bounds must be a dict of input name to the number of ids its embedding "
                                 f"holds, such as {{'input_ids': 30522}}, got {self.id_bounds!r}")
        for name, v in (self.id_bounds or {}).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GraphwrapError(f"id_bounds[{name!r}] must be an int >= 1, got {v!r}")


def dtype_for(name: Optional[str], asked: Optional[str], dtypes: Mapping[Optional[str], Any]) -> torch.dtype:
    """The dtype of input ``name`` (None: the one array): the server's choice, else the
    client's if it names one of :data:`DTYPES`, else by the input's name."""
    if name in dtypes:
        return dtypes[name]
    if asked is not None:
        if not isinstance(asked, str) or asked not in DTYPES:
            raise RequestError(400, f"dtype {asked!r} of {_what(name)} is not one of {', '.join(DTYPES)}")
        return DTYPES[asked]
    if name is not None and (name.endswith("_ids") or name.endswith("_mask") or name in ("ids", "mask")):
        return torch.int64
    return torch.float32


def parse_body(raw: bytes, limits: Limits) -> dict:
    """The JSON object of a request body; 413 past ``max_body_bytes``, 400 if it is not one."""
    if len(raw) > limits.max_body_bytes:
        raise RequestError(413, f"the body has {len(raw)} bytes, more than max_body_bytes={limits.max_body_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(400, "the body is not UTF-8 text; send JSON encoded as UTF-8") from None
    try:
        body = json.loads(text)
    except ValueError as e:
        raise RequestError(400, f"the body is not JSON: {e}") from None
    except RecursionError:
        raise RequestError(400, "the body nests arrays or objects too deeply to parse") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the body is a JSON {_json_type(body)}, not an object with \"inputs\"")
    return body


def read_inputs(body: dict, dtypes: Mapping[Optional[str], Any],
                non_finite: bool = False) -> Tuple[tuple, Dict[str, torch.Tensor]]:
    """``(args, kwargs)`` of the module from a body's ``"inputs"``; 400 where they are not arrays
    of numbers (or hold NaN or infinities, unless ``non_finite``)."""
    if "inputs" not in body:
        raise RequestError(400, 'the body has no "inputs": send {"inputs": [[...]]} or {"inputs": {"name": [[...]]}}')
    inputs = body["inputs"]
    if isinstance(inputs, dict):
        if not inputs:
            raise RequestError(400, '"inputs" is an empty object')
        asked = body.get("dtypes") or {}
        if not isinstance(asked, dict):
            raise RequestError(400, '"dtypes" must be an object of input names to dtype names')
        kwargs = {}
        for name, value in inputs.items():
            kwargs[name] = _tensor(value, name, dtype_for(name, asked.get(name), dtypes), non_finite)
        return (), kwargs
    return (_tensor(inputs, None, dtype_for(None, body.get("dtype"), dtypes), non_finite),), {}


def check_limits(args, kwargs, limits: Limits, seq_dim=None):
    """413 where an input has more rows or positions than the limits allow; 422 where ids lie
    outside ``id_bounds``. Positions are counted along ``seq_dim`` (the module's: an int for
    every input, a dict by input name or position, None where inputs have no sequence)."""
    for name, bound in (limits.id_bounds or {}).items():
        t = kwargs.get(name)
        if isinstance(t, torch.Tensor) and t.numel() and not t.is_floating_point():
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= bound:
                raise RequestError(422, f"input {name!r} holds ids from {lo} to {hi}, outside [0, {bound})")
    for name, t in [(None, a) for a in args] + list(kwargs.items()):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        if t.shape[0] > limits.max_rows:
            raise RequestError(413, f"{_what(name)} has {t.shape[0]} rows, more than max_rows={limits.max_rows}")
        sd = _seq_dim_of(seq_dim, name, args, t)
        if sd is not None and -t.dim() <= sd < t.dim() and t.shape[sd] > limits.max_length:
            raise RequestError(413, f"{_what(name)} has length {t.shape[sd]}, more than max_length={limits.max_length}")


def _seq_dim_of(seq_dim, name, args, t):
    if seq_dim is None or isinstance(seq_dim, int):
        return seq_dim
    key = name if name is not None else next((i for i, a in enumerate(args) if a is t), None)
    return seq_dim.get(key)


def status_of(e: BaseException) -> int:
    """422 for a model that refuses the request's inputs, 500 for any other failure."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return 500
    if isinstance(e, REJECTED):
        return 422
    if isinstance(e, RuntimeError) and not str(e).startswith("CUDA error"):
        text = str(e).lower()
        if any(w in text for w in _REJECTED_WORDS):
            return 422
    return 500


def to_json(x):
    """Outputs as JSON values: tensors as nested lists, containers and dataclasses as objects and
    lists, other objects by their repr."""
    import dataclasses

    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return _finite(t.tolist())
        return t.tolist()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: to_json(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_json(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return _finite(x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def _finite(v):
    if isinstance(v, list):
        return [_finite(u) for u in v]
    if v != v:
        return "NaN"
    return _NOT_FINITE.get(v, v)


def _tensor(value, name: Optional[str], dtype: torch.dtype, non_finite: bool = False) -> torch.Tensor:
    if not isinstance(value, list):
        raise RequestError(400, f"{_what(name)} is a JSON {_json_type(value)}, not an array of numbers")
    try:
        t = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise RequestError(400, f"{_what(name)} is not a rectangular array of numbers: {e}") from None
    if t.numel() == 0:
        raise RequestError(400, f"{_what(name)} is empty (shape {list(t.shape)}): send at least one row of numbers")
    if t.is_floating_point() and not non_finite and not bool(torch.isfinite(t).all()):
        raise RequestError(400, f"{_what(name)} holds NaN or infinite numbers (NaN, Infinity, or past float64, such "
                                "as 1e400), which JSON has none of; the server takes them with limits={'non_finite': "
                                "True}")
    if t.is_floating_point() and not dtype.is_floating_point and not bool((t == t.round()).all()):
        raise RequestError(400, f"{_what(name)} holds numbers that are not integers, and its dtype is "
                                f"{str(dtype).replace('torch.', '')}")
    if not dtype.is_floating_point and dtype != torch.bool and t.dtype != dtype:
        info = torch.iinfo(dtype)
        if bool((t < info.min).any()) or bool((t > info.max).any()):
            raise RequestError(400, f"{_what(name)} holds numbers outside {str(dtype).replace('torch.', '')}'s range "
                                    f"[{info.min}, {info.max}]")
    return t.to(dtype)


def _json_type(value) -> str:
    """JSON's name for the type of a parsed value."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _what(name: Optional[str]) -> str:
    return "the input" if name is None else f"input {name!r}"
