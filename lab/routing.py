"""
Routing divergence of a Looped-MoE checkpoint: does a physical layer send a token to other experts on
each loop, and by more than chance? (docs/papers.md §5: the paper's overlap histograms, and the chance
level that decides what they mean.)

    python lab/routing.py out-looped-moe                      # a folder holding ckpt.pt (or the file itself)
    python lab/routing.py out-looped-moe --batches=64 --json=routing.json

For every physical layer h[j] and pair of loops (a, b), over the tokens of val batches, with S_a the top-k
set a token gets on loop a:
  overlap   the histogram of o = |S_a ∩ S_b| (o = 0: disjoint, o = k: identical) and the mean Jaccard
            o / (2k - o); beside them the same under independent routing with each loop's own usage
            (exact, from the two loops' empirical distributions of top-k sets) and under independent
            uniform routing (hypergeometric: for top-2 of 8, 53.6 % disjoint, 3.6 % identical)
  kappa     (mean o - o_ind) / (k - o_ind), o_ind the chance mean: 0 independent, 1 identical routing
  kappa|token  the same against the chance agreement within each input token (the token of X at that
            position): o_ind|token = sum_t (n_t / N) o_ind(t), o_ind(t) from the two loops' routing of the
            n_t tokens t alone. A router that reads the token routes a token alike on every loop by chance;
            this kappa counts only agreement beyond it (0: the token explains all of it)
  JS        Jensen-Shannon divergence of the two loops' expert usage, in bits (0 = same usage, 1 = no
            expert shared): experts specialised by loop
and per layer: distinct experts per token over its R loops beside chance (E (1 - (1 - k/E)^R) uniform,
sum_e 1 - prod_r (1 - p_r(e)) from the loops' marginals), and the load max/mean of every visit
(1 = balanced, E/k = every token on the same k experts). It ends with one line: the loops route alike,
apart, or as chance would (mean kappa beyond +-0.1), and a warning per layer whose load has collapsed.
The report goes to stdout, the tables to JSON (default <out_dir>/routing.json).
"""
import itertools
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from configurator import Parser, die
from run import checkpoint
from eval_depth import open_checkpoint, val_windows, write_json
from prepare import load_meta

# -----------------------------------------------------------------------------
# metrics of top-k index tensors idx (N, k): token i was sent to experts idx[i] (k distinct of E)

def members(idx, E):
    """(N, E) 0/1 float: row i marks token i's top-k set S_i."""
    return torch.zeros(idx.size(0), E, dtype=torch.float64).scatter_(1, idx.cpu(), 1.0)


def overlap_hist(a, b, E):
    """P(o = |S_a ∩ S_b|) over the tokens, o = 0..k (k + 1,): the same tokens on loops a and b."""
    o = (members(a, E) * members(b, E)).sum(1).long()
    return torch.bincount(o, minlength=a.size(1) + 1).double() / a.size(0)


def set_dist(idx, E):
    """The empirical distribution of top-k sets: their (M, E) membership rows and (M,) frequencies."""
    sets, counts = torch.unique(members(idx, E), dim=0, return_counts=True)
    return sets, counts.double() / idx.size(0)


def chance_hist(a, b, E, chunk=4096):
    """P(o) if loops a and b routed independently, each with its own distribution of top-k sets:
    sum over set pairs Pa(S) Pb(S') [|S ∩ S'| = o]. Exact; costs (distinct sets of a) x (those of b)."""
    (sa, pa), (sb, pb) = set_dist(a, E), set_dist(b, E)
    hist = torch.zeros(a.size(1) + 1, dtype=torch.float64)
    for i in range(0, len(sb), chunk):
        o = (sa @ sb[i:i + chunk].T).round().long()  # (Ma, chunk) overlaps of every pair of sets
        hist += torch.bincount(o.flatten(), (pa[:, None] * pb[None, i:i + chunk]).flatten(), len(hist))
    return hist


def hypergeom(E, k):
    """P(o) under independent uniform routing: C(k, o) C(E - k, k - o) / C(E, k), o = 0..k."""
    return torch.tensor([math.comb(k, o) * math.comb(E - k, k - o) / math.comb(E, k) for o in range(k + 1)],
                        dtype=torch.float64)


def mean_overlap(hist):
    return sum(o * p for o, p in enumerate(hist.tolist()))


