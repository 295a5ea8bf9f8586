"""Loading a model, choosing an engine, and decoding through it: what `larql run` does, as
functions. `generate` and `stream` drive the one generation loop (`GenerationSession`);
`teacher_forced_logits` is the teacher-forced run the accuracy harness scores."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from larql.api.engine_specs import EngineLike, engine_spec
from larql.api.renamed import renamed_arguments
from larql.api.resume_archive import Resumed, rebuild
from larql.errors import InvalidInput
from larql.inference.decode_path import decode_path
from larql.inference.ffn import build_ffn
from larql.inference.ffn.policy import FfnLayerPolicy
from larql.inference.generation import GenerationSession
from larql.inference.generation import teacher_forced_logits as teacher_forced_run
from larql.inference.memory import MemoryBreakdown
from larql.inference.prefix_cache import PrefixCache, prefill_leaving_states
from larql.inference.prompt import check_context, encode_prompt
from larql.inference.sampling import Sampler, SamplingParams
from larql.inference.snapshots import SavedState, model_fingerprint, save_state
from larql.kv.catalog import parse_engine as parse_catalog_spec
from larql.kv.snapshots import State, load_state_dir
from larql.models.model import Model
from larql.models.model import load_model as load_weights

Prompt = str | Sequence[int]


def load_model(
    name_or_path: str | None = None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    weights: str = "auto",
    threads: int | None = None,
) -> Model:
    """A registry name (`larql models`), a `.gguf` file or an HF directory; None = the default
    model. `device`, `dtype`, `weights` and `threads` are `larql run`'s options of those names
    (`threads` sets torch's CPU threads for the whole process)."""
    if threads is not None:
        if threads < 1:
            raise InvalidInput(f"threads must be ≥ 1, got {threads}")
        torch.set_num_threads(threads)
    return load_weights(name_or_path, dtype=dtype, device=device, weights=weights)


@dataclass(frozen=True)
class TopToken:
    """One row of the next-token table: a candidate for the first generated position, with the
    model's probability for it (softmax of the raw logits, whatever the sampling)."""

    token_id: int
    text: str
    probability: float
    logit: float

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.token_id,
            "text": self.text,
            "probability": self.probability,
            "logit": self.logit,
        }


