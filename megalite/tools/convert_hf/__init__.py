"""Hugging Face interop: GPT-2, BERT, the Llama family (Llama, Mistral, Qwen2, Qwen3) and the
mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), DeepSeek-V3, Nemotron and gpt-oss weights
into megalite and back.

    from megalite.tools.convert_hf import from_hf, to_hf, model_kind
    config, sd = from_hf(hf_model_or_saved_dir)   # GPT2LMHeadModel, LlamaForCausalLM, ... (SUPPORTED)
    kind = model_kind(sd)                         # "gpt" | "bert"  (also hf_model_kind(model_or_dir))
    model = (GPTModel if kind == "gpt" else BERTModel)(config, seed=0)
    model.load_state_dict(sd)                     # single device, tp = 1
    hf = to_hf(config, sd)                        # the inverse (architecture= picks the class)

Command line (checkpoints through `megalite.checkpoint`):

    python -m megalite.tools.convert_hf import --hf-dir HF_DIR --out CKPT_DIR
    python -m megalite.tools.convert_hf export --load CKPT_DIR --out HF_DIR [--architecture CLASS]

Modules: `common` (the table engine: each parameter maps through one row saying how its tensor
changes; refusals; reading directories), one per family with its table and config mapping
(`gpt2`, `bert`, `llama`, `moe`, `deepseek`, `nemotron`, `gpt_oss`; docs/hf.md lists the tables; `yarn_rope`
maps YaRN for those that have it), DeepSeek-V3's parts beside
`deepseek` (`deepseek_mla` attention, `deepseek_moe` routing and experts, `deepseek_mtp` multi-token
prediction, over `deepseek_shape`), `convert` (from_hf / to_hf: which family), `cli`.
"""
from megalite.tools.convert_hf.cli import main
from megalite.tools.convert_hf.common import ConversionError, ConversionNote
from megalite.tools.convert_hf.convert import SUPPORTED, from_hf, hf_model_kind, model_kind, to_hf

__all__ = ["SUPPORTED", "ConversionError", "ConversionNote", "from_hf", "hf_model_kind", "main", "model_kind",
           "to_hf"]
