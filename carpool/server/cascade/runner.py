"""A cascade request on the server: each step is an ordinary request to that step's model (its tier, prefix cache
and gate admission, and a ledger row of its own), scored from its token logprobs once finished; the first step
whose score reaches its threshold, or the last step, answers the client.

Streaming: a step before the last runs as a streaming Generation whose events wait in its own queue until the
step is scored; the accepted step's queue is then streamed as is, so the client sees its chunks only once the
step is accepted, and never the chunks of a rejected step. The last step, accepted whatever it says, streams live.
"""

from dataclasses import dataclass

from carpool.economics.contract import GateError, Principal, part_request_id
from carpool.server.cascade.config import Cascade, Step
from carpool.server.cascade.prompt_pass import prompt_pass
from carpool.server.cascade.router import Router
from carpool.server.errors import APIError
from carpool.server.generation import Generation, GenerationFailed
from carpool.server.protocol import ChatCompletionRequest, CompletionRequest
from carpool.server.serving import Serving

STEP_HEADER = "x-carpool-cascade-step"  # 0-based step that answered
ANSWERED_BY_HEADER = "x-carpool-answered-by"  # the model that answered (also the response's `model`)
# "<status> <code>" of the refusal when an escalation was refused and a rejected step's answer stands instead
ESCALATION_REFUSED_HEADER = "x-carpool-cascade-escalation-refused"
ROUTED_TO_HEADER = "x-carpool-routed-to"  # the model a router chose from the prompt (a cascade may escalate it)


@dataclass
class Verdict:
    """A step's score and whether its answer stands; computed once, when the step's usage is recorded."""

    score: float | None = None
    accepted: bool | None = None


class CascadeServing:
    """The cascades and routers of --cascades, served as model names."""

    def __init__(self, serving: Serving, cascades: dict[str, Cascade | Router]):
        self.serving, self.cascades = serving, cascades

    def __contains__(self, model: str | None) -> bool:
        return model in self.cascades

    def card(self, name: str, created: int) -> dict:
        """The cascade (or router) as /v1/models lists it: an OpenAI model object, with its steps under `cascade`
        (a router's models under `router`: what a client needs to tell it from a served model) and the context
        every model of it can take."""
        named = self.cascades[name]
        if isinstance(named, Router):
            described = {
                "router": {
                    "models": list(named.models),
                    "thresholds": list(named.thresholds),
                    "features": named.features,
                }
            }
            if named.cascade is not None:
                described["router"]["cascade"] = named.cascade
        else:
            steps = [
                {"model": step.model}
                | ({} if step.scorer is None else {"scorer": step.scorer.kind, "threshold": step.threshold})
                for step in named.steps
            ]
            described = {"cascade": {"steps": steps}}
        max_model_len = min(self.serving.models[model].engine.max_model_len for model in named.models)
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "carpool",
            "max_model_len": max_model_len,
        } | described

    def cards(self, created: int) -> list[dict]:
        return [self.card(name, created) for name in self.cascades]

    async def answer(
        self, body: ChatCompletionRequest | CompletionRequest, principal: Principal, client_request_id: str
    ):
        """(generation, format, headers) of the accepted step; the generation of the last step may still run.
        A router's request runs as the cascade from the routed-to model on: that model alone, or with the
        router's `cascade` that cascade's steps from there; its rows are numbered by the router's models."""
        named = self.cascades[body.model]
        _check_single_choice(body)
        if isinstance(named, Router):
            text, surprisals = _routed_text(body), None
            if named.reads_prompt_pass:
                # checked before the pass runs and is billed: a body the routed-to model would refuse pays nothing
                for model in named.models:
                    self.serving.check(body.model_copy(update={"model": model}), principal)
                surprisals = await prompt_pass(self.serving, named, body, text, principal, client_request_id)
            first = named.route(text, surprisals)
            steps = self.cascades[named.cascade].steps[first:] if named.cascade else (Step(named.models[first]),)
            cascade, routed = Cascade(named.name, steps), {ROUTED_TO_HEADER: named.models[first]}
        else:
            first, cascade, routed = 0, named, {}
        final = len(cascade.steps) - 1
        attempts = [
            body.model_copy(update={"model": step.model} | ({} if i == final else _with_logprobs(body)))
            for i, step in enumerate(cascade.steps)
        ]
        for attempt in attempts:  # a body a later step refuses must not run (and bill) the earlier ones
            self.serving.check(attempt, principal)
        best = None  # (generation, format, index, step) of the last rejected step with a whole answer
        for index, (step, attempt) in enumerate(zip(cascade.steps, attempts), first):
            last = index == first + final
            try:
                gen, fmt = self._start(attempt, principal, part_request_id(client_request_id, f"cascade-{index}"))
            except (APIError, GateError) as refusal:
                # The escalation is refused (a full tier queue, a spent budget, the ledger down) after an earlier
                # step ran and was billed: that step's whole answer is delivered, marked, rather than an error
                # for a request billed anyway (the soak's "billed without delivery", issue 55).
                if best is None:
                    raise
                return _escalation_refused(best, body, refusal, routed)
            verdict = Verdict()
            gen.ledger_fields = _ledger_fields(cascade, index, step, verdict, client_request_id, last)
            if last and best is not None and not body.stream:
                # The same when the last step ran but its row could not be written (the ledger's disk full, its
                # database down): its answer is withheld, and the billed earlier one stands instead of a 503.
                try:
                    await gen.wait()
                except GateError as unrecorded:
                    return _escalation_refused(best, body, unrecorded, routed)
                except GenerationFailed:
                    pass  # answered by the response as without a cascade (a 500)
            if not last:
                try:
                    await gen.wait()
                except GenerationFailed as error:
                    raise APIError(500, f"The engine failed while generating: {error}") from error
                finally:  # the handler cancelled (server stopping): the step's engine work stops with it
                    gen.cancel()
                if not verdict.accepted:
                    if gen.choices[0].finish_reason in ("stop", "length"):
                        best = (gen, fmt, index, step)
                    continue
            fmt.logprobs = _client_wants_logprobs(body)  # the scorer's logprobs go to the client only if asked
            return gen, fmt, {STEP_HEADER: str(index), ANSWERED_BY_HEADER: step.model} | routed
        raise AssertionError("the last step always answers")

    def _start(self, body, principal: Principal, request_id: str):
        if isinstance(body, ChatCompletionRequest):
            return self.serving.start_chat(body, principal, request_id=request_id)
        return self.serving.start_completion(body, principal, request_id=request_id)


