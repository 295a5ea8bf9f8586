"""Model weights as plain tensors, in the layout the forward pass wants.

Loaders produce a *canonical state dict* (names below, float32, `nn.Linear` layout, norm offsets
already folded in); `ModelWeights.from_state` fuses the per-layer projections (Q|K|V and
gate|up, one matmul each) and moves everything to the requested dtype and device.

Canonical names: `embed`, `lm_head` (absent when tied), `final_norm`, and per layer
`layers.{i}.{attn_norm, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm, post_attn_norm,
ffn_norm, w_gate, w_up, w_down, post_ffn_norm, layer_scalar}` (biases, optional norms and the
layer scalar may be absent).
A mixture-of-experts layer has `layers.{i}.router` [E, H] and the experts stacked,
`layers.{i}.{experts_gate, experts_up}` [E, F, H] and `experts_down` [E, H, F], optionally a
shared expert `layers.{i}.{shared_gate, shared_up, shared_down}` with its sigmoid gate
`shared_expert_gate` [1, H]; its dense `w_gate, w_up, w_down` are then optional (present: a
dense MLP beside the experts, their outputs added).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from larql.models.blocks import BlockRows, fuse_layer_blocks
from larql.models.config import ExpertRouting, ModelConfig
from larql.models.errors import ModelFormatError

StateDict = Mapping[str, torch.Tensor]
Getter = Callable[[str], torch.Tensor]
OptionalGetter = Callable[[str], torch.Tensor | None]


@dataclass
class ExpertWeights:
    """One mixture-of-experts block."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2·F, H] (gate rows, then up rows)
    down: torch.Tensor  # [E, H, F]
    router_bias: torch.Tensor | None = None  # [E]
    gate_up_bias: torch.Tensor | None = None  # [E, 2·F]
    down_bias: torch.Tensor | None = None  # [E, H]
    shared_gate_up: torch.Tensor | None = None  # [2·Fs, H]
    shared_down: torch.Tensor | None = None  # [H, Fs]
    shared_expert_gate: torch.Tensor | None = None  # [1, H]
    # Gemma 4: the router reads the raw residual through a weightless RMS norm × this × 1/√H,
    # and each chosen expert's routing weight is × its `per_expert_scale`
    router_scale: torch.Tensor | None = None  # [H]
    per_expert_scale: torch.Tensor | None = None  # [E]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in vars(self).values() if isinstance(t, torch.Tensor)]

    def decode_read_bytes(self, top_k: int) -> int:
        """Bytes one token reads: the router, its top_k experts and the shared expert."""

        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        experts = self.router.shape[0]
        routed = (size(self.gate_up) + size(self.down)) * top_k // experts
        shared = size(self.shared_gate_up) + size(self.shared_down) + size(self.shared_expert_gate)
        return size(self.router) + routed + shared


