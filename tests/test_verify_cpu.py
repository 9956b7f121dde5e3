import torch

from graphwrap.core.compare import compare_leaves, compare_tensors, tolerance


def test_float_tolerance_scales_with_magnitude():
    w = torch.randn(100, dtype=torch.float32) * 1e6
    assert compare_tensors(w * (1 + 1e-6), w, tolerance(torch.float32)) is None
    assert "max abs diff" in compare_tensors(w * 1.01, w, tolerance(torch.float32))


def test_a_single_wrong_element_is_caught():
    w = torch.randn(64, 64)
    g = w.clone()
    g[10, 10] += 0.5
    assert compare_tensors(g, w, tolerance(torch.float32)) is not None


def test_nan_and_inf_positions_must_match():
    w = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    assert compare_tensors(w.clone(), w, 1e-4) is None
    g = w.clone()
    g[0] = float("nan")
    assert "NaN" in compare_tensors(g, w, 1e-4)
    g = w.clone()
    g[2] = -float("inf")
    assert "infinities" in compare_tensors(g, w, 1e-4)


def test_integers_exact_and_shapes_checked():
    w = torch.arange(10)
    assert compare_tensors(w.clone(), w, 0.0) is None
    assert "1 of 10" in compare_tensors(w + (w == 3), w, 0.0)
    assert "shape" in compare_tensors(w[:5], w, 0.0)


def test_half_precision_tolerances_are_looser():
    assert tolerance(torch.float16) > tolerance(torch.float32) > tolerance(torch.float64)
    assert tolerance(torch.bfloat16) >= tolerance(torch.float16)
    assert tolerance(torch.int64) == 0.0


def test_compare_leaves_names_the_leaf():
    a = [torch.ones(2), 3]
    assert compare_leaves(a, [torch.ones(2), 3]) is None
    assert compare_leaves(a, [torch.ones(2), 4]).startswith("output 1")
    assert compare_leaves(a, [torch.zeros(2), 3], names=lambda i: f"out[{i}]").startswith("out[0]")
