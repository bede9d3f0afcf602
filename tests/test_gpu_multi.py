"""FSDP2 through the Trainer on two GPUs, with a Llama-3.2-1B-shaped model (random weights, the tiny tokenizer):
full fine-tuning and LoRA train, save sharded checkpoints, resume exactly and consolidate into a model that plain
transformers / PEFT load; `fp32_norms` keeps the norms in float32 while the rest computes in bfloat16. QLoRA (a
smaller random Llama) trains with its 4-bit weights sharded, resumes, consolidates, and its adapter loads in plain
PEFT on the 4-bit base. Hybrid sharding (2 x 2) trains like FSDP2 over four GPUs.

Skipped without two CUDA GPUs (the hybrid test without four). Each run is a real `torchrun` of
tests/train_worker.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import CHAT_DATA, logged_losses, trainer_state
from tests.test_distributed import run_torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]
REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "train_worker.py"
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory, tiny_tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    target = tmp_path_factory.mktemp("llama-1b")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B, pad_token_id=tiny_tokenizer.pad_token_id)).to(torch.bfloat16)
    model.save_pretrained(target)
    tiny_tokenizer.save_pretrained(target)
    del model
    torch.cuda.empty_cache()
    return target


def config(tmp_path: Path, model: Path, **overrides) -> dict:
    raw = {
        "base_model": str(model),
        "datasets": [{"path": CHAT_DATA, "type": "chat_template"}],
        "sequence_len": 512,
        "sample_packing": True,
        "micro_batch_size": 2,
        "max_steps": 4,
        "save_steps": 2,
        "logging_steps": 1,
        "learning_rate": 1e-4,
        "lr_scheduler": "constant",
        "bf16": True,
        "gradient_checkpointing": True,
        "fsdp_version": 2,
        "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "state_dict_type": "SHARDED_STATE_DICT"},
        "output_dir": str(tmp_path / "out"),
        "dataset_prepared_path": str(tmp_path / "prepared"),
    }
    raw.update(overrides)
    return raw


def torchrun(tmp_path: Path, raw: dict, name: str, nproc: int = 2) -> dict:
    config_file = tmp_path / f"{name}.json"
    config_file.write_text(json.dumps(raw))
    result = tmp_path / f"{name}.result.json"
    run_torchrun(WORKER, str(config_file), str(result), timeout=600, nproc=nproc)
    return json.loads(result.read_text())


def consolidate(raw: dict, tmp_path: Path, checkpoint: Path, target: Path) -> None:
    config_file = tmp_path / "consolidate.json"
    config_file.write_text(json.dumps(raw))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hellbender",
            "consolidate",
            str(config_file),
            "--checkpoint",
            str(checkpoint),
            "--output",
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def assert_resumes_exactly(tmp_path: Path, raw: dict, losses: dict[int, float]) -> None:
    """A second run started from checkpoint-2 logs the same losses for steps 3-4 as the uninterrupted run."""
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(Path(raw["output_dir"]) / "checkpoint-2", resumed_dir / "checkpoint-2")
    torchrun(tmp_path, {**raw, "output_dir": str(resumed_dir), "auto_resume_from_checkpoints": True}, "resumed")
    resumed = logged_losses(resumed_dir)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(losses[step], rel=2e-2), (step, resumed, losses)


def test_fsdp2_full_fine_tune_saves_resumes_and_consolidates(tmp_path, llama_1b):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    raw = config(tmp_path, llama_1b)
    torchrun(tmp_path, raw, "full")
    out = Path(raw["output_dir"])
    losses = logged_losses(out)
    assert all(torch.isfinite(torch.tensor(list(losses.values()))))
    assert (out / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()  # sharded, one part per process
    final = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)  # the final model is saved whole
    assert_resumes_exactly(tmp_path, raw, losses)
    target = tmp_path / "consolidated"
    consolidate(raw, tmp_path, out / "checkpoint-4", target)
    joined = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    for name, tensor in final.state_dict().items():  # checkpoint-4 and the final model are the same weights
        torch.testing.assert_close(joined.state_dict()[name], tensor, rtol=0, atol=0)
    base = load_file(llama_1b / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(base[key], joined.state_dict()[key])  # trained, not the starting weights


def test_fsdp2_lora_saves_resumes_and_consolidates(tmp_path, llama_1b):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    raw = config(
        tmp_path,
        llama_1b,
        adapter="lora",
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        lora_target_linear=True,
        learning_rate=1e-3,
    )
    torchrun(tmp_path, raw, "lora")
    out = Path(raw["output_dir"])
    losses = logged_losses(out)
    assert all(torch.isfinite(torch.tensor(list(losses.values()))))
    assert (out / "adapter_model.safetensors").is_file()
    assert_resumes_exactly(tmp_path, raw, losses)
    target = tmp_path / "consolidated"
    consolidate(raw, tmp_path, out / "checkpoint-4", target)
    final = load_file(out / "adapter_model.safetensors")
    joined = load_file(target / "adapter_model.safetensors")
    assert set(final) == set(joined) and any("lora_B" in k for k in final)
    for name, tensor in final.items():
        torch.testing.assert_close(joined[name], tensor, rtol=0, atol=0)
    base = AutoModelForCausalLM.from_pretrained(llama_1b, dtype=torch.bfloat16, device_map="cuda")
    model = PeftModel.from_pretrained(base, str(target))
    assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]], device=model.device)).logits).all()


def test_fp32_norms_keep_norms_float32_while_the_rest_runs_in_bfloat16(tmp_path, llama_1b):
    raw = config(tmp_path, llama_1b, fp32_norms=True, max_steps=2, save_steps=10)
    result = torchrun(tmp_path, raw, "fp32-norms")
    stored, compute = result["stored"], result["compute"]
    norms = {n: d for n, d in stored.items() if n.endswith("norm.weight")}
    assert len(norms) == 2 * LLAMA_1B["num_hidden_layers"] + 1
    assert set(norms.values()) == {"torch.float32"}
    assert set(d for n, d in compute.items() if n.endswith("norm.weight")) == {"torch.float32"}
    others = {n: d for n, d in compute.items() if not n.endswith("norm.weight")}
    assert "torch.bfloat16" in others.values(), others  # two precision groups, not a model run all in float32
    assert others["model.layers.0.self_attn.q_proj.weight"] == "torch.bfloat16"


SMALL_LLAMA = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
)


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory, tiny_tokenizer) -> Path:
    """A small random Llama over the tiny tokenizer's vocabulary: small enough that QLoRA visibly lowers the loss
    of the chat data within a few steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target = tmp_path_factory.mktemp("small-llama")
    torch.manual_seed(0)
    config = LlamaConfig(**SMALL_LLAMA, vocab_size=len(tiny_tokenizer), pad_token_id=tiny_tokenizer.pad_token_id)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(target)
    tiny_tokenizer.save_pretrained(target)
    return target


