"""Which layers each virtual pipeline stage holds, from whichever flag says: --pipeline-layers itself, or
one of Megatron-LM's rules that derive it (its layout string, the uneven first/last stage, the split
that counts the embedding and the loss as layers), and the virtual stages per rank they imply."""
from __future__ import annotations

from megalite.config.run import ConfigError
from megalite.models.presets import PRESETS
from megalite.pipeline.layer_layout import account_flags, accounted_layer_counts, layout_layer_counts, layout_stages
from megalite.pipeline.partition import V_SCHEDULES, uneven_stage_counts

LAYOUT = "--pipeline-model-parallel-layout"
FIRST_LAST = "--decoder-first/last-pipeline-num-layers"
ACCOUNT = "--account-for-embedding/loss-in-pipeline-split"


def mtp_layers(m, name: str) -> int:
    """The model's multi-token-prediction layers: --mtp-num-layers, else its preset's."""
    return m.mtp_num_layers if m.mtp_num_layers is not None else PRESETS[name].get("mtp_num_layers", 0)


def split_rules(p) -> list[str]:
    """The Megatron-LM flags given that place the layers on the stages (each derives --pipeline-layers)."""
    return [rule for rule, on in (
        (LAYOUT, p.pipeline_model_parallel_layout is not None),
        (FIRST_LAST, p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None),
        (ACCOUNT, p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split)) if on]


def _spelled(p, rule: str) -> str:
    """A rule as the flags the user gave."""
    if rule == ACCOUNT:
        return account_flags(p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
    return rule


def split_pipeline_layers(p, num_layers: int, vpp: int | None, given, defer: bool = False,
                          mtp: int = 0) -> list[int] | None:
    """--pipeline-layers, or the split of `num_layers` one of Megatron-LM's rules gives (ConfigError
    where it does not fit; None instead with `defer`)."""
    rules = split_rules(p)
    if not rules:
        return p.pipeline_layers
    if "parallel.pipeline_layers" in given or len(rules) > 1:
        pair = [_spelled(p, r) for r in rules[:2]] if len(rules) > 1 else ["--pipeline-layers", _spelled(p, rules[0])]
        raise ConfigError(f"{pair[0]} and {pair[1]} both split the layers over the stages: keep one")
    rule, v_shape = rules[0], p.pipeline_schedule in V_SCHEDULES
    if v_shape and rule == FIRST_LAST:
        raise ConfigError(f"{rule} size a pipeline rank's layers, but --pipeline-schedule {p.pipeline_schedule} "
                          f"places two chunks per rank in a V: give --pipeline-layers (or {LAYOUT}), one count per "
                          f"chunk in stage order")
    try:
        if rule == LAYOUT:
            per_rank, counts = layout_layer_counts(p.pipeline_model_parallel_layout, p.pp, num_layers, mtp)
            if v_shape and per_rank != 2:
                raise ValueError(f"{LAYOUT} names {per_rank} stage(s) per pipeline rank, but --pipeline-schedule "
                                 f"{p.pipeline_schedule} runs two chunks per rank in a V: give {2 * p.pp} stages, "
                                 f"in stage order")
            return counts
        if rule == FIRST_LAST:
            return uneven_stage_counts(num_layers, p.pp, vpp, p.decoder_first_pipeline_num_layers,
                                       p.decoder_last_pipeline_num_layers)
        return accounted_layer_counts(num_layers, p.pp, vpp, p.account_for_embedding_in_pipeline_split,
                                      p.account_for_loss_in_pipeline_split)
    except ValueError as e:
        if defer:
            return None
        raise ConfigError(str(e)) from None


def virtual_stages(p, layers: int, vpp: int | None, given=frozenset()) -> int | None:
    """--vpp, or the virtual stages per rank Megatron-LM's layout names, or its
    --num-layers-per-virtual-pipeline-stage makes of `layers` layers (with the embedding and the loss
    where --account-for-embedding/loss-in-pipeline-split counts them); none when one a rank."""
    per_stage = p.num_layers_per_virtual_pipeline_stage
    if p.pipeline_model_parallel_layout is not None:
        try:
            stages = len(layout_stages(p.pipeline_model_parallel_layout))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        named = stages // p.pp if stages % p.pp == 0 else None  # not a multiple: the split says why
        if per_stage is not None:
            raise ConfigError(f"{LAYOUT} names the virtual stages itself: drop --num-layers-per-virtual-pipeline-stage")
        if "parallel.vpp" in given and named is not None and (vpp or 1) != named:
            raise ConfigError(f"--vpp {vpp} and {LAYOUT} ({named} virtual stages per pipeline rank) disagree: "
                              f"drop --vpp")
        if named is not None:  # what the schedule's own checks would say of a --vpp, said of the layout
            if named > 1 and p.pp == 1:
                raise ConfigError(f"{LAYOUT} names {stages} stages, which --pp 1 would run as chunks of one rank: "
                                  f"give --pp {stages} (or a layout of one stage)")
            if named > 1 and p.pipeline_schedule == "zb-h1":
                raise ConfigError(f"{LAYOUT} names {named} stages per pipeline rank, but --pipeline-schedule zb-h1 "
                                  f"runs one: give {p.pp} stages, or use --pipeline-schedule interleaved")
            if named == 1 and p.pipeline_schedule == "interleaved":
                raise ConfigError(f"--pipeline-schedule interleaved runs model chunks per rank, but {LAYOUT} names "
                                  f"one stage per pipeline rank: give {2 * p.pp} stages or more (a multiple of --pp)")
        return named if named and named > 1 else None
    if per_stage is None:
        return vpp
    counted = int(p.account_for_embedding_in_pipeline_split) + int(p.account_for_loss_in_pipeline_split)
    layers += counted
    per = per_stage * p.pp
    if layers % per:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_stage} x --pp {p.pp} does not divide the "
                          f"{layers} layers{f' ({counted} of them the embedding or the loss, {ACCOUNT})' if counted else ''}")
    if vpp is not None and vpp != layers // per:
        raise ConfigError(f"--vpp {vpp} and --num-layers-per-virtual-pipeline-stage {per_stage} disagree "
                          f"({layers // per} virtual stages)")
    return layers // per if layers // per > 1 else None
