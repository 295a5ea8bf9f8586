"""An engine's state as an object tree ↔ (JSON-able tree, flat tensor dict).

The tree an engine hands over (`Engine.state_dict()`) may hold tensors, numbers, strings, lists,
tuples, dicts, enums, dtypes and devices, the model it decodes with, and larql objects (K/V
buffers, residual stores, codecs, …) that are themselves such trees. Encoding replaces each
tensor with a reference into a flat `{name: tensor}` dict (what safetensors writes) and each
larql object with its class path and its `__getstate__()`; decoding rebuilds them without
calling any constructor. Only classes of larql's own modules are rebuilt, so a manifest cannot
name arbitrary code. Anything else (a function, a file handle, a path) is refused with the
attribute path that holds it, so an engine that grows unsnapshotable state fails loudly.
"""

from __future__ import annotations

import enum
import importlib
from typing import Any

import torch

from larql.inference.snapshots.errors import SnapshotCorrupt
from larql.models.model import Model

_PRIMITIVES = (type(None), bool, int, float, str)
_OWN_PREFIX = "larql."


class Unencodable(TypeError):
    """A value of the state tree with no encoding; `path` says where it sits."""

    def __init__(self, path: str, value: object) -> None:
        super().__init__(f"{path} holds a {type(value).__name__}, which a snapshot cannot keep")
        self.path = path


class TreeEncoder:
    """Encodes trees into one shared tensor dict (names t0, t1, … in encounter order): copies
    on the CPU for a file, or (`keep_device`) copies where they are, for an in-memory fork.
    `models` collects the models the tree refers to."""

    def __init__(self, keep_device: bool = False) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.models: list[Model] = []
        self._target = None if keep_device else "cpu"

    def encode(self, value: Any, path: str = "state") -> Any:
        if isinstance(value, enum.Enum):
            return {"__enum__": _class_path(type(value)), "value": self.encode(value.value, path)}
        if type(value) in _PRIMITIVES:
            return value
        if isinstance(value, torch.Tensor):
            name = f"t{len(self.tensors)}"
            copied = value.detach().to(self._target or value.device, copy=True)
            self.tensors[name] = copied.contiguous()
            return {"__tensor__": name, "cpu": value.device.type == "cpu"}
        if isinstance(value, list):
            return [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            return {
                "__dict__": [
                    [self.encode(k, path), self.encode(v, f"{path}[{k!r}]")]
                    for k, v in value.items()
                ]
            }
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"__device__": value.type}
        if isinstance(value, Model):
            self.models.append(value)
            return {"__model__": True}
        if type(value).__module__.startswith(_OWN_PREFIX) and hasattr(value, "__dict__"):
            state = value.__getstate__()
            return {"__object__": _class_path(type(value)), "state": self.encode(state, path)}
        raise Unencodable(path, value)


class TreeDecoder:
    """Rebuilds trees from a tensor dict, onto `model` (its device for non-CPU tensors)."""

    def __init__(self, tensors: dict[str, torch.Tensor], model: Model | None) -> None:
        self.tensors, self.model = tensors, model

    def decode(self, node: Any) -> Any:
        if type(node) in _PRIMITIVES:
            return node
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if not isinstance(node, dict) or len(node) == 0:
            raise SnapshotCorrupt(f"unexpected node in the state tree: {node!r:.80}")
        try:
            return self._decode_marked(node)
        except (KeyError, TypeError, ValueError, AttributeError, ImportError) as e:
            raise SnapshotCorrupt(f"the state tree does not decode ({e})") from None

    def _decode_marked(self, node: dict[str, Any]) -> Any:
        if "__tensor__" in node:
            tensor = self.tensors[node["__tensor__"]]
            on_model = not node["cpu"] and self.model is not None
            return tensor.to(self.model.device) if on_model else tensor
        if "__tuple__" in node:
            return tuple(self.decode(v) for v in node["__tuple__"])
        if "__dict__" in node:
            return {self.decode(k): self.decode(v) for k, v in node["__dict__"]}
        if "__dtype__" in node:
            dtype = getattr(torch, node["__dtype__"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{node['__dtype__']!r} is not a dtype")
            return dtype
        if "__device__" in node:
            if node["__device__"] == "cpu" or self.model is None:
                return torch.device(node["__device__"])
            return self.model.device
        if "__model__" in node:
            return self.model
        if "__enum__" in node:
            return _own_class(node["__enum__"])(self.decode(node["value"]))
        if "__object__" in node:
            cls = _own_class(node["__object__"])
            obj = cls.__new__(cls)
            state = self.decode(node["state"])
            if hasattr(cls, "__setstate__"):
                obj.__setstate__(state)
            elif state is not None:
                obj.__dict__.update(state)
            return obj
        raise ValueError(f"unknown node kind {sorted(node)}")


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _own_class(path: str) -> type:
    module, _, qualname = path.partition(":")
    if not module.startswith(_OWN_PREFIX):
        raise ValueError(f"{path!r} is not a larql class")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not isinstance(found, type):
        raise ValueError(f"{path!r} is not a class")
    return found
