"""Requests over HTTP on a CPU, without Ray: bodies read into inputs, dtypes from a fixed list,
limits and status codes, preprocess and postprocess, and a replica that keeps serving after a
failing request (graphwrap.serve.wire and graphwrap.serve.Server)."""

import asyncio
import json

import pytest
import torch
from serve_models import Embedder, NoNaN, mean_pool, tokenize

from graphwrap import GraphwrapError
from graphwrap.serve.wire import (
    Limits,
    RequestError,
    check_limits,
    dtype_for,
    parse_body,
    read_inputs,
    status_of,
)


def _error(fn, *a):
    with pytest.raises(RequestError) as e:
        fn(*a)
    return e.value.status, e.value.message


def test_one_array_or_named_inputs_with_dtypes_by_name():
    args, kwargs = read_inputs({"inputs": [[0.5, 1.0], [2.0, 3.0]]}, {})
    assert kwargs == {} and args[0].dtype == torch.float32 and args[0].shape == (2, 2)
    args, kwargs = read_inputs({"inputs": {"input_ids": [[101, 7, 0]], "attention_mask": [[1, 1, 0]],
                                           "pixel_values": [[0.1, 0.2, 0.3]]}}, {})
    assert args == ()
    assert kwargs["input_ids"].dtype == kwargs["attention_mask"].dtype == torch.int64
    assert kwargs["pixel_values"].dtype == torch.float32
    # the client may choose among the fixed names; the server's choice wins
    _, kwargs = read_inputs({"inputs": {"x": [[1, 2]]}, "dtypes": {"x": "float16"}}, {})
    assert kwargs["x"].dtype == torch.float16
    _, kwargs = read_inputs({"inputs": {"x": [[1, 2]]}, "dtypes": {"x": "float16"}}, {"x": torch.bfloat16})
    assert kwargs["x"].dtype == torch.bfloat16
    assert dtype_for(None, "int32", {}) == torch.int32


def test_malformed_bodies_are_400_with_what_is_wrong():
    limits = Limits()
    assert _error(parse_body, b"{not json", limits)[0] == 400
    assert "not an object" in _error(parse_body, b"[1, 2]", limits)[1]
    assert 'no "inputs"' in _error(read_inputs, {"nope": 1}, {})[1]
    # a dtype is never looked up on torch by the client's text
    status, msg = _error(read_inputs, {"inputs": [[1.0]], "dtype": "Tensor"}, {})
    assert status == 400 and "is not one of" in msg
    status, msg = _error(read_inputs, {"inputs": [[1.0]], "dtype": "__class__"}, {})
    assert status == 400
    assert "rectangular" in _error(read_inputs, {"inputs": [[1.0, 2.0], [3.0]]}, {})[1]
    assert "not an array" in _error(read_inputs, {"inputs": {"input_ids": "hello"}}, {})[1]
    assert "not integers" in _error(read_inputs, {"inputs": {"input_ids": [[1.5, 2.0]]}}, {})[1]
    assert _error(read_inputs, {"inputs": [[1, "a"]]}, {})[0] == 400


def test_numbers_empty_arrays_and_bodies_that_are_not_utf8_are_400_naming_the_problem():
    status, msg = _error(read_inputs, {"inputs": 5}, {})
    assert status == 400 and "is a JSON number, not an array" in msg
    status, msg = _error(read_inputs, {"inputs": []}, {})
    assert status == 400 and "empty" in msg
    status, msg = _error(read_inputs, {"inputs": {"input_ids": [[]]}}, {})
    assert status == 400 and "'input_ids' is empty" in msg
    status, msg = _error(read_inputs, {"inputs": True}, {})
    assert status == 400 and "boolean" in msg
    status, msg = _error(parse_body, '{"inputs": [[1.0]]}'.encode("utf-16"), Limits())
    assert status == 400 and "not UTF-8" in msg


