"""`kv-quant`: K/V quantised by the plain methods users compare turbo-quant against — per-token
groups of int8 / int4 / int2 (a scale and a zero point each) or fp8 e4m3 (a scale each),
optionally after a Walsh–Hadamard rotation, optionally with the newest rows (KIVI's residual)
and the first rows kept exact. The state policy is turbo-quant's (the same store of sinks, codes
and recent rows); only the codec differs, so the two are compared at equal bytes on equal terms.
On the CPU a float32 model's integer codes are attended in place by the compiled extension
(`compiled`), as turbo-quant's are. On CUDA, integer codes the Triton kernels take (`kernels`:
int2/int4/int8 of a power-of-two coded width in power-of-two groups) take turbo-quant's kernel
path — codes in fixed slots attended in place, the new row encoded on the GPU, the step in a
CUDA graph, sessions batched — with the same bytes; fp8 codes and other widths keep the torch
path, which decodes every stored row each step (`attention=sdpa`: the torch path everywhere)."""

from __future__ import annotations

from types import ModuleType

import torch

import larql.kernels
from larql.inference.shared_kv import SharedKv
from larql.kernels.cpu import cpu_extension
from larql.kv.kv_quant.codecs import Fp8Codec, IntCodec, triton_codes
from larql.kv.kv_quant.compiled import attend_grouped, grouped_codes, grouped_in_place
from larql.kv.turbo_quant.codec import RowCodec
from larql.kv.turbo_quant.engine import TurboQuantEngine, exact_rows_label
from larql.kv.turbo_quant.kernel_path import KernelPath
from larql.kv.turbo_quant.store import KvLayout
from larql.models.model import Model


class KvQuantEngine(TurboQuantEngine):
    name = "kv-quant"

    def __init__(
        self,
        bits: int = 4,
        fp8: bool = False,
        group: int = 32,
        rotate: bool = False,
        recent: int = 0,
        sinks: int = 0,
        profiling: bool = False,
        recent_bits: int = 16,
        attention: str = "auto",
        use_graph: bool = True,
    ) -> None:
        self.fp8, self.group, self.rotate = fp8, group, rotate
        self._torch_path_note = ""  # why the kernels did not take a GPU model (describe)

        def codec(dim: int) -> RowCodec:
            if fp8:
                return Fp8Codec(dim, group, rotate)
            return IntCodec(dim, bits, group, rotate)

        super().__init__(
            bits=8 if fp8 else bits,
            profiling=profiling,
            codec_factory=codec,
            rotated_attention=False,
            attention=attention,
            use_graph=use_graph,
            recent=recent,
            sinks=sinks,
            recent_bits=recent_bits,
        )

    def codes_label(self) -> str:
        kind = "fp8 e4m3" if self.fp8 else f"int{self.bits}"
        rotated = " after a Walsh–Hadamard rotation" if self.rotate else ""
        exact = (
            f", {exact_rows_label(self.sinks, self.recent, self.recent_bits)}"
            if self.recent or self.sinks
            else ""
        )
        return f"{kind} K/V in groups of {self.group}{rotated}{exact}"

    def config(self) -> str:
        parts = ["format=fp8" if self.fp8 else f"bits={self.bits}", f"group={self.group}"]
        levers = {"rotate": int(self.rotate), "recent": self.recent, "sinks": self.sinks}
        parts += [f"{name}={value}" for name, value in levers.items() if value]
        if self.recent and self.recent_bits != 16:
            parts.append(f"recent_bits={self.recent_bits}")
        parts += [] if self.attention == "auto" else [f"attention={self.attention}"]
        parts += [] if self.use_graph else ["graph=0"]
        return ",".join(parts)

    def _path(self) -> str:
        """The decode path: turbo-quant's kernel path's label, else the torch path's (and, on a
        GPU, why the kernels did not take it)."""
        if self._fast is not None:
            return super()._path()
        return f"decoded attention{self._torch_path_note}"

    def _kernels_for_codec(self) -> bool:
        """Integer codes have Triton kernels (`kernels`); fp8 codes do not."""
        return not self.fp8

    def _triton_kernels(self) -> ModuleType:
        from larql.kv.kv_quant import kernels  # imports Triton: only where it runs

        return kernels

    def _kernel_path(self, model: Model, keeps: list[int | None]) -> KernelPath | None:
        """turbo-quant's kernel path over these codes where it runs and takes them; else None,
        noting why the kernels left a GPU model on the torch path."""
        path = super()._kernel_path(model, keeps)
        self._torch_path_note = ""
        if (
            path is None
            and self.attention != "sdpa"
            and larql.kernels.triton_available(model.device)
        ):
            if self.fp8:
                self._torch_path_note = " (torch path: the Triton kernels take integer codes)"
            elif self._layout is not None and not triton_codes(self._layout.k_codec):
                self._torch_path_note = (
                    " (torch path: the Triton kernels take int2/int4/int8 codes of a "
                    "power-of-two width ≥ 16 in power-of-two groups ≥ 2)"
                )
        return path

    def _compiled(self, model: Model, layout: KvLayout) -> bool:
        """Integer or fp8 codes of one codec are encoded by the CPU extension (and its one-call
        step takes them where it applies); not with `attention=sdpa`."""
        if self.attention == "sdpa":
            return False
        return grouped_codes(model, layout.k_codec, layout.v_codec)

    def _attend_in_place(
        self,
        model: Model,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotation: torch.Tensor | None,
        shared: SharedKv,
    ) -> torch.Tensor | None:
        """The attention over the integer or fp8 codes in the CPU extension (`compiled`), or
        None."""
        assert self._layers is not None
        store = self._layers[layer]
        in_place = self.attention != "sdpa" and grouped_in_place(model, layer, store, shared)
        kernels = cpu_extension() if in_place else None
        if kernels is None:
            return None
        with self._profiler.stage("attention", model.device):
            return attend_grouped(kernels, model, layer, store, q, k, v)
