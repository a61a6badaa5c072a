"""The engine loop: schedule -> run -> postprocess, one iteration per call to `step()`."""

import dataclasses
import time
from dataclasses import dataclass

import torch

from carpool.engine.block_manager import BlockManager, cdiv
from carpool.engine.config import EngineConfig, resolve_dtype
from carpool.engine.detokenizer import Detokenizer
from carpool.engine.door import RequestDoor
from carpool.engine.kv_pools import kv_pool_sizes
from carpool.engine.model_runner import ModelRunner
from carpool.engine.outputs import RequestOutput
from carpool.engine.request import CacheBreakpoint, EngineRequest
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.scheduler import ScheduledBatch, Scheduler
from carpool.engine.sequence import Sequence
from carpool.engine.slo import StepLimits
from carpool.engine.spec_decode import SpecStepStats, Speculator
from carpool.engine.spec_decode.draft_model import DraftModelDrafter
from carpool.engine.spec_decode.ngram import NgramDrafter
from carpool.engine.spec_decode.rejection_sampler import sample_verified
from carpool.engine.step_shape import step_shape
from carpool.engine.structured.masks import prefetch_grammar_masks
from carpool.engine.tiers import DEFAULT_TIER
from carpool.models import Tokenizer, load_model
from carpool.models.loader import resolve_model_dir
from carpool.models.quantization import check_quantization, first_dense_linear, matmul_mode


