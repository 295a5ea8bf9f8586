"""What the weights are: config, architectures, GGUF/safetensors loading, tokenizer, registry."""

from larql.models.config import Arch, LayerSpec, ModelConfig, RopeSpec
from larql.models.errors import ModelError, ModelFormatError, ModelNotFound, UnsupportedArchitecture
from larql.models.model import DTYPES, Model, load_model, parse_device, parse_dtype
from larql.models.registry import DEFAULT_MODEL, KNOWN_MODELS
from larql.models.tokenizer import ChatTemplateMissing, TextTokenizer

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "KNOWN_MODELS",
    "Arch",
    "ChatTemplateMissing",
    "LayerSpec",
    "Model",
    "ModelConfig",
    "ModelError",
    "ModelFormatError",
    "ModelNotFound",
    "RopeSpec",
    "TextTokenizer",
    "UnsupportedArchitecture",
    "load_model",
    "parse_device",
    "parse_dtype",
]
