"""From a validated request body to engine requests: defaults resolved, prompts encoded, one request per choice.

The body's shape is checked by ``speed.serve.protocol`` (pydantic); what
depends on the model and capacity (prompt length, vocabulary, ``max_tokens``,
``launch_loop``, ``branches``, ``branch_depth``) and the sampling settings are checked once, by the engine's
``add`` and ``speed.engine.sampling.Sampling``: their ``ValueError`` is the 400's
message (``engine_error``). Only what neither can know is checked here: the model's name and, for a
looped LM, its context's length (said in the deployment's words); the task is one of the registry's
(``speed.data.tasks``), given with text prompts only, as the body's schema says. SPEED's fields of the
body (``speed.engine.LEVERS``) become one ``speed.engine.Speculation``, the deployment's where the body leaves one out.

Text becomes tokens as the served family reads it (``contexts``: ``Family.served_prompts`` and
``Family.served_chat``). A T5 encodes ``task prefix + text`` and EOS; a chat request's text is its last user
message. A looped LM's prompt is its whole context, without EOS: under a task, the task's instruction and the
text as one user turn of the checkpoint's chat template (``speed.chat.task_prompt``: exactly a finetuning
prompt), without one the raw text; a chat request is its messages rendered by the template
(``speed.chat.render_chat``; under a task, the instruction opens the last user message); an imported model's
template is its directory's Jinja template, whose refusal (``raise_exception``: a role out of order) is a 400.
Token-id prompts pass through as they are, for both. Every request ends at the tokenizer's ``stop_ids`` (an
imported chat model's end of turn besides its EOS).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Any

from speed.chat import CHAT_TEMPLATE, ChatRenderer
from speed.data import get_task
from speed.engine import LEVERS, ExitRule, Request
from speed.engine.sampling import Sampling, choice_seed
from speed.models.family import DEFAULT_FAMILY, FAMILIES, Family
from speed.serve.protocol import BadRequest, ChatRequest, CompletionRequest
from speed.serve.settings import decoding


@dataclass(frozen=True)
class Plan:
    """A request resolved into one engine request per choice (prompt-major), and how to answer it."""

    requests: list[Request]
    prompts: list[int]  # per choice: its prompt's index
    seeds: list[int]  # per choice: its sampling seed
    echoes: list[str]  # per prompt: the text echoed before its choices' text ("" without echo)
    task: str | None
    seed: int  # the request's seed (given, or drawn for it)
    stops: list[str]
    logprobs: int | None  # top alternatives per token; None: no logprobs
    include_usage: bool

    def settings(self) -> dict[str, Any]:
        """How it was decoded, for the answer's ``speed`` object (every choice alike but for its seed)."""
        return decoding(self.requests[0], self.seed)


def contexts(
    body: CompletionRequest | ChatRequest, task: str | None, tokenizer: Any, family: Family, template: ChatRenderer
) -> list[list[int]]:
    """The token ids of a request's text prompts (or its chat), as the served ``family`` reads them."""
    found = get_task(task) if task else None  # the body's (protocol) or the deployment's (settings): both checked
    if not isinstance(body, ChatRequest):
        return family.served_prompts(body.prompts(), found, tokenizer, template)
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}  # OpenAI's newer name for system
        for m in body.messages
    ]
    return [family.served_chat(messages, body.last_user(), found, tokenizer, template)]


