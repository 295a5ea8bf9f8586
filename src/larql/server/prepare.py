"""A validated OpenAI request → what the scheduler runs: prompt ids, limits, sampling and an
engine built from the request's spec. Every problem is an `ApiError` naming the field."""

from __future__ import annotations

from larql.errors import LarqlError
from larql.inference.engine import Engine
from larql.inference.sampling import SamplingParams
from larql.kv.catalog import CATALOG, parse_engine
from larql.kv.spec import EngineSpec, EngineSpecError, NotAvailableForLiveDecode, SpecPolicy
from larql.models.model import Model
from larql.models.tokenizer import ChatTemplateMissing
from larql.server.errors import ApiError, bad_request
from larql.server.scheduler import SessionRequest
from larql.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    Prompt,
)
from larql.server.settings import ServerSettings

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a request without temperature samples


def prepare_completion(
    body: CompletionRequest, model: Model, settings: ServerSettings
) -> list[tuple[SessionRequest, Engine]]:
    """One session per prompt (a list of prompts is answered with one choice each)."""
    check_model_name(body.model, model, settings)
    kind = choose_engine(body.engine, model, settings)  # before any prompt is tokenized
    prompts = body.prompts()
    most = settings.max_sessions + settings.max_queue
    if len(prompts) > most:
        raise bad_request(
            f"{len(prompts)} prompts in one request; this server takes at most {most} "
            "(--max-sessions + --max-queue)",
            "prompt",
        )
    if body.stream and len(prompts) > 1:
        raise bad_request("stream=true takes one prompt; send several prompts unstreamed", "stream")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request(
            "max_tokens=0 generates nothing; it is accepted with echo=true (score the prompt)",
            "max_tokens",
        )
    return [
        _session_request(
            body,
            kind,
            prompt_ids(prompt, model),
            body.max_tokens,
            DEFAULT_COMPLETION_TOKENS,
            model,
            settings,
            logprobs=body.logprobs,
            echo=body.echo,
        )
        for prompt in prompts
    ]


def prompt_ids(prompt: Prompt, model: Model) -> list[int]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad_request("prompt is empty", "prompt")
        return model.tokenizer.encode(unicode_text(prompt, "prompt"))
    ids = [int(t) for t in prompt]
    vocab = model.config.vocab_size
    if not ids:
        raise bad_request("prompt is empty", "prompt")
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    return ids


def prepare_chat(
    body: ChatCompletionRequest, model: Model, settings: ServerSettings
) -> tuple[SessionRequest, Engine]:
    check_model_name(body.model, model, settings)
    kind = choose_engine(body.engine, model, settings)
    if not body.messages:
        raise bad_request("messages is empty", "messages")
    if not any(m.text().strip() for m in body.messages):
        raise bad_request("every message is empty", "messages")
    for m in body.messages:
        unicode_text(m.text(), "messages")
    try:
        ids = model.tokenizer.encode_chat([m.for_template() for m in body.messages])
    except ChatTemplateMissing:
        raise bad_request(
            f"{model.name} has no chat template; use /v1/completions",
            "messages",
            "chat_template_missing",
        ) from None
    except LarqlError as e:  # the template refused the conversation (e.g. role order)
        raise bad_request(str(e), "messages") from None
    return _session_request(
        body,
        kind,
        ids,
        body.requested_tokens,
        settings.max_new_tokens,
        model,
        settings,
        logprobs=body.top_n,
    )


def unicode_text(text: str, param: str) -> str:
    """JSON can carry lone surrogates (`"\\ud800"`); no tokenizer can encode them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param} is not valid Unicode text (a lone surrogate?)", param) from None
    return text


def check_model_name(name: str | None, model: Model, settings: ServerSettings) -> None:
    if name is None or name in (model.name, *settings.model_aliases):
        return
    raise ApiError(
        404,
        f"unknown model {name!r}; this server serves {model.name!r}",
        param="model",
        code="model_not_found",
    )


def choose_engine(spec: str | None, model: Model, settings: ServerSettings) -> EngineSpec:
    """The request's engine spec (or the server's default, the operator's), parsed under a
    request's policy: no path or file name at any depth, every size within the model's and
    this server's limits — refused before anything is built."""
    if spec is None:
        return settings.default_engine
    try:
        kind = parse_engine(spec, request_policy(model, settings))
        kind.require_live_decode()
    except NotAvailableForLiveDecode as e:
        message = f"{e} (live-decode engines: {', '.join(live_engine_names())})"
        raise bad_request(message, "engine", "invalid_engine") from None
    except EngineSpecError as e:
        raise bad_request(str(e), "engine", "invalid_engine") from None
    return kind


def request_policy(model: Model, settings: ServerSettings) -> SpecPolicy:
    """What a request's engine spec may say: the most tokens one of its sequences can reach
    here bounds its windows and budgets (with no prompt limit, the model's context does)."""
    limit = settings.max_prompt_tokens
    return SpecPolicy.untrusted(model, None if limit is None else limit + settings.max_new_tokens)


def live_engine_names() -> list[str]:
    return [e.name for e in CATALOG.entries if e.live_decode]


def _session_request(
    body: GenerationFields,
    kind: EngineSpec,
    ids: list[int],
    requested: int | None,
    default_tokens: int,
    model: Model,
    settings: ServerSettings,
    logprobs: int | None = None,
    echo: bool = False,
) -> tuple[SessionRequest, Engine]:
    max_new = min(default_tokens, settings.max_new_tokens) if requested is None else requested
    if max_new < (0 if echo else 1):
        least = "≥ 0 (with echo)" if echo else "≥ 1"
        raise bad_request(f"max_tokens must be {least}, got {max_new}", "max_tokens")
    _check_prompt_length(len(ids), model, settings, generates=max_new > 0)
    if max_new > settings.max_new_tokens:
        raise bad_request(
            f"max_tokens {max_new} is over this server's limit of {settings.max_new_tokens} "
            "(--max-new-tokens)",
            "max_tokens",
        )
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
        )
    except LarqlError as e:
        raise bad_request(str(e)) from None
    try:
        engine = kind.build(model)
    except LarqlError as e:
        raise bad_request(str(e), "engine", "invalid_engine") from None
    request = SessionRequest(
        prompt_ids=tuple(ids),
        max_new_tokens=max_new,
        sampling=sampling,
        engine_spec=kind.spec(),
        engine_name=kind.entry.name,
        stop_strings=body.stop_strings(),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        echo=echo,
        streamed=bool(body.stream),
    )
    return request, engine


def _check_prompt_length(n: int, model: Model, settings: ServerSettings, generates: bool) -> None:
    context = model.config.max_positions
    if n > context or (generates and n == context):
        room = " and the prompt must leave room for at least one new token" if generates else ""
        raise bad_request(
            f"the prompt is {n} tokens; {model.name}'s context is {context} tokens{room}",
            "prompt",
            "context_length_exceeded",
        )
    limit = settings.max_prompt_tokens
    if limit is not None and n > limit:
        raise bad_request(
            f"the prompt is {n} tokens; this server accepts at most {limit} (--max-prompt-tokens)",
            "prompt",
            "context_length_exceeded",
        )
