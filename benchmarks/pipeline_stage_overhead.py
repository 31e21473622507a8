"""Cost of running a pipeline stage through the model's own forward (automodel.pipeline.hf_stage).

A later stage calls the whole model's forward with placeholders installed: skipped layers, a
hand-over slot, NaN inputs_embeds. Baseline, measured in the same run: the same layers, final
norm and head as a model of its own (transformers' Llama built with only those layers), called
with the received hidden states as ``inputs_embeds`` -- the same arithmetic without the stage
machinery. Forward + backward per micro-batch, CPU, one process; the two alternate sample by sample.

    uv run --frozen python benchmarks/pipeline_stage_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from automodel.pipeline.hf import (
    hf_module_fqns_per_stage,
    make_causal_lm_stage,
    validate_hf_model_for_pipeline_support,
)
from automodel.pipeline.split import split_module


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_interleaved(first, second, *, repeats: int, warmup: int) -> tuple[float, float, float]:
    """Median times of both and the median of per-pair ratios.

    The two alternate, so load from other processes on the machine hits both alike.
    """
    for _ in range(warmup):
        first()
        second()
    pairs = [(_seconds(first), _seconds(second)) for _ in range(repeats)]
    return (
        statistics.median(a for a, _ in pairs),
        statistics.median(b for _, b in pairs),
        statistics.median(a / b for a, b in pairs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    structure = validate_hf_model_for_pipeline_support(model)
    fqns = hf_module_fqns_per_stage(model, num_stages=2, structure=structure)
    stage = make_causal_lm_stage(
        split_module(model, fqns=fqns[1], shared_fqns=set(fqns[0]) & set(fqns[1])),
        model=model,
        structure=structure,
        stage_index=1,
        num_stages=2,
    )
    held = args.layers - args.layers // 2
    alone = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": held}))
    hidden = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)

    def run_stage() -> None:
        stage(hidden, position_ids=positions).float().sum().backward()

    def run_alone() -> None:
        alone(inputs_embeds=hidden, position_ids=positions, use_cache=False).logits.float().sum().backward()

    t_stage, t_alone, ratio = _time_interleaved(run_stage, run_alone, repeats=args.repeats, warmup=2)
    print(
        f"last stage of 2 ({held} layers + norm + head), batch {args.batch} x seq {args.seq}, hidden {args.hidden}"
    )
    print(f"  stage through the model's own forward: {t_stage * 1e3:8.1f} ms / micro-batch (fwd+bwd)")
    print(f"  same layers as a model of their own:   {t_alone * 1e3:8.1f} ms / micro-batch (fwd+bwd)")
    print(f"  ratio stage / alone (median of interleaved pairs): {ratio:.3f}")


if __name__ == "__main__":
    main()