def top_tokens(model: Model, logits: torch.Tensor, n: int) -> tuple[TopToken, ...]:
    """The n most likely next tokens of logits [V], most likely first."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    best = torch.topk(logits.float(), min(n, logits.shape[-1]))
    return tuple(
        TopToken(int(i), model.tokenizer.decode([int(i)]), float(probabilities[i]), float(v))
        for v, i in zip(best.values, best.indices, strict=True)
    )


REPR_TEXT = 60  # characters of the text a Generation's repr shows


@dataclass(frozen=True)
class Generation:
    """One generation. `token_ids`: every generated id (an end-of-turn id that ended the run
    included); `text`: their text without it. `memory`: the bytes of the engine's state after
    generation (`larql run`'s `memory_bytes`); `memory_breakdown` splits it by tier and adds
    the growth reserve."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str  # "stop" (an end-of-turn token) or "length"
    memory: int
    memory_breakdown: MemoryBreakdown
    prefill_ms: float  # prefill + first pick
    decode_tok_s: float | None  # None when only one token was generated
    model: str
    engine: str  # the canonical spec
    engine_summary: str
    ffn: str
    loaded_state: SavedState | None = None  # what `load_state` read
    saved_state: SavedState | None = None  # what `save_state` wrote
    top: tuple[TopToken, ...] = ()  # with `top=N`: the next-token table after the prompt
    # what the decode steps ran: device · dtype · weights · kernel path (`larql run -v`)
    decode_path: str = ""
    # prompt tokens whose state came from the prefix cache (`prefix_cache=`): not computed
    cached_prompt_tokens: int = 0
    resumed: Resumed | None = None  # with `resume=`: the archived sequence it continued

    def __repr__(self) -> str:
        """One short line (the token lists and the memory tables left out): the counts, the
        engine and the head of the text."""
        head = self.text if len(self.text) <= REPR_TEXT else self.text[:REPR_TEXT] + "…"
        return (
            f"Generation(model={self.model!r}, engine={self.engine!r}, "
            f"prompt_tokens={len(self.prompt_ids)}, tokens={len(self.token_ids)}, "
            f"finish_reason={self.finish_reason!r}, memory={self.memory}, text={head!r})"
        )

    def as_json(self) -> dict[str, Any]:
        """The object `larql run --output json` prints."""
        return {
            "model": self.model,
            "engine": self.engine,
            "prompt_tokens": len(self.prompt_ids),
            "token_ids": self.token_ids,
            "tokens": self.token_ids,  # the old name of token_ids, kept for scripts
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_tok_s": self.decode_tok_s,
            "memory_bytes": self.memory,
            "memory": self.memory_breakdown.as_json(),
            **({"top": [t.as_json() for t in self.top]} if self.top else {}),
            **({"resumed": self.resumed.as_json()} if self.resumed else {}),
        }


class _TextRun:
    """One generation as text pieces: `pieces()` steps the session and yields the text each
    visible token adds; `result()` afterwards."""

    def __init__(
        self,
        model: Model,
        engine: EngineLike | State | None,
        prompt: Prompt,
        max_new_tokens: int,
        sampling: SamplingParams,
        chat: bool,
        ffn: str,
        load_state: str | Path | None = None,
        save_state: str | Path | None = None,
        top: int = 0,
        prefix_cache: PrefixCache | None = None,
        resume: str | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise InvalidInput(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if top < 0:
            raise InvalidInput(f"top must be ≥ 0, got {top}")
        FfnLayerPolicy.from_spec(ffn)  # a bad policy fails here, before `stream` yields
        self.top, self.top_rows = top, ()
        self.model, self.sampling, self.ffn_spec = model, sampling, ffn
        self.save_state, self.saved_state = save_state, None
        self.loaded_state: SavedState | None = None
        self.prefix_cache, self.cached_tokens = prefix_cache, 0
        self.resumed: Resumed | None = None
        start = self._start_state(model, engine, load_state)
        if resume is not None:  # the rebuilt engine is this run's own: no fork
            if start is not None:
                raise InvalidInput("give resume= or a State / load_state, not both")
            self.spec = engine_spec(engine)  # type: ignore[arg-type]
            start, self.resumed = rebuild(model, self.spec, resume, ffn=ffn)
            self.engine = start.engine
            self.resume_hidden = start.hidden
            self.held_ids = list(start.token_ids)
            self.prompt_ids = self._continuation(model, prompt, chat)
        elif start is None:
            self.spec = engine_spec(engine)  # type: ignore[arg-type]
            self.spec.require_live_decode()
            self.prompt_ids = prompt_ids(model, prompt, chat)
            self.engine = self.spec.build(model)
            self.resume_hidden: torch.Tensor | None = None
            self.held_ids: list[int] = []
            self._cached_start()
        else:  # continue a state through a fork of it: the prompt (may be empty) as decode steps
            self.spec = parse_catalog_spec(start.spec)
            self.engine = start.fork().engine
            self.resume_hidden = start.hidden
            self.held_ids = list(start.token_ids)
            self.prompt_ids = self._continuation(model, prompt, chat)
        check_context(model, self.engine.position - self.cached_tokens + len(self.prompt_ids))
        self.max_new_tokens = max_new_tokens
        self.ffn_name = ""
        self.text = ""
        self.session: GenerationSession | None = None

    def _cached_start(self) -> None:
        """Start from the prefix cache's state for the longest start of the prompt it has."""
        if self.prefix_cache is None:
            return
        resumed = self.prefix_cache.lookup(self.model, self._cache_key(), self.prompt_ids)
        if resumed is not None:
            self.engine, self.cached_tokens = resumed.engine, resumed.tokens

    def _cache_key(self) -> str:
        """A state depends on the engine and on the FFN that computed it."""
        return f"{self.spec.spec()} · ffn {self.ffn_spec}"

    @staticmethod
    def _continuation(model: Model, prompt: Prompt, chat: bool) -> list[int]:
        """The ids a continued state takes as decode steps (none for an empty prompt)."""
        empty = prompt.strip() == "" if isinstance(prompt, str) else not prompt
        return [] if empty else prompt_ids(model, prompt, chat)

    def _start_state(
        self, model: Model, engine: EngineLike | State | None, path: str | Path | None
    ) -> State | None:
        """The state a run continues: the one given, or the one saved at `path`; None: a
        fresh engine takes the prompt."""
        if isinstance(engine, State):
            if path is not None:
                raise InvalidInput("give a State or load_state, not both")
            if model_fingerprint(engine.model) != model_fingerprint(model):
                raise InvalidInput(
                    f"the State was made with model {engine.model.name!r}, not {model.name!r}"
                )
            return engine
        if path is None:
            return None
        asked = None if engine is None else engine_spec(engine)
        if asked is not None:
            asked.require_live_decode()
        state, manifest = load_state_dir(path, model, asked)
        self.loaded_state = SavedState(manifest, state.hidden, Path(path))
        return state

    def pieces(self) -> Iterator[str]:
        tokenizer = self.model.tokenizer
        stop_ids = tokenizer.stop_ids
        router = build_ffn(self.model, self.ffn_spec)
        self.ffn_name = router.name
        try:
            sampler = Sampler(self.sampling)
            session = GenerationSession(
                self.engine,
                self.model,
                router,
                self.prompt_ids[self.cached_tokens :],
                self.max_new_tokens,
                sampler,
                resume_hidden=self.resume_hidden,
                resumes=self.cached_tokens > 0,
            )
            self.session = session
            decoder = tokenizer.stream_decoder()
            token = None if session.finished else self._prefill()
            if token is not None and self.prefix_cache is not None:
                self.prefix_cache.store(
                    self.model, self._cache_key(), self.prompt_ids, self.engine, self.cached_tokens
                )
            if token is not None and self.top and session.logits is not None:
                self.top_rows = top_tokens(self.model, session.logits, self.top)
            if token is not None and self.save_state is not None:
                assert session.last_hidden is not None
                self.saved_state = save_state(
                    self.engine,
                    self.save_state,
                    self.model,
                    session.last_hidden,
                    self.held_ids + self.prompt_ids,
                )
            while token is not None:
                if token not in stop_ids and (piece := decoder.step(token)):
                    self.text += piece
                    yield piece
                token = None if session.finished else session.step()
        finally:
            router.close()
        # a multi-byte character cut off by the end of the run: what decoding the ids gives
        rest = tokenizer.decode([t for t in session.tokens if t not in stop_ids])[len(self.text) :]
        if rest:
            self.text += rest
            yield rest

    def _prefill(self) -> int:
        """The session's prompt in → the first token; with a prefix cache, states along the
        prompt left in it where the engine makes them (`prefill_leaving_states`)."""
        session = self.session
        assert session is not None
        if self.prefix_cache is None:
            return session.prefill()
        return prefill_leaving_states(
            session, self.prefix_cache, self.model, self._cache_key(), self.prompt_ids
        )

    def result(self) -> Generation:
        assert self.session is not None, "result() before pieces() ran"
        done = self.session.result()
        memory = self.engine.memory()
        return Generation(
            text=self.text,
            token_ids=done.tokens,
            prompt_ids=list(self.prompt_ids),
            finish_reason=done.finish_reason,
            memory=memory.state,
            memory_breakdown=memory,
            prefill_ms=done.prefill_ms,
            decode_tok_s=done.decode_tok_s,
            model=self.model.name,
            engine=self.spec.spec(),
            engine_summary=self.engine.info().summary(),
            ffn=self.ffn_name,
            loaded_state=self.loaded_state,
            saved_state=self.saved_state,
            top=self.top_rows,
            decode_path=decode_path(self.model, done.decode_kinds, len(done.step_ms)),
            cached_prompt_tokens=self.cached_tokens,
            resumed=self.resumed,
        )


def prompt_ids(model: Model, prompt: Prompt, chat: bool = False) -> list[int]:
    """Text (or one chat turn) → ids; ids pass through."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidInput("the prompt is empty")
        return encode_prompt(model, prompt, chat)
    if chat:
        raise InvalidInput("chat=True wraps text in the chat template: pass the prompt as text")
    ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidInput("the prompt has no tokens")
    vocab = model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidInput(
            f"token id {bad[0]} is outside {model.name}'s vocabulary (0..{vocab - 1})"
        )
    return ids


@renamed_arguments(ffn="ffn_policy")
def generate(
    model: Model,
    engine: EngineLike | State | None,
    prompt: Prompt,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    chat: bool = False,
    ffn_policy: str = "dense",
    on_text: Callable[[str], None] | None = None,
    load_state: str | Path | None = None,
    save_state: str | Path | None = None,
    top: int = 0,
    prefix_cache: PrefixCache | None = None,
    resume: str | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` tokens from `prompt` (text, or token ids) through a fresh
    engine built from `engine` (a spec string or an `EngineSpec`); an end-of-turn token ends
    the run early. Sampling as `larql run` (temperature 0 = greedy); `ffn_policy` the FFN
    policy of every layer (`--ffn-policy`); `on_text` gets each text piece as it is decoded.

    `engine` may also be a `State` (`prefill`, `load_state`): the run continues a fork of it,
    `prompt` (may be empty) fed as decode steps, and the state itself is left as it was.
    `save_state`: a directory the engine's state is written to once the prompt is in.
    `load_state`: start from a state saved there instead of a fresh engine (`engine` None or
    the spec it was saved with).
    `top=N`: also the N most likely first tokens with their probabilities (`Generation.top`).
    `prefix_cache`: a `PrefixCache` the run starts from (the state of the longest start of the
    prompt an earlier run with that cache, engine and FFN had) and offers its prompt's state
    to (`Generation.cached_prompt_tokens` says how many tokens it saved).
    `resume`: a sequence `engine` (`boundary-kv:archive=DIR`) archived — its tokens are run
    through a fresh engine of that spec again (`larql.resume`), then `prompt` (may be empty)
    continues them (`Generation.resumed` says what was resumed)."""
    run = _TextRun(
        model,
        engine,
        prompt,
        max_new_tokens,
        SamplingParams(temperature, top_k, top_p, seed),
        chat,
        ffn_policy,
        load_state,
        save_state,
        top,
        prefix_cache,
        resume,
    )
    for piece in run.pieces():
        if on_text is not None:
            on_text(piece)
    return run.result()


@renamed_arguments(ffn="ffn_policy")
def stream(
    model: Model,
    engine: EngineLike | State,
    prompt: Prompt,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    chat: bool = False,
    ffn_policy: str = "dense",
    prefix_cache: PrefixCache | None = None,
) -> Iterator[str]:
    """`generate`, yielding the text as it is decoded; the pieces join to `generate`'s text.
    Arguments are checked when this is called, before the first piece is asked for."""
    run = _TextRun(
        model,
        engine,
        prompt,
        max_new_tokens,
        SamplingParams(temperature, top_k, top_p, seed),
        chat,
        ffn_policy,
        prefix_cache=prefix_cache,
    )
    return run.pieces()


@renamed_arguments(ffn="ffn_policy")
def prefill(
    model: Model,
    engine: EngineLike,
    prompt: Prompt,
    *,
    chat: bool = False,
    ffn_policy: str = "dense",
) -> State:
    """Run `prompt` (text, or token ids; `chat=True` wraps text in the chat template) through a
    fresh engine built from `engine` → the `State` after it: save it (`State.save`), fork it,
    or continue it with `generate(model, state, …)` as often as wanted."""
    spec = engine_spec(engine)
    spec.require_live_decode()
    ids = prompt_ids(model, prompt, chat)
    check_context(model, len(ids))
    built = spec.build(model)
    router = build_ffn(model, ffn_policy)
    try:
        with torch.inference_mode():
            hidden = built.prefill(model, router, ids)  # [1, H]
    finally:
        router.close()
    return State(model, built, hidden, tuple(ids))


def load_state(model: Model, path: str | Path, *, engine: EngineLike | None = None) -> State:
    """The `State` saved in directory `path` (by `State.save`, `generate(save_state=…)` or
    `larql run --save-state`), on `model` — the one it was saved with. The engine is rebuilt
    from the spec the state names, or from `engine`, which must be that spec; every field and
    tensor is checked on the way in, and nothing in the directory can name code to run."""
    asked = None if engine is None else engine_spec(engine)
    if asked is not None:
        asked.require_live_decode()
    state, _ = load_state_dir(path, model, asked)
    return state


@renamed_arguments(ffn="ffn_policy")
def teacher_forced_logits(
    model: Model,
    engine: EngineLike,
    tokens: Prompt,
    *,
    prompt_tokens: int = 1,
    ffn_policy: str = "dense",
) -> torch.Tensor:
    """Prefill the first `prompt_tokens` ids through a fresh engine, then feed every later id as
    a decode step whatever the model would pick → next-token logits after the prompt and after
    each fed id, `[T − prompt_tokens + 1, V]` for T ids (`[T, V]` with the default 1: row i
    predicts id i + 1). The accuracy harness scores engines on exactly this run."""
    ids = prompt_ids(model, tokens)
    if not 1 <= prompt_tokens <= len(ids):
        raise InvalidInput(
            f"prompt_tokens must be in 1..{len(ids)} (the ids given), got {prompt_tokens}"
        )
    if len(ids) > model.config.max_positions:
        raise InvalidInput(
            f"{len(ids)} ids exceed {model.name}'s context of {model.config.max_positions} tokens"
        )
    built = engine_spec(engine).build(model)
    router = build_ffn(model, ffn_policy)
    try:
        return teacher_forced_run(built, model, router, ids, prompt_tokens)
    finally:
        router.close()