def plan_request(
    body: CompletionRequest | ChatRequest,
    settings: Any,
    tokenizer: Any,
    model_name: str,
    family: Family = FAMILIES[DEFAULT_FAMILY],
    template: ChatRenderer = CHAT_TEMPLATE,
) -> Plan:
    """Resolve ``body`` against the deployment's ``settings`` (``ServeSettings``) into engine requests, its text
    read as the served ``family`` reads it (an LM's with its chat ``template``)."""
    s = settings
    if body.model is not None and body.model != model_name:
        raise BadRequest(f"model {body.model!r} is not served here; this server serves {model_name!r}", "model", 404)
    chat = isinstance(body, ChatRequest)
    prompts = [body.source()] if chat else body.prompts()
    texts = isinstance(prompts[0], str)
    task = (body.task or s.task) if texts else None
    try:
        inputs = contexts(body, task, tokenizer, family, template) if texts else [list(p) for p in prompts]
    except ValueError as err:  # the chat template's refusal (an imported model's raise_exception)
        raise BadRequest(f"{'messages' if chat else 'prompt'}: {err}", "messages" if chat else "prompt") from None
    longest = max(range(len(inputs)), key=lambda i: len(inputs[i]))
    if family.whole_context and len(inputs[longest]) > s.max_source_len:  # the engine would name the prompt as sent
        what = "the chat" if chat else f"prompt {longest}"
        raise BadRequest(
            f"{what} is {len(inputs[longest])} tokens as the model reads it (an LM's whole context: chat template "
            f"and task instruction included), more than the deployment's max_source_len {s.max_source_len}: "
            "shorten it, or raise max_source_len",
            "messages" if chat else "prompt",
        )
    echo = not chat and body.echo
    try:
        echoes = [(p if texts else tokenizer.decode(p)) if echo else "" for p in prompts]
    except ValueError as err:  # a token id the tokenizer does not know
        raise BadRequest(f"prompt: {err}", "prompt") from None
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    max_tokens = (body.requested_tokens if chat else body.max_tokens) or s.max_tokens
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0  # vLLM: -1 (or 0) is off
    logprobs = ((body.top_logprobs or 0) if body.logprobs else None) if chat else body.logprobs
    given = {name: getattr(body, name) for name in LEVERS if getattr(body, name) is not None}
    speculation = replace(s.speculation, **given)  # the protocol checked the body's values as Speculation does
    method = body.method or s.method
    if method == "speed" and speculation.branches and not s.allow_branches:  # the cache has no side entries
        raise BadRequest(
            f"branches={speculation.branches}: this deployment allocates no runner-up branches; deploy it with "
            "allow_branches: true (a ServeSettings key: jobs/serve.py --set allow_branches=true)",
            "branches",
        )
    stops = getattr(tokenizer, "stop_ids", None)  # None (token-id prompts, no tokenizer): the model's EOS
    exit_rule = _exit_rule(body, method)
    requests, prompt_of, seeds = [], [], []
    for p, ids in enumerate(inputs):
        for k in range(body.n):
            index = p * body.n + k
            try:
                sampling = Sampling(
                    temperature=body.temperature if body.temperature is not None else 0.0,
                    top_k=top_k,
                    top_p=body.top_p if body.top_p is not None else 1.0,
                    seed=choice_seed(seed, index),
                    presence_penalty=body.presence_penalty or 0.0,
                    frequency_penalty=body.frequency_penalty or 0.0,
                )
            except ValueError as err:
                raise BadRequest(str(err)) from None
            requests.append(
                Request(
                    ids,
                    max_tokens,
                    method,
                    speculation,
                    sampling=sampling,
                    logprobs=logprobs,
                    stop_ids=stops,
                    exit_rule=exit_rule,
                )
            )
            prompt_of.append(p)
            seeds.append(sampling.seed)
    return Plan(requests, prompt_of, seeds, echoes, task, seed, body.stops(), logprobs, body.include_usage)


def _exit_rule(body: CompletionRequest | ChatRequest, method: str) -> ExitRule | None:
    """The exit gate's rule of an ``exit_gate`` request (``ExitRule``'s defaults for the fields left out; the
    protocol allows them with that method only); None for another method."""
    return ExitRule(**body.exit_fields()) if method == "exit_gate" else None  # bounds checked as ExitRule does


# what an engine refusal can be about, in the request's words
_PARAMS = ("max_tokens", "exit_step", "method", *LEVERS, "prompt")


def engine_error(err: ValueError) -> BadRequest:
    """The engine's refusal of a planned request (its ``add`` checks what depends on the model and capacity) as a
    400 in the request's words (``max_tokens``, ``prompt[i]``), naming the field it is about."""
    message = str(err).replace("max_new_tokens", "max_tokens").replace("input_ids", "prompt")
    message = message.replace("exit rule step", "exit_step")
    message = f"prompt{message}" if message.startswith("[") else message
    return BadRequest(message, next((p for p in _PARAMS if p in message), None))
