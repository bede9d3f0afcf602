"""Flex attention: packed documents kept apart on the trainer's path, and `flex_attn_compile_kwargs` reaching
torch.compile. Forward passes only (torch 2.13 has no flex backward on CPU); whole models run under
`set_stance("force_eager")`, since compiling with inductor takes minutes on a CI machine and the masks under test are
the same. Training with flex attention is checked on a GPU (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from hellbender.config import validate_config
from hellbender.data.collator import CausalLMCollator
from hellbender.data.packing import concat_documents
from hellbender.errors import ConfigError
from hellbender.models.flex_attention import COMPILED_FLEX_PREFIX, make_attention_function, use_compiled_flex
from tests.helpers import base_config

PAD = 1


def documents() -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (9, 14, 6, 11)]
    return [{"input_ids": d, "labels": list(d)} for d in docs]


def packed(docs: list[dict[str, list[int]]], splits: list[int]) -> list[dict[str, list]]:
    rows, start = [], 0
    for n in splits:
        part = docs[start : start + n]
        rows.append(concat_documents([d["input_ids"] for d in part], [d["labels"] for d in part]))
        start += n
    return rows


def eval_loss(model, rows, attn: str, tmp_path) -> float:
    """The evaluation loss the trainer computes (its `compute_loss`, one batch)."""
    from transformers import TrainingArguments

    from hellbender.train.trainer import HellbenderTrainer

    args = TrainingArguments(  # rows keep their `seq_lens` for the collator, as hellbender's arguments say
        output_dir=str(tmp_path),
        per_device_eval_batch_size=len(rows),
        remove_unused_columns=False,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = HellbenderTrainer(model=model, args=args, eval_dataset=rows, data_collator=CausalLMCollator(PAD))
    with torch.compiler.set_stance("force_eager"):
        return trainer.evaluate()["eval_loss"]


def test_trainer_scores_packed_rows_with_flex_attention_like_the_documents_alone(tiny_model_path, tmp_path):
    """Packed rows (two rows, the second padded) with flex attention give the evaluation loss of the unpacked
    documents with SDPA: documents do not attend to each other on the trainer's own forward path."""
    from transformers import AutoModelForCausalLM

    def load(attn):
        return AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attn, dtype=torch.float32)

    docs = documents()
    expected = eval_loss(load("sdpa"), docs, "sdpa", tmp_path / "sdpa")
    got = eval_loss(load("flex_attention"), packed(docs, [3, 1]), "flex_attention", tmp_path / "flex")
    # The first label of each packed document is masked; unpacked, that token has no prediction either.
    assert got == pytest.approx(expected, rel=1e-5)


def test_flex_compile_kwargs_are_torch_compile_arguments_of_flex_attention():
    """The registered attention function compiles flex attention with the given arguments: a recording backend sees
    one compile per sequence length under `dynamic: false`, and the output equals SDPA with the same mask."""
    compiled: list[int] = []

    def recording_backend(graph_module, example_inputs):
        compiled.append(len(example_inputs))
        return graph_module.forward

    attention = make_attention_function({"backend": recording_backend, "dynamic": False})
    module = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    for seq in (16, 24, 16):
        query = torch.randn(2, 4, seq, 8, generator=gen)
        key, value = torch.randn(2, 2, seq, 8, generator=gen), torch.randn(2, 2, seq, 8, generator=gen)
        doc = (torch.arange(seq) >= seq // 3).long()  # two documents per row

        def same_doc_causal(b, h, q, kv, doc=doc):
            return (q >= kv) & (doc[q] == doc[kv])

        mask = create_block_mask(same_doc_causal, None, None, seq, seq, device="cpu", _compile=False)
        out, weights = attention(module, query, key, value, mask, scaling=0.5)
        dense = (torch.arange(seq)[:, None] >= torch.arange(seq)) & (doc[:, None] == doc)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=dense, scale=0.5, enable_gqa=True
        ).transpose(1, 2)
        assert weights is None
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert len(compiled) == 2  # 16, 24, then 16 again from the cache


def test_config_switches_the_model_to_compiled_flex_that_still_separates_documents(tmp_path, tiny_tokenizer):
    """`flex_attn_compile_kwargs` on the model-loading path: the model uses hellbender's registered implementation,
    whose masks are transformers' flex masks (causal, packed documents apart)."""
    from hellbender.models.stack import load_base_model

    cfg = validate_config(
        base_config(
            tmp_path,
            attn_implementation="flex_attention",
            sample_packing=True,
            flex_attn_compile_kwargs={"backend": "eager", "dynamic": False},
        )
    )
    model = load_base_model(cfg, tiny_tokenizer).eval()
    assert model.config._attn_implementation.startswith(COMPILED_FLEX_PREFIX)
    docs = documents()[:3]
    batch = CausalLMCollator(PAD)(packed(docs, [3]))
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        alone = torch.cat([model(torch.tensor([d["input_ids"]]), use_cache=False).logits[0] for d in docs])
    torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)


def test_compile_kwargs_on_a_model_without_flex_attention_are_refused(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa")
    with pytest.raises(ConfigError, match="the loaded model does not use flex attention"):
        use_compiled_flex(model, {"dynamic": False})
    assert model.config._attn_implementation == "sdpa"


def test_dynamic_false_without_fixed_lengths_gets_a_notice(tmp_path):
    from hellbender.config.checks import find_notices

    flex = dict(attn_implementation="flex_attention", flex_attn_compile_kwargs={"dynamic": False})
    varying = find_notices(validate_config(base_config(tmp_path, **flex)))
    fixed = find_notices(validate_config(base_config(tmp_path, pad_to_sequence_len=True, **flex)))
    assert any("compiles flex attention anew for every batch length" in n for n in varying)
    assert not any("flex attention" in n for n in fixed)


def test_a_flex_layout_the_compiler_cannot_build_is_refused_before_training(tiny_model_path, monkeypatch):
    """The start-up probe runs flex attention for the model's head layout (4 query / 2 key-value heads of 16 here)
    and turns a compiler failure into one paragraph naming the layout and what to use instead."""
    from transformers import AutoModelForCausalLM

    from hellbender.models import flex_attention

    seen = {}

    class InductorError(RuntimeError):
        pass

    def failing_flex(query, key, value, enable_gqa=False):
        seen.update(query=tuple(query.shape), key=tuple(key.shape), enable_gqa=enable_gqa)
        raise InductorError("LoweringException: NoValidChoicesError: No choices to select.\n  target: flex_attention")

    monkeypatch.setattr(flex_attention, "compiled_flex", lambda kwargs: failing_flex)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with pytest.raises(ConfigError) as error:
        flex_attention.check_flex_compiles(model, {"dynamic": False}, torch.float32, device=torch.device("cpu"))
    assert seen == {"query": (1, 4, 128, 16), "key": (1, 2, 128, 16), "enable_gqa": True}
    message = str(error.value)
    assert "4 query / 2 key-value heads of size 16" in message
    assert "InductorError: LoweringException: NoValidChoicesError" in message
    assert "`attn_implementation: sdpa`" in message and "\n" not in message
