"""Packed documents score as they do alone with SDPA and eager attention, in families with sliding-window and
chunked layers too: transformers builds each layer pattern's mask from the restarting position ids, and hellbender
builds them for the families whose forward does not hand the position ids to transformers' mask builder."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hellbender.data.collator import REAL_TOKENS_KEY, CausalLMCollator, forward_kwargs
from hellbender.data.packing import concat_documents
from hellbender.errors import ConfigError
from hellbender.models.packed_attention import (
    MASKS_WITHOUT_POSITION_IDS,
    check_packed_masks,
    chunks_restart_at_each_document,
    packed_attention_mask,
    text_config,
    unwrapped,
)

IGNORE = -100
PAD = 1
WINDOW = 8
SIZES = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    pad_token_id=PAD,
    bos_token_id=2,
    eos_token_id=3,
)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]


def tiny_config(family: str):
    import transformers as t

    if family == "llama":
        return t.LlamaConfig(num_hidden_layers=2, **SIZES)
    if family == "mistral":
        return t.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **SIZES)
    if family == "qwen2":  # the first layer slides, the second attends to everything
        return t.Qwen2Config(
            num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **SIZES
        )
    if family == "gemma3_text":
        return t.Gemma3TextConfig(num_hidden_layers=3, sliding_window=WINDOW, layer_types=MIXED, **SIZES)
    if family == "llama4_text":  # chunked attention on the first layer
        return t.Llama4TextConfig(
            num_hidden_layers=2,
            attention_chunk_size=WINDOW,
            no_rope_layers=[1, 0],
            intermediate_size_mlp=64,
            num_local_experts=2,
            **SIZES,
        )
    if family == "gpt_oss":  # its forward builds masks without the position ids
        return t.GptOssConfig(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            **SIZES,
        )
    raise AssertionError(family)


def tiny_model(family: str, attn: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(family)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def documents() -> list[dict[str, list[int]]]:
    """Documents longer than the window (20, 13 and 17 tokens) beside a short one."""
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (20, 13, 5, 17)]
    return [{"input_ids": d, "labels": list(d)} for d in docs]


def packed_rows(docs: list[dict[str, list[int]]]) -> list[dict[str, list]]:
    """Two packed rows: three documents, then one, padded after it (padding is a block of its own)."""
    return [
        concat_documents([d["input_ids"] for d in part], [d["labels"] for d in part]) for part in (docs[:3], docs[3:])
    ]


def per_token_nll(model, batch: dict) -> torch.Tensor:
    """What the trainer's forward gets (`forward_kwargs`, `packed_attention_mask`), scored per trained token."""
    batch = dict(batch)
    batch.pop(REAL_TOKENS_KEY)
    labels = batch.pop("labels")
    batch.update(forward_kwargs(batch))
    batch.update(packed_attention_mask(model, batch))
    with torch.no_grad():
        logits = model(**batch).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target = labels[:, 1:]
    keep = target != IGNORE
    return -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0][keep]


def block_diagonal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """One [batch, 1, seq, seq] mask for every layer: what the collator passed to SDPA before."""
    doc = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1) != 1).cumsum(-1)
    same = doc[:, :, None] == doc[:, None, :]
    return (same & torch.ones_like(same[0]).tril())[:, None]


CASES = [
    pytest.param(family, attn, id=f"{family}-{attn}")
    for family in ("llama", "mistral", "qwen2", "gemma3_text", "llama4_text")
    for attn in ("sdpa", "eager")
] + [pytest.param("gpt_oss", "eager", id="gpt_oss-eager")]  # gpt-oss has no SDPA in transformers (sinks)


@pytest.mark.parametrize("family, attn", CASES)
def test_packed_rows_score_every_token_as_the_documents_alone(family, attn):
    model = tiny_model(family, attn)
    if family == "llama4_text" and not chunks_restart_at_each_document(model.config.get_text_config()):
        # transformers 5.17 counts chunks from the packed row's start: the run is refused at loading instead
        with pytest.raises(ConfigError, match=r"counts chunks from the start of the packed row"):
            check_packed_masks(model)
        return
    docs = documents()
    collate = CausalLMCollator(PAD)
    alone = torch.cat([per_token_nll(model, collate([d])) for d in docs])
    packed_batch = collate(packed_rows(docs))
    packed = per_token_nll(model, packed_batch)
    assert packed.shape == alone.shape == (19 + 12 + 4 + 16,)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    if family == "llama":
        return
    # One block-diagonal mask for all layers lets a sliding or chunked layer see the whole document: measurably
    # different, so the documents above do reach past the window.
    one_mask = dict(packed_batch, attention_mask=block_diagonal_mask(packed_batch["position_ids"]))
    assert (per_token_nll(model, one_mask) - alone).abs().max() > 1e-3


def test_gpt_oss_gets_a_mask_per_layer_type_built_from_the_positions():
    model = tiny_model("gpt_oss", "eager")
    batch = CausalLMCollator(PAD)(packed_rows(documents()))
    masks = packed_attention_mask(model, batch)["attention_mask"]
    assert set(masks) == {"sliding_attention", "full_attention"}
    full, sliding = (masks[k][:, 0] == 0 for k in ("full_attention", "sliding_attention"))  # additive: 0 = attend
    assert torch.equal(full, block_diagonal_mask(batch["position_ids"])[:, 0])
    # Token 19 of the first document sees itself and the 7 before it in the sliding layer, all 20 in the full one.
    assert sliding[0, 19].nonzero().flatten().tolist() == list(range(12, 20))
    assert full[0, 19].nonzero().flatten().tolist() == list(range(20))
    assert packed_attention_mask(model, CausalLMCollator(PAD)(documents()[:2])) == {}  # not packed: nothing