def jaccard(hist):
    """Mean Jaccard |S ∩ S'| / |S ∪ S'| = o / (2k - o) of k-sets: a function of o, so of its histogram."""
    k = len(hist) - 1
    return sum(p * o / (2 * k - o) for o, p in enumerate(hist.tolist()))


def kappa(hist, chance):
    """Chance-corrected agreement (mean o - o_ind) / (k - o_ind): 0 as independent, 1 identical routing.
    None where chance alone already gives o = k (both loops send every token to one set)."""
    k, o_ind = len(hist) - 1, mean_overlap(chance)
    return None if k - o_ind < 1e-9 else (mean_overlap(hist) - o_ind) / (k - o_ind)


def kappa_given_token(a, b, tokens, E):
    """(o_ind|token, kappa|token) of loops a and b, tokens (N,) the input token of each row: kappa against
    the chance agreement within each input token t, sum_t (n_t / N) sum_e P_a(e in S | t) P_b(e in S | t)
    (the chance mean of independent routing, docs/papers.md §5, computed on the n_t tokens t alone).
    kappa|token is None where that chance alone already gives o = k, as kappa is: every input token goes to
    one set on both loops, so the token decides the routing and no agreement is left to explain. Like
    kappa's chance, it pairs each token with itself too: under independent routing that costs nothing, but
    agreement beyond chance moves it toward the observed overlap by about (distinct input tokens) / N of
    the gap, 0.4 % for 65 characters over 16,384 tokens."""
    k, tokens = a.size(1), tokens.flatten().cpu().long()
    assert tokens.numel() == a.size(0), f"{tokens.numel()} input tokens for {a.size(0)} routed rows"
    V = int(tokens.max()) + 1
    n = torch.bincount(tokens, minlength=V).double()
    ma, mb = members(a, E), members(b, E)
    pa = torch.zeros(V, E, dtype=torch.float64).index_add_(0, tokens, ma)  # n_t P_a(e in S | t)
    pb = torch.zeros(V, E, dtype=torch.float64).index_add_(0, tokens, mb)
    seen = n > 0
    o_ind = ((pa[seen] * pb[seen]).sum(1) / n[seen]).sum().item() / tokens.numel()
    observed = (ma * mb).sum(1).mean().item()
    return o_ind, None if k - o_ind < 1e-9 else (observed - o_ind) / (k - o_ind)


def usage(idx, E):
    """(E,) the fraction of routed slots each expert took (sums to 1); k x usage = P(e in S)."""
    return torch.bincount(idx.flatten().cpu(), minlength=E).double() / idx.numel()


def js_divergence(a, b, E):
    """Jensen-Shannon divergence of loops a and b's expert usage, in bits: 0 same usage, 1 disjoint."""
    p, q = usage(a, E), usage(b, E)
    m = (p + q) / 2
    p, q, m = p[m > 0], q[m > 0], m[m > 0]
    kl = lambda x: torch.xlogy(x, x / m).sum().item() / math.log(2)
    return (kl(p) + kl(q)) / 2


def distinct_experts(idxs, E):
    """Mean over tokens of |S_1 ∪ ... ∪ S_R|, idxs the R loops' (N, k) choices."""
    return torch.stack([members(x, E) for x in idxs]).amax(0).sum(1).mean().item()


def distinct_chance(idxs, E):
    """Chance distinct experts over R loops: from the loops' own marginals if independent,
    sum_e 1 - prod_r (1 - P_r(e in S)), and uniform, E (1 - (1 - k/E)^R)."""
    k, R = idxs[0].size(1), len(idxs)
    miss = torch.stack([1 - k * usage(x, E) for x in idxs]).prod(0)
    return (1 - miss).sum().item(), E * (1 - (1 - k / E) ** R)


def load_ratio(idx, E):
    """Max / mean tokens per expert in one visit: 1 balanced, E/k all tokens on the same k experts."""
    counts = torch.bincount(idx.flatten().cpu(), minlength=E).double()
    return (counts.max() / counts.mean()).item()