def _escalation_refused(best: tuple, body, refusal: APIError | GateError, routed: dict) -> tuple:
    """(generation, format, headers) of the last rejected step's billed answer, marked with why the escalation
    did not answer."""
    gen, fmt, index, step = best
    fmt.logprobs = _client_wants_logprobs(body)
    refused = f"{refusal.status} {refusal.code or 'refused'}"
    headers = {STEP_HEADER: str(index), ANSWERED_BY_HEADER: step.model, ESCALATION_REFUSED_HEADER: refused}
    return gen, fmt, headers | routed


def _check_single_choice(body) -> None:
    """A cascade scores one answer: several choices (n, best_of) or prompts would each need a verdict."""
    if (body.n or 1) > 1:
        raise APIError(400, "n: a cascade answers with one choice; n must be 1", param="n")
    if isinstance(body, CompletionRequest):
        if (body.best_of or 1) > 1:
            raise APIError(400, "best_of: a cascade answers with one choice; best_of must be 1", param="best_of")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
            raise APIError(400, "prompt: a cascade answers one prompt per request", param="prompt")


def _routed_text(body) -> str:
    """What a router reads: a chat's last user turn (what its classifier was trained on: one user message; the
    turn being answered says how hard it is), or a completion's text prompt."""
    if isinstance(body, ChatCompletionRequest):
        users = [message.text for message in body.messages if message.role == "user"]
        return users[-1] if users else "\n".join(message.text for message in body.messages)
    prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt else body.prompt
    if not isinstance(prompt, str):
        raise APIError(400, "prompt: a router reads the prompt's text; token ids cannot be routed", param="prompt")
    return prompt


def _with_logprobs(body) -> dict:
    if isinstance(body, ChatCompletionRequest):
        return {"logprobs": True}
    return {"logprobs": body.logprobs if body.logprobs is not None else 0}


def _client_wants_logprobs(body) -> bool:
    return bool(body.logprobs) if isinstance(body, ChatCompletionRequest) else body.logprobs is not None


def _ledger_fields(cascade: Cascade, index: int, step: Step, verdict: Verdict, parent: str, last: bool):
    """The attempt's ledger columns; the verdict is taken here, as the row is written, from the finished output.
    An attempt that ended without a whole answer (aborted, failed) is never accepted; the last step accepts any
    whole answer unscored."""

    def fields(gen: Generation) -> dict:
        if verdict.accepted is None:
            choice = gen.choices[0]
            output = choice.last
            if output is None or choice.finish_reason not in ("stop", "length"):
                verdict.accepted = False
            elif last:
                verdict.accepted = True
            else:
                logprobs = [lp.logprob for lp in output.logprobs or []]
                try:
                    verdict.score = step.scorer.score(logprobs, choice.finish_reason == "length")
                except Exception:  # whatever the scorer raises, the row must still be written: escalate unscored
                    verdict.accepted = False
                else:
                    verdict.accepted = verdict.score >= step.threshold
        return {
            "purpose": "cascade_attempt",
            "parent_request_id": parent,
            "cascade": cascade.name,
            "cascade_step": index,
            "cascade_accepted": verdict.accepted,
        }

    return fields
