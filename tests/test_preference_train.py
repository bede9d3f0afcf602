"""`hellbender train` end to end for KTO, ORPO, SimPO and reward models (LoRA and full fine-tuning): a few steps on
prepared preference data, an output that plain transformers / PEFT load, the method's metrics in the logs and the
run report's plots of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hellbender.config.loading import validate_config
from hellbender.train.run import train
from tests.helpers import PREFERENCE_DATA, base_config, trainer_state

LORA = {"adapter": "lora", "lora_r": 8, "lora_alpha": 16}


def kto_rows(path: Path) -> Path:
    """`chatml.prompt_pairs` KTO rows from the bundled pairs: each pair's chosen answer (desirable) or its rejected
    one (undesirable), alternating."""
    rows = [json.loads(line) for line in Path(PREFERENCE_DATA).read_text().splitlines()[:48]]
    with path.open("w") as out:
        for i, row in enumerate(rows):
            answer = row["chosen" if i % 2 == 0 else "rejected"]["content"]
            prompt = row["messages"][-1]["content"]
            out.write(json.dumps({"prompt": prompt, "completion": answer, "label": i % 2 == 0}) + "\n")
    return path


def run(tmp_path: Path, **settings) -> tuple[dict, Path]:
    cfg = validate_config(base_config(tmp_path, **{"micro_batch_size": 4, "max_steps": 3, **settings}))
    metrics = train(cfg)
    return metrics, Path(cfg.output_dir)


def logged_keys(output_dir: Path) -> set[str]:
    return {key for entry in trainer_state(output_dir)["log_history"] for key in entry}


PAIRS = [{"path": PREFERENCE_DATA, "type": "chat_template.default"}]


@pytest.mark.parametrize(
    ("method", "metrics", "plots"),
    [
        ("kto", {"rewards/chosen", "rewards/rejected", "rewards/margins", "kl"}, {"rewards.png", "kl.png"}),
        ("orpo", {"rewards/margins", "nll_loss", "log_odds_ratio"}, {"rewards.png", "preference_terms.png"}),
        ("simpo", {"rewards/margins", "nll_loss"}, {"rewards.png", "preference_terms.png"}),
    ],
)
def test_a_preference_method_trains_and_saves_a_loadable_adapter(tmp_path, method, metrics, plots):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hellbender.models.tiny import tiny_model_dir

    datasets = (
        [{"path": str(kto_rows(tmp_path / "kto.jsonl")), "type": "chatml.prompt_pairs"}] if method == "kto" else PAIRS
    )
    # KTO logs the desirable and the undesirable rewards of a step only when its batch holds both kinds.
    result, out = run(tmp_path, rl=method, datasets=datasets, **LORA, **({"max_steps": 6} if method == "kto" else {}))
    assert result["trained_tokens"] > 0 and result["input_tokens"] > result["trained_tokens"]
    assert metrics <= logged_keys(out), sorted(logged_keys(out))
    for plot in plots:
        assert (out / "report" / plot).stat().st_size > 0
    assert all(plot in (out / "report" / "report.md").read_text() for plot in plots)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir("hellbender/tiny-llama"))
    model = PeftModel.from_pretrained(base, out)
    assert set(model.peft_config) == {"default"}
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape[-1] == base.config.vocab_size


def test_kto_full_fine_tuning_saves_a_causal_lm(tmp_path):
    from transformers import AutoModelForCausalLM

    datasets = [{"path": str(kto_rows(tmp_path / "kto.jsonl")), "type": "chatml.prompt_pairs"}]
    _, out = run(tmp_path, rl="kto", datasets=datasets, max_steps=2)
    assert {"kl", "rewards/chosen"} <= logged_keys(out)
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "llama"


@pytest.mark.parametrize("adapter", [LORA, {}], ids=["lora", "full"])
def test_kto_with_precomputed_reference_scores_trains_as_with_the_reference_model(tmp_path, adapter):
    """The reference scores of each row and of its KL completion, computed once before training, are the ones the
    reference model gives during training: the logged losses, KL and rewards agree, and no score file is written."""
    datasets = [{"path": str(kto_rows(tmp_path / "kto.jsonl")), "type": "chatml.prompt_pairs"}]
    keys = dict(rl="kto", datasets=datasets, max_steps=4, lora_dropout=0.0, **adapter)
    _, live = run(tmp_path / "live", **keys)
    _, precomputed = run(tmp_path / "precomputed", precompute_ref_log_probs=True, **keys)
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected"):
        expected = {e["step"]: e[key] for e in trainer_state(live)["log_history"] if key in e}
        got = {e["step"]: e[key] for e in trainer_state(precomputed)["log_history"] if key in e}
        assert sorted(got) == sorted(expected) and expected, key
        assert got == pytest.approx(expected, abs=1e-5), key
    # TRL would cache the scores as an Arrow file among hellbender's prepared data; only the KL pairing's rows are.
    from datasets import Dataset

    for cached in tmp_path.rglob("cache-*.arrow"):
        assert not {"ref_logps", "ref_KL_logps"} & set(Dataset.from_file(str(cached)).column_names), cached


def test_reward_model_full_fine_tuning_saves_a_sequence_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification

    _, out = run(tmp_path, reward_model=True, datasets=PAIRS)
    assert {"accuracy", "margin"} <= logged_keys(out)
    assert (out / "report" / "preference_accuracy.png").exists()
    loaded = AutoModelForSequenceClassification.from_pretrained(out)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id is not None
    scores = loaded(input_ids=torch.tensor([[5, 6, 7], [5, 6, 8]])).logits
    assert scores.shape == (2, 1)


def test_reward_model_with_lora_saves_its_score_head_and_merges(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from hellbender.models.tiny import tiny_model_dir
    from hellbender.use.merge import merge_lora

    cfg = validate_config(
        base_config(tmp_path, micro_batch_size=4, max_steps=3, reward_model=True, datasets=PAIRS, **LORA)
    )
    train(cfg)
    out = Path(cfg.output_dir)
    assert {"accuracy", "margin"} <= logged_keys(out)
    assert any("score" in name for name in load_file(out / "adapter_model.safetensors"))
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir("hellbender/tiny-llama"), num_labels=1)
    adapted = PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits

    merged_dir = merge_lora(cfg)
    merged = AutoModelForSequenceClassification.from_pretrained(merged_dir).eval()
    assert merged.config.num_labels == 1
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