def divergence(routes, n_expert, top_k, tokens=None):
    """Per physical layer and pair of loops, every metric above. routes {(j, r): idx (N, k)}: layer j's
    choice on loop r, the same N tokens in the same order for every r; tokens (N,): their input token ids
    in that order, for kappa|token (None: not measured, null in the JSON). Returns a JSON-able dict."""
    E, k = n_expert, top_k
    uniform = hypergeom(E, k)
    res = dict(n_expert=E, top_k=k, layers=[],
               uniform=dict(overlap=uniform.tolist(), jaccard=jaccard(uniform)))
    for j in sorted({j for j, _ in routes}):
        loops = sorted(r for jj, r in routes if jj == j)
        idxs = [routes[j, r] for r in loops]
        for r, x in zip(loops, idxs):
            assert x.shape == (idxs[0].size(0), k), \
                f"layer {j} loop {r}: idx {tuple(x.shape)}, expected (N, {k})"
        pairs = []
        for (a, ia), (b, ib) in itertools.combinations(zip(loops, idxs), 2):
            hist, chance = overlap_hist(ia, ib, E), chance_hist(ia, ib, E)
            o_tok, k_tok = (None, None) if tokens is None else kappa_given_token(ia, ib, tokens, E)
            pairs.append(dict(loops=[a, b], overlap=hist.tolist(), chance=chance.tolist(),
                              mean_overlap=mean_overlap(hist), o_ind=mean_overlap(chance),
                              jaccard=jaccard(hist),
                              jaccard_chance=jaccard(chance), kappa=kappa(hist, chance),
                              o_ind_token=o_tok, kappa_given_token=k_tok, js_bits=js_divergence(ia, ib, E)))
        marg, unif = distinct_chance(idxs, E)
        res['layers'].append(dict(layer=j, loops=loops, tokens=idxs[0].size(0), pairs=pairs,
                                  distinct=distinct_experts(idxs, E), distinct_chance=marg,
                                  distinct_uniform=unif, load=[load_ratio(x, E) for x in idxs],
                                  usage=[usage(x, E).tolist() for x in idxs]))
    return res

# -----------------------------------------------------------------------------
# the checkpoint's routing on val batches

