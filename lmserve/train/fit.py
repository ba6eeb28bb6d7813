"""Training Medusa and EAGLE-1 heads on a model's own answers (self-distillation).

Both heads learn two things at once, as EAGLE trains its heads: the model's hidden state
further on (a smooth-L1 regression to the model's own feature there) and the model's
distribution of the token that feature chooses (cross-entropy against the model's softmax,
through its head: every position teaches the whole ranking, not just the token written, and
sampled answers teach the model's choice, not the sample). The cross-entropy ranks the tokens
that occur in the answers (``answer_vocabulary``), a few thousand instead of the whole
vocabulary: the model's greedy answers never choose a token outside it (at the prompt's
positions, which train too, its distribution is renormalized over them), and the regression
keeps the rest where the model's own head puts them. The model's head stays frozen (Medusa's
vocabulary projections are copies of it), so a short run on a CPU trains only the small parts:
Medusa's residual blocks, EAGLE's ``fc`` and decoder layer.

Medusa head ``i`` reads the final hidden state at ``t`` and predicts the one at ``t + i + 1``,
whose head logits give token ``t + i + 2``. EAGLE row ``p`` reads token ``p + 1``'s embedding
and the feature at ``p`` (with uniform noise, as EAGLE trains) and predicts the feature at
``p + 1`` and token ``p + 2``; and since the engine drafts further from the head's own
predictions, the head also learns from those: ``draft_passes`` per conversation
(``EagleNet.draft_passes``, EAGLE-3's training-time test), pass ``s`` weighted
``STEP_WEIGHT ** s``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from lmserve.layers.rotary import RotaryEmbedding
from lmserve.models.args import ModelArgs
from lmserve.speculative.eagle_heads import eagle_layer_args
from lmserve.speculative.head_nets import EagleNet, MedusaNet
from lmserve.train.data import Sample


@dataclass
class FitSettings:
    """How a head is trained: passes over the data, AdamW's learning rate (cosine decay after a
    short warm-up), conversations per optimizer step, the cross-entropy's weight beside the
    regression's, EAGLE's input noise (uniform, this wide), EAGLE's draft passes per position
    (1: teacher forced only) and the seed."""

    epochs: int = 10
    lr: float = 1e-3
    batch: int = 8
    ce_weight: float = 0.1
    noise: float = 0.2
    draft_passes: int = 2
    seed: int = 0


# The weight of EAGLE's draft pass s (of draft_passes) in the loss is STEP_WEIGHT ** s: a later
# draft counts only when the ones before it were accepted.
STEP_WEIGHT = 0.8


def answer_vocabulary(samples: list[Sample]) -> torch.Tensor:
    """The sorted token ids that occur in the answers, as a ``(V',)`` tensor."""
    return torch.tensor(sorted({t for s in samples for t in s.tokens[s.answer_start :]}))


class _Objective:
    """Regression plus cross-entropy against the model's own distribution over the answer
    vocabulary, through the frozen head."""

    def __init__(self, head: torch.Tensor, vocabulary: torch.Tensor, ce_weight: float) -> None:
        self.head = head[vocabulary].float()  # (V', D)
        self.ce_weight = ce_weight

    def __call__(self, hidden: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """The loss of predicted features ``hidden (N, D)`` against the model's ``feature
        (N, D)``, and how many of the rows rank the model's choice first."""
        logits = hidden @ self.head.t()  # (N, V')
        with torch.no_grad():
            wanted = F.softmax(feature @ self.head.t(), dim=-1)
        cross_entropy = -(wanted * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        loss = F.smooth_l1_loss(hidden, feature) + self.ce_weight * cross_entropy
        return loss, int((logits.argmax(-1) == wanted.argmax(-1)).sum()), len(hidden)


def _fit(parameters: list[torch.nn.Parameter], samples: list[Sample], settings: FitSettings,
         loss_of: Callable[[Sample], tuple[torch.Tensor, int, int]],
         progress: Callable[[int, float, float], None]) -> None:
    """AdamW over ``samples`` for ``settings.epochs``; ``loss_of`` gives one conversation's
    loss and top-1 counts; ``progress(tokens, loss, top-1 accuracy)`` after each step."""
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=0.0)
    steps = settings.epochs * math.ceil(len(samples) / settings.batch)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    order = random.Random(settings.seed)
    for _ in range(settings.epochs):
        shuffled = list(samples)
        order.shuffle(shuffled)
        for i in range(0, len(shuffled), settings.batch):
            batch = shuffled[i : i + settings.batch]
            total, right, counted = 0.0, 0, 0
            for sample in batch:
                loss, hits, n = loss_of(sample)
                (loss / len(batch)).backward()
                total, right, counted = total + float(loss.detach()), right + hits, counted + n
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            progress(sum(len(s.tokens) for s in batch), total / len(batch), right / max(counted, 1))


def fit_medusa(samples: list[Sample], head: torch.Tensor, num_heads: int, num_layers: int,
               settings: FitSettings, progress: Callable[[int, float, float], None]) -> MedusaNet:
    """Medusa heads (``num_heads``, ``num_layers`` blocks each) over the model's head ``(V, D)``."""
    torch.manual_seed(settings.seed)
    net = MedusaNet(head, num_heads, num_layers)
    objective = _Objective(head, answer_vocabulary(samples), settings.ce_weight)

    def loss_of(sample: Sample) -> tuple[torch.Tensor, int, int]:
        f, n = sample.features, len(sample.tokens)
        assert f is not None  # features() recorded every sample before the fit
        losses, right, counted = [], 0, 0
        for i in range(num_heads):
            rows = n - i - 1  # positions t with a feature at t + i + 1
            if rows <= 0:
                break
            hidden = net.hidden(i, f[:rows])  # (rows, D)
            loss, hits, labeled = objective(hidden, f[i + 1 : i + 1 + rows])
            losses.append(loss)
            right, counted = right + hits, counted + labeled
        return torch.stack(losses).sum(), right, counted

    _fit([p for p in net.parameters() if p.requires_grad], samples, settings, loss_of, progress)
    return net


def fit_eagle(samples: list[Sample], head: torch.Tensor, embed: torch.Tensor, target: ModelArgs,
              settings: FitSettings, progress: Callable[[int, float, float], None]) -> EagleNet:
    """An EAGLE-1 head (one decoder layer shaped like the model's, ``fc`` with a bias) for a
    model with token embeddings ``embed (V, D)`` and head ``(V, D)``."""
    torch.manual_seed(settings.seed)
    args = eagle_layer_args({}, target)
    net = EagleNet(args, version=1, fc_bias=True)
    objective = _Objective(head, answer_vocabulary(samples), settings.ce_weight)
    longest = max(len(s.tokens) for s in samples)
    rotary = RotaryEmbedding(args.head_dim, longest, args.rope_theta, args.rope_scaling,
                             torch.device("cpu"))

    def loss_of(sample: Sample) -> tuple[torch.Tensor, int, int]:
        f = sample.features
        assert f is not None  # features() recorded every sample before the fit
        noisy = f[:-1] + (torch.rand_like(f[:-1]) - 0.5) * settings.noise
        emb = embed[torch.tensor(sample.tokens[1:])].float()  # (n-1, D): token p + 1
        # (n-1, D) each: the feature at p + 1; pass s from row s on (a chain needs s earlier
        # rows, so a conversation of n tokens has at most n - 1 passes)
        passes = net.draft_passes(emb, noisy, rotary, min(settings.draft_passes, len(emb)))
        results = [objective(hidden[s:], f[1 + s :]) for s, hidden in enumerate(passes)]
        _, hits, labeled = results[0]  # top-1 of the first draft
        total = sum(STEP_WEIGHT**s * loss for s, (loss, _, _) in enumerate(results))
        assert isinstance(total, torch.Tensor)  # a sum of one loss or more
        return total, hits, labeled

    _fit(list(net.parameters()), samples, settings, loss_of, progress)
    return net
