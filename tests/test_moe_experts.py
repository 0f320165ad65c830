"""grouped_linear's two paths on a CPU: torch's grouped GEMM (fp32, rows of 16-byte multiples, not
while compiling) and the loop of torch.mm; both equal per-expert matmuls in outputs and gradients,
experts without rows included, and a compiled graph takes the loop (torch's meta function for the
grouped GEMM takes bf16 only)."""
import pytest
import torch

from megalite.models.moe import experts as E


def _per_expert(x, w, counts):
    return torch.cat([xe @ w[e].t() for e, xe in enumerate(x.split(counts))])


def _run(fn, x, w, grad):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 16, 0], [4, 4, 4, 4]], ids=["uneven", "one", "even"])
def test_the_grouped_gemm_and_the_loop_equal_per_expert_matmuls(counts):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(sum(counts), 8, generator=g), torch.randn(4, 12, 8, generator=g)
    grad = torch.randn(sum(counts), 12, generator=g)
    assert E._grouped_mm_applies(x, w)
    want = _run(lambda a, b: _per_expert(a, b, counts), x, w, grad)
    grouped = _run(lambda a, b: E.grouped_linear(a, b, counts), x, w, grad)
    original = E._grouped_mm_applies
    E._grouped_mm_applies = lambda a, b: False
    try:
        loop = _run(lambda a, b: E.grouped_linear(a, b, counts), x, w, grad)
    finally:
        E._grouped_mm_applies = original
    for got in (grouped, loop):
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert grouped[2][[c == 0 for c in counts]].abs().sum() == 0  # experts no row reached: zero gradient


def test_where_the_grouped_gemm_applies_on_a_cpu(monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(2, 12, 8)
    assert E._grouped_mm_applies(x, w)
    assert not E._grouped_mm_applies(x.bfloat16(), w.bfloat16())  # CPU bf16: the loop
    assert not E._grouped_mm_applies(torch.randn(4, 6), torch.randn(2, 12, 6))  # 24-byte rows
    assert not E._grouped_mm_applies(x[:0], w)  # no rows
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not E._grouped_mm_applies(x, w)


def test_a_compiled_grouped_linear_equals_the_eager_one():
    counts = [3, 0, 5]
    g = torch.Generator().manual_seed(1)
    x, w, grad = torch.randn(8, 8, generator=g), torch.randn(3, 4, 8, generator=g), torch.randn(8, 4, generator=g)
    eager = _run(lambda a, b: E.grouped_linear(a, b, counts), x, w, grad)
    compiled = _run(torch.compile(lambda a, b: E.grouped_linear(a, b, counts), backend="aot_eager"), x, w, grad)
    for a, b in zip(compiled, eager):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_compiled_moe_layer_equals_the_eager_one_with_its_loss_terms_and_figures():
    """What --torch-compile does to each layer, on one MoE layer: outputs, input and weight gradients
    (the aux and z-loss terms' included), and the figures the log line reads, as eager. (Whole runs:
    3 iterations of the tiny MoE GPT under --torch-compile give the eager losses bitwise, by hand,
    2026-11-26; 125 s of compiling, so not in CI.)"""
    from megalite.models.config import TransformerConfig
    from megalite.models.moe import stats
    from megalite.models.moe.layer import MoELayer

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                               moe_router_topk=2, moe_ffn_hidden_size=8, gated_linear_unit=True, activation="silu",
                               normalization="rmsnorm", add_bias_linear=False, moe_aux_loss_coeff=0.01,
                               moe_z_loss_coeff=0.001, moe_shared_expert_intermediate_size=8)
    torch.manual_seed(0)
    layer = MoELayer(config, layer_number=0).train()
    g = torch.Generator().manual_seed(2)
    x, grad = torch.randn(6, 2, 16, generator=g), torch.randn(6, 2, 16, generator=g)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(grad)
        figures = stats.take([layer], 1, [0], 4, torch.device("cpu"))
        return [y.detach(), xi.grad, *(p.grad for p in layer.parameters())], figures

    eager, eager_figures = run(layer)
    compiled, compiled_figures = run(torch.compile(layer, backend="aot_eager"))
    for a, b in zip(compiled, eager):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    assert eager_figures["moe_aux_loss"] > 0 and eager_figures["moe_z_loss"] > 0
    assert compiled_figures.keys() == eager_figures.keys()
    for k in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance", "moe_dropped_fraction"):
        assert compiled_figures[k] == pytest.approx(eager_figures[k], rel=1e-6), k


def test_two_moe_models_in_one_process_keep_their_figures_apart():
    """Issue #49: the figures lived in module state keyed by layer number, so a second MoE model (other
    experts) crashed in `record` unless `reset()` was called; now each layer holds its own."""
    from megalite.models.config import TransformerConfig
    from megalite.models.moe import stats
    from megalite.models.moe.layer import MoELayer

    def layer(experts):
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=experts,
                                   moe_router_topk=2, moe_ffn_hidden_size=8, gated_linear_unit=True,
                                   activation="silu", normalization="rmsnorm", add_bias_linear=False)
        return MoELayer(config, layer_number=0).train()

    torch.manual_seed(0)
    four, eight = layer(4), layer(8)
    x = torch.randn(6, 2, 16)
    four(x).sum().backward()
    eight(x).sum().backward()
    eight(x).sum().backward()
    a = stats.take([four], 1, [0], 4, torch.device("cpu"))
    b = stats.take([eight], 1, [0], 8, torch.device("cpu"))
    assert four.figures is None and eight.figures is None  # taken: the next log line starts anew
    assert len(a["moe_load_imbalance_per_layer"]) == 1 and a["moe_load_imbalance"] >= 1.0
    assert b["moe_load_imbalance"] >= 1.0 and a["moe_dropped_fraction"] == b["moe_dropped_fraction"] == 0.0


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 16, 0], [4, 4, 4, 4]], ids=["uneven", "one", "even"])
def test_a_grouped_linear_by_groups_of_experts_equals_the_whole_bitwise(counts):
    # The chunked dispatcher's GEMMs (megalite.models.moe.chunked): each group of experts multiplies
    # its rows with its slice of the weights; the group whose backward runs last computes the whole
    # weight's gradient from every group's rows, groups without rows included.
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(sum(counts), 8, generator=g), torch.randn(4, 12, 8, generator=g)
    grad = torch.randn(sum(counts), 12, generator=g)
    for loop in (False, True):
        original = E._grouped_mm_applies
        if loop:
            E._grouped_mm_applies = lambda a, b: False
        try:
            whole = _run(lambda a, b: E.grouped_linear(a, b, counts), x, w, grad)
            groups, shared = [(0, 2), (2, 3), (3, 4)], E.SharedGradient(3)

            def by_groups(a, b):
                rows = a.split([sum(counts[lo:hi]) for lo, hi in groups])
                return torch.cat([E._GroupedLinearOfGroup.apply(r, b, counts[lo:hi], lo, hi, shared)
                                  for r, (lo, hi) in zip(rows, groups)])
            grouped = _run(by_groups, x, w, grad)
        finally:
            E._grouped_mm_applies = original
        assert all(torch.equal(a, b) for a, b in zip(whole, grouped))
        assert shared.left == 0 and shared.parts == []
