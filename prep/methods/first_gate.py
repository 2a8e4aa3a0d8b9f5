"""AdapMoE's first-layer predictive gate (AdapMoE section 4.3, eq. 9): a linear map from the previous
token's final-normed last hidden state to the next token's first-MoE-layer routing.

The first MoE layer has no earlier layer of the same token to predict from, so the loader runs this gate
after the last decoder layer of token t and prefetches what the first MoE layer of token t+1 will need.

Direction: the paper's printed loss slices teacher[:, 0:-1] against student[:, 1:], which pairs the
gate applied at position p+1 with the routing at p (predicting the past). The text says the input is the
*previous* token's activation, so this module trains the causal pairing, teacher at p+1 against student
at p (``pairing="causal"``); ``"as_printed"`` exists only so a test can show the difference. Pairs never
cross a sequence boundary.

Training (the paper gives no training details; these are our choices): AdamW, lr 1e-3, no weight decay,
mini-batches of about 1024 positions, early stopping on held-out KL(teacher || student), the best
weights kept. The result is W [E, H] (no bias) plus held-out KL, top-1 accuracy and top-K recall, and
the same figures for a marginal-frequency predictor as the baseline to beat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prep.errors import MoeprepError

PAIRINGS = ("causal", "as_printed")


def gate_pairs(student_inputs: list[torch.Tensor], teacher_logits: list[torch.Tensor],
               pairing: str = "causal") -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [N, H], teacher logits [N, E]) of every position pair inside each sequence.

    ``causal``: the student's input at p with the teacher's logits at p + 1. ``as_printed``: the paper's
    slices (the student's input at p + 1 with the teacher at p).
    """
    if pairing not in PAIRINGS:
        raise MoeprepError(f"pairing {pairing!r} unknown; use one of {PAIRINGS}")
    if len(student_inputs) != len(teacher_logits) or not student_inputs:
        raise MoeprepError(f"gate_pairs needs one teacher per sequence: got {len(student_inputs)} input and "
                           f"{len(teacher_logits)} teacher sequences")
    xs, ys = [], []
    for i, (x, y) in enumerate(zip(student_inputs, teacher_logits, strict=True)):
        if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
            raise MoeprepError(f"sequence {i}: inputs must be [T, H] and teacher logits [T, E] with the same T, "
                               f"got {tuple(x.shape)} and {tuple(y.shape)}")
        if pairing == "causal":
            xs.append(x[:-1])
            ys.append(y[1:])
        else:
            xs.append(x[1:])
            ys.append(y[:-1])
    return torch.cat(xs).float(), torch.cat(ys).float()


