"""
Diagnostics of a looped GPT's loops, which train.py (kappa_R at every eval, with log_kappa) and
lab/eval_depth.py (all of them) import:

  visit alignment  kappa_R of every shared matrix: how far the R visits' gradients point the same way
                   (docs/papers.md §2: the quantity DeepLoop's exponent rests on)
  radial gradient  |<dL/dh, h>| / (||dL/dh|| ||h||) per token at every loop state h_k (docs/papers.md §1,
  fraction         Lemma 1: ~0 through an RMSNorm or LayerNorm readout)
  radial clamp     the loop states with each loop's radial growth taken out, or rescaled to loop 1's RMS:
                   what the norm growth is worth to the predictions (docs/papers.md §1)
"""
import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

CLAMPS = ('none', 'radial', 'freeze')

# -----------------------------------------------------------------------------
# visit alignment kappa_R (docs/papers.md §2: the quantity DeepLoop's exponent rests on)

def kappa(grads):
    """kappa_R = ||sum_r G_r||_F^2 / sum_r ||G_r||_F^2 of the R per-visit gradients of one shared matrix:
    R when the visits push it the same way, 1 when their pushes are orthogonal, 0 when they cancel.
    None when every G_r is zero (the matrix gets no gradient)."""
    total = sum(g.double().pow(2).sum() for g in grads)
    return float(sum(g.double() for g in grads).pow(2).sum() / total) if total > 0 else None


class PerVisit(nn.Module):
    """Stands in for one shared block during a diagnostic pass: visit r (the r-th loop) runs the block with
    its own copy of the weights, so the copies' gradients are the per-visit gradients G_r."""

    def __init__(self, block, n_loop):
        super().__init__()
        self.block, self.visit = block, 0
        self.copies = [{name: p.detach().clone().requires_grad_(True) for name, p in block.named_parameters()}
                       for _ in range(n_loop)]

    def forward(self, *args):
        params = self.copies[self.visit]
        self.visit += 1
        return torch.func.functional_call(self.block, params, args)


def visit_gradients(model, X, Y):
    """{'h.<j>.<param>': [G_1, ..., G_R]} for every matrix of the K shared blocks: the gradients of the
    training loss (model.loss) on batch (X, Y) through each of the R visits. Their sum is the model's own
    gradient. The model is left as it was."""
    blocks = model.transformer.h
    per_visit = [PerVisit(block, model.config.n_loop) for block in blocks]
    model.transformer.h = nn.ModuleList(per_visit)  # the loop now calls the stand-ins
    try:
        with torch.enable_grad():
            loss = model.loss(model.run(X), Y)
            names = [(j, name) for j, pv in enumerate(per_visit)
                     for name, w in pv.copies[0].items() if w.dim() == 2]
            flat = [per_visit[j].copies[r][n] for j, n in names for r in range(model.config.n_loop)]
            grads = torch.autograd.grad(loss, flat, allow_unused=True)
    finally:
        model.transformer.h = blocks
    R = model.config.n_loop
    zero = lambda t, g: torch.zeros_like(t) if g is None else g
    return {f'h.{j}.{n}': [zero(flat[i * R + r], grads[i * R + r]) for r in range(R)]
            for i, (j, n) in enumerate(names)}


def visit_alignment(model, X, Y):
    """kappa_R of every shared matrix on batch (X, Y), and their mean (matrices with no gradient skipped)."""
    per_matrix = {name: kappa(grads) for name, grads in visit_gradients(model, X, Y).items()}
    values = [v for v in per_matrix.values() if v is not None]
    return dict(per_matrix=per_matrix, mean=sum(values) / len(values) if values else None)

# -----------------------------------------------------------------------------
# radial gradient fraction (docs/papers.md §1, Lemma 1)

def radial_fraction(g, h):
    """Mean over tokens of |<g, h>| / (||g|| ||h||); g, h (B, T, C)."""
    g, h = g.detach().double(), h.detach().double()
    cos = (g * h).sum(-1).abs() / (g.norm(dim=-1) * h.norm(dim=-1)).clamp(min=1e-300)
    return float(cos.mean())


def radial_gradient(model, X, Y, batch_size):
    """Radial gradient fraction at every loop state h_k, averaged over batches:
    'readout': of exit k's CE through its own readout only (docs/papers.md §1 Lemma 1: 0 for a
    scale-invariant readout); 'total': of the whole training loss (model.loss: weighted exit CEs + norm
    penalty), through the readout, all later loops and the penalty."""
    R = model.config.n_loop
    readout_frac, total_frac, n = np.zeros(R), np.zeros(R), 0
    for i in range(0, X.size(0), batch_size):
        idx, tgt = X[i:i + batch_size], Y[i:i + batch_size]
        with torch.enable_grad():
            out = model.run(idx)
            states = out.states
            # with backprop_loops the early states have no graph: no gradient reaches them (fraction 0)
            live = [h for h in states if h.requires_grad]
            live_grads = iter(torch.autograd.grad(model.loss(out, tgt), live, allow_unused=True))
            grads = [next(live_grads) if h.requires_grad else None for h in states]
            for k, (h, g) in enumerate(zip(states, grads)):
                total_frac[k] += radial_fraction(g, h) if g is not None else 0.0
                hk = h.detach().requires_grad_(True)
                gk, = torch.autograd.grad(F.cross_entropy(model.readout(hk, k + 1).float().flatten(0, 1),
                                                          tgt.reshape(-1)), hk)
                readout_frac[k] += radial_fraction(gk, hk)
        n += 1
    return (readout_frac / n).tolist(), (total_frac / n).tolist()

# -----------------------------------------------------------------------------
# the radial clamp: the loop states with each loop's radial growth taken out (docs/papers.md §1)

def remove_radial(h_new, h_prev):
    """Clamp (i): h_new - a u with u = h_prev / rms(h_prev), a = mean_c(u_c (h_new - h_prev)_c), per token:
    the update keeps only its part orthogonal to h_prev."""
    u = h_prev / h_prev.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-12)  # (B, T, C), unit RMS
    a = (u * (h_new - h_prev)).mean(-1, keepdim=True)                          # (B, T, 1)
    return h_new - a * u


def rescale_rms(h, ref):
    """Clamp (ii), "freeze to loop 1": h rescaled, per token, to the RMS of ref."""
    rms = lambda t: t.pow(2).mean(-1, keepdim=True).sqrt()
    return h * (rms(ref) / rms(h).clamp(min=1e-12))


def clamped_states(model, idx, n_loop=None, clamp='none'):
    """The loop states h_1..h_R of idx, with an inference-time clamp from loop 2 on (loop 1 is left alone:
    its 'update' maps the embedding into the loop). clamp='radial': each loop's update h_k - h_{k-1} loses
    its radial part along h_{k-1}, the previous loop's state before the inter-loop norm and injection (as the
    reference code measures it); clamp='freeze': each state is rescaled to loop 1's
    per-token RMS. The clamped state is what is read out and what enters the next loop."""
    assert clamp in CLAMPS, f"clamp={clamp!r}: choose one of {', '.join(CLAMPS)}"
    R = model.config.n_loop if n_loop is None else n_loop
    h = e = model.begin(idx)
    states = []
    for k in range(1, R + 1):  # one loop at a time: the clamped h_k is what loop k+1 reads
        h_prev, h = h, model.loops(h, e, [k]).states[0]
        if k > 1 and clamp == 'radial':
            h = remove_radial(h, h_prev)
        elif k > 1 and clamp == 'freeze':
            h = rescale_rms(h, states[0])
        states.append(h)
    return states
