"""What `larql serve` was started with: the default engine and the limits every request obeys."""

from __future__ import annotations

from dataclasses import dataclass, field

from larql.kv.catalog import parse_engine
from larql.kv.spec import EngineSpec
from larql.server.scheduler import SchedulerLimits


@dataclass(frozen=True)
class ServerSettings:
    default_engine: EngineSpec = field(default_factory=lambda: parse_engine("standard"))
    max_sessions: int = 4
    max_queue: int = 16
    max_prompt_tokens: int | None = None  # None: the model's context (less one new token)
    max_new_tokens: int = 512
    request_timeout_s: float = 300.0
    max_body_bytes: int = 8 * 2**20  # a prompt of the whole context as token ids is ~60 kB
    retry_after_s: int = 1
    prefill_chunk: int = 32  # new prompts' tokens a step takes in while other streams decode
    shutdown_timeout_s: float = 10.0  # running streams' time to finish once shutdown begins
    # names the `model` field may carry besides the model's own (e.g. the -m path it came from)
    model_aliases: tuple[str, ...] = ()
    access_log: bool = False  # a line on stderr per request (`larql serve` unless --quiet)
    verbose: bool = False  # the access log says what each request ran (`larql serve -v`)
    # bytes of engine state the prefix cache keeps (0: no cache; None: a share of the memory,
    # `prefix_cache.default_size`)
    prefix_cache_bytes: int | None = None

    def scheduler_limits(self) -> SchedulerLimits:
        return SchedulerLimits(
            max_sessions=self.max_sessions,
            max_queue=self.max_queue,
            request_timeout_s=self.request_timeout_s,
            retry_after_s=self.retry_after_s,
            prefill_chunk=self.prefill_chunk,
            shutdown_timeout_s=self.shutdown_timeout_s,
        )