def kl_teacher_student(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(softmax(teacher) || softmax(student)), in nats."""
    return F.kl_div(F.log_softmax(student_logits, -1), F.log_softmax(teacher_logits, -1), reduction="batchmean",
                    log_target=True)


def prediction_metrics(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int) -> dict:
    """KL, top-1 accuracy (argmax agreement) and top-K recall (|predicted top-K & true top-K| / K)."""
    if not 1 <= k <= teacher_logits.shape[-1]:
        raise MoeprepError(f"k must be in 1..{teacher_logits.shape[-1]}, got {k}")
    predicted = student_logits.topk(k, -1).indices
    true = teacher_logits.topk(k, -1).indices
    overlap = (predicted.unsqueeze(-1) == true.unsqueeze(-2)).any(-1).sum(-1).float()
    return {"kl": float(kl_teacher_student(student_logits, teacher_logits)),
            "top1": float((student_logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean()),
            f"top{k}_recall": float((overlap / k).mean())}


def marginal_logits(train_teacher: torch.Tensor, rows: int) -> torch.Tensor:
    """The baseline: every row predicts the training set's mean routing distribution."""
    mean = F.softmax(train_teacher.float(), -1).mean(0)
    return mean.clamp_min(1e-12).log().expand(rows, -1)


@dataclass(frozen=True)
class FirstGate:
    weight: torch.Tensor  # [E, H], logits = x @ weight.T
    epochs: int  # epochs run (early stopping included)
    best_epoch: int
    held_out: dict  # prediction_metrics of the gate on the held-out pairs
    marginal: dict  # the same for the marginal-frequency predictor
    init: str


def train_first_gate(train_x: torch.Tensor, train_y: torch.Tensor, held_x: torch.Tensor, held_y: torch.Tensor,
                     *, k: int, init: str | torch.Tensor = "zeros", lr: float = 1e-3, batch_size: int = 1024,
                     max_epochs: int = 200, patience: int = 10, seed: int = 0, on_epoch=None) -> FirstGate:
    """Fit W [E, H] by AdamW on KL(teacher || softmax(x W^T)); keep the weights with the lowest held-out KL.

    ``init``: ``"zeros"`` or a tensor [E, H] (e.g. the first router's weights). ``on_epoch(epoch, held_kl)``
    reports progress.
    """
    if train_x.dim() != 2 or train_y.dim() != 2 or train_x.shape[0] != train_y.shape[0] or not len(train_x):
        raise MoeprepError("training pairs must be non-empty [N, H] inputs and [N, E] teacher logits")
    if held_x.shape[0] != held_y.shape[0] or not len(held_x):
        raise MoeprepError("held-out pairs must be non-empty and as many inputs as teacher rows")
    hidden, experts = train_x.shape[1], train_y.shape[1]
    if isinstance(init, str):
        if init != "zeros":
            raise MoeprepError(f"init must be 'zeros' or a [E, H] tensor, got {init!r}")
        start, init_name = torch.zeros(experts, hidden), "zeros"
    else:
        if tuple(init.shape) != (experts, hidden):
            raise MoeprepError(f"init weights must be [{experts}, {hidden}], got {tuple(init.shape)}")
        start, init_name = init.detach().float().clone(), "given"
    weight = torch.nn.Parameter(start)
    optimizer = torch.optim.AdamW([weight], lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    train_x, train_y, held_x, held_y = train_x.float(), train_y.float(), held_x.float(), held_y.float()

    def held_kl() -> float:
        with torch.no_grad():
            return float(kl_teacher_student(held_x @ weight.T, held_y))

    best_kl, best_weight, best_epoch, epoch = held_kl(), weight.detach().clone(), 0, 0
    for epoch in range(1, max_epochs + 1):
        order = torch.randperm(len(train_x), generator=gen)
        for start_row in range(0, len(order), batch_size):
            rows = order[start_row:start_row + batch_size]
            loss = kl_teacher_student(train_x[rows] @ weight.T, train_y[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        value = held_kl()
        if on_epoch is not None:
            on_epoch(epoch, value)
        if not math.isfinite(value):
            raise MoeprepError(f"first-gate training diverged at epoch {epoch} (held-out KL {value}); lower lr")
        if value < best_kl:
            best_kl, best_weight, best_epoch = value, weight.detach().clone(), epoch
        elif epoch - best_epoch >= patience:
            break
    with torch.no_grad():
        held = prediction_metrics(held_x @ best_weight.T, held_y, k)
        marginal = prediction_metrics(marginal_logits(train_y, len(held_y)), held_y, k)
    return FirstGate(weight=best_weight, epochs=epoch, best_epoch=best_epoch, held_out=held, marginal=marginal,
                     init=init_name)


@torch.no_grad()
def first_gate_data(model, adapter, sequences: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: (the final-normed last hidden state [T, H], the first MoE layer's router logits [T, E]).

    The input is what the LM head reads (so it is normed by the model's own final norm, on every
    architecture); the teacher is the router's own output, so routing quirks (biases, groups) are the
    model's.
    """
    router = adapter.router(model, adapter.moe_layers[0])
    head = model.get_output_embeddings()
    captured: dict[str, torch.Tensor] = {}
    hooks = [router.register_forward_hook(
                 lambda _m, _a, out: captured.__setitem__("logits", adapter.unpack_router_output(out)[0])),
             head.register_forward_pre_hook(lambda _m, args: captured.__setitem__("hidden", args[0]))]
    inputs, teachers = [], []
    try:
        for seq in sequences:
            captured.clear()
            model(input_ids=seq.view(1, -1).to(head.weight.device), use_cache=False)
            inputs.append(captured["hidden"].reshape(-1, captured["hidden"].shape[-1]).float().cpu())
            teachers.append(captured["logits"].reshape(-1, adapter.num_experts).float().cpu())
    finally:
        for hook in hooks:
            hook.remove()
    return inputs, teachers