# Three LoRA steps of the small Llama, compared between two ways of spreading them over the GPUs.
SMALL_LORA_RUN = dict(
    adapter="lora",
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.0,
    lora_target_linear=True,
    sequence_len=256,
    max_steps=3,
    save_steps=10,
    learning_rate=2e-3,
)


def qlora_config(tmp_path: Path, model: Path, **overrides) -> dict:
    keys = dict(
        adapter="qlora",
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        lora_target_linear=True,
        sequence_len=256,
        max_steps=6,
        learning_rate=2e-3,
        fsdp_config={"transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "state_dict_type": "SHARDED_STATE_DICT"},
    )
    return config(tmp_path, model, **{**keys, **overrides})


def chat_loss(model, tokenizer) -> float:
    """The model's loss on the first rows of the training data, as one sequence each."""
    rows = [json.loads(line) for line in Path(CHAT_DATA).read_text().splitlines()[:4]]
    total = 0.0
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        ids = torch.tensor([tokenizer(text)["input_ids"][:256]], device=model.device)
        with torch.no_grad():
            total += float(model(input_ids=ids, labels=ids).loss)
    return total / len(rows)


def test_fsdp2_qlora_trains_saves_resumes_and_the_adapter_loads_in_peft(tmp_path, small_llama):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    raw = qlora_config(tmp_path, small_llama)
    result = torchrun(tmp_path, raw, "qlora")
    out = Path(raw["output_dir"])
    losses = logged_losses(out)
    values = [losses[step] for step in sorted(losses)]
    assert len(values) == 6 and all(torch.isfinite(torch.tensor(values))), losses
    assert sum(values[-2:]) < sum(values[:2]), losses  # the loss falls
    stored = result["stored"]
    packed = {n: d for n, d in stored.items() if n.endswith("base_layer.weight") and ".layers." in n}
    assert len(packed) == 7 * SMALL_LLAMA["num_hidden_layers"]
    assert set(packed.values()) == {"torch.bfloat16"}, packed  # stored in the run's dtype, as FSDP2 gathers them
    assert {d for n, d in stored.items() if "lora_" in n} == {"torch.float32"}
    assert (out / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()
    assert (out / "adapter_model.safetensors").is_file()
    assert_resumes_exactly(tmp_path, raw, losses)
    target = tmp_path / "consolidated"
    consolidate(raw, tmp_path, out / "checkpoint-6", target)
    final = load_file(out / "adapter_model.safetensors")
    joined = load_file(target / "adapter_model.safetensors")
    assert set(final) == set(joined) and any("lora_B" in k for k in final)
    for name, tensor in final.items():  # checkpoint-6 and the final adapter are the same weights
        torch.testing.assert_close(joined[name], tensor, rtol=0, atol=0)

    # Plain PEFT on the 4-bit base, without hellbender: the adapter is the trained one.
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    base = AutoModelForCausalLM.from_pretrained(
        small_llama, dtype=torch.bfloat16, quantization_config=quantization, device_map="cuda"
    )
    tokenizer = AutoTokenizer.from_pretrained(small_llama)
    untrained = chat_loss(base, tokenizer)
    model = PeftModel.from_pretrained(base, str(out))
    trained = chat_loss(model, tokenizer)
    assert trained < untrained - 0.1, (trained, untrained)


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_fsdp2_with_parameters_offloaded_to_host_memory_trains(tmp_path, small_llama, adapter):
    """Axolotl's FSDP examples offload the sharded parameters (`offload_params`); the gradient norm is then reduced
    over host-memory shards, which needs the CPU backend beside NCCL."""
    raw = qlora_config(tmp_path, small_llama, adapter=adapter, max_steps=3, save_steps=10)
    raw["fsdp_config"] = {**raw["fsdp_config"], "offload_params": True, "cpu_ram_efficient_loading": True}
    torchrun(tmp_path, raw, f"{adapter}-offload")
    losses = logged_losses(raw["output_dir"])
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(list(losses.values())))), losses
    assert (Path(raw["output_dir"]) / "adapter_model.safetensors").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs")
