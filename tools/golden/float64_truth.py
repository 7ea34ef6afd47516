"""Run HF transformers code in float64 throughout.

A model moved to float64 with ``model.to(torch.float64)`` still computes part of its math in
float32: HF upcasts on purpose (RMSNorm variance, rotary tables, the eager attention softmax, the
cross-entropy logits, the MoE router softmax and aux-loss sums all name ``torch.float32`` /
``.float()``). For a float64 *truth* those upcasts would cap the precision at float32's, so inside
``Float64Mode`` every request for float32 becomes a request for float64:

  * ``dtype=torch.float32`` in any torch call (softmax, zeros, arange, ...)
  * ``tensor.to(torch.float32)`` / ``tensor.to(dtype=torch.float32)``
  * ``tensor.float()``

Integer and bool dtypes are left alone. Build the model inside the mode too, so buffers computed
at construction (the rotary inverse frequencies) are float64 from the start.
"""

import torch
from torch.overrides import TorchFunctionMode


def _promote(x):
    return torch.float64 if x is torch.float32 else x


class Float64Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        if "dtype" in kwargs:
            kwargs["dtype"] = _promote(kwargs["dtype"])
        if func is torch.Tensor.to:
            args = tuple(_promote(a) for a in args)
        return func(*args, **kwargs)


def adamw_steps(loss_fn, init, steps, lr, weight_decay, max_norm, betas, eps):
    """torch.optim.AdamW (decoupled weight decay) after clip_grad_norm_, written out in plain
    tensor ops: the independent check of the float64 run. `loss_fn(P)` maps name -> tensor to
    a scalar loss; `init` holds the starting values. Returns (final parameters, losses)."""
    names = list(init)
    P = {n: init[n].detach().clone().double() for n in names}
    m = {n: torch.zeros_like(P[n]) for n in names}
    v = {n: torch.zeros_like(P[n]) for n in names}
    b1, b2 = betas
    losses = []
    for t in range(1, steps + 1):
        for n in names:
            P[n].requires_grad_(True)
        loss = loss_fn(P)
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, [P[n] for n in names], allow_unused=True)
        grads = [torch.zeros_like(P[n]) if g is None else g for n, g in zip(names, grads)]
        total = torch.sqrt(sum((g ** 2).sum() for g in grads))
        coef = min(1.0, max_norm / (total.item() + 1e-6))
        with torch.no_grad():
            for n, g in zip(names, grads):
                g = g * coef
                p = P[n].detach()
                p.mul_(1 - lr * weight_decay)
                m[n].mul_(b1).add_(g, alpha=1 - b1)
                v[n].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v[n].sqrt() / (1 - b2 ** t) ** 0.5) + eps
                p.addcdiv_(m[n], denom, value=-lr / (1 - b1 ** t))
                P[n] = p
    return P, losses
