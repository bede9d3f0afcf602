"""What the planner needs to know about the model, read from its module tree on the meta device (no weights are
read and no memory is used): every parameter with its dtype and whether it trains, which linear weights a quantized
base stores in 4 or 8 bits, the decoder's shape, and which inputs LoRA wraps. Online distillation's teacher is
described the same way, as `load_teacher` loads it (train/teacher.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hellbender.config import HellbenderConfig
from hellbender.plan.kernel_costs import LayerTraffic
from hellbender.plan.launches import KernelCounts, count_kernels

if TYPE_CHECKING:
    from hellbender.plan.compiled_layers import CompiledLayer

# Linear layers whose inputs are one tensor in a Llama-style decoder layer: LoRA modules that read the same input
# are grouped, since autograd saves one tensor for all of them.
_SHARED_INPUTS = {
    "q_proj": "attention input",
    "k_proj": "attention input",
    "v_proj": "attention input",
    "qkv_proj": "attention input",
    "o_proj": "attention output",
    "gate_proj": "MLP input",
    "up_proj": "MLP input",
    "gate_up_proj": "MLP input",
    "down_proj": "MLP inner",
}


_VISION_PARTS = ("vision", "visual", "image", "audio", "multi_modal_projector")


@dataclass(frozen=True)
class Parameter:
    name: str
    numel: int
    element_size: int  # bytes per element as the run holds it unquantized
    trainable: bool
    quantizable: bool  # a linear weight that a 4- or 8-bit base stores quantized
    rows: int  # output features of a linear weight (8-bit keeps one scale per row); 0 otherwise
    in_layer: int | None  # index of the decoder layer holding it, None outside the decoder layers

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class LoraInput:
    """One input tensor that LoRA modules of a decoder layer read (q/k/v share one)."""

    group: str
    width: int
    modules: int
    rank_sum: int  # sum of the ranks of the modules reading it


@dataclass(frozen=True)
class LayerWidths:
    """One decoder layer's widths that its saved activations scale with."""

    q: int  # query (and attention output) width
    kv: int  # key (and value) width
    inner: int  # the MLP's inner width (with the routed experts' share for a mixture of experts)
    extra_norms: int = 0  # elements per token normalised beyond a Llama layer's two norms (Gemma's four, q/k norms)


