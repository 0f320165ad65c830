"""Generation (megalite.generation, python -m megalite.tools.generate): tiny Llama, Mixtral-style MoE,
DeepSeek-V3-style (MLA + MoE, sigmoid router with expert biases, a shared expert) and GPT-2 models
built in megalite (random weights moved off their init), saved as megalite checkpoints and exported
with megalite's exporter: greedy tokens equal transformers' `generate(do_sample=False)` on the export,
stopping at the same end-of-sequence token, at tp 1, tp 2, pp 2 and ep 2; the cached decode equals
recomputing the whole prefix; a batch of unequal prompts equals each prompt alone; seeded sampling
is reproducible and the same on every TP rank; the command line prints completions, errors in one line."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

tf = pytest.importorskip("transformers")

from helpers import randomized  # noqa: E402
from megalite import checkpoint, parallel  # noqa: E402
from megalite.generation import Sampling, filtered, generate, log_samples, next_tokens  # noqa: E402
from megalite.models import GPTModel, TransformerConfig  # noqa: E402
from megalite.testing import run_ranks  # noqa: E402
from megalite.tools.convert_hf import to_hf  # noqa: E402

VOCAB, NEW = 96, 8
PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16]]  # unequal: left-padded together
_ROPE = dict(position_embedding_type="rope", normalization="rmsnorm", gated_linear_unit=True, activation="silu",
             add_bias_linear=False, untie_embeddings_and_output_weights=True)
_COMMON = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
               layernorm_epsilon=1e-5)
FAMILIES = {
    "llama": dict(_ROPE, num_query_groups=2, ffn_hidden_size=48),
    "mixtral": dict(_ROPE, num_query_groups=2, ffn_hidden_size=24, num_moe_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=24),
    "deepseek": dict(_ROPE, layernorm_epsilon=1e-6, multi_latent_attention=True, q_lora_rank=20, kv_lora_rank=12,
                     qk_head_dim=6, qk_pos_emb_head_dim=8, v_head_dim=10, ffn_hidden_size=40, num_moe_experts=4,
                     moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1],
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_shared_expert_intermediate_size=16),
    "gpt2": dict(),  # learned positions, LayerNorm, GELU, biases, tied
}


def _config(name: str, **changes) -> TransformerConfig:
    return TransformerConfig(**{**_COMMON, **FAMILIES[name], **changes})


def _model(name: str, **changes) -> GPTModel:
    """A one-device model of family `name`, every weight moved off its init, routers sharpened and
    expert biases set so that routing decides."""
    model = randomized(GPTModel(_config(name, **changes), seed=1, device="cpu"), seed=sorted(FAMILIES).index(name) + 2)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in model.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.weight.mul_(4.0)
                if router.expert_bias is not None:
                    router.expert_bias.copy_(0.5 * torch.randn(router.expert_bias.shape, generator=gen))
    return model


@torch.no_grad()
def _hf_greedy(hf, prompt, eos):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0 if eos is None else eos)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """{family: (one-device model, checkpoint directory, eos id, transformers' greedy tokens per
    prompt)}. The eos id is a token the first prompt's greedy completion reaches mid-way, so that row
    stops early there while the others go on."""
    out = {}
    for name in FAMILIES:
        model = _model(name)
        sd = model.state_dict()
        directory = tmp_path_factory.mktemp(f"ckpt-{name}")
        checkpoint.save_model_checkpoint(directory, model.config, "gpt", sd, iteration=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = to_hf(model.config, sd)
            eos = _hf_greedy(hf, PROMPTS[0], None)[3]
            reference = [_hf_greedy(hf, p, eos) for p in PROMPTS]
        out[name] = (model, str(directory), eos, reference)
    return out


# --- one device ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_tokens_equal_transformers_generate_on_the_export(name, families):
    model, _, eos, reference = families[name]
    assert reference[0][-1] == eos and len(reference[0]) <= 4 < NEW  # the first row stops early
    batch = generate([model], PROMPTS, max_new_tokens=NEW, eos_id=eos)
    assert batch.tokens == reference
    for prompt, expected in zip(PROMPTS, reference):
        assert generate([model], [prompt], max_new_tokens=NEW, eos_id=eos).tokens == [expected]


YARN = dict(yarn_factor=4.0, yarn_original_max_position_embeddings=16, yarn_mscale=1.0, yarn_mscale_all_dim=0.7)


@pytest.mark.parametrize("name", ["llama", "mixtral", "deepseek-yarn-mtp", "gpt2"])
def test_cached_decode_equals_recomputing_the_whole_prefix(name):
    """Each step's logits (prefill of unequal, left-padded prompts, then one token a step against
    the cache) equal the logits of the whole sequence so far run without a cache, within 1e-5. The
    DeepSeek model's rope is YaRN's and it carries a multi-token prediction module, unused."""
    model = _model("deepseek", mtp_num_layers=1, **YARN) if name == "deepseek-yarn-mtp" else _model(name)
    assert_cached_decode_is_the_whole_prefixs(model)


def assert_cached_decode_is_the_whole_prefixs(model, new: int = NEW) -> None:
    """`new` greedy steps of PROMPTS against the cache: each step's logits within 1e-5 of the whole
    sequence so far run without a cache, and its token their argmax."""
    out = generate([model], PROMPTS, max_new_tokens=new, eos_id=None, return_logits=True)
    assert len(out.logits) == new
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS):
            full = model(torch.tensor([prompt + out.tokens[row]]))[0, :, :VOCAB]
            for step in range(new):
                expected = full[len(prompt) - 1 + step]
                assert (out.logits[step][row] - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
                assert out.tokens[row][step] == expected.argmax().item()


def test_seeded_sampling_is_reproducible_and_filters_as_asked():
    model = _model("llama")
    kwargs = dict(max_new_tokens=NEW, eos_id=None, temperature=1.0, top_k=20, top_p=0.9)
    first = generate([model], PROMPTS, seed=3, **kwargs).tokens
    assert generate([model], PROMPTS, seed=3, **kwargs).tokens == first
    assert generate([model], PROMPTS, seed=4, **kwargs).tokens != first
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).log_softmax(-1)
    assert torch.isfinite(filtered(logits, top_k=2)).tolist() == [[False, False, False, True, True]]
    probs = torch.tensor([[0.05, 0.1, 0.15, 0.3, 0.4]]).log()  # the top two hold 0.7: p 0.6 keeps them
    assert torch.isfinite(filtered(probs, top_p=0.6)).tolist() == [[False, False, False, True, True]]
    assert torch.isfinite(filtered(probs, top_p=0.01)).tolist() == [[False, False, False, False, True]]
    gen = torch.Generator().manual_seed(0)
    assert next_tokens(probs, Sampling(temperature=1.0, top_p=0.01), gen).tolist() == [4]
    with pytest.raises(ValueError, match="--top-p must be in"):
        Sampling(top_p=0.0)


def test_bad_requests_are_refused_in_one_line():
    model = _model("llama")
    with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings \(64\)"):
        generate([model], [[1] * 60], max_new_tokens=8)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate([model], [[VOCAB]], max_new_tokens=2)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        generate([model], ["hello"], max_new_tokens=2)


class _Letters:
    """A tokenizer of lower-case letters (ids 10..35) and spaces (36), end of sequence 1."""
    eod, bos, add_bos = 1, None, False

    def tokenize(self, text):
        return [36 if c == " " else ord(c) - 87 for c in text]

    def detokenize(self, ids):
        return "".join(" " if i == 36 else chr(i + 87) if 10 <= i < 36 else "?" for i in ids)


class _Board:
    def __init__(self):
        self.texts = []

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))


def test_training_samples_go_to_the_log_and_tensorboard(tmp_path):
    model = _model("llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n\nthe cat\n")
    said, board = [], _Board()
    texts = log_samples([model], prompts, _Letters(), iteration=5, say=said.append, tensorboard=board, max_new_tokens=4)
    assert texts == generate([model], ["hello", "the cat"], tokenizer=_Letters(), max_new_tokens=4).texts
    assert said == [f"megalite: sample at iteration 5: 'hello' -> {texts[0]!r}",
                    f"megalite: sample at iteration 5: 'the cat' -> {texts[1]!r}"]
    assert len(board.texts) == 1 and board.texts[0][0] == "samples" and board.texts[0][2] == 5
    assert f"| the cat | {texts[1]} |" in board.texts[0][1]


# --- at other layouts, from the checkpoints ------------------------------------------------------------

def _at_layouts(rank, world_size, layouts, runs):
    """Every (family, checkpoint, eos) of `runs` loaded and run at each (tp, pp, ep) of `layouts`
    (ep 2 for the families with experts): {(tp, pp, ep, family): (greedy tokens of the batch, seeded
    samples at tp 2, else None)}."""
    from megalite.tools.generate import build_stage

    out = {}
    for tp, pp, ep in layouts:
        parallel.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
        parallel.model_parallel_manual_seed(1)
        for name, directory, eos in runs:
            if ep > 1 and "num_moe_experts" not in FAMILIES[name]:
                continue
            model, _ = build_stage(directory, tp, pp, "cpu")
            greedy = generate([model], PROMPTS, max_new_tokens=NEW, eos_id=eos).tokens
            sampled = None if tp == 1 else generate([model], PROMPTS, max_new_tokens=NEW, eos_id=None, temperature=1.0,
                                                    top_k=30, top_p=0.95, seed=7).tokens
            out[(tp, pp, ep, name)] = (greedy, sampled)
        parallel.destroy_model_parallel()
    return out


LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]  # tp 2 (MoE under sequence parallelism), pp 2, ep 2


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_at_tp2_pp2_and_ep2(families):
    runs = [(name, directory, eos) for name, (_, directory, eos, _) in families.items()]
    results = run_ranks(_at_layouts, 2, args=(LAYOUTS, runs), timeout=240)
    assert len(results[0]) == len(results[1]) == 2 * len(FAMILIES) + 2  # ep 2: the two MoE families
    for key, (greedy, sampled) in results[0].items():
        reference = families[key[-1]][3]
        assert greedy == reference == results[1][key][0], key
        assert sampled == results[1][key][1], key  # seeded draws: the same on both TP ranks


# --- the command line --------------------------------------------------------------------------------

def test_cli_prints_completions_of_prompt_ids_and_refuses_in_one_line(families, tmp_path, capsys):
    from megalite.tools.generate import main

    _, directory, eos, reference = families["llama"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(map(str, p)) for p in PROMPTS) + "\n\n")
    capsys.readouterr()
    assert main(["--load", directory, "--prompt-file", str(prompts), "--prompt-ids", "--max-new-tokens", str(NEW),
                 "--eos-id", str(eos), "--jsonl", "--batch-size", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["tokens"] for line in lines] == reference
    assert lines[1]["prompt"] == "10 11" and lines[1]["completion"] == " ".join(map(str, reference[1]))
    assert main(["--load", directory, "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names no tokenizer: give --tokenizer" in err[0], err
    assert main(["--load", str(tmp_path / "missing"), "--prompt", "1", "--prompt-ids"]) == 2
    assert "does not exist" in capsys.readouterr().err