@dataclass
class PerLayerEmbedding:
    """Gemma 4's per-layer inputs (PLE): each row gets a P-wide input for every layer, from its
    token's row of `table` and a projection of its embedding (`layer.per_layer_inputs`)."""

    table: torch.Tensor  # [V, L·P]
    projection: torch.Tensor  # [L·P, H]
    norm: torch.Tensor  # [P]

    def tensors(self) -> list[torch.Tensor]:
        return [self.table, self.projection, self.norm]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor  # [q_dim + 2·kv_dim, H]
    bqkv: torch.Tensor | None  # [q_dim + 2·kv_dim]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    wo: torch.Tensor  # [H, q_dim]
    bo: torch.Tensor | None  # [H]
    post_attn_norm: torch.Tensor | None  # [H]
    ffn_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor | None  # [2·F, H] (None: a layer of experts alone)
    w_down: torch.Tensor | None  # [H, F]
    post_ffn_norm: torch.Tensor | None  # [H]
    experts: ExpertWeights | None = None
    attn_sinks: torch.Tensor | None = None  # [Hq] (GPT-OSS)
    layer_scalar: torch.Tensor | None = None  # [1]: the layer's output residual × this (Gemma 4)
    # Gemma 4's experts beside the dense MLP: they read the residual through `experts_norm`;
    # the MLP's output is normed by `post_mlp_norm`, the experts' by `post_experts_norm`, and
    # their sum by `post_ffn_norm` (None: the experts, if any, read the MLP's input)
    experts_norm: torch.Tensor | None = None  # [H]
    post_mlp_norm: torch.Tensor | None = None  # [H]
    post_experts_norm: torch.Tensor | None = None  # [H]
    # Gemma 4's per-layer input, added after the FFN: h + norm(W_proj · (act(W_gate · h) ⊙ input))
    per_layer_gate: torch.Tensor | None = None  # [P, H]
    per_layer_projection: torch.Tensor | None = None  # [H, P]
    per_layer_post_norm: torch.Tensor | None = None  # [H]
    # the same matrices kept in their GGUF blocks (`wqkv`, `wo`, `w_gate_up`, `w_down`), read
    # by one-token products on the CPU instead of the float ones above
    blocks: dict[str, BlockRows] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        own = [t for t in vars(self).values() if isinstance(t, torch.Tensor)]
        return own + (self.experts.tensors() if self.experts is not None else [])


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]; the same storage as `embed` when tied
    final_norm: torch.Tensor  # [H]
    layers: list[LayerWeights]
    lm_head_blocks: BlockRows | None = None  # the LM head in GGUF blocks, as `blocks`
    per_layer: PerLayerEmbedding | None = None  # Gemma 4's per-layer inputs

    def attach_blocks(self, blocks: dict[str, BlockRows], activation: str = "float") -> None:
        """Keep these block matrices (canonical unfused names) beside the float weights; their
        one-row products take the input as `activation` says (`BlockRows.activation`)."""
        blocks = {name: replace(b, activation=activation) for name, b in blocks.items()}
        for i, lw in enumerate(self.layers):
            lw.blocks = fuse_layer_blocks(blocks, i)
        self.lm_head_blocks = blocks.get("lm_head", blocks.get("embed"))
        if "lm_head" not in blocks and self.lm_head.data_ptr() != self.embed.data_ptr():
            self.lm_head_blocks = None  # an untied head without blocks of its own

    def share_blocks(self, other: ModelWeights) -> None:
        """Hold the block matrices `other` holds (a copy of the same model)."""
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.blocks = theirs.blocks
        self.lm_head_blocks = other.lm_head_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of the block matrices held."""
        held = sum(b.nbytes for lw in self.layers for b in lw.blocks.values())
        return held + (self.lm_head_blocks.nbytes if self.lm_head_blocks is not None else 0)

    @classmethod
    def from_state(
        cls,
        config: ModelConfig,
        state: StateDict,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> ModelWeights:
        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise ModelFormatError(f"weights are missing tensor {name!r}")
            return state[name].to(device=device, dtype=dtype)

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in state else None

        layers = []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            # a layer attending over another's K/V projects its queries alone
            parts = ("q",) if config.kv_source_of(i) is not None else ("q", "k", "v")
            biases = [opt(p + "b" + part) for part in parts]
            bqkv = None
            if any(b is not None for b in biases):
                sizes = (config.q_dim_of(i), config.kv_dim_of(i), config.kv_dim_of(i))
                bqkv = stack_rows(
                    [
                        b if b is not None else torch.zeros(n, dtype=dtype, device=device)
                        for b, n in zip(biases, sizes, strict=False)
                    ],
                    p + "bq|bk|bv",
                )
            layers.append(
                LayerWeights(
                    attn_norm=get(p + "attn_norm"),
                    wqkv=stack_rows([get(p + "w" + part) for part in parts], p + "wq|wk|wv"),
                    bqkv=bqkv,
                    q_norm=opt(p + "q_norm"),
                    k_norm=opt(p + "k_norm"),
                    wo=get(p + "wo"),
                    bo=opt(p + "bo"),
                    post_attn_norm=opt(p + "post_attn_norm"),
                    ffn_norm=get(p + "ffn_norm"),
                    w_gate_up=_dense_gate_up(state, p, get),
                    w_down=opt(p + "w_down"),
                    post_ffn_norm=opt(p + "post_ffn_norm"),
                    experts=_experts(state, p, get, opt),
                    attn_sinks=opt(p + "attn_sinks"),
                    layer_scalar=opt(p + "layer_scalar"),
                    experts_norm=opt(p + "experts_norm"),
                    post_mlp_norm=opt(p + "post_mlp_norm"),
                    post_experts_norm=opt(p + "post_experts_norm"),
                    per_layer_gate=opt(p + "per_layer_gate"),
                    per_layer_projection=opt(p + "per_layer_projection"),
                    per_layer_post_norm=opt(p + "per_layer_post_norm"),
                )
            )
        embed = get("embed")
        lm_head = embed if "lm_head" not in state else get("lm_head")
        per_layer = None
        if "per_layer_table" in state:
            per_layer = PerLayerEmbedding(
                get("per_layer_table"), get("per_layer_projection"), get("per_layer_norm")
            )
        weights = cls(
            embed=embed,
            lm_head=lm_head,
            final_norm=get("final_norm"),
            layers=layers,
            per_layer=per_layer,
        )
        weights._check_shapes(config)
        return weights

    def _check_shapes(self, config: ModelConfig) -> None:
        h = config.hidden_size
        expected: dict[str, tuple[torch.Size, tuple[int, ...]]] = {
            "embed": (self.embed.shape, (config.vocab_size, h))
        }
        for i, lw in enumerate(self.layers):
            own_kv = config.kv_source_of(i) is None
            qkv_rows = config.q_dim_of(i) + (2 * config.kv_dim_of(i) if own_kv else 0)
            expected[f"layers.{i}.wqkv"] = (lw.wqkv.shape, (qkv_rows, h))
            expected.update(self._attention_shapes(config, lw, i))
            if lw.w_gate_up is None and lw.experts is None:
                raise ModelFormatError(f"layer {i} has neither an MLP nor experts")
            if (lw.w_gate_up is None) != (lw.w_down is None):
                part = "w_down" if lw.w_down is None else "w_gate"
                raise ModelFormatError(f"weights are missing tensor 'layers.{i}.{part}'")
            beside = (lw.experts_norm, lw.post_mlp_norm, lw.post_experts_norm, lw.w_gate_up)
            if lw.experts_norm is not None and any(t is None for t in beside):
                raise ModelFormatError(
                    f"layer {i} has experts beside its MLP without the MLP, its post-norm and "
                    "the experts' pre- and post-norms"
                )
            if lw.experts is not None and config.experts is None:
                raise ModelFormatError(f"layer {i} has experts but the config no routing")
            if lw.experts is not None and config.experts is not None:
                if lw.experts.router.dim() != 2:
                    shape = tuple(lw.experts.router.shape)
                    raise ModelFormatError(f"layer {i}'s router has shape {shape}, not [E, H]")
                count = lw.experts.router.shape[0]
                if count != config.experts.num_experts:
                    raise ModelFormatError(
                        f"layer {i} has {count} experts, the config {config.experts.num_experts}"
                    )
                expected.update(_expert_shapes(lw.experts, config.experts, f"layers.{i}.", h))
        self._check_per_layer_shapes(config, expected)
        for i, lw in enumerate(self.layers):
            if lw.w_gate_up is not None and lw.w_down is not None:
                f = config.intermediate_size_of(i)
                expected[f"layers.{i}.w_gate_up"] = (lw.w_gate_up.shape, (2 * f, h))
                expected[f"layers.{i}.w_down"] = (lw.w_down.shape, (h, f))
        for name, (got, want) in expected.items():
            if tuple(got) != want:
                raise ModelFormatError(f"tensor {name} has shape {tuple(got)}, expected {want}")

    @staticmethod
    def _attention_shapes(
        config: ModelConfig, layer: LayerWeights, i: int
    ) -> dict[str, tuple[torch.Size, tuple[int, ...]]]:
        """The layer's tensors the config fixes the shape of, beside the fused ones."""
        held = {"attn_norm": layer.attn_norm, "ffn_norm": layer.ffn_norm, "wo": layer.wo}
        for name in ("q_norm", "k_norm", "bo", "post_attn_norm", "post_ffn_norm"):
            if getattr(layer, name) is not None:
                held[name] = getattr(layer, name)
        out = {}
        for name, tensor in held.items():
            want = expected_shape(config, f"layers.{i}.{name}")
            if want is not None:
                out[f"layers.{i}.{name}"] = (tensor.shape, want)
        if layer.attn_sinks is not None:
            out[f"layers.{i}.attn_sinks"] = (layer.attn_sinks.shape, (config.num_heads,))
        return out

    def _check_per_layer_shapes(
        self, config: ModelConfig, expected: dict[str, tuple[torch.Size, tuple[int, ...]]]
    ) -> None:
        """Every layer has a per-layer input block where the model has per-layer inputs."""
        h, table = config.hidden_size, self.per_layer
        blocks = [lw.per_layer_gate is not None for lw in self.layers]
        if table is None:
            if any(blocks):
                raise ModelFormatError("layers take per-layer inputs but there is no table")
            return
        if table.norm.dim() != 1:
            raise ModelFormatError(f"per_layer_norm has shape {tuple(table.norm.shape)}, not [P]")
        width = table.norm.shape[0]
        per_row = config.num_layers * width
        expected["per_layer_table"] = (table.table.shape, (table.table.shape[0], per_row))
        expected["per_layer_projection"] = (table.projection.shape, (per_row, h))
        for i, lw in enumerate(self.layers):
            if lw.per_layer_gate is None or lw.per_layer_projection is None:
                raise ModelFormatError(f"layer {i} has no per-layer input gate and projection")
            if lw.per_layer_post_norm is None:
                raise ModelFormatError(f"layer {i} has no per-layer input norm")
            expected[f"layers.{i}.per_layer_gate"] = (lw.per_layer_gate.shape, (width, h))
            expected[f"layers.{i}.per_layer_projection"] = (
                lw.per_layer_projection.shape,
                (h, width),
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def nbytes(self) -> int:
        """Bytes of weights held (a tied LM head is counted once)."""
        tensors = [self.embed, self.final_norm, *(t for lw in self.layers for t in lw.tensors())]
        if self.per_layer is not None:
            tensors += self.per_layer.tensors()
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        return sum(t.numel() * t.element_size() for t in tensors)

    def decode_read_bytes(self, blocks: bool = True, top_k: int = 0) -> int:
        """Weight bytes one decode step reads: every layer matrix (its blocks where it has them
        and `blocks`: the block kernels run), the norms and the LM head (only one embedding
        row is read)."""
        layer_bytes = 0
        for lw in self.layers:
            for name, t in vars(lw).items():
                if isinstance(t, torch.Tensor):
                    kept = lw.blocks.get(name) if blocks else None
                    layer_bytes += kept.nbytes if kept is not None else t.numel() * t.element_size()
            if lw.experts is not None:
                layer_bytes += lw.experts.decode_read_bytes(top_k)
        if self.per_layer is not None:  # the projection of the row's embedding (one table row)
            projection = self.per_layer.projection
            layer_bytes += projection.numel() * projection.element_size()
        head = self.lm_head.numel() * self.lm_head.element_size()
        if blocks and self.lm_head_blocks is not None:
            head = self.lm_head_blocks.nbytes
        return layer_bytes + head + self.final_norm.numel() * self.final_norm.element_size()


def expected_shape(config: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The shape `config` implies for the canonical tensor `name`, where it fixes one (None
    for the tensors whose shape the config alone does not fix: experts, routers, per-layer
    inputs, …, and for a layer the config does not have). Loaders check a file's tensors
    against it before reading them."""
    h = config.hidden_size
    if name in ("embed", "lm_head"):
        return (config.vocab_size, h)
    if name == "final_norm":
        return (h,)
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit():
        return None
    i, kind = int(parts[1]), parts[2]
    if i >= config.num_layers:
        return None
    q, kv, f = config.q_dim_of(i), config.kv_dim_of(i), config.intermediate_size_of(i)
    head = config.head_dim_of(i)
    shapes: dict[str, tuple[int, ...]] = {
        "wq": (q, h),
        "wk": (kv, h),
        "wv": (kv, h),
        "wo": (h, q),
        "bq": (q,),
        "bk": (kv,),
        "bv": (kv,),
        "bo": (h,),
        "q_norm": (head,),
        "k_norm": (head,),
        "attn_norm": (h,),
        "post_attn_norm": (h,),
        "ffn_norm": (h,),
        "post_ffn_norm": (h,),
        "w_gate": (f, h),
        "w_up": (f, h),
        "w_down": (h, f),
    }
    return shapes.get(kind)


def _expert_shapes(
    experts: ExpertWeights, routing: ExpertRouting, prefix: str, hidden: int
) -> dict[str, tuple[torch.Size, tuple[int, ...]]]:
    """One layer's experts against each other and the config: E experts of the config's width F
    (where it gives one, else `gate_up`'s 2·F rows') over the hidden size, their biases and the
    shared expert's matrices to match."""
    e = experts.router.shape[0]
    f2 = experts.gate_up.shape[1] if experts.gate_up.dim() == 3 else -1
    if routing.expert_width is not None:
        f2 = 2 * routing.expert_width
    out = {
        prefix + "router": (experts.router.shape, (e, hidden)),
        prefix + "experts_gate_up": (experts.gate_up.shape, (e, f2 - f2 % 2, hidden)),
        prefix + "experts_down": (experts.down.shape, (e, hidden, f2 // 2)),
    }
    optional = {
        "router_bias": (experts.router_bias, (e,)),
        "experts_gate_up_bias": (experts.gate_up_bias, (e, f2)),
        "experts_down_bias": (experts.down_bias, (e, hidden)),
        "shared_expert_gate": (experts.shared_expert_gate, (1, hidden)),
        "router_scale": (experts.router_scale, (hidden,)),
        "per_expert_scale": (experts.per_expert_scale, (e,)),
    }
    for name, (tensor, want) in optional.items():
        if tensor is not None:
            out[prefix + name] = (tensor.shape, want)
    shared, down = experts.shared_gate_up, experts.shared_down
    if (shared is None) != (down is None):
        raise ModelFormatError(f"{prefix}shared expert has only part of its matrices")
    if shared is not None and down is not None:
        fs2 = shared.shape[0] if shared.dim() == 2 else -1
        if routing.shared_width is not None:  # 0: the config has no shared expert
            fs2 = 2 * routing.shared_width
        out[prefix + "shared_gate_up"] = (shared.shape, (fs2 - fs2 % 2, hidden))
        out[prefix + "shared_down"] = (down.shape, (hidden, fs2 // 2))
    return out


def stack_rows(parts: list[torch.Tensor], what: str, dim: int = 0) -> torch.Tensor:
    """`torch.cat` of tensors read from a file, refused (not a torch error) where their other
    dimensions differ."""
    shapes = {t.shape[:dim] + t.shape[dim + 1 :] for t in parts}
    if len(shapes) > 1 or any(t.dim() <= dim for t in parts):
        sizes = ", ".join(str(tuple(t.shape)) for t in parts)
        raise ModelFormatError(f"tensors {what} do not fit together: {sizes}")
    return torch.cat(parts, dim=dim)


def _dense_gate_up(state: StateDict, prefix: str, get: Getter) -> torch.Tensor | None:
    """[2·F, H] gate and up rows of a layer's dense MLP (None: a layer of experts alone)."""
    if prefix + "w_gate" not in state and prefix + "router" in state:
        return None
    return stack_rows([get(prefix + "w_gate"), get(prefix + "w_up")], prefix + "w_gate|w_up")


def _experts(
    state: StateDict, prefix: str, get: Getter, opt: OptionalGetter
) -> ExpertWeights | None:
    if prefix + "router" not in state:
        return None
    shared_gate = opt(prefix + "shared_gate")
    shared_up = opt(prefix + "shared_up")
    gate_bias, up_bias = opt(prefix + "experts_gate_bias"), opt(prefix + "experts_up_bias")
    return ExpertWeights(
        router=get(prefix + "router"),
        gate_up=_expert_gate_up(state, prefix, get),
        down=get(prefix + "experts_down"),
        router_bias=opt(prefix + "router_bias"),
        gate_up_bias=None
        if gate_bias is None or up_bias is None
        else stack_rows([gate_bias, up_bias], prefix + "experts_gate_bias|up_bias", dim=1),
        down_bias=opt(prefix + "experts_down_bias"),
        shared_gate_up=None
        if shared_gate is None or shared_up is None
        else stack_rows([shared_gate, shared_up], prefix + "shared_gate|shared_up"),
        shared_down=opt(prefix + "shared_down"),
        shared_expert_gate=opt(prefix + "shared_expert_gate"),
        router_scale=opt(prefix + "router_scale"),
        per_expert_scale=opt(prefix + "per_expert_scale"),
    )


def _expert_gate_up(state: StateDict, prefix: str, get: Getter) -> torch.Tensor:
    """[E, 2·F, H]: stored so (Gemma 4) or the gate and up matrices stacked."""
    if prefix + "experts_gate_up" in state:
        return get(prefix + "experts_gate_up")
    gate, up = get(prefix + "experts_gate"), get(prefix + "experts_up")
    return stack_rows([gate, up], prefix + "experts_gate|experts_up", dim=1)