@dataclass
class ModelFacts:
    parameters: list[Parameter]
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # the average over the layers (q width / heads), kv_heads x head_dim the k width
    vocab: int
    q_dim: int  # query (and attention output) width, averaged over the layers
    kv_dim: int  # key (and value) width, averaged over the layers
    sliding_windows: list[int | None]  # per decoder layer: the attention window, None for full attention
    layer_widths: list[LayerWidths] = field(default_factory=list)  # per decoder layer (the averages above where empty)
    lora_inputs: list[LoraInput] = field(default_factory=list)  # of one decoder layer (the first)
    lora_dropout: float = 0.0
    head_trainable: bool = False
    head_numel: int = 0
    head_bytes: int = 0  # the output head's weight in the run's dtype
    decoder_linear_numel: int = 0  # base linear weights of the decoder layers (pre-quantization)
    other_linear_numel: int = 0  # linear weights outside the decoder and the head (a vision tower, a projector)
    lora_numel: int = 0
    largest_layer_bytes: int = 0  # the decoder layer with the most parameter bytes (FSDP2 / ZeRO-3 gather it whole)
    attention: str = "sdpa"  # the attention implementation the model runs
    shared_prompt_refusal: str | None = None  # why DPO pairs could not share their prompt in one row (None: they can)
    kernels: KernelCounts = field(default_factory=KernelCounts)  # GPU kernels a forward launches (launches.py)
    expert_numel: int = 0  # stacked experts' weights in the decoder layers (all of them are in memory)
    expert_lora_numel: int = 0  # LoRA's adapters on those experts (one per expert)
    expert_lora_rank: int = 0
    merged_expert_bytes: int = 0  # per decoder layer: the experts' weights PEFT merges with their adapters each forward
    active_expert_share: float = 1.0  # top-k of the experts: the share of the experts' weights a token runs
    kv_shared_layers: list[int] = field(default_factory=list)  # layers reading an earlier layer's keys and values
    vision_linear_numel: int = 0  # linear weights of a vision (or audio) tower and its projector
    not_modelled: list[str] = field(default_factory=list)  # what the plan leaves out for this model, said in the report
    notes: list[str] = field(default_factory=list)  # how this model's special parts are planned
    teacher: ModelFacts | None = None  # online distillation's teacher (`kd_teacher_model`), frozen beside the student
    logit_softcapping: bool = False  # `final_logit_softcapping` (Gemma): the head's tanh saves its logit-sized output
    # Gemma's per-layer inputs (`hidden_size_per_layer_input` per layer), made once before the first layer: values per
    # token for all layers together, and whether their projection's norm trains.
    per_layer_inputs: int = 0
    per_layer_inputs_norm_trains: bool = False
    layer_traffic: list[LayerTraffic] = field(default_factory=list)  # per decoder layer: work outside its matmuls
    # `torch_compile`: one compiled decoder layer as the compiler partitions it (what it keeps for backward, what its
    # graphs ask of the GPU; compiled_layers.py); None where it is not traced (every layer planned as uncompiled).
    compiled_layer: CompiledLayer | None = None

    @property
    def compiled_layer_bytes_per_token(self) -> float | None:
        return self.compiled_layer.saved_bytes_per_token if self.compiled_layer is not None else None

    @property
    def trainable(self) -> list[Parameter]:
        return [p for p in self.parameters if p.trainable]

    @property
    def mlp_linear_numel(self) -> int:
        """Linear weights of the decoder layers' MLPs, their adapters' included (`tiled_mlp` runs them once more)."""
        return sum(
            p.numel
            for p in self.parameters
            if p.in_layer is not None and ".mlp." in p.name and (p.quantizable or _is_lora_part(p.name))
        )

    def layer_parameters(self, index: int) -> list[Parameter]:
        return [p for p in self.parameters if p.in_layer == index]

    def kv_width(self, index: int) -> int:
        """Decoder layer `index`'s key (and value) width; the average where the widths per layer are unknown."""
        return self.layer_widths[index].kv if index < len(self.layer_widths) else self.kv_dim

    def q_width(self, index: int) -> int:
        """Decoder layer `index`'s query width; the average where the widths per layer are unknown."""
        return self.layer_widths[index].q if index < len(self.layer_widths) else self.q_dim

    def window(self, index: int) -> int | None:
        """Decoder layer `index`'s attention window; None for full attention."""
        return self.sliding_windows[index] if index < len(self.sliding_windows) else None


def planned_dtype(cfg: HellbenderConfig) -> Any:
    """The run's dtype on the planned GPU: every card the planner knows computes in bfloat16, so `bf16: auto` is
    planned as bfloat16 on whatever machine plans it (on a CPU-only machine it would otherwise mean float32)."""
    from hellbender.config.machine import Machine
    from hellbender.config.precision import torch_dtype

    return torch_dtype(cfg, Machine(cuda=True, bf16=True, cpus=1))


def meta_model(cfg: HellbenderConfig) -> Any:
    """The trainable model as training builds it (the run's dtype, the adapter, frozen vision modules), on the meta
    device. Quantization is left out: `memory.weight_bytes` computes the quantized storage from the shapes."""
    import torch

    from hellbender.models.adapters import apply_adapter
    from hellbender.models.architecture_class import class_for_config
    from hellbender.models.loading import _transformers_class, model_config, resolve_model_path

    config = model_config(cfg, resolve_model_path(cfg.base_model))
    config._attn_implementation = cfg.attn_implementation or "sdpa"
    cls = class_for_config(_transformers_class(cfg.model_type, "model_type"), config)
    with torch.device("meta"):
        build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
        model = build(config, dtype=planned_dtype(cfg))
    return apply_adapter(cfg, model)


