"""What matmul="int8-dot" costs in accuracy: a real text fed one token a step (so every linear layer runs at one
activation row, decode's case, the one int8-dot changes), next-token distributions of "int8-dot" against "exact"
at every position: top-1 agreement and mean KL(exact || int8-dot).

    python -m carpool.bench.matmul_accuracy [--model smollm2-135m] [--positions 300] [--dtype auto]
"""

import argparse

import torch

from carpool.bench.datasets import long_docs
from carpool.engine.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.sampling_params import SamplingParams


def next_token_logprobs(model: str, matmul: str, token_ids: list[int], dtype: str) -> torch.Tensor:
    """[positions, vocab] log-probabilities after each prefix, computed one token a step."""
    engine = LLMEngine(EngineConfig(model=model, matmul=matmul, dtype=dtype, max_num_batched_tokens=1,
                                    max_num_seqs=1, enable_prefix_caching=False, num_kv_blocks=64))
    rows = []

    def keep_last_position(module, inputs, hidden):
        rows.append(torch.log_softmax(engine.model.compute_logits(hidden[-1:]).float(), -1)[0])

    handle = engine.model.register_forward_hook(keep_last_position)
    try:
        engine.add_request("accuracy", token_ids, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        handle.remove()
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--positions", type=int, default=300)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    text = next(long_docs())["document"]
    tokenizer = LLMEngine(EngineConfig(model=args.model, num_kv_blocks=4)).tokenizer
    token_ids = tokenizer.encode(text)[: args.positions]
    exact = next_token_logprobs(args.model, "exact", token_ids, args.dtype)
    fast = next_token_logprobs(args.model, "int8-dot", token_ids, args.dtype)
    kl = (exact.exp() * (exact - fast)).sum(-1)
    agree = (exact.argmax(-1) == fast.argmax(-1)).float().mean().item()
    print(f"{args.model} ({args.dtype}), {len(token_ids)} positions of long_docs.jsonl's first document: "
          f"top-1 agreement {agree:.1%}, mean KL {kl.mean().item():.2e} nats (max {kl.max().item():.2e})")


if __name__ == "__main__":
    main()
