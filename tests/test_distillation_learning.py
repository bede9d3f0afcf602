"""Distillation transfers what a teacher knows faster than the data's own labels do: a tiny student trained on the
top-k targets of a tiny teacher that knows a task reaches the teacher's held-out accuracy in fewer steps than the
same student trained with cross-entropy on the same batches.

The task: each token is the sum of the two before it (mod 16), but half of the training tokens are replaced by
random ones, so a label is a noisy sample while the teacher's distribution says what the rule is. The models are
small two-token MLP language models (a transformers model costs ~100x more per step on the shared CPUs); the loss is
hellbender's own (`distillation_loss`, with `kd_alpha: 1, kd_ce_alpha: 0` against `kd_alpha: 0, kd_ce_alpha: 1`) and
the targets come from the online teacher's code (`topk_targets`, `per_token`)."""

from __future__ import annotations

import pytest
import torch

from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK
from hellbender.train.distillation_loss import DistillationLoss, distillation_loss
from hellbender.train.teacher import per_token, topk_targets

VOCAB, LENGTH, NOISE, TOP_K = 16, 12, 0.5, 8
STUDENT_STEPS, EVERY = 200, 10


class PairLM(torch.nn.Module):
    """A causal LM that sees the current and the previous token: logits [B, T, VOCAB]."""

    def __init__(self, seed: int, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        previous = torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], 1)
        return self.mlp(torch.cat([self.embed(ids), self.embed(previous)], -1))


def sequences(n: int, generator: torch.Generator, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows where token t is (token t-1 + token t-2) mod VOCAB, or with probability `noise` a random token; the first
    two tokens are not trained."""
    ids = torch.zeros(n, LENGTH, dtype=torch.long)
    ids[:, :2] = torch.randint(0, VOCAB, (n, 2), generator=generator)
    for t in range(2, LENGTH):
        rule = (ids[:, t - 1] + ids[:, t - 2]) % VOCAB
        flip = torch.rand(n, generator=generator) < noise
        ids[:, t] = torch.where(flip, torch.randint(0, VOCAB, (n,), generator=generator), rule)
    labels = ids.clone()
    labels[:, :2] = -100
    return ids, labels


@torch.no_grad()
def accuracy(model: PairLM, ids: torch.Tensor) -> float:
    """How often the most likely next token is the rule's, on clean held-out rows."""
    predicted = model(ids)[:, 1:-1].argmax(-1)
    return (predicted == (ids[:, 1:-1] + ids[:, :-2]) % VOCAB).float().mean().item()


def train_student(teacher: PairLM, settings: DistillationLoss, held_out: torch.Tensor) -> list[float]:
    """Held-out accuracy every EVERY steps of a student trained with `settings` on the same batches each time."""
    batches = torch.Generator().manual_seed(5)
    student = PairLM(seed=2, hidden=64)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    curve = []
    for step in range(1, STUDENT_STEPS + 1):
        ids, labels = sequences(32, batches, NOISE)
        with torch.no_grad():
            targets = per_token(topk_targets(teacher(ids), TOP_K, settings.temperature))
        parts = distillation_loss(
            student(ids), labels, targets[TARGET_IDS], targets[TARGET_LOGPROBS], targets[TARGET_MASK], settings
        )
        optimizer.zero_grad()
        parts.loss.backward()
        optimizer.step()
        if step % EVERY == 0:
            curve.append(accuracy(student, held_out))
    return curve


@pytest.fixture
def one_thread():
    """Tiny matrices: a second thread only adds contention on the shared CPUs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_distilled_student_reaches_the_teachers_accuracy_in_fewer_steps_than_cross_entropy(one_thread):
    data = torch.Generator().manual_seed(0)
    held_out, _ = sequences(1000, data, noise=0.0)
    teacher = PairLM(seed=1, hidden=256)  # trained here with plain cross-entropy on many noisy rows
    optimizer = torch.optim.Adam(teacher.parameters(), lr=1e-2)
    for _ in range(150):
        ids, labels = sequences(256, data, NOISE)
        loss = torch.nn.functional.cross_entropy(
            teacher(ids)[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    goal = accuracy(teacher, held_out)
    assert goal > 0.98  # the teacher knows the rule despite the noisy labels

    distilled = train_student(teacher, DistillationLoss(alpha=1.0, ce_alpha=0.0), held_out)
    labels_only = train_student(teacher, DistillationLoss(alpha=0.0, ce_alpha=1.0), held_out)

    def steps_to_goal(curve: list[float]) -> float:
        return next(((i + 1) * EVERY for i, acc in enumerate(curve) if acc >= goal - 0.005), float("inf"))

    print(
        f"\nteacher held-out accuracy {goal:.3f}; steps to reach it: distilled {steps_to_goal(distilled)}, "
        f"cross-entropy {steps_to_goal(labels_only)}; accuracy every {EVERY} steps:\n"
        f"  distilled     {[round(a, 3) for a in distilled]}\n  cross-entropy {[round(a, 3) for a in labels_only]}"
    )
    assert steps_to_goal(distilled) <= STUDENT_STEPS
    assert steps_to_goal(distilled) < steps_to_goal(labels_only)
    assert distilled[5] > labels_only[5] + 0.1  # after 60 steps, well ahead
