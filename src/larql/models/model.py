"""`Model` = config + weights + tokenizer; `load_model` is what every command calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from larql.models.cache import cached_state_dict, cached_tokenizer
from larql.models.config import ModelConfig
from larql.models.errors import ModelError, ModelFormatError
from larql.models.fields import Fields
from larql.models.gguf_file import GgufFile
from larql.models.gguf_loader import gguf_block_rows, gguf_config, gguf_state_dict
from larql.models.hf_loader import hf_config, hf_state_dict, read_hf_config
from larql.models.quantise import LOAD_FORMATS, quantise_state
from larql.models.registry import resolve_model_path
from larql.models.shard import (
    TensorShard,
    check_splits,
    shard_blocks,
    shard_config,
    shard_state,
)
from larql.models.tokenizer import (
    TextTokenizer,
    chat_template_from_dir,
    stop_ids_for,
    tokenizer_from_file,
    tokenizer_from_gguf,
)
from larql.models.weights import ExpertWeights, ModelWeights

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


@dataclass(frozen=True)
class LoadArgs:
    """What `load_model` was called with: another process loads the same model from them."""

    model: str
    dtype: str
    device: str
    weights: str


@dataclass
class Model:
    name: str
    source: Path
    config: ModelConfig
    weights: ModelWeights
    tokenizer: TextTokenizer
    # Derived per-model artefacts (RoPE tables, ...) that the forward pass builds on first use.
    runtime: dict[object, object] = field(default_factory=dict, repr=False, compare=False)
    load_args: LoadArgs | None = field(default=None, repr=False, compare=False)
    # this process's place in a tensor-parallel group (`larql.parallel`): the config and weights
    # are then the rank's share, and the layers add the ranks' partial outputs; None: whole
    shard: TensorShard | None = field(default=None, repr=False, compare=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def to(self, dtype: torch.dtype | None = None, device: str | None = None) -> Model:
        """A copy of the model with its weights in another dtype/device (tokenizer shared)."""
        state = _state_from_weights(self.weights)
        weights = ModelWeights.from_state(
            self.config, state, dtype or self.dtype, device or self.device
        )
        if weights.device.type == "cpu" and weights.dtype != torch.float64:
            weights.share_blocks(self.weights)  # float64, the precision reference, has none
        return Model(self.name, self.source, self.config, weights, self.tokenizer, shard=self.shard)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ModelError(
            f"unknown dtype {name!r}; accepted: float32, bfloat16, float16, float64"
        ) from None


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ModelError(f"unknown device {name!r}; accepted: cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ModelError(f"device {name!r} is not supported; accepted: cpu, cuda, cuda:N")
    return device


# --weights: the block matrices' activation, None for float weights only; `q8_0` / `q4_0`
# quantise the matrices at load (`larql.models.quantise`)
WEIGHT_MODES = {
    "auto": "int16",
    "blocks-int16": "int16",
    "blocks-int8": "int8",
    "blocks-float": "float",
    "float": None,
    "q8_0": "int16",
    "q4_0": "int16",
}


def load_model(
    model: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    weights: str = "auto",
    shard: TensorShard | None = None,
) -> Model:
    """Load a registry model, a `.gguf` file or an HF directory.

    weights: `float` keeps every matrix dequantised to `dtype` only; `blocks-float` also keeps
    a GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K matrices in their blocks when the model runs on the CPU below
    float64, and one-token products read those where the CPU kernels are built (`make setup`),
    with a float32 input (the float product up to the order of its sums); `blocks-int16` /
    `blocks-int8` the same with the input rounded to int16 / int8 codes per block of 32
    (integer block sums; int8 is llama.cpp's arithmetic); each one's fidelity against `float`
    is measured in docs/FIDELITY.md. `auto` is `blocks-int16`. `q8_0` / `q4_0` quantise every
    layer matrix and the LM head (of any model: a quantised GGUF's are re-quantised from their
    dequantised floats) to that GGUF format at load and replace the float weights by the blocks'
    dequantised values, on every device and dtype; on the CPU below float64 the blocks are kept
    too and read as `blocks-int16` reads a GGUF's.

    shard: this process's rank in a tensor-parallel group; the model is then that rank's share
    of the heads and MLP (`larql.models.shard`), its blocks cut alike. A group of one holds
    the whole model and runs exactly as a process alone (CUDA graphs, fused layers)."""
    if shard is not None and shard.world == 1:
        shard = None
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    device = parse_device(device) if isinstance(device, str) else device
    if weights not in WEIGHT_MODES:
        raise ModelError(f"unknown weights mode {weights!r}; accepted: {', '.join(WEIGHT_MODES)}")
    name, path = resolve_model_path(model)
    # an HF directory's tensors are read as this rank's share, each converted to `dtype` as it
    # is read; a GGUF's state (and one quantised at load, from the whole float32 matrices) is
    # read whole and cut after
    quantised = weights in LOAD_FORMATS
    share = shard if path.is_dir() and not quantised else None
    if path.is_dir():
        hold = torch.float32 if quantised else dtype
        config, state, tokenizer = _load_hf_dir(path, name, hold, share)
    else:
        config, state, tokenizer = _load_gguf(path, name)
    blocks = None
    if quantised:
        state, blocks = quantise_state(state, weights)
    whole = config
    if shard is not None:
        config = shard_config(whole, shard.world)
        if share is None:
            state = shard_state(whole, state, shard.rank, shard.world)
    with reading(path):
        held = ModelWeights.from_state(config, state, dtype, device)
    activation = WEIGHT_MODES[weights]
    if activation is not None and _reads_blocks(device, dtype):
        if blocks is None and not path.is_dir():
            blocks = gguf_block_rows(GgufFile(path), whole)
        if blocks and shard is not None:
            blocks = shard_blocks(whole, blocks, shard.rank, shard.world)
        if blocks:
            held.attach_blocks(blocks, activation)
    given = name if model is None else model  # what resolves to this model again
    args = LoadArgs(given, str(dtype).removeprefix("torch."), str(device), weights)
    return Model(
        name=name,
        source=path,
        config=config,
        weights=held,
        tokenizer=tokenizer,
        load_args=None if shard is not None else args,
        shard=shard,
    )


def load_config(model: str | None = None) -> ModelConfig:
    """The config alone of what `load_model` would load (its header, not its weights)."""
    name, path = resolve_model_path(model)
    with reading(path):
        if path.is_dir():
            return hf_config(read_hf_config(path), name)
        return gguf_config(GgufFile(path), name)


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """A model error raised while reading `path` names it, in one line (the loaders' own
    messages say what is wrong; this says where)."""
    try:
        yield
    except ModelError as e:
        message = " ".join(str(e).split())
        if str(path) not in message:
            message = f"{path}: {message}"
        raise type(e)(message) from None


def _reads_blocks(device: torch.device, dtype: torch.dtype) -> bool:
    """On the CPU, below float64 (the precision reference)."""
    return device.type == "cpu" and dtype != torch.float64


def _load_gguf(path: Path, name: str) -> tuple[ModelConfig, dict, TextTokenizer]:
    with reading(path):
        gguf = GgufFile(path)
        config = gguf_config(gguf, name)
        tok = cached_tokenizer(path, lambda: tokenizer_from_gguf(gguf))
        state = cached_state_dict(path, lambda: gguf_state_dict(gguf, config))
        tokens = gguf.strings("tokenizer.ggml.tokens")
        template = Fields(gguf.metadata).text("tokenizer.chat_template", None)
    tokenizer = TextTokenizer(
        tokenizer=tok,
        bos_token=_token_at(tokens, config.bos_token_id),
        eos_token=_token_at(tokens, config.eos_token_ids[0] if config.eos_token_ids else None),
        chat_template=template,
        stop_ids=stop_ids_for(tok, config.eos_token_ids),
    )
    return config, state, tokenizer


def _load_hf_dir(
    path: Path, name: str, dtype: torch.dtype, shard: TensorShard | None
) -> tuple[ModelConfig, dict, TextTokenizer]:
    """The whole model's config, the state in `dtype` (`shard`: that rank's share alone, read
    as such) and the tokenizer."""
    with reading(path / "config.json"):
        config = hf_config(read_hf_config(path), name)
    if shard is not None:
        check_splits(config, shard.world)  # before any tensor is read
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ModelFormatError(f"{path} has no tokenizer.json")
    with reading(tokenizer_file):
        tok = tokenizer_from_file(tokenizer_file, config.vocab_size)
    with reading(path):
        share = None if shard is None else (shard.rank, shard.world)
        state = hf_state_dict(path, config, share=share, dtype=dtype)
        template = chat_template_from_dir(path)
    bos = config.bos_token_id
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    tokenizer = TextTokenizer(
        tokenizer=tok,
        bos_token=tok.id_to_token(bos) if bos is not None else None,
        eos_token=tok.id_to_token(eos) if eos is not None else None,
        chat_template=template,
        stop_ids=stop_ids_for(tok, config.eos_token_ids),
    )
    return config, state, tokenizer


def _token_at(tokens: list[str], index: int | None) -> str | None:
    return tokens[index] if index is not None and 0 <= index < len(tokens) else None


def _state_from_weights(weights: ModelWeights) -> dict[str, torch.Tensor]:
    """Canonical names back from fused weights (used to change dtype or device)."""
    state = {"embed": weights.embed, "final_norm": weights.final_norm}
    if weights.lm_head.data_ptr() != weights.embed.data_ptr():
        state["lm_head"] = weights.lm_head
    for i, lw in enumerate(weights.layers):
        p = f"layers.{i}."
        q_dim = lw.wo.shape[1]
        kv_dim = (lw.wqkv.shape[0] - q_dim) // 2
        state[p + "wq"], state[p + "wk"], state[p + "wv"] = lw.wqkv.split([q_dim, kv_dim, kv_dim])
        if lw.bqkv is not None:
            state[p + "bq"], state[p + "bk"], state[p + "bv"] = lw.bqkv.split(
                [q_dim, kv_dim, kv_dim]
            )
        if lw.w_gate_up is not None:
            state[p + "w_gate"], state[p + "w_up"] = lw.w_gate_up.chunk(2)
        if lw.experts is not None:
            state.update(_expert_state(lw.experts, p))
        for key in (
            "attn_norm",
            "q_norm",
            "k_norm",
            "wo",
            "bo",
            "post_attn_norm",
            "ffn_norm",
            "w_down",
            "post_ffn_norm",
            "attn_sinks",
        ):
            value = getattr(lw, key)
            if value is not None:
                state[p + key] = value
    return state


def _expert_state(experts: ExpertWeights, prefix: str) -> dict[str, torch.Tensor]:
    """Canonical names back from one layer's `ExpertWeights`."""
    state = {prefix + "router": experts.router, prefix + "experts_down": experts.down}
    state[prefix + "experts_gate"], state[prefix + "experts_up"] = experts.gate_up.chunk(2, dim=1)
    if experts.shared_gate_up is not None and experts.shared_down is not None:
        state[prefix + "shared_gate"], state[prefix + "shared_up"] = experts.shared_gate_up.chunk(2)
        state[prefix + "shared_down"] = experts.shared_down
    if experts.shared_expert_gate is not None:
        state[prefix + "shared_expert_gate"] = experts.shared_expert_gate
    if experts.router_bias is not None:
        state[prefix + "router_bias"] = experts.router_bias
    if experts.gate_up_bias is not None:
        gate_bias, up_bias = experts.gate_up_bias.chunk(2, dim=1)
        state[prefix + "experts_gate_bias"], state[prefix + "experts_up_bias"] = gate_bias, up_bias
    if experts.down_bias is not None:
        state[prefix + "experts_down_bias"] = experts.down_bias
    return state
