"""Activation memory per transformer layer, from Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv:2205.05198), section 4.

Bytes stored for backward by one layer with 16-bit activations and 1-byte dropout masks, s the
sequence length, b the micro-batch, h the hidden size, a the heads, t the tensor-parallel size:

    no parallelism                        s*b*h * (34 + 5*a*s/h)
    tensor parallel                       s*b*h * (10 + 24/t + 5*a*s/(h*t))
    tensor + sequence parallel            s*b*h * (34 + 5*a*s/h) / t
    selective recompute (attention core)  drops the 5*a*s/h term: s*b*h * (10 + 24/t), or 34*s*b*h/t with SP
    full recompute                        only the layer's input: 2*s*b*h (/t with SP)

The 5*a*s/h term is the attention core: softmax output (2*a*s^2*b), its dropout mask (a*s^2*b) and
the dropout output (2*a*s^2*b). Fused attention (SDPA flash) never stores it at all.

The same count for the Llama family's layers (s*b*h units): of the 34, 10 stay whole on every TP
rank (the two norms' inputs 4, the attention and MLP inputs 2 + 2, the two dropout masks 2); the
rest is split over TP by heads or ffn features: query 2, key and value 2 each times G/a with G
key/value groups (one group a rank when tp > G), the output projection's input 2, and the MLP's
ffn-wide tensors, 2*f/h each: two for GeLU (its input and fc2's), four for SwiGLU (fc1's gate and
up output, silu(gate) and fc2's input). qk-layernorm keeps its inputs, of which only the queries of
grouped-query attention's separate projection, 2, are not alive anyway (the keys are a view of the
key/value output, which the values keep), and its fp32 statistics, 4*(a + G)/h.
Rotary positions keep rotated copies where the unrotated tensors stay alive anyway: with
grouped-query attention's separate key/value projection the keys, 2*G/a; with multi-head
attention's fused QKV (whose output stays alive for the values) queries and keys, 4; and their fp32
cos/sin tables, 8*d_rot/(b*h) (one table shared by all layers: counted per layer, an upper bound).
PyTorch's fused attention (SDPA) keeps keys and values at G heads; the explicit attention backends
expand them to a heads first, so there grouped-query attention saves no activation memory (count
G = a). Norms are counted as the fused kernels keep them (their 16-bit input); the PyTorch
fallback of RMSNorm keeps fp32 copies, several times more.

Context parallelism (cp ranks, `megalite.parallel.context_parallel`): each rank holds s/cp tokens of
every sequence, so every term above is taken at s/cp. Attention then runs through the ring (p2p)
or the all-to-all (a2a) function, which never stores an s x s matrix (no 5*a*s/h core, as SDPA) and
keeps keys and values at G groups. What they keep besides, in units of (s/cp)*b*h per TP rank:
- p2p: the ring's autograd Function keeps q, k, v and its output (the tensors the layer keeps anyway:
  its output is the output projection's input) and the fp32 log-sum-exp of every query row, 4*a/h;
- a2a: the all-to-alls keep nothing; SDPA on the whole sequence with a/cp heads keeps the gathered
  q, k, v (the same bytes as the local ones), its fp32 log-sum-exp, 4*a/h, and its own output, 2,
  which goes back through the second all-to-all as a new tensor for the output projection.
Both are split over TP with the heads; a2a adds the two int64 index vectors of its reordering to
global token order, 16*s bytes whatever b, h and TP.

Multi-head latent attention (`megalite.models.mla`; r = q_lora_rank, c = kv_lora_rank, d_n, d_r,
d_v its head widths) keeps, in bytes per token (16-bit activations; s*b tokens):
- the attention input, 2h, whole on every TP rank even under sequence parallelism: the projections
  read the input gathered along the sequence, and the down projections' weight gradients need it;
- the latents, replicated on every TP rank: the queries' q_down output (q_norm's input, 2r) and
  q_norm's output (q_up's input, 2r); the keys' and values' latent c_kv (kv_norm's input, 2c: a
  slice of kv_down's output that the fused norm copies to a contiguous tensor, so kv_down's output
  itself is not kept, the shared rotary key going on to rope, which keeps only its cos/sin) and
  kv_norm's output (kv_up's input, 2c); each norm's fp32 mean and rstd, 8;
- split over TP by heads (a/t heads a rank): the queries and keys, each a new tensor of
  a*(d_n + d_r) (the shared rotary key expanded into every head), 2a(d_n + d_r) each; the values,
  a view of kv_up's output, which keeps that whole output alive, 2a(d_n + d_v); the attention's
  output (proj's input), 2a*d_v;
- the fp32 cos/sin tables of d_r dims, 8*d_r*s bytes per layer (as above).
The rest of the layer is the general formula's: the two norms' inputs, the MLP's input and the two
dropout masks (8h, split over TP under sequence parallelism), the MLP's ffn-wide tensors, and the
attention core 5*a*s bytes a token (/t) where it is stored (explicit backends, no recomputation);
but for the MLP's input under sequence parallelism, 2h whole rather than 2h/t: megalite's
column-parallel layers keep the input they gather along the sequence (Korthikanti et al. gather it
again in backward, as the general formula above assumes).
With context parallelism the values are padded to d_n + d_r for the ring or the all-to-all
(`MultiLatentAttention._core`): the padded copy, 2a(d_n + d_r), replaces kv_up's output, and the
core's own padded output, 2a(d_n + d_r), is kept besides the sliced copy proj reads (the p2p and
a2a terms above then count the log-sum-exp alone).
"""
from __future__ import annotations


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none", *, kv_heads: int | None = None, ffn: int | None = None,
                               gated: bool = False, qk_norm: bool = False, rope_dims: int = 0,
                               fused_qkv: bool = True, head_dim: int | None = None, qk_l2_norm: bool = False) -> float:
    """Bytes one TP rank keeps for one layer's backward (see the module docstring); the defaults
    are GPT-2's layer: multi-head attention, ffn = 4h, GeLU, heads h / a wide (`head_dim` otherwise:
    every per-head tensor, queries, keys, values and the output projection's input, scales by
    a * head_dim / h; the attention core's s x s scores do not)."""
    sbh = float(s) * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    core = 5.0 * a * s / h if recompute == "none" else 0.0
    kv_heads = a if kv_heads is None else kv_heads
    ffn = 4 * h if ffn is None else ffn
    kv_split = kv_heads % t == 0  # else each rank holds one whole group (t > G)
    wide = 1.0 if head_dim is None else a * head_dim / h  # the heads' total width in units of h
    kv = 4.0 * kv_heads / a * wide  # key and value
    sharded = 2.0 * wide + (kv if kv_split else 0.0) + 2.0 * wide + (8.0 if gated else 4.0) * ffn / h
    if qk_norm:
        sharded += (0.0 if fused_qkv else 2.0 * wide) + 4.0 * (a + kv_heads) / h
    if qk_l2_norm:  # Megatron-Core's L2Norm under autograd: fp32 copies of q and k, an fp32 rsqrt per head
        sharded += 4.0 * wide + (kv if kv_split else 0.0) + 4.0 * (a + kv_heads) / h
    if rope_dims:
        sharded += 4.0 * wide if fused_qkv else (kv if kv_split else 0.0) / 2
    one_group = 4.0 + (2.0 if rope_dims else 0.0) + (4.0 if qk_l2_norm else 0.0)  # its k, v (rotated k, fp32 k)
    per_rank_kv = 0.0 if kv_split else one_group / a * wide
    per_rank_kv += 8.0 * rope_dims / (b * h)  # cos and sin: whole on every rank, whole sequence
    if sequence_parallel:
        return sbh * (10.0 + sharded + core) / t + sbh * per_rank_kv
    return sbh * (10.0 + sharded / t + core / t) + sbh * per_rank_kv


