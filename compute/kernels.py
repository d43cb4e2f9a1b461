"""
Speed kernels: the model's costliest formulas computed fast, outside the reading path. model.py
calls each where its plain formula stands in a comment; the tests check that they compute it.

    attention(q, k, v, causal, impl)    softmax(q k^T / sqrt(hs) + mask) v, by three paths (one result)
    LinearCrossEntropy.apply(W, y, w, zs)   sum_k w_k CE(z_k W^T, y), no (B, T, V) logits kept alive
    cross_entropy_chunked(h, W, y)      CE(h W^T, y) without grad, in row chunks (diagnostics)
    token_ce(h, W, y)                   per-token CE with a gradient, chunks recomputed in backward
    moe(x, idx, w, c_fc, c_proj, act)   sum_j w_tj expert_j(x_t) over each token's k experts, grouped
"""
import math

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from compute.hardware import attention_path


def attention(q, k, v, causal, impl='auto', dropout_p=0.0, keep=None):
    """softmax(q k^T / sqrt(hs) + mask) v, q (B, nh, Tq, hs), k and v (B, nh, Tk, hs).
    Three paths give one result: 'sdpa' (flash where available), 'math' (its reference kernel)
    and 'explicit'; 'auto' takes the fastest here (hardware.py). causal: query i is position
    Tk - Tq + i and sees keys 0..Tk - Tq + i (the queries are the last Tq of the keys). keep
    (B, 1, 1, Tk) bool, for one query a row (Tq = 1): the keys each row sees (rows that stand at
    their own positions, decoding/batching.py)."""
    if keep is not None:
        assert q.size(2) == 1, "a key mask per row is for one query a row"
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    impl = attention_path(impl, q.device.type, q.dtype, k.size(-2))
    B, nh, Tq, hs = q.shape
    Tk = k.size(-2)
    assert Tq <= Tk, f"{Tq} queries but only {Tk} keys: the queries must be the last of the keys"
    if impl in ('sdpa', 'math'):
        # is_causal aligns its mask top-left, right only when Tq == Tk (training, a prompt at 0);
        # new tokens after a cached history (Tq < Tk) need it bottom-right: a boolean mask
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq) \
            if causal and Tq < Tk else None
        args = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None)
        if impl == 'math':
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, **args)
        return F.scaled_dot_product_attention(q, k, v, **args)
    # scores / sqrt(hs) + mask in one batched matmul; the mask is -inf above the diagonal that
    # starts at key Tk - Tq (the main one when Tq == Tk)
    mask = torch.full((Tq, Tk), -math.inf if causal else 0.0, dtype=q.dtype, device=q.device)
    att = torch.baddbmm(mask.triu(1 + Tk - Tq), q.reshape(B * nh, Tq, hs),
                        k.reshape(B * nh, Tk, hs).transpose(1, 2), alpha=1.0 / math.sqrt(hs))
    att = F.softmax(att, dim=-1)  # (B*nh, Tq, Tk)
    att = F.dropout(att, dropout_p) if dropout_p > 0 else att
    return (att @ v.reshape(B * nh, Tk, hs)).view(B, nh, Tq, hs)