def test_hybrid_sharding_two_by_two_trains_like_fsdp2_over_four_gpus(tmp_path, small_llama):
    common = SMALL_LORA_RUN
    plain = config(tmp_path / "plain", small_llama, **common)
    hybrid = config(tmp_path / "hybrid", small_llama, dp_shard_size=2, dp_replicate_size=2, **common)
    torchrun(tmp_path, plain, "plain", nproc=4)
    torchrun(tmp_path, hybrid, "hybrid", nproc=4)
    expected, got = logged_losses(plain["output_dir"]), logged_losses(hybrid["output_dir"])
    assert len(got) == 3 and all(torch.isfinite(torch.tensor(list(got.values())))), got
    for step, loss in expected.items():  # bf16: reduction order differs between the two meshes
        assert got[step] == pytest.approx(loss, rel=2e-2), (got, expected)
    assert (Path(hybrid["output_dir"]) / "adapter_model.safetensors").is_file()


def test_fsdp2_distills_from_an_online_teacher_like_ddp(tmp_path, small_llama):
    """Online distillation under FSDP2 through the Trainer: the student sharded, a whole teacher in each process
    (loaded after accelerate's FSDP variables are set, with `cpu_ram_efficient_loading`). Per step, the loss and
    both its parts match DDP over the same two GPUs with the same batches (bf16: reduction orders differ)."""
    kd = dict(
        adapter="lora", kd_trainer=True, kd_teacher_model=str(small_llama), kd_online_topk=16, kd_alpha=0.7,
        kd_ce_alpha=0.3, max_steps=3, save_steps=10,
    )  # fmt: skip
    sharded = qlora_config(tmp_path / "fsdp2", small_llama, **kd)
    sharded["fsdp_config"] = {**sharded["fsdp_config"], "cpu_ram_efficient_loading": True}
    ddp = qlora_config(tmp_path / "ddp", small_llama, **kd)
    del ddp["fsdp_version"], ddp["fsdp_config"]
    torchrun(tmp_path, ddp, "kd-ddp")
    torchrun(tmp_path, sharded, "kd-fsdp2")

    def parts(output_dir: str) -> dict[int, dict[str, float]]:
        history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
        return {e["step"]: {k: e[k] for k in ("loss", "kd_loss", "ce_loss")} for e in history if "loss" in e}

    want, got = parts(ddp["output_dir"]), parts(sharded["output_dir"])
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step, expected in want.items():
        assert expected["kd_loss"] > 0 and expected["ce_loss"] > 0
        for key, value in expected.items():
            assert got[step][key] == pytest.approx(value, rel=2e-2), (step, key, got, want)