def mla_activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                   recompute: str = "none", *, q_lora_rank: int | None, kv_lora_rank: int,
                                   qk_head_dim: int, qk_pos_emb_head_dim: int, v_head_dim: int,
                                   ffn: int | None = None, gated: bool = False, cp: int = 1) -> float:
    """Bytes one TP rank keeps for the backward of a layer with multi-head latent attention (see
    the module docstring), s the tokens of each sequence on this rank (s/cp of them with context
    parallelism, `cp` > 1 padding the values)."""
    tokens = float(s) * b
    if recompute == "full":
        return 2.0 * tokens * h / (t if sequence_parallel else 1)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    ffn = 4 * h if ffn is None else ffn
    qk = qk_head_dim + qk_pos_emb_head_dim
    values = qk if cp > 1 else qk_head_dim + v_head_dim  # the padded copy, or kv_up's output
    heads = 2.0 * a * (2 * qk + values + v_head_dim) + (2.0 * a * qk if cp > 1 else 0.0)
    mlp = (8.0 if gated else 4.0) * ffn
    core = 5.0 * a * s if recompute == "none" else 0.0
    latent = 4.0 * kv_lora_rank + 8.0 + (4.0 * q_lora_rank + 8.0 if q_lora_rank is not None else 0.0)
    # on every rank, whole: the (gathered) attention input and the latents, and under SP the MLP's
    # gathered input too (megalite's column-parallel layers keep the input they gather)
    whole = 2.0 * h + latent + (2.0 * h if sequence_parallel else 0.0)
    rope = 8.0 * qk_pos_emb_head_dim / b  # fp32 cos and sin, per token of one sequence
    rest = 6.0 * h if sequence_parallel else 8.0 * h  # norms' inputs, dropout masks (and the MLP input)
    return tokens * ((rest / t if sequence_parallel else rest) + (heads + mlp + core) / t + whole + rope)