@torch.no_grad()
def collect(model, X, batch_size):
    """({(j, r): idx (N, k)} of every looped layer h[j] on loop r, tokens (N,)): N the tokens of X (n, T)
    row-major, tokens their ids in that order (what kappa|token conditions on)."""
    model.eval()
    routes = {}
    K = model.config.n_layer
    for i in range(0, X.size(0), batch_size):
        out = model.run(X[i:i + batch_size])  # its routes: loop 1's K layers, then loop 2's, ...
        for v, route in enumerate(out.routes):
            routes.setdefault((v % K, v // K + 1), []).append(route.idx.cpu())
    return {key: torch.cat(v) for key, v in routes.items()}, X.reshape(-1).cpu()


def print_report(res, title):
    E, k = res['n_expert'], res['top_k']
    pct = lambda h: '/'.join(f"{100 * p:.1f}" for p in h)
    print(title)
    print(f"overlap o = |S_a ∩ S_b| of the top-{k} sets, % of tokens at o = "
          f"{'/'.join(map(str, range(k + 1)))}; "
          f"chance: independent routing, each loop with its own distribution of sets")
    print(f"  uniform chance (hypergeometric): {pct(res['uniform']['overlap'])}, Jaccard "
          f"{res['uniform']['jaccard']:.3f}. kappa: 0 = chance, 1 = identical routing; kappa|token: the same "
          f"against chance within each input token. JS in bits: 0 = same expert usage, 1 = disjoint")
    for L in res['layers']:
        print(f"layer h[{L['layer']}]: {L['tokens']:,} tokens, top-{k} of {E} experts, loops "
              f"{L['loops'][0]}..{L['loops'][-1]}")
        w = 6 * k + 6
        print(f"  {'loops':<7}{'overlap %':<{w}}{'chance %':<{w}}{'Jaccard (chance)':<18}"
              f"{'kappa':>7}{'kappa|token':>13}{'JS bits':>9}")
        for p in L['pairs']:
            kap, tok = ('n/a' if x is None else f"{x:.3f}" for x in (p['kappa'], p.get('kappa_given_token')))
            print(f"  {'{}-{}'.format(*p['loops']):<7}{pct(p['overlap']):<{w}}{pct(p['chance']):<{w}}"
                  f"{'{:.3f} ({:.3f})'.format(p['jaccard'], p['jaccard_chance']):<18}{kap:>7}{tok:>13}"
                  f"{p['js_bits']:>9.3f}")
        print(f"  distinct experts per token over {len(L['loops'])} loops: {L['distinct']:.2f} (chance "
              f"{L['distinct_chance']:.2f} from the loops' marginals, {L['distinct_uniform']:.2f} uniform)")
        print(f"  load max/mean per visit (1 = balanced, {E / k:.2f} = collapse onto {k} experts): "
              + ', '.join(f"loop {r} {x:.2f}" for r, x in zip(L['loops'], L['load'])))


AGREE = 0.1      # mean kappa beyond +-this: the loops route alike (> 0) or apart (< 0), else as chance
COLLAPSED = 0.9  # a visit's load max/mean at this share of E/k (every token on the same k experts) or more


def summary(res):
    """The report's last lines: whether the loops route alike, apart, or as chance would (mean kappa
    over every (layer, loop pair)), and a warning for each layer whose load has collapsed, since
    kappa then compares routings that have almost no choice left."""
    E, k = res['n_expert'], res['top_k']
    kappas = [p['kappa'] for L in res['layers'] for p in L['pairs'] if p['kappa'] is not None]
    if not kappas:
        lines = ["summary: kappa is undefined in every pair (chance alone gives identical sets)"]
    else:
        m = sum(kappas) / len(kappas)
        word = ('the loops route alike: more agreement than chance' if m > AGREE else
                'the loops route apart: less agreement than chance' if m < -AGREE else
                'the loops route as chance would')
        given = [p['kappa_given_token'] for L in res['layers'] for p in L['pairs']
                 if p.get('kappa_given_token') is not None]
        token = (f"; mean kappa|token {sum(given) / len(given):+.3f}, the agreement beyond what the input "
                 f"token explains" if given else '')
        lines = [f"summary: {word} (mean kappa {m:+.3f} over {len(kappas)} layer/loop pairs; "
                 f"|kappa| <= {AGREE} counts as chance{token})"]
    for L in res['layers']:
        worst = max(L['load'])
        if worst >= COLLAPSED * E / k:
            lines.append(f"warning: layer h[{L['layer']}] has collapsed onto about {k} experts (load "
                         f"max/mean {worst:.2f}, {E / k:.2f} = every token on the same {k}): its kappas mean "
                         f"little")
    return lines


def main(argv=None):
    ap = Parser('lab/routing.py', __doc__)
    ap.add_argument('out_dir', help='a folder holding ckpt.pt, or the checkpoint file')
    ap.add_argument('--data_dir', default=None, help="default: data/<the checkpoint's dataset>")
    ap.add_argument('--batches', type=int, default=32, help='val batches of batch_size windows')
    ap.add_argument('--batch_size', type=int, default=16)
    ap.add_argument('--device', default='auto', help='auto | cpu | cuda | cuda:N')
    ap.add_argument('--json', default=None, help='output file; default <out_dir>/routing.json')
    args = ap.parse_args(argv)
    for name in ('batches', 'batch_size'):
        if getattr(args, name) < 1:
            die(f"--{name}={getattr(args, name)}: must be >= 1")
    device, ckpt_path, ckpt = open_checkpoint(args.out_dir, args.device, 'routing')
    E = ckpt['model_args'].get('n_expert', 0)
    if not E:
        die(f"{ckpt_path} has no experts: n_expert = 0 (a dense model; routing needs a Looped-MoE "
            f"checkpoint)")
    model = checkpoint.build_model(ckpt).to(device)
    data_dir = args.data_dir or os.path.join('data', ckpt.get('dataset', ''))
    X, _ = val_windows(data_dir, load_meta(data_dir), model.config.block_size, args.batches * args.batch_size)
    t0 = time.time()
    routes, tokens = collect(model, X.to(device), args.batch_size)
    res = divergence(routes, E, model.config.top_k, tokens)
    res.update(checkpoint=ckpt_path, iter_num=ckpt.get('iter_num'), dataset=ckpt.get('dataset'),
               n_seqs=X.size(0), seq_len=X.size(1), tied_routing=model.config.tied_routing,
               seconds=round(time.time() - t0, 2))
    cfg = model.config
    print_report(res, f"routing: {ckpt_path} (iter {ckpt.get('iter_num')}; K={cfg.n_layer} R={cfg.n_loop}, "
                      f"top-{cfg.top_k} of {E} experts{', tied routing' if cfg.tied_routing else ''}; "
                      f"{X.size(0)} windows x {X.size(1)} tokens on {device})")
    res['summary'] = summary(res)
    print('\n'.join(res['summary']))
    out = args.json or os.path.join(os.path.dirname(ckpt_path) or '.', 'routing.json')
    write_json(out, res)
    print(f"wrote {out} ({res['seconds']:.1f}s)")


if __name__ == '__main__':
    main()