def ce_chunk_rows(V, device):
    # rows per chunk of the readout: the (rows, V) fp32 logits take ~16 MiB on a CPU and ~1 GiB
    # on a GPU, where a few large matmuls keep the head fast
    return max(1, (2 ** 28 if device.type == 'cuda' else 2 ** 22) // V)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_k w_k * CE(h_k @ W^T, targets) without keeping any (B, T, V) logits alive.

    Per-loop supervision reads out R states, and autograd would keep R logit tensors of B*T*V
    floats for the backward pass (the largest tensors in the model at GPT-2's vocabulary). Here
    the forward pass walks over row chunks and computes each chunk's logits, loss and gradient
    (softmax - onehot) at once, keeping only dL/dh (B, T, C) and one dL/dW (V, C). The backward
    pass only scales them. The flops are a plain head's; the memory of R exits about one's.
    """

    @staticmethod
    def forward(ctx, weight, targets, exit_weights, xs):
        # xs (E, B, T, C): the readout inputs of the E supervised exits, one tensor (a list would
        # break torch.compile's graph); exit_weights: E floats
        V, C = weight.shape
        tgt = targets.reshape(-1)
        valid = tgt != -1
        tgt = tgt.clamp(min=0)
        n = valid.sum().clamp(min=1).float()
        rows = ce_chunk_rows(V, weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=weight.device)
        grad_w = torch.zeros(V, C, dtype=torch.float32, device=weight.device)
        grad_xs = torch.empty_like(xs)
        for e, wk in enumerate(exit_weights):
            x, grad_x = xs[e].reshape(-1, C), grad_xs[e].view(-1, C)
            for i in range(0, x.size(0), rows):
                xc, tc, vc = x[i:i + rows], tgt[i:i + rows], valid[i:i + rows]
                logits = (xc @ weight.t()).float()                        # (rows, V)
                logp = torch.log_softmax(logits, dim=-1)
                loss = loss - wk * (logp.gather(1, tc[:, None]).squeeze(1) * vc).sum()
                del logp
                # softmax has its own kernel: exp() of shifted logits that underflow (common at
                # early exits) is ~10x slower on CPUs
                g = torch.softmax(logits, dim=-1)                         # (rows, V)
                del logits
                g[torch.arange(g.size(0), device=g.device), tc] -= 1.0    # p - onehot
                g *= (vc * (wk / n))[:, None]
                g = g.to(xc.dtype)
                grad_x[i:i + rows] = g @ weight.to(xc.dtype)
                grad_w += g.t() @ xc
        ctx.save_for_backward(grad_w.to(weight.dtype), grad_xs)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_w, grad_xs = ctx.saved_tensors
        return grad_w * grad_out, None, None, grad_xs * grad_out


def cross_entropy_chunked(h, weight, targets):
    # CE(h @ W^T, targets) without grad, in the same row chunks (diagnostics at every exit)
    V, C = weight.shape
    x, tgt = h.reshape(-1, C), targets.reshape(-1)
    rows = ce_chunk_rows(V, h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for i in range(0, x.size(0), rows):
        logits = (x[i:i + rows] @ weight.t()).float()
        total += F.cross_entropy(logits, tgt[i:i + rows], ignore_index=-1, reduction='sum')
    return total / (tgt != -1).sum().clamp(min=1)


def token_ce(h, weight, targets):
    # per-token CE (B*T,) of h @ W^T with a gradient, for losses that weight every token's CE
    # (the learned gate). Each chunk's logits are recomputed in the backward pass (checkpoint),
    # so no (B*T, V) tensor outlives its chunk.
    V, C = weight.shape
    x, tgt = h.reshape(-1, C), targets.reshape(-1)
    rows = ce_chunk_rows(V, h.device)
    ce = lambda xc, tc: F.cross_entropy((xc @ weight.t()).float(), tc, ignore_index=-1,
                                        reduction='none')
    return torch.cat([checkpoint(ce, x[i:i + rows], tgt[i:i + rows], use_reentrant=False)
                      for i in range(0, x.size(0), rows)])


def moe(x, idx, w, c_fc, c_proj, act):
    """y_t = sum_j w_tj expert_{idx_tj}(x_t), expert_i(x) = act(x c_fc[i]) c_proj[i]; x (N, C), idx and
    w (N, k), c_fc (E, C, F), c_proj (E, H, C). The N k (token, expert) pairs are sorted by expert, so that
    each expert's rows are one block of a grouped matmul, then added back to their tokens. Equal to
    moe_loop below (the tests), without its E boolean scans of the routing."""
    N, k = idx.shape
    dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x, c_fc, c_proj = x.to(dt), c_fc.to(dt), c_proj.to(dt)  # grouped_mm is not autocast: cast by hand
    flat = idx.flatten()
    order = flat.argsort(stable=True)                   # the pairs grouped by expert
    tok = order // k                                    # each pair's token
    counts = flat.new_zeros(c_fc.size(0)).scatter_add_(0, flat, torch.ones_like(flat))  # rows per expert
    xs = x[tok]                                         # (N k, C)
    if grouped_mm_runs(xs, c_fc, c_proj):
        offs = counts.cumsum(0).to(torch.int32)         # where each expert's rows end
        h = F.grouped_mm(act(F.grouped_mm(xs, c_fc, offs=offs)), c_proj, offs=offs)
    else:
        h = experts_split(xs, counts, c_fc, c_proj, act)
    return torch.zeros_like(x).index_add(0, tok, h * w.flatten()[order, None].to(dt))


@torch.compiler.disable  # data-dependent splits: run eagerly, rather than recompile for every count
def experts_split(xs, counts, c_fc, c_proj, act):
    # one matmul pair per expert, over its contiguous rows
    return torch.cat([act(a @ c_fc[i]) @ c_proj[i] for i, a in enumerate(xs.split(counts.tolist()))])


def grouped_mm_runs(xs, c_fc, c_proj):
    # F.grouped_mm wants rows whose byte strides are multiples of 16, and bf16 on a Hopper+ GPU or under
    # torch.compile (its meta kernel refuses float32, torch 2.13), where float32 takes the loop instead
    widths = (xs.size(-1), c_fc.size(-1), c_proj.size(-2), c_proj.size(-1))  # C, F, H, C
    aligned = all(n * xs.element_size() % 16 == 0 for n in widths)
    if xs.device.type == 'cuda' or torch.compiler.is_compiling():
        hopper = xs.device.type != 'cuda' or torch.cuda.get_device_capability(xs.device)[0] >= 9
        return aligned and xs.dtype == torch.bfloat16 and hopper
    return aligned and xs.device.type == 'cpu'


def moe_loop(x, idx, w, c_fc, c_proj, act):
    """The readable form of moe(): for each expert, the tokens that chose it, through it, weighted, added
    back. The reference the tests hold moe() to; E boolean scans, so slower."""
    y = torch.zeros_like(x)
    for i in range(c_fc.size(0)):
        tok, slot = (idx == i).nonzero(as_tuple=True)  # the tokens that chose expert i, and in which slot
        y = y.index_add(0, tok, w[tok, slot, None] * (act(x[tok] @ c_fc[i]) @ c_proj[i]))
    return y