def context_parallel_attention_bytes(s: int, b: int, h: int, a: int, t: int = 1, cp: int = 1,
                                     comm_type: str = "p2p", head_dim: int | None = None,
                                     a2a_size: int = 1) -> float:
    """Bytes the context-parallel attention keeps on one rank besides what the layer formula counts:
    the fp32 log-sum-exp of s/cp query rows and a/t heads, and for a2a SDPA's own output (see the
    module docstring) and its index vectors (int64, 16 s). a2a+p2p with an all-to-all of `a2a_size`
    ranks > 1 keeps the ring's output beside the copy the all-to-all returns, as a2a keeps SDPA's,
    and index vectors of the tokens it gathers (16 s / P); at 1 it is the ring. 0 at cp = 1, where
    the attention backend's count holds."""
    if comm_type not in ("p2p", "a2a", "a2a+p2p"):
        raise ValueError(f"the context-parallel communication is p2p, a2a or a2a+p2p, got {comm_type!r}")
    if cp == 1:
        return 0.0
    if comm_type == "p2p" or (comm_type == "a2a+p2p" and a2a_size == 1):
        return float(s // cp) * b * h * (4.0 * a / h) / t
    output = 2.0 * (1.0 if head_dim is None else a * head_dim / h)  # the attention's output, heads x head_dim wide
    indices = 16.0 * s if comm_type == "a2a" else 16.0 * s * a2a_size / cp
    return float(s // cp) * b * h * (output + 4.0 * a / h) / t + indices


def _index_bytes(s: int, cp: int, comm_type: str, config) -> float:
    """The all-to-all's int64 index vectors (to position order and back): a2a's of s tokens,
    a2a+p2p's of the s / P its inner group gathers."""
    if comm_type == "a2a":
        return 16.0 * s
    a2a_size = getattr(config, "cp_a2a_size", 1)
    return 16.0 * s * a2a_size / cp if comm_type == "a2a+p2p" and a2a_size > 1 else 0.0


def widened_stream_bytes(config, s: int, b: int, t: int, sequence_parallel: bool, recompute: str) -> float:
    """What --fp32-residual-connection adds to a layer's bytes (s its local tokens): the stream the two
    norms keep is fp32, 4 bytes a value where the formula counts 2 (2 more each, s*b*h units), and under
    full recomputation the layer's input the checkpoint keeps (2 more). Left out: under sequence
    parallelism megalite's residual dropout keeps its mask in the stream's dtype (2 more a mask), as
    the formula's 1-byte masks leave out that path's 16-bit ones."""
    if not getattr(config, "fp32_residual_connection", False):
        return 0.0
    sbh = float(s) * b * config.hidden_size / (t if sequence_parallel else 1)
    return 2.0 * sbh if recompute == "full" else 4.0 * sbh


def layer_activation_bytes(config, s: int, b: int, t: int = 1, recompute: str | None = None,
                           sequence_parallel: bool | None = None, attention_backend: str | None = None,
                           cp: int = 1, cp_comm_type: str | None = None) -> float:
    """`activation_bytes_per_layer` for a layer of `config` on one rank of tp = t, cp = `cp`;
    recompute mode, sequence parallelism and attention backend are the config's unless given (SDPA
    keeps no attention core, as selective recomputation; so does context-parallel attention, which
    adds `context_parallel_attention_bytes`, p2p or a2a as `cp_comm_type` or the config's). s is the
    whole sequence; each CP rank holds s/cp."""
    if s % cp:
        raise ValueError(f"context parallelism splits the sequence over cp = {cp} ranks, but s = {s} is not "
                         f"divisible by {cp}: choose a sequence length that is a multiple of 2 x cp")
    recompute = config.recompute if recompute is None else recompute
    sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
    sdpa = (config.attention_backend if attention_backend is None else attention_backend) == "sdpa" or cp > 1
    if sdpa and recompute == "none":
        recompute = "selective"
    local = s // cp
    widened = widened_stream_bytes(config, local, b, t, sp, recompute)
    if config.multi_latent_attention:
        kept = widened + mla_activation_bytes_per_layer(
            local, b, config.hidden_size, config.num_attention_heads, t, sp, recompute,
            q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_head_dim=config.qk_head_dim,
            qk_pos_emb_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
            ffn=config.ffn_hidden_size, gated=config.gated_linear_unit, cp=cp)
        if recompute == "full" or cp == 1:
            return kept
        comm_type = getattr(config, "cp_comm_type", "p2p") if cp_comm_type is None else cp_comm_type
        # the log-sum-exp (and a2a's index vectors); the padded output is in the MLA count
        return kept + context_parallel_attention_bytes(s, b, config.hidden_size, config.num_attention_heads, t,
                                                       cp, "p2p") + _index_bytes(s, cp, comm_type, config)
    kept = widened + activation_bytes_per_layer(
        local, b, config.hidden_size, config.num_attention_heads, t, sp, recompute,
        kv_heads=config.num_query_groups if sdpa else None, ffn=config.ffn_hidden_size,
        gated=config.gated_linear_unit, qk_norm=config.qk_layernorm, qk_l2_norm=config.qk_l2_norm,
        rope_dims=config.rotary_dims if config.position_embedding_type == "rope" else 0,
        fused_qkv=config.num_query_groups is None, head_dim=config.head_dim)
    if recompute == "full":
        return kept
    comm_type = getattr(config, "cp_comm_type", "p2p") if cp_comm_type is None else cp_comm_type
    return kept + context_parallel_attention_bytes(s, b, config.hidden_size, config.num_attention_heads, t, cp,
                                                   comm_type, head_dim=config.head_dim,
                                                   a2a_size=getattr(config, "cp_a2a_size", 1))