def test_answers_with_numbers_that_are_not_finite_are_valid_json():
    from graphwrap.serve.wire import to_json

    out = to_json({"y": torch.tensor([[1.0, float("nan")], [float("inf"), -float("inf")]]), "s": float("nan"),
                   "n": torch.tensor([1, 2])})
    text = json.dumps(out, allow_nan=False)  # raises on a bare NaN
    assert json.loads(text) == {"y": [[1.0, "NaN"], ["Infinity", "-Infinity"]], "s": "NaN", "n": [1, 2]}


def test_status_of_errors_an_operator_raises_for_the_inputs_whatever_their_case():
    msg = ("Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; "
           "but got torch.cuda.FloatTensor instead (while checking arguments for embedding)")
    assert status_of(RuntimeError(msg)) == 422
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB; max_split_size_mb ...")
    assert status_of(oom) == 500
    assert status_of(RuntimeError("CUDA error: device-side assert triggered (index out of range)")) == 500


def test_limits_are_413():
    limits = Limits(max_body_bytes=100, max_rows=4, max_length=8)
    status, msg = _error(parse_body, b"[" + b"1," * 60 + b"1]", limits)
    assert status == 413 and "max_body_bytes=100" in msg
    status, msg = _error(check_limits, (torch.zeros(5, 3),), {}, limits)
    assert status == 413 and "5 rows" in msg
    status, msg = _error(check_limits, (), {"input_ids": torch.zeros(2, 9, dtype=torch.long)}, limits, 1)
    assert status == 413 and "length 9" in msg and "'input_ids'" in msg
    check_limits((torch.zeros(4, 8),), {"pos": torch.zeros(())}, limits, 1)  # at the limits: fine
    # max_length counts positions along the sequence dimension only: a wide row of features is no sequence
    check_limits((torch.zeros(2, 5000),), {}, limits)
    check_limits((), {"input_ids": torch.zeros(2, 8, dtype=torch.long), "features": torch.zeros(2, 5000)}, limits,
                 {"input_ids": 1})
    status, msg = _error(check_limits, (), {"input_ids": torch.zeros(2, 9, dtype=torch.long)}, limits, {"input_ids": 1})
    assert status == 413 and "length 9" in msg
    status, _ = _error(check_limits, (torch.zeros(2, 3, 9),), {}, limits, {0: 2})
    assert status == 413
    with pytest.raises(GraphwrapError, match="max_rows"):
        Limits(max_rows=0)


def test_ids_outside_their_bounds_are_422_before_the_module_sees_them():
    limits = Limits(id_bounds={"input_ids": 50, "token_type_ids": 2})
    ok = {"input_ids": torch.tensor([[0, 49]]), "token_type_ids": torch.tensor([[0, 1]])}
    check_limits((), ok, limits)
    status, msg = _error(check_limits, (), dict(ok, input_ids=torch.tensor([[3, 50]])), limits)
    assert status == 422 and "'input_ids' holds ids from 3 to 50, outside [0, 50)" in msg
    status, msg = _error(check_limits, (), dict(ok, token_type_ids=torch.tensor([[-1, 0]])), limits)
    assert status == 422 and "'token_type_ids'" in msg
    with pytest.raises(GraphwrapError, match="id_bounds"):
        Limits(id_bounds={"input_ids": 0})


def test_a_hugging_face_config_bounds_the_ids():
    from graphwrap.serve import Server, with_config_bounds

    class Configured(Embedder):
        class config:  # what a transformers model carries
            vocab_size, type_vocab_size = 50, 2

    assert with_config_bounds(Limits(), Configured()).id_bounds == {"input_ids": 50, "token_type_ids": 2}
    assert with_config_bounds(Limits(id_bounds={}), Configured()).id_bounds == {}  # the user's choice
    assert with_config_bounds(Limits(), Embedder()).id_bounds is None
    server = Server(Configured)
    status, body = _answer(server, {"inputs": {"input_ids": [[1, 50]], "attention_mask": [[1, 1]]}})
    assert status == 422 and "outside [0, 50)" in body["error"]
    assert server.batcher.stats()["requests"] == 0
    status, body = _answer(server, {"inputs": {"input_ids": [[1, 49]], "attention_mask": [[1, 1]]}})
    assert status == 200


