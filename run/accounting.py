"""
Accounting, as nanoGPT does it in its model.py: what a looped model costs.

    param_counts(model)              (N_once, N_rec): the iso-depth law's parameter split (docs/isodepth.md)
    flops_per_token(model, T, R)     training FLOPs per token: 6 per weight use, plus attention
    active_params(module)            the parameters one token uses (k of E experts, docs/papers.md §5)
    estimate_mfu(model, n, dt)       model FLOPs utilisation against the device's bf16 peak

Every loop counts: a shared layer run R times costs R times its FLOPs, though its parameters count once.
"""
import torch

from compute.hardware import peak_flops
from model import MoE


def param_counts(model):
    # (N_once, N_rec) as the iso-depth scaling law counts them (docs/isodepth.md): N_once the blocks
    # run once (prelude, coda) and the norms outside the loop, N_rec the K shared blocks, the inter-loop
    # norm and the concat adapter (2 C^2, which the paper counts with the looped block). The embedding,
    # positions, LM head and exit gate are in neither: N is the law's non-embedding count
    t = model.transformer
    n = lambda *parts: sum(p.numel() for part in parts for p in part.parameters())
    loop_norm = () if t.ln_loop is t.ln_out else (t.ln_loop,)  # 'readout': the readout norm, once
    rec = (t.h, *loop_norm, *(t[part] for part in ('adapter', 'lanes') if part in t))
    return n(t.prelude, t.coda, t.ln_emb, t.ln_out), n(*rec)


def flops_per_token(model, T=None, n_loop=None):
    # training flops per token: forward + backward = 6 per weight use (PaLM appendix B)
    cfg = model.config
    T = cfg.block_size if T is None else T
    R = cfg.n_loop if n_loop is None else n_loop
    n_exits = sum(w > 0 for w in model.exit_weights(R))
    # truncated backprop (§4): loops 1..R-b build no graph, so they cost the forward pass only,
    # 2 flops per weight use and a third of the attention's 12 C T (the adapter before loop k is loop k's)
    free = R - cfg.backprop_loops if 0 < cfg.backprop_loops < R else 0
    # the K layers run every loop, the coda and head at every supervised exit, the prelude
    # once, the injection adapter before every loop after the first
    L = cfg.hyper_lanes  # the lanes' mixing: (L^2 + 2L) C per loop, as the paper counts it (§3)
    adapter = 2 * cfg.n_embd ** 2 if cfg.injection in ('concat', 'iso') else (L * L + 2 * L) * cfg.n_embd
    first = cfg.injection != 'concat'  # iso's W and the lanes act before loop 1 too
    # weights in use: a token's k experts of E and the router (active_params, §5)
    head = active_params(model.transformer.coda) + cfg.vocab_size * cfg.n_embd
    loops = lambda n: active_params(model.transformer.h) * n + adapter * max(n - 1 + first, 0)  # loops 1..n
    weights = loops(R) - loops(free) + active_params(model.transformer.prelude)
    visits = cfg.n_layer * (R - free) + cfg.n_prelude + cfg.n_coda * n_exits
    attn = 12 * visits * cfg.n_embd * T + 4 * cfg.n_layer * free * cfg.n_embd * T  # QK^T and AV per visit
    return 6 * (weights + head * n_exits) + 2 * loops(free) + attn


def active_params(module):
    # the parameters one token uses: k of an MoE layer's E stacked experts (§5), all of everything else
    share = lambda m, p: m.top_k / len(p) if isinstance(m, MoE) and p.dim() == 3 else 1
    return round(sum(p.numel() * share(m, p) for m in module.modules() for p in m.parameters(recurse=False)))


def estimate_mfu(model, fwdbwd_per_iter, dt, peak=None, T=None):
    # model flops utilisation of fwdbwd_per_iter sequences in dt seconds against peak FLOP/s;
    # by default the bf16 peak of this CUDA device (hardware.peak_flops; None if unknown)
    T = model.config.block_size if T is None else T
    if peak is None and torch.cuda.is_available():
        peak = peak_flops(torch.cuda.get_device_name())
    if peak is None:
        return None
    return flops_per_token(model, T) * T * fwdbwd_per_iter / dt / peak