def teacher_meta_model(cfg: HellbenderConfig) -> Any:
    """Online distillation's teacher as `train/teacher.py`'s `load_teacher` loads it: transformers' causal LM of
    `kd_teacher_model`, in the run's dtype and attention, frozen, on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hellbender.models.loading import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(cfg.kd_teacher_model, key="kd_teacher_model"))
    config._attn_implementation = cfg.attn_implementation or "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=planned_dtype(cfg))
    return model.requires_grad_(False)


def _decoder_layers(model: Any) -> list[Any]:
    """The repeated decoder layers: the ModuleList of the language model as long as its config says (else its longest
    ModuleList), never a vision tower's blocks."""
    import torch

    wanted = _setting(model.config.get_text_config(), "num_hidden_layers", None)
    lists = [
        m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and not any(part in name for part in _VISION_PARTS)
    ]
    exact = [m for m in lists if len(m) == wanted]
    return exact[0] if exact else max(lists, key=len) if lists else []


def describe(cfg: HellbenderConfig, model: Any) -> ModelFacts:
    """The facts of `model` (built by `meta_model` for `cfg`), with those of its teacher under online distillation."""
    facts = _describe(cfg, model)
    if cfg.torch_compile:  # the student's layers only: the teacher runs uncompiled forwards
        _describe_compiled_layers(cfg, model, facts)
    if cfg.distills and cfg.kd_teacher_model:
        teacher = _describe(cfg, teacher_meta_model(cfg))
        # What `_describe` says of the run's settings (an adapter, fused LoRA layers) concerns the student only.
        teacher.not_modelled, teacher.notes, teacher.lora_dropout = [], [], 0.0
        facts.teacher = teacher
    return facts