@dataclass
class StepStats:
    """What one iteration did, for metrics: the batch-size distribution and the prefill/decode split."""

    num_tokens: int
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    duration: float
    spec: SpecStepStats | None = None  # None: the engine does not speculate
    limits: StepLimits | None = None  # the token budget and sequence cap it ran under, and why
    # What its attention computed (carpool.engine.step_shape): the KV tokens its decodes read, and the query-key
    # pairs of its prompt chunks; with the counts above, a step-time model's inputs (`carpool serve --step-log`).
    decode_context_tokens: int = 0
    prefill_pairs: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, clock=time.monotonic, **engine_args):
        """`clock`: the seconds that cache breakpoints' TTLs run on (tests and `carpool bench cache-ttl` pass a
        simulated one; request timings stay on time.monotonic)."""
        self.config = config or EngineConfig(**engine_args)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.device = torch.device(self.config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        # Both weight settings checked against the device before any weights load, each error naming its own field.
        check_quantization(self.config.quantization, device=self.device)
        if self.config.speculative_quantization is not None:
            check_quantization(self.config.speculative_quantization, "speculative_quantization", self.device)
        self.model, self.tokenizer, self.model_config = load_model(
            self.config.model, self.device, self.dtype, self.config.quantization
        )
        self.config.settle_reproducible(first_dense_linear(self.model))
        self.max_model_len = min(
            self.config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        block_bytes = ModelRunner.kv_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        self.kv_block_bytes = block_bytes  # the target model's, for the pinned-bytes gauge
        num_sliding_layers = sum(1 for i in range(self.model_config.num_layers) if self.model_config.layer_window(i))
        draft_model = self._load_draft_model(num_sliding_layers)
        if draft_model is not None:  # its pool has as many blocks as the target's, inside the same budget
            block_bytes += DraftModelDrafter.kv_bytes_per_block(draft_model, self.config.block_size, self.dtype)
        pools = kv_pool_sizes(
            self.config,
            self.model_config.num_layers,
            num_sliding_layers,
            self.model_config.sliding_window or 0,
            block_bytes,
        )
        self.block_manager = BlockManager(
            pools.full_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            sliding_window=pools.window,
            num_sliding_blocks=pools.sliding_blocks,
            max_pinned_blocks=0 if pools.window else self._max_pinned_blocks(pools.full_blocks),
            clock=clock,
        )
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.runner = ModelRunner(
            self.model,
            pools.full_blocks,
            self.config.block_size,
            self.device,
            self.dtype,
            pools.window,
            pools.sliding_blocks,
            reproducible=self.config.reproducible,
        )
        self.detokenizer = Detokenizer(self.tokenizer)
        self.speculator = self._speculator(draft_model, pools.full_blocks)
        # Prompt plus output of one request: the context window, or the whole KV pool if that is smaller.
        max_request_tokens = min(self.max_model_len, self.block_manager.num_blocks * self.block_manager.block_size)
        self.door = RequestDoor(
            self.tokenizer, self.model_config, self.max_model_len, max_request_tokens, self.config.cache_min_tokens
        )
        self.grammars = self.door.grammars
        self.seqs: dict[str, Sequence] = {}
        self.last_step: StepStats | None = None

    def _max_pinned_blocks(self, num_blocks: int) -> int:
        """The pins' bound: cache_pin_fraction of the pool, less whatever would leave too little beside the pins for
        one request of max_request_tokens (else it would wait up to an hour for pins to lapse). Zero for a model
        with sliding-window layers (a hit there needs the window's blocks of the other group too, which are not
        pinned): its breakpoints are refused, so cached as ordinary prefixes and billed as such."""
        room = num_blocks - cdiv(min(self.max_model_len, num_blocks * self.config.block_size), self.config.block_size)
        return max(0, min(int(self.config.cache_pin_fraction * num_blocks), room))

    def _load_draft_model(self, num_sliding_layers: int):
        name = self.config.speculative_model
        if name is None or name == "ngram":
            return None
        if num_sliding_layers:
            raise ValueError(
                "speculative_model: a draft model needs a target without sliding-window layers (use ngram)"
            )
        tokenizer = Tokenizer.from_dir(resolve_model_dir(name))  # checked before its weights load
        probe = "def speculative(x):\n    return x  # Speculation, 12 tokens!"
        if tokenizer.vocab_size != self.tokenizer.vocab_size or tokenizer.encode(probe) != self.tokenizer.encode(probe):
            raise ValueError(f"speculative_model: {name} does not share the target model's tokenizer")
        quantization = self.config.speculative_quantization or self.config.quantization
        model, _, config = load_model(name, self.device, self.dtype, quantization)
        if any(config.layer_window(i) for i in range(config.num_layers)):
            raise ValueError(f"speculative_model: {name} has sliding-window layers, which a draft cannot have")
        return model

    def _speculator(self, draft_model, num_blocks: int) -> Speculator | None:
        config = self.config
        if config.speculative_model is None:
            return None
        if draft_model is None:
            drafter = NgramDrafter(config.ngram_min, config.ngram_max)
        else:
            drafter = DraftModelDrafter(
                config.speculative_model,
                draft_model,
                num_blocks,
                config.block_size,
                self.device,
                self.dtype,
                self.model_config.vocab_size,
                self.tokenizer.stop_token_ids,
                config.enable_prefix_caching,
                config.speculative_vocab_size,
                self.tokenizer.added_token_ids,
                config.reproducible,
            )
        return Speculator(drafter, config.num_speculative_tokens)

    # Requests ----------------------------------------------------------------------------------------

    def request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        tier: str = DEFAULT_TIER,
        cache_salt: str | None = None,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
    ) -> EngineRequest:
        """Through the engine's door (carpool.engine.door): a checked, settled request, or ValueError naming the
        field. `cache_breakpoints`: prompt prefixes to keep cached for a TTL (CacheBreakpoint); those shorter than
        config.cache_min_tokens are dropped at the door, so such a prefix is cached and billed as any other."""
        return self.door.request(request_id, prompt, params, tier, cache_salt, cache_breakpoints)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        tier: str = DEFAULT_TIER,
        cache_salt: str | None = None,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
    ) -> Sequence:
        """Check a request at the door and queue it, in one call (offline use: `LLM`, the benchmarks)."""
        return self.enqueue(self.request(request_id, prompt, params, tier, cache_salt, cache_breakpoints))

    def enqueue(self, request: EngineRequest) -> Sequence:
        """Queue a request that came through `request()`: all that can still be wrong is an id in use."""
        if request.request_id in self.seqs:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        seq = Sequence(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            priority=request.priority,
            cache_salt=request.cache_salt,
            bad_words_token_ids=request.bad_words_token_ids,
            arrival=request.arrival_time,
            cache_breakpoints=request.cache_breakpoints,
        )
        self.seqs[request.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        seq.times.finished = time.monotonic()
        return self._output(seq, 0, 0)

    def kv_pool_memory(self) -> tuple[int, int]:
        """(bytes of this engine's KV pools, a draft model's included; how many of them are backed by memory now)."""
        runners = [self.runner]
        if self.speculator and isinstance(self.speculator.drafter, DraftModelDrafter):
            runners.append(self.speculator.drafter.runner)
        return sum(runner.kv_pool_bytes for runner in runners), sum(runner.kv_resident_bytes() for runner in runners)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # The loop ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        with matmul_mode(self.config.matmul):  # per thread and per step: each engine's steps run its own mode
            return self._step()

    def _step(self) -> list[RequestOutput]:
        start = time.monotonic()
        if self.speculator:
            self.speculator.plan(self.scheduler.running, self.max_model_len)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.speculator:
            self.speculator.propose(batch)
        shape = step_shape(
            [(seq.num_computed_tokens, n, seq.num_prompt_tokens) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        )
        forward_start = time.monotonic()
        prefetch_grammar_masks(batch.seqs, batch.num_new_tokens, self.model_config.vocab_size)
        logits, sampling = self.runner.run(batch)
        sampled = sample_verified(logits, sampling, self.tokenizer.stop_token_ids) if sampling else []
        spec = (
            self.speculator.observe(batch, sampling, sampled, time.monotonic() - forward_start)
            if self.speculator
            else None
        )
        num_decode_tokens = sum(n for seq, n in zip(batch.seqs, batch.num_new_tokens) if n == 1 or seq.spec_token_ids)
        # KV the step read, for the SLO controller's step-time model only (read before postprocessing moves it on).
        context_tokens = (
            sum(seq.num_computed_tokens for seq in batch.seqs) + batch.num_tokens if self.scheduler.slo else 0
        )
        outputs = self._postprocess(batch, dict(zip(map(id, sampling), sampled)))
        end = time.monotonic()
        self._record_step(batch, num_decode_tokens, spec, end - start, shape)
        if self.scheduler.slo:
            self.scheduler.slo.observe(
                batch.num_tokens, len(batch.seqs), context_tokens, start, end, self.scheduler.has_work()
            )
        return outputs

    def _postprocess(self, batch: ScheduledBatch, sampled: dict) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            drafts, seq.spec_token_ids, seq.spec_probs = seq.spec_token_ids, [], None
            seq.num_computed_tokens += num_new - len(drafts)
            if id(seq) not in sampled:
                self.block_manager.cache_full_blocks(seq)
                continue
            emitted_before = self.detokenizer.settled_length(seq)
            reason, appended = None, 0
            for token, logprob in zip(*sampled[id(seq)]):  # accepted drafts, then the token that follows them
                seq.token_ids.append(token)
                appended += 1
                if logprob is not None:
                    seq.cumulative_logprob += logprob.logprob
                    if seq.params.logprobs is not None:
                        seq.logprobs.append(logprob)
                reason = self._finish_reason(seq, token)
                if reason:  # tokens past a stop, EOS or max_tokens are discarded, as if never drafted
                    break
            # Accepted drafts became tokens whose KV the pass computed; the newest token's is computed next step.
            seq.num_computed_tokens = seq.num_tokens - 1
            self.block_manager.cache_full_blocks(seq)
            seq.times.first_token = seq.times.first_token or now
            if self.scheduler.slo and seq.times.last_token is not None:  # the gap the ITL SLO is about
                self.scheduler.slo.observe_gap(seq.priority, now - seq.times.last_token)
            seq.times.last_token = now
            if reason:
                seq.finish_reason = reason
                seq.times.finished = now
                if self.scheduler.slo:
                    computed_prompt = seq.num_prompt_tokens - seq.num_cached_prompt_tokens
                    self.scheduler.slo.observe_finished(seq.priority, computed_prompt, seq.num_output_tokens)
                self.scheduler.remove(seq)
                del self.seqs[seq.request_id]
            else:  # slots reserved for drafts that were rejected, or never proposed, go back
                self.block_manager.truncate(seq, seq.num_tokens)
            outputs.append(self._output(seq, emitted_before, appended))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        stop_hit = self.detokenizer.update(seq)
        if not params.ignore_eos and token in self.tokenizer.stop_token_ids:  # EOS or an end-of-turn token
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop"
        if stop_hit:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, emitted_before: int, num_new_tokens: int) -> RequestOutput:
        settled = self.detokenizer.settled_length(seq)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.output_text[:settled],
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            delta_text=seq.output_text[emitted_before:settled],
            delta_token_ids=seq.output_token_ids[seq.num_output_tokens - num_new_tokens :] if num_new_tokens else [],
            delta_logprobs=seq.logprobs[-num_new_tokens:] if num_new_tokens and seq.logprobs else [],
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None or seq.params.ranked else None,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            num_cache_write_tokens=seq.num_cache_write_tokens,
            cache_write_tokens_by_ttl=dict(seq.cache_write_tokens_by_ttl),
            num_preemptions=seq.num_preemptions,
            times=dataclasses.replace(seq.times),  # a snapshot: the server reads it on another thread
        )

    def _record_step(
        self, batch: ScheduledBatch, decode: int, spec: SpecStepStats | None, duration: float, shape: tuple[int, int]
    ) -> None:
        self.last_step = StepStats(
            num_tokens=batch.num_tokens,
            num_seqs=len(batch.seqs),
            num_prefill_tokens=batch.num_tokens - decode,
            num_decode_tokens=decode,
            num_preemptions=len(batch.preempted),
            duration=duration,
            spec=spec,
            limits=self.scheduler.limits,
            decode_context_tokens=shape[0],
            prefill_pairs=shape[1],
        )
