"""The router's auxiliary (load-balancing) loss of mixture-of-experts models, asked for with Axolotl's
`model_config: {output_router_logits: true, router_aux_loss_coef: ...}`: the training loss is cross-entropy plus
the weighted auxiliary loss exactly once on every loss path (hellbender's cross-entropy, the model's own loss as the
fused path uses it, packed rows), the router receives its gradient, the loss is logged on its own, and a key that
would do nothing is refused by name."""

from __future__ import annotations

import datasets  # noqa: F401 - imported before any CliRunner call (see tests/test_cli_errors.py)
import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments
from transformers.loss.loss_utils import ForCausalLMLoss

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from tests.test_moe_lora import lora_config, moe_config

COEF = 0.25  # large beside the defaults (0.001 - 0.01), so a dropped or doubled term shows


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """family -> a saved tiny model directory (test_moe_lora.py's shapes, built once per module)."""
    from hellbender.models.tiny import build_tiny_tokenizer

    built = {}

    def build(family: str):
        if family not in built:
            tokenizer = build_tiny_tokenizer()
            torch.manual_seed(0)
            built[family] = tmp_path_factory.mktemp(family)
            AutoModelForCausalLM.from_config(moe_config(family, tokenizer)).save_pretrained(built[family])
            tokenizer.save_pretrained(built[family])
        return built[family]

    return build


def load(tmp_path, model_dir, full: bool = False, **overrides):
    from hellbender.models.loading import load_model, load_tokenizer_and_processor

    raw = lora_config(tmp_path, model_dir, **overrides)
    if full:
        del raw["adapter"]
    cfg = validate_config(raw)
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    return load_model(cfg, tokenizer)


def router_keys(coef: float = COEF) -> dict:
    return {"model_config": {"output_router_logits": True, "router_aux_loss_coef": coef}}


def trainer_for(model, tmp_path, fused: bool = False, cpu: bool = True):
    from hellbender.train.trainer import HellbenderTrainer

    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), report_to=[], use_cpu=cpu)
    return HellbenderTrainer(model=model, args=args, fused_loss=fused)