def _describe(cfg: HellbenderConfig, model: Any) -> ModelFacts:
    import torch

    from hellbender.models.pair_layout import why_model_not_shared

    text = model.config.get_text_config()
    layers = _decoder_layers(model)
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    head = model.get_output_embeddings()
    head_weight = head.weight if head is not None else None
    embeddings = model.get_input_embeddings().weight
    linear_weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not _is_lora_part(name):
            linear_weights[id(module.weight)] = module.out_features
    parameters = []
    for name, p in model.named_parameters():
        is_head = head_weight is not None and p is head_weight
        quantizable = id(p) in linear_weights and not is_head and p is not embeddings
        parameters.append(
            Parameter(
                name=name,
                numel=p.numel(),
                element_size=p.element_size(),
                trainable=p.requires_grad,
                quantizable=quantizable,
                rows=linear_weights.get(id(p), 0),
                in_layer=layer_of.get(id(p)),
            )
        )
    heads = _setting(text, "num_attention_heads", 1)
    kv_heads = _setting(text, "num_key_value_heads", heads)
    head_dim = _setting(text, "head_dim", text.hidden_size // heads)
    # Widths as the layers' projections have them, averaged over the layers (Gemma 4's full-attention layers have
    # wider heads than its sliding ones; its config refuses a global `head_dim`).
    q_dim = _mean_width(layers, ("q_proj",), "out_features") or heads * head_dim
    kv_dim = _mean_width(layers, ("k_proj",), "out_features") or kv_heads * head_dim
    dense_inner = _mean_width(layers, ("down_proj",), "in_features")
    experts = _stacked_experts(layers)
    top_k = _setting(text, "num_experts_per_tok", None) or _setting(text, "top_k", None)
    if experts and top_k:
        # Each token runs its top-k experts: their inner tensors are saved, beside a shared expert's (dense_inner).
        expert_inner = _setting(text, "moe_intermediate_size", None) or _setting(text, "intermediate_size", 0)
        intermediate = dense_inner + top_k * expert_inner
    else:
        intermediate = dense_inner or _setting(text, "intermediate_size", 4 * text.hidden_size)
    windows = _sliding_windows(text, len(layers))
    # Per layer where the layers differ (Gemma 4: wider heads on full-attention layers, a double-wide MLP on the layers
    # that share keys and values): the layers left unrecomputed are the last ones, not average ones.
    widths = zip(
        _layer_widths(layers, ("q_proj",), "out_features"),
        _layer_widths(layers, ("k_proj",), "out_features"),
        _layer_widths(layers, ("down_proj",), "in_features"),
        strict=True,
    )
    experts_inner = intermediate - dense_inner if dense_inner else 0  # the routed experts' share (0 without)
    layer_widths = [
        LayerWidths(
            q or q_dim,
            kv or kv_dim,
            inner + experts_inner if inner else intermediate,
            _extra_norm_elements(layer, q or q_dim, kv, text.hidden_size),
        )
        for layer, (q, kv, inner) in zip(layers, widths, strict=True)
    ]
    facts = ModelFacts(
        parameters=parameters,
        hidden=text.hidden_size,
        intermediate=intermediate,
        layers=len(layers),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=max(1, q_dim // heads),
        q_dim=q_dim,
        kv_dim=kv_dim,
        vocab=text.vocab_size,
        sliding_windows=windows,
        layer_widths=layer_widths,
        lora_dropout=cfg.lora_dropout if cfg.adapter else 0.0,
        head_trainable=bool(head_weight is not None and head_weight.requires_grad),
        head_numel=head_weight.numel() if head_weight is not None else 0,
        head_bytes=head_weight.numel() * head_weight.element_size() if head_weight is not None else 0,
    )
    facts.attention = getattr(text, "_attn_implementation", None) or "sdpa"
    facts.logit_softcapping = bool(_setting(text, "final_logit_softcapping", None))
    facts.per_layer_inputs = len(layers) * (_setting(text, "hidden_size_per_layer_input", None) or 0)
    facts.per_layer_inputs_norm_trains = any(p.trainable and "per_layer_projection_norm" in p.name for p in parameters)
    facts.shared_prompt_refusal = why_model_not_shared(model)
    facts.decoder_linear_numel = sum(
        p.numel for p in parameters if p.quantizable and p.in_layer is not None and not _is_lora_part(p.name)
    )
    facts.other_linear_numel = sum(p.numel for p in parameters if p.quantizable and p.in_layer is None)
    facts.lora_numel = sum(p.numel for p in parameters if _is_lora_part(p.name))
    per_layer = [0] * len(layers)
    for p in parameters:
        if p.in_layer is not None:
            per_layer[p.in_layer] += p.nbytes
    facts.largest_layer_bytes = max(per_layer, default=0)
    if layers:
        facts.lora_inputs = _lora_inputs(layers[0])
    facts.kernels = count_kernels(model, list(layers))
    facts.layer_traffic = [
        _layer_traffic(layer, text.hidden_size, w) for layer, w in zip(layers, layer_widths, strict=True)
    ]
    if experts:
        count = experts
        facts.active_expert_share = min(1.0, top_k / count) if top_k else 1.0
        stacked = {name for name, p in model.named_parameters() if p.dim() == 3}
        facts.expert_numel = sum(p.numel for p in parameters if p.name in stacked)
        facts.expert_lora_numel = sum(p.numel for p in parameters if _is_expert(p.name) and _is_lora_part(p.name))
        if facts.expert_lora_numel:
            # PEFT's LoRA on a stacked parameter adds B A to the whole stack in every forward; the merged copy is
            # what the experts' matmuls save for backward.
            facts.expert_lora_rank = cfg.lora_r or 0
            facts.merged_expert_bytes = sum(p.nbytes for p in parameters if p.name in stacked) // max(1, len(layers))
        facts.notes.append(
            f"mixture of experts: {top_k or count} of {count} experts per token (their FLOPs and activations), all "
            "experts' weights in memory; routing is planned as balanced (no expert takes more than its share)"
        )
    elif top_k:
        facts.not_modelled.append(
            "the mixture of experts' routing: this model's experts are not stacked tensors, so every expert's FLOPs "
            "and activations are planned as if each token ran them all (an upper bound)"
        )
    facts.kv_shared_layers = [i for i, layer in enumerate(layers) if _reads_shared_kv(layer)]
    facts.vision_linear_numel = sum(p.numel for p in parameters if p.quantizable and p.in_layer is None
                                    and any(part in p.name for part in _VISION_PARTS))  # fmt: skip
    if facts.vision_linear_numel:
        facts.not_modelled.append(
            "the vision tower's work per image (images per row and their patches are not in the config): its "
            "weights count in full, its activations not, its FLOPs as if every token went through its linear "
            "layers once (a tower that pools several patches into one token, as Gemma 4's does, runs more) and its "
            "kernels once per micro-batch"
        )
    if cfg.splits_sequences:
        exchanged = (
            "the whole row's keys and values each GPU gathers for one layer at a time (packed rows)"
            if cfg.splits_packed_rows
            else "the keys and values the GPUs pass around the ring"
        )
        facts.not_modelled.append(
            "the attention of `context_parallel_size`: each GPU is planned with its share of every row's tokens "
            f"(activations, logits, FLOPs), but not {exchanged}, nor the time that exchange takes"
        )
    if cfg.lora_kernels and not cfg.torch_compile:  # compiled, the fused LoRA layers run PEFT's ops
        facts.not_modelled.append(
            f"the fused LoRA layers ({', '.join(f'`{k}`' for k in cfg.lora_kernels)}): fewer kernels and fewer passes "
            "over each projection's output; they are planned as PEFT's layers (measured on the 8B benchmark on an "
            "H100: 1.24x faster at the same peak)"
        )
    return facts


def _describe_compiled_layers(cfg: HellbenderConfig, model: Any, facts: ModelFacts) -> None:
    """`torch_compile`: the student's compiled layers, traced where they can be, and what stays unplanned."""
    facts.compiled_layer = _compiled_layer(cfg, model, _decoder_layers(model), facts)
    planned = facts.compiled_layer is not None
    if planned:
        facts.notes.append(
            "compiled layers keep what the compiler's partitioner saves for backward, traced on one layer"
            + (f" at `activation_memory_budget: {cfg.activation_memory_budget}`" if cfg.activation_memory_budget
               is not None else "")
            + f": {facts.compiled_layer_bytes_per_token / 1024:.1f} KiB per token; their time beyond the matmuls' "
            "FLOPs from the bytes and kernels of the traced graphs (calibrated on the 8B LoRA benchmark on an H200)"
        )  # fmt: skip
    else:
        facts.not_modelled.append(
            "`torch_compile`: compiled decoder layers launch far fewer kernels, fuse their elementwise work and keep "
            "what the compiler decides; this model's layer was not traced, so the memory and the step time below "
            "are the uncompiled run's (measured on the 8B benchmark on an H200: bf16 LoRA 1.55x faster at the same "
            "peak; QLoRA 1.82x faster at 17.5 GiB against 7.8)"
        )


def _compiled_layer(cfg: HellbenderConfig, model: Any, layers: list[Any], facts: ModelFacts) -> CompiledLayer | None:
    """`compiled_layers.py`'s trace of the first decoder layer, where it stands for all of them: the layers are of
    one kind (no shared keys and values, no experts, no 4-bit base whose dequantization it would not see), and the
    attention is a kernel that saves no probabilities (not eager)."""
    from hellbender.plan.compiled_layers import trace_compiled_layer

    uniform = not facts.kv_shared_layers and not facts.expert_numel and not facts.per_layer_inputs
    if not uniform or cfg.load_in_4bit or cfg.load_in_8bit or facts.attention == "eager" or not layers:
        return None
    return trace_compiled_layer(cfg, model, layers[0], cfg.sequence_len)


def _stacked_experts(layers: list[Any]) -> int:
    """How many experts a decoder layer holds as stacked 3-D weights (transformers 5's MoE blocks), 0 if none."""
    for layer in layers[:1] or []:
        for p in layer.parameters():
            if p.dim() == 3 and p.shape[0] > 1:
                return p.shape[0]
    return 0


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _reads_shared_kv(layer: Any) -> bool:
    """Gemma 4's KV-shared layers compute no keys or values of their own: they reuse an earlier layer's."""
    attention = getattr(layer, "self_attn", None)
    return bool(getattr(attention, "is_kv_shared_layer", False))


def _is_lora_part(name: str) -> bool:
    return ".lora_" in name


def _setting(text: Any, name: str, default: Any) -> Any:
    """A setting of the text config; `default` where it has none, or none that holds for every layer."""
    try:
        value = getattr(text, name, None)
    except Exception:  # transformers' per-layer configs refuse a global read of a per-layer attribute
        return default
    return value if value else default


def _mean_width(layers: list[Any], names: tuple[str, ...], attribute: str) -> int:
    """The average `attribute` of the linear layers named `names` in the decoder layers (0 if there are none); LoRA's
    wrappers are read through to the base layer."""
    widths = [w for layer in _widths_by_layer(layers, names, attribute) for w in layer]
    return round(sum(widths) / len(widths)) if widths else 0


def _layer_widths(layers: list[Any], names: tuple[str, ...], attribute: str) -> list[int]:
    """Per decoder layer, the average `attribute` of its linear layers named `names` (0 where it has none)."""
    return [round(sum(w) / len(w)) if w else 0 for w in _widths_by_layer(layers, names, attribute)]


def _widths_by_layer(layers: list[Any], names: tuple[str, ...], attribute: str) -> list[list[int]]:
    """Per decoder layer, the `attribute` of each of its linear layers named `names` (read through LoRA's wrappers)."""
    out = []
    for layer in layers:
        widths = []
        for name, module in layer.named_modules():
            if name.rsplit(".", 1)[-1] in names:
                base = getattr(module, "base_layer", module)
                if hasattr(base, attribute):
                    widths.append(getattr(base, attribute))
        out.append(widths)
    return out


_LLAMA_NORMS = 2  # the attention's and the MLP's input norms, which activations.py counts for every layer


def _norm_widths(layer: Any, q: int, kv: int, hidden: int) -> list[int]:
    """Elements per token each of one decoder layer's norms normalises: a per-head query norm the query width, key and
    value norms the key width, every other norm the hidden width."""
    widths = []
    for name, module in layer.named_modules():
        if not type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "q_norm":
            widths.append(q)
        elif leaf in ("k_norm", "v_norm"):
            widths.append(kv)
        else:
            widths.append(hidden)
    return widths


def _extra_norm_elements(layer: Any, q: int, kv: int, hidden: int) -> int:
    """Elements per token that one decoder layer's norms normalise beyond a Llama layer's two (each saves its float32
    input for backward): Gemma's norms after attention and after the MLP, per-head query and key norms. A layer that
    reads shared keys and values (no `k_proj`, `kv` 0) runs no key or value norm."""
    widths = _norm_widths(layer, q, kv, hidden)
    hidden_norms = sum(1 for w in widths if w == hidden)
    return sum(widths) - min(hidden_norms, _LLAMA_NORMS) * hidden


def _layer_traffic(layer: Any, hidden: int, widths: LayerWidths) -> LayerTraffic:
    """One decoder layer's memory-bound work per token (kernel_costs.py prices it), from its modules."""
    lora = 0
    for module in layer.modules():
        if _runs_lora(module):
            base = getattr(module, "base_layer", module)
            lora += getattr(base, "in_features", 0) + getattr(base, "out_features", 0)
    norms = sum(_norm_widths(layer, widths.q, widths.kv, hidden))
    return LayerTraffic(norms, widths.q + widths.kv, widths.inner, 2 * hidden, lora)


def _runs_lora(module: Any) -> bool:
    """A LoRA-wrapped layer that runs its adapter on every token (LoRA on a stacked parameter, the experts', is
    merged into the weight instead)."""
    lora_a = getattr(module, "lora_A", None)
    return lora_a is not None and len(lora_a) > 0 and not getattr(module, "parameter_name", None)


def _sliding_windows(text: Any, count: int) -> list[int | None]:
    window = _setting(text, "sliding_window", None)
    types = _setting(text, "layer_types", None)
    if not window:
        return [None] * count
    if types:
        return [window if t == "sliding_attention" else None for t in list(types)[:count]]
    return [window] * count


def _lora_inputs(layer: Any) -> list[LoraInput]:
    groups: dict[str, list[tuple[int, int]]] = {}
    for name, module in layer.named_modules():
        if not _runs_lora(module):
            continue
        adapter = next(iter(module.lora_A.values()))
        leaf = name.rsplit(".", 1)[-1]
        group = _SHARED_INPUTS.get(leaf, name)
        groups.setdefault(group, []).append((adapter.in_features, adapter.out_features))
    return [
        LoraInput(group, width=members[0][0], modules=len(members), rank_sum=sum(r for _, r in members))
        for group, members in groups.items()
    ]
