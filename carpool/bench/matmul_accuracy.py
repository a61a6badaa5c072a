"""What the int8 matmul modes cost in accuracy: next-token distributions against matmul="exact" at every position of a
real text, top-1 agreement and mean KL(exact || int8).

- default: "int8-dot" with the text fed one token a step, so every linear layer runs at one activation row (decode's
  case, the one int8-dot changes);
- --prefill: "int8-dot-all" with the text as one prompt, every position's logits from its prefill step (hundreds of
  rows a linear: the prompt chunks that int8-dot-all moves onto the integer kernels).

    python -m carpool.bench.matmul_accuracy [--model smollm2-135m] [--positions 300] [--dtype auto] [--prefill]
"""

import argparse

import torch

from carpool.bench.datasets import long_docs
from carpool.engine.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.sampling_params import SamplingParams


def next_token_logprobs(model: str, matmul: str, token_ids: list[int], dtype: str, prefill: bool) -> torch.Tensor:
    """[positions, vocab] log-probabilities after each prefix: one token a step, or every position of one prefill."""
    step_tokens = len(token_ids) if prefill else 1
    engine = LLMEngine(
        EngineConfig(
            model=model,
            matmul=matmul,
            dtype=dtype,
            max_num_batched_tokens=step_tokens,
            max_num_seqs=1,
            enable_prefix_caching=False,
            num_kv_blocks=64,
        )
    )
    rows = []

    def keep_positions(module, inputs, hidden):
        kept = hidden if prefill else hidden[-1:]
        rows.extend(torch.log_softmax(engine.model.compute_logits(kept).float(), -1))

    handle = engine.model.register_forward_hook(keep_positions)
    try:
        engine.add_request("accuracy", token_ids, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        handle.remove()
    return torch.stack(rows[: len(token_ids)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--positions", type=int, default=300)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefill", action="store_true", help="int8-dot-all on one prompt's prefill")
    args = parser.parse_args()
    text = next(long_docs())["document"]
    tokenizer = LLMEngine(EngineConfig(model=args.model, num_kv_blocks=4)).tokenizer
    token_ids = tokenizer.encode(text)[: args.positions]
    fast_mode = "int8-dot-all" if args.prefill else "int8-dot"
    exact = next_token_logprobs(args.model, "exact", token_ids, args.dtype, args.prefill)
    fast = next_token_logprobs(args.model, fast_mode, token_ids, args.dtype, args.prefill)
    kl = (exact.exp() * (exact - fast)).sum(-1)
    agree = (exact.argmax(-1) == fast.argmax(-1)).float().mean().item()
    how = f"one {len(token_ids)}-token prefill" if args.prefill else "one token a step"
    print(
        f"{args.model} ({args.dtype}), {fast_mode} against exact, {len(token_ids)} positions of long_docs.jsonl's "
        f"first document, {how}: top-1 agreement {agree:.1%}, mean KL {kl.mean().item():.2e} nats "
        f"(max {kl.max().item():.2e})"
    )


if __name__ == "__main__":
    main()
