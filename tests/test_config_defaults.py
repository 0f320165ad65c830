"""One default for each setting that both TransformerConfig and the command line carry: a model
built in Python trains like the same model built by pretrain_gpt.py / pretrain_bert.py."""
import pytest

from megalite import arguments
from megalite.models import TransformerConfig, preset

SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)


@pytest.mark.parametrize("default_model", ["gpt-tiny", "bert-tiny"])
@pytest.mark.parametrize("field", ["hidden_dropout", "attention_dropout"])
def test_config_dropout_default_is_the_command_line_default(default_model, field):
    cli = arguments.build_parser("test", default_model=default_model).parse_args([])
    assert getattr(TransformerConfig(**SHAPE), field) == getattr(cli.model, field) == 0.0
    assert getattr(preset(default_model), field) == getattr(arguments.model_config(cli), field)