def batch(packed: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    ids = torch.randint(3, 200, (2, 12))
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt that is not trained
    if packed:  # two documents per row, told apart by restarting position ids
        return {"input_ids": ids, "labels": labels, "position_ids": torch.tensor([list(range(5)) + list(range(7))] * 2)}
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def hand_aux_loss(router_logits: tuple[torch.Tensor, ...], experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss over every layer's tokens: experts x the sum over experts of (share
    of top-k assignments) x (mean routing probability)."""
    logits = torch.cat([layer.float() for layer in router_logits])
    probs = logits.softmax(-1)
    chosen = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, experts).sum(1).float()
    return experts * (chosen.mean(0) * probs.mean(0)).sum()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ForCausalLMLoss(logits.float(), labels, logits.shape[-1])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_loss_is_cross_entropy_plus_weighted_aux_loss_with_the_key_and_cross_entropy_without(
    family, tiny_dir, tmp_path
):
    inputs = batch()
    with_key = load(tmp_path, tiny_dir(family), **router_keys())
    trainer = trainer_for(with_key, tmp_path)
    assert trainer.router_aux_coefficient == COEF
    loss, outputs = trainer.compute_loss(with_key, dict(inputs), return_outputs=True)
    config = with_key.config
    aux = hand_aux_loss(outputs.router_logits, len(outputs.router_logits[0][0]), config.num_experts_per_tok)
    assert aux > 0
    torch.testing.assert_close(outputs.aux_loss, aux, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss, cross_entropy(outputs.logits, inputs["labels"]) + COEF * aux)

    without = load(tmp_path / "plain", tiny_dir(family))
    plain = trainer_for(without, tmp_path)
    assert plain.router_aux_coefficient is None
    plain_loss, plain_outputs = plain.compute_loss(without, dict(inputs), return_outputs=True)
    assert plain_outputs.get("aux_loss") is None
    torch.testing.assert_close(plain_loss, cross_entropy(plain_outputs.logits, inputs["labels"]))
    torch.testing.assert_close(plain_loss + COEF * aux, loss)  # same weights: only the router term differs


def test_gpt_oss_adds_its_own_aux_loss_once(tiny_dir, tmp_path):
    model = load(tmp_path, tiny_dir("gpt_oss"), **router_keys())
    inputs = batch()
    loss, outputs = trainer_for(model, tmp_path).compute_loss(model, dict(inputs), return_outputs=True)
    assert outputs.aux_loss > 0
    torch.testing.assert_close(loss, cross_entropy(outputs.logits, inputs["labels"]) + COEF * outputs.aux_loss)


def test_fused_path_takes_the_models_loss_which_holds_the_aux_loss_once(tiny_dir, tmp_path):
    """The fused path (Liger's fused linear cross-entropy) lets the model compute its loss from the labels; the
    stock forward stands in for Liger's here (CPU), both adding `coef x aux_loss` themselves."""
    model = load(tmp_path, tiny_dir("mixtral"), **router_keys())
    inputs = batch()
    fused = trainer_for(model, tmp_path, fused=True)
    assert fused.compute_loss_func is None
    loss, outputs = fused.compute_loss(model, dict(inputs), return_outputs=True)
    ce = cross_entropy(outputs.logits, inputs["labels"])
    torch.testing.assert_close(loss, ce + COEF * outputs.aux_loss)
    unfused = trainer_for(model, tmp_path).compute_loss(model, dict(inputs))
    torch.testing.assert_close(unfused, loss)


@pytest.mark.gpu
def test_liger_fused_cross_entropy_holds_the_aux_loss_once(tiny_dir, tmp_path):
    """Liger's fused forward computes the loss with the term itself; the trainer takes it as it is, equal to the
    unfused path's cross-entropy plus the weighted auxiliary loss."""
    from types import SimpleNamespace

    pytest.importorskip("liger_kernel")
    from hellbender.models.kernels import LIGER_ARGUMENTS, apply_liger_kernels

    def model():
        path = tiny_dir("mixtral")
        built = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **router_keys()["model_config"])
        return built.cuda().train()

    inputs = {key: value.cuda() for key, value in batch().items()}
    fused_model = model()
    only_fused_loss = SimpleNamespace(
        **{key: key == "liger_fused_linear_cross_entropy" for key in LIGER_ARGUMENTS},
        fused_cross_entropy_chunk_scale=None,
    )
    assert apply_liger_kernels(only_fused_loss, fused_model) == ["liger_fused_linear_cross_entropy"]
    fused = trainer_for(fused_model, tmp_path, fused=True, cpu=False)
    fused_loss = fused.compute_loss(fused_model, dict(inputs))
    plain_model = model()
    loss, outputs = trainer_for(plain_model, tmp_path, cpu=False).compute_loss(
        plain_model, dict(inputs), return_outputs=True
    )
    assert outputs.aux_loss > 0
    torch.testing.assert_close(loss, cross_entropy(outputs.logits, inputs["labels"]) + COEF * outputs.aux_loss)
    torch.testing.assert_close(fused_loss, loss, atol=1e-4, rtol=1e-4)
    fused_loss.backward()
    router = [p.grad for n, p in fused_model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert router and all(g is not None and g.abs().sum() > 0 for g in router)


def test_packed_rows_include_the_aux_loss(tiny_dir, tmp_path):
    model = load(tmp_path, tiny_dir("mixtral"), **router_keys(), sample_packing=True)
    inputs = batch(packed=True)
    loss, outputs = trainer_for(model, tmp_path).compute_loss(model, dict(inputs), return_outputs=True)
    aux = hand_aux_loss(outputs.router_logits, 4, 2)
    torch.testing.assert_close(loss, cross_entropy(outputs.logits, inputs["labels"]) + COEF * aux)


def test_the_router_receives_the_aux_loss_gradient(tiny_dir, tmp_path):
    """Full fine-tuning: the router weights' gradient with the key is the one without it plus coef x the gradient of
    the auxiliary loss."""
    inputs = batch()
    grads = {}
    for name, overrides in (("with", router_keys()), ("without", {})):
        model = load(tmp_path / name, tiny_dir("mixtral"), full=True, **overrides)
        model.train()
        loss, outputs = trainer_for(model, tmp_path).compute_loss(model, dict(inputs), return_outputs=True)
        loss.backward(retain_graph=True)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
        if name == "with":
            model.zero_grad()
            hand_aux_loss(outputs.router_logits, 4, 2).backward()
            aux_grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(grads["with"]) == 2  # one router per layer
    for n, grad in grads["with"].items():
        assert aux_grads[n].abs().sum() > 0
        torch.testing.assert_close(grad, grads["without"][n] + COEF * aux_grads[n], atol=1e-6, rtol=1e-4)


class Logs(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_a_run_logs_the_aux_loss_each_step_and_the_report_shows_it(tiny_dir, tmp_path):
    from hellbender.train.report import _num
    from hellbender.train.run import train

    raw = lora_config(tmp_path, tiny_dir("qwen3_moe"), lora_target_linear=True, **router_keys())
    raw["max_steps"] = 3
    logs = Logs()
    train(validate_config(raw), callbacks=[logs])
    steps = [entry for entry in logs.logs if "loss" in entry]
    assert len(steps) == 3 and all(entry["aux_loss"] > 0 for entry in steps)
    # Top-2 of 4 experts: 2 (top-k) at an even load, more when uneven, at most 4 (the number of experts).
    assert all(1.5 < entry["aux_loss"] <= 4.0 for entry in steps)
    report = (tmp_path / "out" / "report" / "report.md").read_text()
    assert f"Router auxiliary loss (before its weight): {_num(steps[0]['aux_loss'])} at step 1" in report


def test_a_run_without_the_key_logs_no_aux_loss(tiny_dir, tmp_path):
    from hellbender.train.run import train

    logs = Logs()
    train(validate_config(lora_config(tmp_path, tiny_dir("mixtral"))), callbacks=[logs])
    assert [e for e in logs.logs if "loss" in e] and not any("aux_loss" in e for e in logs.logs)


@pytest.mark.parametrize(
    ("family", "overrides", "needles"),
    [
        ("qwen3", {"output_router_logits": True}, ["`overrides_of_model_config.output_router_logits`", "`qwen3`"]),
        ("deepseek_v3", {"output_router_logits": True}, ["output_router_logits", "`deepseek_v3`", "bias"]),
        ("qwen3", {"router_aux_loss_coef": 0.1}, ["`overrides_of_model_config.router_aux_loss_coef`", "no router"]),
        ("mixtral", {"router_aux_loss_coef": 0.1}, ["router_aux_loss_coef: 0.1`", "`output_router_logits: true`"]),
    ],
    ids=["dense", "bias-balanced", "weight-on-dense", "weight-without-logits"],
)
def test_router_keys_that_would_do_nothing_are_refused_by_name(family, overrides, needles, tiny_dir, tmp_path):
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, tiny_dir(family), model_config=overrides)
    message = str(refused.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_packing_with_block_diagonal_masks_is_refused_with_the_aux_loss(tiny_dir, tmp_path):
    """gpt-oss builds its masks without position ids, so packed rows carry a 4-D mask, which its load-balancing
    loss cannot read (it takes one mask entry per token)."""
    with pytest.raises(ConfigError, match="`output_router_logits: true` with `sample_packing`"):
        load(tmp_path, tiny_dir("gpt_oss"), sample_packing=True, **router_keys())


def test_families_with_and_without_the_loss():
    import transformers

    from hellbender.models.router_aux_loss import computes_router_aux_loss

    has = [transformers.MixtralConfig(), transformers.Qwen3MoeConfig(), transformers.OlmoeConfig()]
    has += [transformers.GptOssConfig(), transformers.Qwen2MoeConfig()]
    assert all(computes_router_aux_loss(c) for c in has)
    lacks = [transformers.LlamaConfig(), transformers.DeepseekV3Config(), transformers.Llama4TextConfig()]
    lacks += [transformers.Glm4MoeConfig(), transformers.Gemma4TextConfig()]
    assert not any(computes_router_aux_loss(c) for c in lacks)
