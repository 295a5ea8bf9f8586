"""A model's structure without its weights: the config from the file's header and every weight
a tensor on torch's `meta` device, of the shape and dtype a load gives it, holding no data.

Code run over a structure computes shapes only, so it answers in seconds whatever the model's
size and reads no weight: `larql memory` runs the engines' own prefill and decode over one and
counts what they hold with the code that counts a real run's (`numel × element_size`).

Where the shapes come from: a `.gguf` file's tensor table; an HF directory's safetensors
headers, or, where it has no weight files (a `config.json` alone), `config.json` itself: every
attention and norm tensor of the shape the loader checks a file's against, and a dense MLP of
the config's width on every layer (no engine's state depends on the FFN's shape, so a mixture
of experts is counted as such an MLP there). A structure has no tokenizer (an empty one)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from larql.models.config import ModelConfig
from larql.models.gguf_file import GgufFile
from larql.models.gguf_loader import gguf_config, gguf_shapes
from larql.models.hf_loader import hf_config, hf_state_dict, read_hf_config
from larql.models.model import Model, parse_dtype, reading
from larql.models.registry import resolve_model_path
from larql.models.tokenizer import TextTokenizer
from larql.models.weights import ModelWeights, expected_shape

META = torch.device("meta")
UNKNOWN = "<unk>"  # the empty tokenizer's one token


def load_structure(model: str | None = None, dtype: torch.dtype | str = torch.float32) -> Model:
    """The structure of a registry model, a `.gguf` file or an HF directory (None: the default
    model), its weights meta tensors of `dtype`."""
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    name, path = resolve_model_path(model)
    config, shapes = _hf_structure(path, name) if path.is_dir() else _gguf_structure(path, name)
    state = {key: torch.empty(shape, device=META) for key, shape in shapes.items()}
    with reading(path):
        weights = ModelWeights.from_state(config, state, dtype, META)
    return Model(name=name, source=path, config=config, weights=weights, tokenizer=_no_tokenizer())


def _gguf_structure(path: Path, name: str) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    with reading(path):
        gguf = GgufFile(path)  # the header; the tensor data is mapped, never read here
        config = gguf_config(gguf, name)
        return config, gguf_shapes(gguf, config)


def _hf_structure(path: Path, name: str) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    with reading(path / "config.json"):
        config = hf_config(read_hf_config(path), name)
    if not any(path.glob("*.safetensors")):
        return config, config_shapes(config)
    with reading(path):
        state = hf_state_dict(path, config, meta=True)
    return config, {key: tuple(tensor.shape) for key, tensor in state.items()}


def config_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The canonical state's shapes as the config fixes them (`expected_shape`): embeddings,
    the LM head where untied, and per layer its attention (its K/V projections where it keeps
    its own), the norms its architecture has, and a dense MLP."""
    names = ["embed", "final_norm"] + ([] if config.tie_embeddings else ["lm_head"])
    arch = config.arch
    for i in range(config.num_layers):
        own_kv = config.kv_source_of(i) is None
        kinds = ["attn_norm", "wq", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
        kinds += ["wk", "wv"] if own_kv else []
        kinds += (["q_norm"] + (["k_norm"] if own_kv else [])) if arch.qk_norm else []
        kinds += ["post_attn_norm", "post_ffn_norm"] if arch.post_norms else []
        names += [f"layers.{i}.{kind}" for kind in kinds]
    shapes = {}
    for key in names:
        shape = expected_shape(config, key)
        assert shape is not None, key  # every name above is one the config fixes
        shapes[key] = shape
    if arch.attention_sinks:
        for i in range(config.num_layers):
            shapes[f"layers.{i}.attn_sinks"] = (config.num_heads,)
    return shapes


def _no_tokenizer() -> TextTokenizer:
    return TextTokenizer(Tokenizer(WordLevel({UNKNOWN: 0}, unk_token=UNKNOWN)))