def test_status_of_a_failure():
    assert status_of(ValueError("NaN in the input")) == 422
    assert status_of(RuntimeError("mat1 and mat2 shapes cannot be multiplied (1x5 and 4x16)")) == 422
    assert status_of(RuntimeError("CUDA error: an illegal memory access was encountered")) == 500
    assert status_of(KeyError("x")) == 500


# ---------------------------------------------------------------------------------- the Server


class _Request:
    def __init__(self, body):
        self._body = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def body(self):
        return self._body


def _answer(server, body):
    pytest.importorskip("starlette", reason='the HTTP answer needs starlette: pip install -e ".[serve]" in a checkout')
    r = asyncio.run(server(_Request(body)))
    if isinstance(r, dict):
        return 200, r
    return r.status_code, json.loads(r.body)


def test_the_server_answers_each_status_and_keeps_serving():
    from graphwrap.serve import Server

    server = Server(NoNaN, limits={"max_rows": 8})
    model = NoNaN().eval()
    x = [[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, -1.0, 0.5]]
    status, body = _answer(server, {"inputs": x})
    assert status == 200
    torch.testing.assert_close(torch.tensor(body["outputs"]), model(torch.tensor(x)).detach())
    assert _answer(server, b"{oops")[0] == 400
    status, body = _answer(server, {"inputs": [[0.0] * 4] * 9})
    assert status == 413 and "max_rows=8" in body["error"]
    for bad in (b'{"inputs": [[NaN, 0, 0, 0]]}', b'{"inputs": [[Infinity, 0, 0, 0]]}', b'{"inputs": [[1e400, 0, 0, 0]]}'):
        status, body = _answer(server, bad)  # numbers JSON has not: refused before the module
        assert status == 400 and "holds NaN or infinite numbers" in body["error"], body
    lenient = Server(NoNaN, limits={"non_finite": True})
    status, body = _answer(lenient, {"inputs": [[float("nan")] * 4]})
    assert status == 422 and "NaN in the input" in body["error"], "taken, and refused by the model itself"
    status, body = _answer(server, {"inputs": [[0.0] * 5]})  # a wrong width
    assert status == 422 and "shapes cannot be multiplied" in body["error"]
    status, body = _answer(server, {"inputs": [[1e7] * 4]})
    assert status == 500 and "KeyError" in body["error"]
    status, body = _answer(server, {"inputs": x})  # still serving
    assert status == 200 and len(body["outputs"]) == 2
    s = server.stats()
    assert s["http_status"] == {200: 2, 400: 4, 413: 1, 422: 1, 500: 1}
    assert s["batcher"]["requests"] == 4  # the 400s and the 413 never reached the module


class _Get(_Request):
    method = "GET"


def test_a_get_is_405_and_float_ids_to_an_embedding_are_422_not_500():
    from graphwrap.serve import Server

    pytest.importorskip("starlette", reason='the HTTP answer needs starlette: pip install -e ".[serve]" in a checkout')
    server = Server(Embedder)
    r = asyncio.run(server(_Get(b"")))
    assert r.status_code == 405 and "POST" in json.loads(r.body)["error"]
    ids = [[1, 2, 3]]
    status, body = _answer(server, {"inputs": {"input_ids": ids, "attention_mask": [[1, 1, 1]]},
                                    "dtypes": {"input_ids": "float32"}})
    assert status == 422 and "scalar type" in body["error"].lower()
    status, body = _answer(server, {"inputs": 5})
    assert status == 400
    status, body = _answer(server, {"inputs": {"input_ids": ids, "attention_mask": [[1, 1, 1]]}})
    assert status == 200


