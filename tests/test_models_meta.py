"""Models build on the meta device with the parameters of a real build (the planner counts them
that way, without memory), and each feature's registry holds components that build and run."""
import pytest
import torch

from megalite.models import BERTModel, GPTModel, TransformerConfig, TransformerLayer
from megalite.models.attention import ATTENTION_BACKENDS
from megalite.models.mlp import ACTIVATIONS
from megalite.models.norms import NORMS

H = 32
VARIANTS = {
    "pre-layernorm": {},
    "post-layernorm": dict(layernorm_position="post", activation="gelu"),
    "rmsnorm": dict(normalization="rmsnorm"),
}


def tiny_config(**changes):
    return TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4, vocab_size=100,
                             max_position_embeddings=16, **changes)


def shapes(module):
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def count(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_transformer_layer_built_on_meta_has_the_parameters_of_a_real_build(variant):
    config = tiny_config(**VARIANTS[variant])
    meta = TransformerLayer(config, layer_number=1, seed=3, device="meta")
    real = TransformerLayer(config, layer_number=1, seed=3, device="cpu")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert shapes(meta) == shapes(real)
    # QKV 3h^2 + 3h, projection h^2 + h, MLP 8h^2 + 5h, two norms of 2h (LayerNorm) or h (RMSNorm).
    norm_params = 2 * (H if variant == "rmsnorm" else 2 * H)
    assert count(meta) == count(real) == 12 * H * H + 9 * H + norm_params


@pytest.mark.parametrize("model_class", [GPTModel, BERTModel])
@pytest.mark.parametrize("pre_process, post_process", [(True, True), (True, False), (False, True)])
def test_a_model_stage_built_on_meta_has_the_parameters_of_a_real_build(model_class, pre_process, post_process):
    config = tiny_config()
    meta = model_class(config, pre_process, post_process, layer_numbers=[1], seed=3, device="meta")
    real = model_class(config, pre_process, post_process, layer_numbers=[1], seed=3, device="cpu")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert shapes(meta) == shapes(real) and count(meta) == count(real)


@pytest.mark.parametrize("field, name", [("attention_backend", n) for n in ATTENTION_BACKENDS]
                         + [("normalization", n) for n in NORMS] + [("activation", n) for n in ACTIVATIONS])
def test_every_registered_component_builds_and_runs_in_a_layer(field, name):
    config = tiny_config(**{field: name})  # the config accepts every registered name
    layer = TransformerLayer(config, layer_number=0, seed=3, device="cpu")
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(0))
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("field", ["attention_backend", "normalization", "activation"])
def test_a_component_name_no_registry_holds_is_refused_by_the_config(field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**{field: "nonesuch"})