def split_like_one_gpu(tmp_path: Path, model: Path, **common) -> dict:
    """`context_parallel_size: 2` on two GPUs against one GPU alone with the same rows per step: each process's
    forward sees half of each row, and the losses, gradient norms and token counts are the one GPU's. Returns the
    split run's config."""
    alone = config(tmp_path / "alone", model, **common)
    for key in ("fsdp_version", "fsdp_config"):
        alone.pop(key)
    split = config(tmp_path / "split", model, context_parallel_size=2, **common)
    whole = torchrun(tmp_path, alone, "alone", nproc=1)["forward_lengths"]
    halves = torchrun(tmp_path, split, "split", nproc=2)["forward_lengths"]
    steps = common["max_steps"]
    # Each process's forward sees half of each row, padded to a multiple of 4 (2 x 2 chunks): the split happened.
    assert len(halves) == len(whole) == steps and halves == [-(-n // 4) * 4 // 2 for n in whole], (halves, whole)
    logs, logs_alone = (
        [entry for entry in trainer_state(raw["output_dir"])["log_history"] if "loss" in entry]
        for raw in (split, alone)
    )
    assert len(logs) == steps and all(torch.isfinite(torch.tensor([entry["loss"] for entry in logs]))), logs
    for got, expected in zip(logs, logs_alone, strict=True):  # bf16: the attention sums in another order
        assert got["loss"] == pytest.approx(expected["loss"], rel=2e-2), (logs, logs_alone)
        # Adam hides a gradient scaled by a constant from the losses; the gradient norm does not.
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=5e-2), (logs, logs_alone)
    assert (logs[-1]["input_tokens"], logs[-1]["trained_tokens"]) == (
        logs_alone[-1]["input_tokens"],
        logs_alone[-1]["trained_tokens"],
    )
    assert (Path(split["output_dir"]) / "adapter_model.safetensors").is_file()
    return split


def test_context_parallelism_over_two_gpus_trains_like_one_gpu(tmp_path, small_llama):
    """Padded rows split over the two GPUs by PyTorch's ring attention over SDPA."""
    split_like_one_gpu(tmp_path, small_llama, **{**SMALL_LORA_RUN, "sample_packing": False})


def test_context_parallelism_over_packed_rows_trains_and_resumes_like_one_gpu(tmp_path, small_llama):
    """Packed rows split over the two GPUs by hellbender, attended with the split attention that keeps their documents
    apart (one GPU alone separates them by their position ids); a run resumed from checkpoint-2 logs the
    uninterrupted run's losses."""
    split = split_like_one_gpu(tmp_path, small_llama, **{**SMALL_LORA_RUN, "max_steps": 4, "save_steps": 2})
    assert_resumes_exactly(tmp_path, split, logged_losses(split["output_dir"]))