def test_named_inputs_preprocess_and_postprocess():
    from graphwrap.serve import Server

    model = Embedder().eval()
    server = Server(Embedder, graphed={"seq_dim": 1}, preprocess=tokenize, postprocess=mean_pool)
    status, body = _answer(server, {"texts": ["hello", "graphs"]})
    assert status == 200
    enc = tokenize({"texts": ["hello", "graphs"]})
    want = mean_pool(model(**enc), enc)
    torch.testing.assert_close(torch.tensor(body["outputs"]), want.detach())
    status, body = _answer(server, {"nothing": []})
    assert status == 400 and body["error"].startswith("preprocess: KeyError")

    plain = Server(Embedder)
    ids = [[3, 4, 5, 0]]
    status, body = _answer(plain, {"inputs": {"input_ids": ids, "attention_mask": [[1, 1, 1, 0]]}})
    assert status == 200
    want = model(torch.tensor(ids), torch.tensor([[1, 1, 1, 0]]))
    torch.testing.assert_close(torch.tensor(body["outputs"]), want.detach())
    # through a handle's path: tensors in, postprocess applied, tensors on the CPU out
    out = asyncio.run(server.infer(**enc))
    torch.testing.assert_close(out, want_pooled := mean_pool(model(**enc), enc).detach())
    assert out.device.type == "cpu" and want_pooled.shape == (2, 8)


def test_server_arguments_are_checked_before_any_replica_starts():
    from graphwrap.serve.ray_serve import Server, check_args, deployment

    model = torch.nn.Linear(4, 2)
    for make in (Server, deployment):
        with pytest.raises(GraphwrapError, match="factory must be a function that builds the model, got Linear"):
            make(model)
    bad = [
        (dict(limits={"bogus": 1}), r"limits takes \['max_body_bytes'.*got \['bogus'\]"),
        (dict(limits={"id_bounds": [1]}), "id_bounds must be a dict of input name"),
        (dict(limits=3), "limits must be"),
        (dict(graphed={"outputs": "x"}), 'outputs must be "clone" or "view"'),
        (dict(graphed={"bogus": 1}), r"graphed takes .*got \['bogus'\]"),
        (dict(batcher={"delay": 1}), r"batcher takes .*got \['delay'\]"),
        (dict(dtypes={None: "float17"}), "dtypes\\[None\\] must be a torch dtype or one of"),
        (dict(dtypes={3: torch.float16}), "dtypes keys are input names"),
    ]
    for kwargs, words in bad:
        with pytest.raises(GraphwrapError, match=words):
            check_args(lambda: model, kwargs.get("graphed"), kwargs.get("batcher"), kwargs.get("limits"),
                       kwargs.get("dtypes"))
    limits, dtypes = check_args(lambda: model, {"outputs": "view"}, {"max_delay_ms": 1}, {"max_rows": 8},
                                {None: "float16", "mask": torch.int64})
    assert limits.max_rows == 8 and dtypes == {None: torch.float16, "mask": torch.int64}


def test_bodies_json_cannot_hold_well_are_400_in_jsons_own_words():
    from graphwrap.serve import Server

    server = Server(NoNaN)
    status, body = _answer(server, b"[" * 100_000)
    assert status == 400 and "nests arrays or objects too deeply" in body["error"]
    for inputs, words in ((None, "a JSON null"), ("abc", "a JSON string"), ({"x": {"y": 1}}, "a JSON object"),
                          (3, "a JSON number")):
        status, body = _answer(server, {"inputs": inputs})
        assert status == 400 and words in body["error"], (inputs, body)
    status, body = _answer(server, [1, 2])
    assert status == 400 and "the body is a JSON array" in body["error"]
    ids = Server(Embedder)
    status, body = _answer(ids, {"inputs": {"input_ids": [[1e30, 2]]}})
    assert status == 400 and "outside int64's range" in body["error"] and "-9223372036854775808, " in body["error"]