def test_families_that_find_documents_themselves_get_no_mask_from_hellbender():
    model = tiny_model("mistral", "sdpa")
    assert packed_attention_mask(model, CausalLMCollator(PAD)(packed_rows(documents()))) == {}


def test_trainer_and_evaluate_score_packed_gpt_oss_rows_like_the_documents_alone(tmp_path):
    """Both forward paths that take packed batches add the masks: the Trainer's `compute_loss` and
    `hellbender evaluate`'s `token_metrics`."""
    from transformers import TrainingArguments

    from hellbender.train.trainer import HellbenderTrainer
    from hellbender.use.evaluate import token_metrics

    model = tiny_model("gpt_oss", "eager")
    docs = documents()
    collate = CausalLMCollator(PAD)
    alone = per_token_nll(model, collate(docs)).mean().item()
    rows = packed_rows(docs)
    assert token_metrics(model, rows, collate, batch_size=2)["loss"] == pytest.approx(alone, abs=1e-5)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=2,
        remove_unused_columns=False,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = HellbenderTrainer(model=model, args=args, eval_dataset=rows, data_collator=collate)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(alone, abs=1e-5)


def test_a_family_whose_layers_carry_state_along_the_row_is_refused_with_any_attention():
    """Granite hybrid's Mamba layers read every earlier token of the row: flash attention keeps its attention layers'
    documents apart, not those."""
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(num_hidden_layers=2, layer_types=["mamba", "attention"])
    for attention in ("sdpa", "flash_attention_2"):
        config._attn_implementation = attention
        with pytest.raises(
            ConfigError, match=r"`granitemoehybrid` model apart: its layers carry a state along the row"
        ):
            check_packed_masks(SimpleNamespace(config=config))


def test_bloom_is_refused_with_packing_naming_its_alibi():
    """BLOOM's forward reads `attention_mask` as a 2-D padding mask for its ALiBi biases; a block mask fails there."""
    from transformers import BloomConfig

    config = BloomConfig(n_layer=1, hidden_size=32, n_head=2)
    config._attn_implementation = "eager"
    with pytest.raises(ConfigError, match=r"`sample_packing` cannot keep .* `bloom` .* ALiBi position biases"):
        check_packed_masks(SimpleNamespace(config=config))


BUILDERS = {"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"}


def functions_calling_a_builder(source: str) -> list[ast.FunctionDef]:
    """The functions of a module that call a mask builder, each parsed alone (parsing every model's whole module
    takes half a minute)."""
    lines = source.splitlines()
    found: dict[int, ast.FunctionDef] = {}
    for number, line in enumerate(lines):
        if not any(f"{name}(" in line for name in BUILDERS):
            continue
        indent = len(line) - len(line.lstrip())
        start = next(
            (n for n in range(number, -1, -1) if re.match(rf"^ {{0,{max(indent - 1, 0)}}}def ", lines[n])), None
        )
        if start is None or start in found:
            continue
        depth = len(lines[start]) - len(lines[start].lstrip())
        end = next(
            (
                n
                for n in range(start + 1, len(lines))
                if lines[n].strip()
                and not lines[n].lstrip().startswith(")")  # the end of a signature spread over lines
                and len(lines[n]) - len(lines[n].lstrip()) <= depth
            ),
            len(lines),
        )
        found[start] = ast.parse(textwrap.dedent("\n".join(lines[start:end]))).body[0]
    return list(found.values())


def builds_masks_without_position_ids(source: str) -> bool:
    """Whether any call of a transformers mask builder in a model's module lacks `position_ids`, passed by keyword
    or through a dict literal (or a copy of one) spread into the call."""
    for function in functions_calling_a_builder(source):
        keys: dict[str, set] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                name, value = node.targets[0].id, node.value
                if isinstance(value, ast.Dict):
                    keys.setdefault(name, set()).update(k.value for k in value.keys if isinstance(k, ast.Constant))
                elif (
                    isinstance(value, ast.Call)
                    and isinstance(value.func, ast.Attribute)
                    and value.func.attr == "copy"
                    and isinstance(value.func.value, ast.Name)
                ):
                    keys.setdefault(name, set()).update(keys.get(value.func.value.id, set()))
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in BUILDERS:
                passed = {k.arg for k in node.keywords if k.arg}
                for spread in (k.value for k in node.keywords if k.arg is None):
                    passed |= keys.get(getattr(spread, "id", None), set())
                if "position_ids" not in passed and len(node.args) < 5:
                    return True
    return False


def test_every_causal_lm_family_building_masks_without_position_ids_is_listed():
    """Reads the installed transformers' model code (without importing it), so that a family added or changed there cannot leak packed
    documents into each other unnoticed."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = set()
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        code = Path(transformers.__file__).parent / "models" / module / f"modeling_{module}.py"
        if code.exists() and builds_masks_without_position_ids(code.read_text()):
            found.add(model_type)
    assert "gpt_oss" in found and "llama" not in found  # the check itself sees what it should
    assert found <= MASKS_WITHOUT_POSITION_IDS, sorted(found - MASKS_WITHOUT_POSITION_IDS)


def test_the_model_is_found_inside_ddp_and_deepspeeds_engine(tiny_model_path):
    """DDP's wrapper has no `config`; DeepSpeed's engine has one of its own, a dict, which the Trainer's every step
    reached through `text_config` before the model's (a ZeRO-2 run on two GPUs stopped at its first step)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ddp_like = SimpleNamespace(module=model)
    engine_like = SimpleNamespace(config={"zero_optimization": {"stage": 2}}, module=ddp_like)
    assert unwrapped(ddp_like) is model and unwrapped(engine_like) is model and unwrapped(model) is model
    assert text_config(engine_like) is model.config
