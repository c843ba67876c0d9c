"""The engine outside training (part of tierlm.runtime.engine.Engine): the held-out loss and the
next token's logits, one forward streaming the segments as the step does, with dropout off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tierlm.data.batch import inputs_and_targets, position_ids, trained_targets
from tierlm.runtime.schedule import Action


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode for a forward outside training (held-out loss, sampling), as the
    reference trainer's `model.eval()`: no dropout in the held-out loss, and nothing drawn from
    the training random stream (a resumed or reference run would draw other masks after)."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


class Evaluation:
    """The Engine's held-out loss and sampling forward."""

    def _streamed_head(
        self, ids: torch.Tensor, read, positions: torch.Tensor | None = None
    ) -> object:
        """One forward of `ids` outside training, streaming the segments as the step does:
        `read(views, hn)` is called under autocast with the head's parameter views and its
        normed input (B, T, D); its result is returned. `positions`: see tierlm.data.batch."""
        self.synchronize()
        n = len(self.states)
        actions = [Action("fwd", s, (0,)) for s in range(n - 1)] + [Action("head", n - 1, (0,))]
        self.cache.begin([self._needs(a) for a in actions])
        h, ctx = ids, self.adapter.embed_context(ids, positions)
        with self._outside_training():
            for k, a in enumerate(actions):
                st = self.states[a.seg]
                w = self._weights(k, a.seg)
                w = self._trained_flat(a.seg, w)
                with self.opts.autocast():
                    if a.kind == "fwd":
                        h = st.seg.forward(self._param_views(a.seg, w), h, ctx)
                        if a.seg == 0:
                            ctx = self.adapter.context(ids, h, positions)
                    else:
                        views = self._views(k, a.seg, w)
                        out = read(views, st.seg.forward(views, h, ctx))
        self.cache.drop_all()
        return out

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean token loss of one (B, T+1) batch, streaming weights as the step does."""
        ids, targets = (t.to(self.device) for t in inputs_and_targets(batch))
        head = self.states[-1].seg
        t = targets.flatten()
        step = self.chunk_tokens

        def loss_sum(views, hn) -> float:
            hn = hn.flatten(0, 1)  # (B*T, D)
            return sum(
                F.cross_entropy(head.project(views, hn[c : c + step]).float(), t[c : c + step],
                                reduction="sum").item()
                for c in range(0, t.numel(), step)
            )

        positions = _to(position_ids(batch), self.device)
        return self._streamed_head(ids, loss_sum, positions) / trained_targets(batch)

    @torch.no_grad()
    def next_token_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(V,) fp32 logits after the last token of `ids` (1, T), projecting only the last
        position (sampling never builds the whole model)."""
        head = self.states[-1].seg
        return self._streamed_head(
            ids.to(self.device), lambda views, hn: head.project(views, hn[0, -1:])[0].float()
        )


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
